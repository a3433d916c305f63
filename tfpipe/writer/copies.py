"""Byte-identical copies among the images of one write: reported, never silently written.

Kaggle datasets often hold one image under two names, sometimes with two different answers, and a copy in another fold
than its original makes validation score an image the model trained on. So a write with folds first finds the source
files of equal bytes (``source_copies``; ``tfpipe.sources.folds`` keeps each set in one fold), and after encoding
``tfpipe.write`` reads its staged shards back once before committing them (every runner, a resumed write too) and
reports what it found -- which also catches images stored alike from different source bytes; the shards stay exactly as
the input asked (nothing is merged, dropped or relabelled).

    first_of = source_copies(items, identities)  # planning, with folds
    copies = find_copies([(path, fold), ...])  # after encoding
    for line in copy_lines(copies, classes):
        print(f"tfpipe.write: warning: {line}", file=sys.stderr)
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections import defaultdict
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor

from tfpipe.format import schema
from tfpipe.format.checks import STAT_THREADS
from tfpipe.format.tfrecord import read_records
from tfpipe.runtime import fs
from tfpipe.runtime.errors import TfpipeError
from tfpipe.sources.source import Item

HASH_CHUNK = 2**20  # bytes read at a time while hashing a source file


@dataclasses.dataclass(frozen=True)
class Stored:
    """One stored image: its name, labels (class indices; None unlabeled) and fold (None without folds)."""

    name: str
    labels: frozenset[int] | None
    fold: int | None


@dataclasses.dataclass(frozen=True)
class Copy:
    """An image whose stored bytes equal those of an earlier one (``first``, in written order)."""

    image: Stored
    first: Stored


def find_copies(parts: Iterable[tuple[str, int | None]]) -> list[Copy]:
    """Every image of the shard files ``parts`` ((path, fold) in written order) whose stored bytes (their
    ``schema.image_digest``, the identity ``tfpipe.image_digests`` gives) repeat an earlier image's."""
    seen: dict[str, Stored] = {}
    copies = []
    for path, fold in parts:
        for raw in read_records(path):
            feature = schema.parse_record(raw, path).features.feature
            target = feature[schema.TARGET].int64_list.value if schema.TARGET in feature else None
            stored = Stored(
                feature[schema.IMAGE_NAME].bytes_list.value[0].decode("utf-8"),
                None if target is None else frozenset(target),
                fold,
            )
            digest = schema.image_digest(feature[schema.IMAGE].bytes_list.value[0])
            if digest in seen:
                copies.append(Copy(stored, seen[digest]))
            else:
                seen[digest] = stored
    return copies


def copy_lines(copies: Sequence[Copy], classes: Sequence[str]) -> list[str]:
    """What ``copies`` mean, one line each kind with its first example: copies at all, copies labelled otherwise
    than their first (one image, two answers), copies in another fold (validation scores trained-on images)."""
    if not copies:
        return []
    first = copies[0]
    example = f"e.g. {first.image.name} = {first.first.name}"
    lines = [f"{_count(copies)} byte-identical to an earlier image once stored ({example}); the shards hold every copy"]
    kinds: list[tuple[list[Copy], Callable[[Copy], str]]] = [
        (
            [c for c in copies if c.image.labels != c.first.labels],
            lambda c: (
                f"labelled otherwise than the image it copies (e.g. {c.image.name} [{_labels(c.image, classes)}],"
                f" {c.first.name} [{_labels(c.first, classes)}]): one image, two answers; correct the CSV if that is a "
                "mistake"
            ),
        ),
        (
            [c for c in copies if c.image.fold != c.first.fold],
            lambda c: (
                f"in another fold than the image it copies (e.g. {c.image.name} in fold {c.image.fold}, "
                f"{c.first.name} in fold {c.first.fold}): validating on such a fold scores images the model "
                "trained on; drop the copies from the CSV to keep validation honest"
            ),
        ),
    ]
    lines += [f"{_count(found)} {say(found[0])}" for found, say in kinds if found]
    return lines


def _count(copies: Sequence[Copy]) -> str:
    return f"{len(copies)} image{' is' if len(copies) == 1 else 's are'}"


def _labels(image: Stored, classes: Sequence[str]) -> str:
    return " ".join(classes[i] for i in sorted(image.labels or ()))


def source_copies(items: Sequence[Item], sizes: Sequence[int | None]) -> list[int]:
    """For every item, the index of the first item whose source bytes equal its own (its own index when none
    does). ``sizes``: each item's size in bytes (None: not readable now; its record reports it). Only items of a
    size that repeats are hashed (SHA-256, in threads: one read each is slow on a bucket), so a dataset of
    distinct sizes reads nothing."""
    by_size: dict[int, list[int]] = defaultdict(list)
    for i, size in enumerate(sizes):
        if size:  # 0 bytes is no image (and a FIFO or a device stats as 0): its record reports it
            by_size[size].append(i)
    candidates = [i for same in by_size.values() if len(same) > 1 for i in same]
    with ThreadPoolExecutor(STAT_THREADS) as pool:
        digests = list(pool.map(lambda i: _digest(items[i]), candidates))
    first_of = list(range(len(items)))
    seen: dict[tuple[int, str], int] = {}
    for i, digest in sorted(zip(candidates, digests)):  # input order: the first of equal bytes is the earliest
        if digest is not None:
            first_of[i] = seen.setdefault((sizes[i] or 0, digest), i)
    return first_of


def _digest(item: Item) -> str | None:
    """The SHA-256 of an item's source bytes; None for a file that cannot be read now (its record reports it)."""
    if item.data is not None:
        return hashlib.sha256(item.data).hexdigest()
    h = hashlib.sha256()
    try:
        fs.check_regular(item.path, "image")  # a FIFO would hang the read
        with fs.open(item.path, "rb") as f:
            while chunk := f.read(HASH_CHUNK):
                h.update(chunk)
    except (OSError, TfpipeError):
        return None
    return h.hexdigest()
