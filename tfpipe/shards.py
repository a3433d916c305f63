"""Shard planning, naming, staged writing and the manifest.

Shard files are named ``{split}[-fold{f}]-{i}-of-{n}-{count}.tfrec``: the
record count at the end is the Kaggle convention that notebooks read with a
regex. They are written under ``.staging/`` with a name that does not end in
``.tfrec`` and only renamed into place, followed by ``manifest.json``, once
every shard is complete: nobody globbing ``*.tfrec`` ever reads half a dataset.

All file access goes through ``tfpipe.fs`` (``tf.io.gfile`` for ``gs://`` and
other remote paths), so a bucket works like a folder.
"""
import json
import math
import posixpath

from tfpipe import fs
from tfpipe.errors import TfpipeError
from tfpipe.tfrecord import RecordWriter

MANIFEST = "manifest.json"
STAGING = ".staging"
SHARD_SUFFIX = ".tfrec"
TARGET_SHARD_BYTES = 150 * 2**20  # 100-200 MB shards: big reads, yet many files to spread over readers
MIN_SHARD_RECORDS = 64  # below this a shard costs more in file opens than it gives in parallelism
SHARD_MULTIPLE = 8  # a TPU v3-8 has 8 cores; 8k shards split evenly between them


def num_shards(num_records, est_bytes, requested=None):
    """How many shards to write: a multiple of 8 where the data allows it.

    Args:
      num_records: records to write.
      est_bytes: estimated total size in bytes.
      requested: the user's ``--shards``, which wins (capped at one record a shard).
    """
    if requested:
        return max(1, min(requested, num_records))
    by_bytes = max(1, math.ceil(est_bytes / TARGET_SHARD_BYTES))
    by_bytes = math.ceil(by_bytes / SHARD_MULTIPLE) * SHARD_MULTIPLE
    most = num_records // MIN_SHARD_RECORDS
    if most < SHARD_MULTIPLE:
        return max(1, min(by_bytes, most))
    return min(by_bytes, most // SHARD_MULTIPLE * SHARD_MULTIPLE)


def split_evenly(n, parts):
    """Sizes of ``parts`` consecutive chunks of ``n`` items, differing by at most one."""
    return [n // parts + (1 if i < n % parts else 0) for i in range(parts)]


def plan(fold_sizes, total_shards):
    """Assigns consecutive record ranges to shards, never mixing folds in a shard.

    Args:
      fold_sizes: records per fold in write order (one entry when there are no folds).
      total_shards: the wanted number of shards; with folds each fold gets an
        equal share (at least one).

    Returns:
      A list of dicts with ``fold`` (or None), ``start``, ``size`` and ``index``.
    """
    with_folds = len(fold_sizes) > 1
    per_fold = max(1, round(total_shards / len(fold_sizes)))
    shards, start = [], 0
    for fold, size in enumerate(fold_sizes):
        for part in split_evenly(size, min(per_fold, max(size, 1))):
            shards.append({"fold": fold if with_folds else None, "start": start, "size": part, "index": len(shards)})
            start += part
    return shards


def shard_name(split, index, total, count, fold=None):
    """``train-00-of-16-2071.tfrec``, or ``train-fold3-07-of-20-512.tfrec`` with folds."""
    width = max(2, len(str(total - 1)))
    fold_part = "" if fold is None else f"-fold{fold}"
    return f"{split}{fold_part}-{index:0{width}d}-of-{total:0{width}d}-{count}{SHARD_SUFFIX}"


def existing_shards(out_dir):
    """Shard files (``*.tfrec``) directly in ``out_dir``, sorted by name."""
    if not fs.isdir(out_dir):
        return []
    return sorted(fs.glob(posixpath.join(out_dir, "*" + SHARD_SUFFIX)))


class StagedShards:
    """Writes shards under ``out/.staging`` and moves them into place on ``commit``.

    Use as a context manager: leaving the block without ``commit`` (an error,
    Ctrl-C) removes the staged files, so the output folder is as it was.
    """

    def __init__(self, out_dir, split, shard_plan):
        self.out_dir, self.split, self.plan = out_dir, split, shard_plan
        self.staging = posixpath.join(out_dir, STAGING)
        self.counts = [0] * len(shard_plan)
        self._writer, self._current = None, None

    def __enter__(self):
        if fs.exists(self.staging):
            fs.rmtree(self.staging)
        fs.makedirs(self.staging)
        return self

    def _staged_path(self, index):
        return posixpath.join(self.staging, f"{self.split}-{index:05d}.part")

    def write(self, index, record):
        """Appends a serialized record to shard ``index`` (shards are written in order)."""
        if index != self._current:
            self._close()
            self._writer, self._current = RecordWriter(self._staged_path(index)), index
        self._writer.write(record)
        self.counts[index] += 1

    def _close(self):
        if self._writer is not None:
            self._writer.close()
            self._writer = None

    def commit(self, manifest, overwrite=False):
        """Renames finished shards into place and writes the manifest last.

        Shards left empty (every record skipped) are dropped. Returns the
        manifest's shard list.
        """
        self._close()
        if overwrite:
            remove_outputs(self.out_dir)
        kept = [s for s in self.plan if self.counts[s["index"]] > 0]
        entries = []
        for new_index, s in enumerate(kept):
            name = shard_name(self.split, new_index, len(kept), self.counts[s["index"]], s["fold"])
            staged = self._staged_path(s["index"])
            if not fs.exists(staged):
                raise RuntimeError(f"staged shard {staged} is missing")
            fs.rename(staged, posixpath.join(self.out_dir, name), overwrite=True)
            entries.append({"file": name, "count": self.counts[s["index"]], "fold": s["fold"]})
        manifest = dict(manifest, shards=entries)
        write_manifest(self.out_dir, manifest)
        fs.rmtree(self.staging)
        return manifest

    def __exit__(self, exc_type, exc, tb):
        self._close()
        if fs.exists(self.staging):
            fs.rmtree(self.staging)
        return False


def remove_outputs(out_dir):
    """Deletes the shards and manifest of an earlier write in ``out_dir``."""
    for path in existing_shards(out_dir):
        fs.remove(path)
    manifest = posixpath.join(out_dir, MANIFEST)
    if fs.exists(manifest):
        fs.remove(manifest)


def write_manifest(out_dir, manifest):
    """Writes ``manifest.json`` through a temporary name, so it is never half-written."""
    path = posixpath.join(out_dir, MANIFEST)
    tmp = path + ".tmp"
    with fs.open(tmp, "w") as f:
        f.write(json.dumps(manifest, indent=1, ensure_ascii=False) + "\n")
    fs.rename(tmp, path, overwrite=True)


def read_manifest(out_dir):
    """Reads ``manifest.json`` from a shard folder."""
    path = posixpath.join(out_dir, MANIFEST)
    if not fs.exists(path):
        raise TfpipeError(f"{out_dir}: no {MANIFEST} (not a folder written by tfpipe.write)")
    with fs.open(path, "r") as f:
        try:
            return json.loads(f.read())
        except json.JSONDecodeError as e:
            raise TfpipeError(f"{path}: manifest is not valid JSON ({e})") from None
