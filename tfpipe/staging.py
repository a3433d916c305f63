"""The writer's side of a shard folder: how many shards, which records go where, and staged writing.

Shards are written under ``.staging/`` with a name that does not end in
``.tfrec`` and only renamed into place, followed by ``manifest.json``, once
every shard is complete: nobody globbing ``*.tfrec`` ever reads half a dataset.
Finished staged shards are listed in ``.staging/progress.json`` as they
complete, which is what ``--resume`` continues from. Names, the manifest and
everything a reader needs are in ``tfpipe.shards``.
"""
import json
import math
import posixpath

from tfpipe import fs
from tfpipe.errors import TfpipeError, option
from tfpipe.shards import PROGRESS, STAGING, remove_outputs, shard_name, write_manifest
from tfpipe.tfrecord import RecordWriter

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


class StagedShards:
    """Writes shards under ``out/.staging`` and moves them into place on ``commit``.

    Every finished shard is recorded in ``.staging/progress.json`` (an
    incremental manifest, replaced atomically), so an interrupted write -- an
    error, Ctrl-C or ``kill -9`` -- keeps its finished shards and ``resume=True``
    writes only the rest. ``fingerprint`` identifies the job (inputs, labels,
    plan, image settings): progress from a different job is never reused.
    Nothing under ``.staging`` ends in ``.tfrec``, and a new write without
    ``resume`` starts by clearing it.
    """

    def __init__(self, out_dir, split, shard_plan, fingerprint="", resume=False):
        self.out_dir, self.split, self.plan = out_dir, split, shard_plan
        self.fingerprint, self.resume = fingerprint, resume
        self.staging = posixpath.join(out_dir, STAGING)
        self.progress_path = posixpath.join(self.staging, PROGRESS)
        self.counts = [0] * len(shard_plan)
        self.skipped = [[] for _ in shard_plan]
        self.finished = set()
        self._writer, self._current = None, None

    def __enter__(self):
        progress = self._read_progress() if self.resume else None
        if progress is not None and progress["fingerprint"] != self.fingerprint:
            raise TfpipeError(f"{self.staging}: the interrupted write there had other inputs or settings; "
                              f"run without {option('resume', True)} to start over")
        if progress is None:
            if fs.exists(self.staging):
                fs.rmtree(self.staging)
            fs.makedirs(self.staging)
            return self
        for entry in progress["shards"]:
            index = entry["index"]
            if not fs.exists(self.staged_path(index)):
                raise TfpipeError(f"{self.staged_path(index)} is listed as finished but missing; "
                                  f"run without {option('resume', True)} to start over")
            self.counts[index], self.skipped[index] = entry["count"], entry["skipped"]
            self.finished.add(index)
        return self

    def _read_progress(self):
        if not fs.exists(self.progress_path):
            return None
        with fs.open(self.progress_path, "r") as f:
            return json.loads(f.read())

    def staged_path(self, index):
        return posixpath.join(self.staging, f"{self.split}-{index:05d}.part")

    def first_unfinished_record(self):
        """Index of the first record not in a finished shard (shards are consecutive record ranges)."""
        for s in self.plan:
            if s["index"] not in self.finished:
                return s["start"]
        return sum(s["size"] for s in self.plan)

    def write(self, index, record):
        """Appends a serialized record to shard ``index`` (shards are written in order)."""
        if index != self._current:
            self._close()
            self._writer, self._current = RecordWriter(self.staged_path(index)), index
        self._writer.write(record)
        self.counts[index] += 1

    def skip(self, index, entry):
        """Notes a record of shard ``index`` that was skipped (``entry``: image and reason)."""
        self.skipped[index].append(entry)

    def finish(self, index):
        """Marks shard ``index`` complete: closes it and records it in the progress file."""
        if self._current == index:
            self._close()
        self.finished.add(index)
        entries = [{"index": i, "count": self.counts[i], "skipped": self.skipped[i]} for i in sorted(self.finished)]
        fs.write_atomic(self.progress_path, json.dumps({"fingerprint": self.fingerprint, "shards": entries}))

    def add_finished(self, index, count, skipped):
        """Records shard ``index`` as complete when something else wrote its staged file (the Beam runner)."""
        self.counts[index], self.skipped[index] = count, skipped
        self.finish(index)

    def _close(self):
        if self._writer is not None:
            self._writer.close()
            self._writer, self._current = None, None

    def all_skipped(self):
        return [entry for per_shard in self.skipped for entry in per_shard]

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
            staged = self.staged_path(s["index"])
            if not fs.exists(staged):
                raise RuntimeError(f"staged shard {staged} is missing")
            size = fs.size(staged)
            fs.rename(staged, posixpath.join(self.out_dir, name), overwrite=True)
            entries.append({"file": name, "count": self.counts[s["index"]], "fold": s["fold"], "bytes": size})
        manifest = dict(manifest, shards=entries)
        write_manifest(self.out_dir, manifest)
        fs.rmtree(self.staging)
        return manifest

    def __exit__(self, exc_type, exc, tb):
        """On failure keeps the finished shards for ``resume`` and drops the unfinished one."""
        current = self._current
        self._close()
        if exc_type is not None and current is not None and current not in self.finished:
            fs.remove(self.staged_path(current))
        if exc_type is not None and not self.finished and fs.exists(self.staging):
            fs.rmtree(self.staging)  # nothing worth keeping
        return False
