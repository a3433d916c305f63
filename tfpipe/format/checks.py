"""Checks of shard files before reading starts, without TensorFlow: each file's first record is one of tfpipe's
(for a glob or list without a manifest), and each listed shard is there, a file of its folder, readable and of the
size the manifest says. Every file is checked at once (one request each is slow on a bucket); the first problem,
in file order, is the error."""

from __future__ import annotations

import os
import posixpath
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor

from tfpipe.format import schema
from tfpipe.format.manifest import MANIFEST, Manifest
from tfpipe.format.tfrecord import CorruptRecord, compressed, read_records
from tfpipe.runtime import fs
from tfpipe.runtime.errors import TfpipeError

STAT_THREADS = 16  # size checks run at once: one stat per file is slow on a bucket


def check_first_records(files: Iterable[str]) -> None:
    """For shards without a manifest (a glob, a list): the first record of each file must be a
    ``tf.train.Example`` with tfpipe's ``image`` bytes, so a foreign ``.tfrec`` the glob picked up is named here
    instead of failing later inside TensorFlow (``Feature: image is required``, no file named)."""

    def problem(path: str) -> str | None:
        try:
            raw = next(read_records(path), None)
        except CorruptRecord as e:  # at byte 0: not TFRecord framing at all (a CSV, an image, a text file)
            return f"{path}: not a TFRecord file ({e.what} at byte 0{e.note})" if e.offset == 0 else str(e)
        if raw is None:
            return None  # an empty shard reads as nothing
        try:
            features = schema.parse_record(raw, path).features.feature
        except TfpipeError as e:
            return str(e)
        if schema.IMAGE not in features or features[schema.IMAGE].WhichOneof("kind") != "bytes_list":
            return (
                f"{path}: its records have no {schema.IMAGE!r} bytes feature (features: "
                f"{', '.join(sorted(features)) or 'none'}); not written by tfpipe.write -- leave it out of "
                "the glob or list"
            )
        return None

    raise_first_problem(problem, files)


def raise_first_problem(problem: Callable[[str], str | None], files: Iterable[str]) -> None:
    """Runs ``problem(path)`` for every file at once (one request each is slow on a bucket) and raises the first
    message, in file order, as a ``TfpipeError``."""
    with ThreadPoolExecutor(STAT_THREADS) as pool:
        for message in pool.map(problem, files):
            if message:
                raise TfpipeError(message)


def check_sizes(files: Iterable[str], manifest: Manifest, folder: str) -> None:
    """Compares each file's size with the manifest: a missing or truncated shard is named before reading starts,
    and so is one that is not a file of the folder (a folder, or a link to outside it) or that this user cannot
    read."""
    listed = {s.file: s.bytes for s in manifest.shards}

    def problem(path: str) -> str | None:
        expected = listed.get(posixpath.basename(path))
        if not fs.exists(path):
            return f"{path}: shard listed in {MANIFEST} is missing"
        if fs.isdir(path) or _links_out(path, folder):
            return f"{path}: listed in {MANIFEST} but not a shard file of {folder} (a folder or a link out of it)"
        if not fs.is_remote(path) and not os.access(path, os.R_OK):
            return f"{path}: this user cannot read it (permission denied); give it read access"
        if expected is None:
            return None
        size = fs.size(path)
        if size != expected:
            # a shard gzipped in place, or one truncated or replaced
            why = compressed(path) or "truncated or replaced; check with python -m tfpipe.inspect --verify"
            return f"{path}: shard is {size} bytes, {MANIFEST} says {expected} ({why})"
        return None

    raise_first_problem(problem, files)


def _links_out(path: str, folder: str) -> bool:
    """A local shard that resolves (through links) to somewhere outside its folder."""
    if fs.is_remote(path):
        return False
    return os.path.dirname(os.path.realpath(path)) != os.path.realpath(folder)
