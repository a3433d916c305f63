"""The writer's side of a shard folder: what may be written over, staged writing and the commit.

Shards are written under ``.staging/`` with a name that does not end in
``.tfrec`` and only renamed into place, followed by ``manifest.json``, once
every shard is complete: nobody globbing ``*.tfrec`` ever reads half a dataset.
Finished staged shards are listed in ``.staging/progress.json`` as they
complete, which is what ``--resume`` continues from. How many shards and which
records go where is ``tfpipe.writer.job``'s plan; names are ``tfpipe.format.names``'s,
and everything a reader needs is in ``tfpipe.format.shards``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import posixpath
from collections.abc import Iterable, Iterator, Mapping, Sequence
from types import TracebackType
from typing import Any, Literal

from tfpipe.format.manifest import MANIFEST, PROGRESS, STAGING, Manifest, ShardEntry
from tfpipe.format.names import SHARD_NAMES
from tfpipe.format.tfrecord import RecordSink, RecordWriter
from tfpipe.runtime import fs
from tfpipe.runtime.errors import BadFile, TfpipeError, option, os_error_line
from tfpipe.writer.job import PlannedShard

STAGING_MARK = ".tfpipe-staging"  # in .staging: made by tfpipe.write (a user's own .staging is never deleted)


def existing_shards(out_dir: str) -> list[str]:
    """Shard files (``*.tfrec``) directly in ``out_dir``, sorted by name."""
    if not fs.isdir(out_dir):
        return []
    return sorted(fs.glob(posixpath.join(out_dir, SHARD_NAMES.glob)))


def remove_outputs(out_dir: str, manifest: Manifest) -> None:
    """Deletes what an earlier ``tfpipe.write`` wrote in ``out_dir``: its manifest first (so the folder never
    describes a half-deleted dataset), then the shards that (validated) manifest lists -- plain ``*.tfrec`` names
    inside the folder, never other files. (A commit killed half-way left its shards and no manifest here.)"""
    if fs.exists(posixpath.join(out_dir, MANIFEST)):
        fs.remove(posixpath.join(out_dir, MANIFEST))
    for name in manifest.files:
        path = posixpath.join(out_dir, name)
        if fs.exists(path) and not fs.isdir(path):
            fs.remove(path)  # a link is removed itself, never what it points to


def write_manifest(folder: str, manifest: Manifest) -> None:
    """Saves ``manifest`` in ``folder`` (a seam: tests fill the disk here)."""
    manifest.save(folder)


def existing_manifest(out_dir: str) -> Manifest | None:
    """The validated manifest of an earlier write in ``out_dir``, or None when there is none. A manifest that
    fails validation is never acted on (``--overwrite`` would delete what it lists): the user decides."""
    if not fs.exists(posixpath.join(out_dir, MANIFEST)):
        return None
    try:
        return Manifest.load(out_dir)
    except BadFile as e:  # what is wrong, with tfpipe.write's remedy instead of the manifest's
        remedy = f"tfpipe.write deletes nothing a damaged manifest lists -- restore it, or remove {out_dir} yourself"
        raise BadFile(e.path, e.problem, f"{remedy} and write again", e.joined) from None


def check_destination(
    out_dir: str, split: str, fingerprint: str, overwrite: bool, resume: bool
) -> tuple[Manifest | None, Manifest | None]:
    """What may happen to ``out_dir``. Returns (finished, replace): the manifest when ``resume`` finds this job
    already finished there (nothing to do), and the manifest of the dataset an ``overwrite`` replaces (only the
    files it lists are deleted); raises when writing would replace or mix with something it must not.

    Never written over: ``*.tfrec`` files a tfpipe manifest does not list (a user's other data), another split's
    finished dataset, a finished dataset when neither ``overwrite`` nor (for the same job) ``resume`` says so,
    and anything a manifest that fails validation lists (an edited manifest naming ``../precious.txt``).
    """
    folders = [p for p in existing_shards(out_dir) if fs.isdir(p)]
    if folders:  # checked before anything is written or removed: the commit could not put a shard there
        raise TfpipeError(
            f"{folders[0]} is a folder named like a shard; tfpipe.write removes or replaces only files it wrote "
            f"-- move it out of {out_dir} first"
        )
    manifest = existing_manifest(out_dir)
    pending = pending_commit(out_dir)  # a commit killed half-way: the shards it moved are tfpipe's too
    listed = set(manifest.files if manifest else ()) | set(pending.files if pending else ())
    foreign = [p for p in existing_shards(out_dir) if posixpath.basename(p) not in listed]
    if foreign:
        more = f" and {len(foreign) - 1} more" if len(foreign) > 1 else ""
        raise TfpipeError(
            f"{out_dir} holds {posixpath.basename(foreign[0])}{more}, not written by tfpipe.write "
            f"(not in a {MANIFEST}); write into another folder, or move them"
        )
    if manifest is None:  # with --overwrite, a killed commit's moved shards go (the progress tells a new write)
        return None, pending if overwrite else None
    if manifest.split != split:
        raise TfpipeError(
            f"{out_dir} holds the {manifest.split!r} split; write {split!r} into its own "
            f"folder (one split per folder, so no write replaces another split)"
        )
    if resume and manifest.fingerprint == fingerprint:
        return manifest, None
    if resume:
        raise TfpipeError(
            f"{out_dir} holds a finished write whose inputs or settings changed since (an image's "
            f"size or time, a label, a setting); {option('resume', True)} does not replace it -- pass "
            f"{option('overwrite', True)} to write it again"
        )
    if not overwrite:
        raise TfpipeError(f"{out_dir} already holds shards; pass {option('overwrite', True)} to replace them")
    return None, manifest


def pending_commit(out_dir: str) -> Manifest | None:
    """The manifest of a commit that was killed half-way (``kill -9`` while shards moved into ``out_dir``): it
    waits, validated, in our ``.staging``; None when there is none."""
    staging = posixpath.join(out_dir, STAGING)
    if not (fs.exists(posixpath.join(staging, STAGING_MARK)) and fs.exists(posixpath.join(staging, MANIFEST))):
        return None
    return Manifest.load(staging)


def finish_commit(out_dir: str, fingerprint: str) -> Manifest | None:
    """``--resume`` of this job's commit killed half-way: the shards still staged are moved as the commit would
    have (in order, each to the name its manifest gives, sizes checked), then the manifest; returns it. None when
    no commit of this job waits."""
    pending = pending_commit(out_dir)
    if pending is None or pending.fingerprint != fingerprint:
        return None
    staging = posixpath.join(out_dir, STAGING)
    parts = [p for p in sorted(fs.listdir(staging)) if p.endswith(".part") and fs.size(posixpath.join(staging, p))]
    waiting = [e for e in pending.shards if not fs.exists(posixpath.join(out_dir, e.file))]
    if [fs.size(posixpath.join(staging, p)) for p in parts] != [e.bytes for e in waiting]:
        raise TfpipeError(
            f"{out_dir}: the commit of an interrupted write cannot be finished (the shards left in {staging} are "
            f"not the ones its {MANIFEST} still waits for); pass {option('overwrite', True)} to write it again"
        )
    _move_all([(posixpath.join(staging, p), posixpath.join(out_dir, e.file)) for p, e in zip(parts, waiting)])
    fs.rename(posixpath.join(staging, MANIFEST), posixpath.join(out_dir, MANIFEST), overwrite=True)
    fs.rmtree(staging)
    return Manifest.load(out_dir)


class StagedShards:
    """Writes shards under ``out/.staging`` and moves them into place on ``commit``.

    Every finished shard is recorded in ``.staging/progress.json`` (an
    incremental manifest, replaced atomically), so an interrupted write -- an
    error, Ctrl-C or ``kill -9`` -- keeps its finished shards and ``resume=True``
    writes only the rest. ``fingerprint`` identifies the job (inputs, labels,
    plan, image settings): progress from a different job is never reused.
    Nothing under ``.staging`` ends in ``.tfrec``. A new write refuses to clear
    an interrupted one's progress unless ``discard`` (``--overwrite``).
    """

    def __init__(
        self,
        out_dir: str,
        split: str,
        shard_plan: Sequence[PlannedShard],
        fingerprint: str = "",
        resume: bool = False,
        discard: bool = False,
    ) -> None:
        self.out_dir, self.split, self.plan = out_dir, split, shard_plan
        self.fingerprint, self.resume, self.discard = fingerprint, resume, discard
        self.staging = posixpath.join(out_dir, STAGING)
        self.progress_path = posixpath.join(self.staging, PROGRESS)
        self.counts = [0] * len(shard_plan)
        self.skipped: list[list[dict[str, str]]] = [[] for _ in shard_plan]
        self.finished: set[int] = set()
        self.sizes: dict[int, int] = {}  # bytes of each finished staged shard, recorded so --resume can check the file
        self._writer: RecordSink | None = None
        self._current: int | None = None

    def __enter__(self) -> StagedShards:
        if fs.exists(self.staging) and not self._ours():
            raise TfpipeError(
                f"{self.staging} exists and was not made by tfpipe.write; it is not deleted -- move it, "
                "or write into another folder"
            )
        progress = self._read_progress() if self.resume else None
        if progress is not None and progress["fingerprint"] != self.fingerprint:
            raise TfpipeError(
                f"{self.staging}: the interrupted write there had other inputs or settings (an "
                f"image's size or time, a label, a setting changed since); run with "
                f"{option('overwrite', True)} instead of {option('resume', True)} to start over"
            )
        if progress is None:
            if not self.resume and not self.discard and self._read_progress() is not None:
                raise TfpipeError(
                    f"{self.out_dir} holds an interrupted write ({self.staging}); continue it with "
                    f"{option('resume', True)} or pass {option('overwrite', True)} to start over"
                )
            if fs.exists(self.staging):
                fs.rmtree(self.staging)
            fs.makedirs(self.staging)
            fs.write_atomic(posixpath.join(self.staging, STAGING_MARK), self.fingerprint + "\n")
            return self
        for entry in progress["shards"]:
            self._take_finished(entry)
        return self

    def _ours(self) -> bool:
        """Whether ``.staging`` was made by tfpipe.write: it holds our mark, or (a staging folder without the mark) a
        progress file of ours. Anything else there is the user's and is never deleted."""
        if fs.exists(posixpath.join(self.staging, STAGING_MARK)):
            return True
        try:
            return _valid_progress(fs.read_json(self.progress_path, "progress file"), self.plan)
        except (TfpipeError, OSError):
            return False

    def _take_finished(self, entry: Mapping[str, Any]) -> None:
        """Keeps a shard the interrupted write finished, after checking its staged file is the one recorded."""
        index, staged = entry["index"], self.staged_path(entry["index"])
        present = fs.exists(staged)
        if (entry["count"] and not present) or (
            "bytes" in entry and (fs.size(staged) if present else 0) != entry["bytes"]
        ):
            raise TfpipeError(
                f"{staged} is listed as finished but missing or of another size; run with "
                f"{option('overwrite', True)} instead of {option('resume', True)} to start over"
            )
        self.counts[index], self.skipped[index] = entry["count"], entry["skipped"]
        self.sizes[index] = entry.get("bytes", 0)
        self.finished.add(index)

    def _read_progress(self) -> dict[str, Any] | None:
        """The progress file, validated: a damaged one is an error, never a resume from wrong offsets."""
        if not fs.exists(self.progress_path):
            return None
        try:
            progress = fs.read_json(self.progress_path, "progress file")
        except TfpipeError:
            progress = None
        if _valid_progress(progress, self.plan):
            return progress
        if not self.resume:
            return {"fingerprint": None, "shards": []}  # an interrupted write all the same
        raise TfpipeError(
            f"{self.progress_path} is damaged; run with {option('overwrite', True)} instead of "
            f"{option('resume', True)} to start over"
        )

    def staged_path(self, index: int) -> str:
        return posixpath.join(self.staging, f"{self.split}-{index:05d}.part")

    def first_unfinished_record(self) -> int:
        """Index of the first record not in a finished shard (shards are consecutive record ranges)."""
        for s in self.plan:
            if s["index"] not in self.finished:
                return s["start"]
        return sum(s["size"] for s in self.plan)

    def write(self, index: int, record: bytes) -> None:
        """Appends a serialized record to shard ``index`` (shards are written in order)."""
        with self._naming(index):
            if index != self._current:
                self._close()
                self._writer, self._current = RecordWriter(self.staged_path(index)), index
            assert self._writer is not None  # open whenever _current is set
            self._writer.write(record)
        self.counts[index] += 1

    @contextlib.contextmanager
    def _naming(self, index: int) -> Iterator[None]:
        """An ``OSError`` while staging shard ``index`` (a full disk says only "No space left on device") as one
        line naming the file, and what is kept for ``--resume``."""
        try:
            yield
        except OSError as e:
            kept = len(self.finished)
            raise TfpipeError(
                f"{os_error_line(e, self.staged_path(index))}; {kept} finished shard{'s' * (kept != 1)} kept in "
                f"{self.staging}: run it again with {option('resume', True)}"
            ) from None

    def skip(self, index: int, entry: dict[str, str]) -> None:
        """Notes a record of shard ``index`` that was skipped (``entry``: image and reason)."""
        self.skipped[index].append(entry)

    def finish(self, index: int) -> None:
        """Marks shard ``index`` complete: closes it and records it in the progress file."""
        with self._naming(index):
            if self._current == index:
                self._close()
            staged = self.staged_path(index)
            size = fs.size(staged) if fs.exists(staged) else 0  # every record skipped: no file
            entries = [
                {"index": i, "count": self.counts[i], "skipped": self.skipped[i], "bytes": self.sizes[i]}
                for i in sorted(self.finished)
            ] + [{"index": index, "count": self.counts[index], "skipped": self.skipped[index], "bytes": size}]
            fs.write_atomic(
                self.progress_path,
                json.dumps({"fingerprint": self.fingerprint, "shards": sorted(entries, key=lambda e: e["index"])}),
            )
        self.finished.add(index)  # only once its progress is saved: a shard the disk cut short is not finished
        self.sizes[index] = size

    def add_finished(self, index: int, count: int, skipped: list[dict[str, str]]) -> None:
        """Records shard ``index`` as complete when something else wrote its staged file (the Beam runner)."""
        self.counts[index], self.skipped[index] = count, skipped
        self.finish(index)

    def _close(self) -> None:
        writer, self._writer = self._writer, None  # closed once, even when closing fails (a full disk's flush)
        if writer is not None:
            writer.close()
            self._current = None

    def all_skipped(self) -> list[dict[str, str]]:
        return [entry for per_shard in self.skipped for entry in per_shard]

    def commit(self, manifest: Manifest, replace: Manifest | None = None) -> Manifest:
        """Moves the finished shards into place, the manifest last; returns the manifest.

        The manifest is written under ``.staging`` first, so a full disk fails before anything moves (the staged
        shards stay for ``--resume``); a failed move puts back the shards already moved. ``replace``: the
        manifest of the dataset being replaced (``--overwrite``); only the files it lists are deleted. Shards
        left empty (every record skipped) are dropped.
        """
        self._close()
        kept = [s for s in self.plan if self.counts[s["index"]] > 0]
        moves, entries = [], []
        for new_index, s in enumerate(kept):
            name = SHARD_NAMES.name(self.split, new_index, len(kept), self.counts[s["index"]], s["fold"])
            staged = self.staged_path(s["index"])
            moves.append((staged, posixpath.join(self.out_dir, name)))
            entries.append(ShardEntry(name, self.counts[s["index"]], s["fold"], fs.size(staged)))
        manifest = dataclasses.replace(manifest, shards=tuple(entries)).with_id()
        try:
            write_manifest(self.staging, manifest)
        except OSError as e:
            raise TfpipeError(
                f"cannot write {MANIFEST} ({e.strerror or e}); every shard is finished and kept in "
                f"{self.staging}: fix that and run it again with {option('resume', True)}"
            ) from None
        blocked = next((dst for _, dst in moves if fs.isdir(dst)), None)
        if blocked is not None:  # made while this job wrote: nothing is removed, the shards stay for --resume
            raise TfpipeError(
                f"{blocked} is a folder, where this write puts a shard; move it away and run it again with "
                f"{option('resume', True)} (every shard is finished and kept in {self.staging})"
            )
        if replace is not None:
            remove_outputs(self.out_dir, replace)
        _move_all(moves)
        fs.rename(posixpath.join(self.staging, MANIFEST), posixpath.join(self.out_dir, MANIFEST), overwrite=True)
        fs.rmtree(self.staging)
        return manifest

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> Literal[False]:
        """On failure keeps the finished shards for ``resume`` and drops the unfinished one."""
        current = self._current
        # After a failure the unfinished shard is dropped below: closing it may fail again (a full disk's flush)
        with contextlib.suppress(OSError) if exc_type is not None else contextlib.nullcontext():
            self._close()
        if exc_type is not None and current is not None and current not in self.finished:
            fs.remove(self.staged_path(current))
        if exc_type is not None and not self.finished and fs.exists(self.staging):
            fs.rmtree(self.staging)  # nothing worth keeping
        return False


def _valid_progress(progress: object, shard_plan: Sequence[PlannedShard]) -> bool:
    """A progress file names the job and lists finished shards of this plan, each with its records and skipped
    images adding up to the shard's planned size (and the staged file's bytes, checked when resuming)."""
    if not isinstance(progress, dict) or not isinstance(progress.get("fingerprint"), str):
        return False
    entries = progress.get("shards")
    if not isinstance(entries, list):
        return False
    for e in entries:
        if not (
            isinstance(e, dict)
            and type(e.get("index")) is int
            and 0 <= e["index"] < len(shard_plan)
            and type(e.get("count")) is int
            and isinstance(e.get("skipped"), list)
            and e["count"] >= 0
            and e["count"] + len(e["skipped"]) == shard_plan[e["index"]]["size"]
            and all(
                isinstance(k, dict) and isinstance(k.get("image"), str) and isinstance(k.get("reason"), str)
                for k in e["skipped"]
            )
            and (type(e.get("bytes", 0)) is int and e.get("bytes", 0) >= 0)
        ):
            return False
    return True


def _move_all(moves: Iterable[tuple[str, str]]) -> None:
    """Renames (source, destination) pairs; on a failure the ones already done are moved back, so no ``*.tfrec``
    of an unfinished commit is left in the folder."""
    done = []
    try:
        for src, dst in moves:
            fs.rename(src, dst, overwrite=True)
            done.append((src, dst))
    except BaseException:
        for src, dst in reversed(done):
            fs.rename(dst, src, overwrite=True)
        raise
