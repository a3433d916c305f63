"""The plan of a write (``Job``): everything decided before any image is touched -- the source's items checked,
the classes, the folds (by group where given), the shards, and the fingerprint ``--resume`` checks.

``tfpipe.writer.engine.write_shards`` plans a job here, then hands it to a runner (``tfpipe.writer.runners``).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeAlias, TypedDict

from tfpipe.format import schema
from tfpipe.format.checks import STAT_THREADS
from tfpipe.runtime import fs
from tfpipe.runtime.errors import TfpipeError, option
from tfpipe.sources.folds import Balance, assign_folds, fold_balance, merge_groups
from tfpipe.sources.source import Item, SourceProtocol, class_names, targets
from tfpipe.writer.copies import source_copies
from tfpipe.writer.images import ImageSpec

EST_BYTES_PER_PIXEL = {"jpeg": 0.5, "png": 2.0}  # for shard planning before any image is encoded

Identity: TypeAlias = tuple[int, int] | str | None  # (size, mtime_ns) of a file, a hash of in-memory bytes, None


TARGET_SHARD_BYTES = 150 * 2**20  # 100-200 MB shards: big reads, yet many files to spread over readers
MIN_SHARD_RECORDS = 64  # below this a shard costs more in file opens than it gives in parallelism
SHARD_MULTIPLE = 8  # a TPU v3-8 has 8 cores; 8k shards split evenly between them


@dataclasses.dataclass(frozen=True)
class KeptCopies:
    """Byte-identical source images a write with folds kept in the fold of the image they copy: each copy's id and
    its first's (in input order), and how many groups the copies joined into how many (0 without groups)."""

    pairs: tuple[tuple[str, str], ...]
    groups_merged: int = 0
    groups_into: int = 0

    def line(self) -> str:
        """``12 byte-identical images kept in the fold of the image they copy (3 groups merged into 1)``."""
        n = len(self.pairs)
        merged = f" ({self.groups_merged} groups merged into {self.groups_into})" if self.groups_merged else ""
        they = "s kept in the fold of the image they copy" if n != 1 else " kept in the fold of the image it copies"
        return f"{n} byte-identical image{they}{merged}"


class PlannedShard(TypedDict):
    """One shard of ``plan``: its fold (None without folds), first record, number of records and index."""

    fold: int | None
    start: int
    size: int
    index: int


def num_shards(num_records: int, est_bytes: float, requested: int | None = None) -> int:
    """How many shards to write: a multiple of 8 where the data allows it.

    Args:
      num_records: records to write.
      est_bytes: estimated total size in bytes.
      requested: the user's ``num_shards`` (``--num-shards``), which wins (capped at one record a shard).
    """
    if requested:
        return max(1, min(requested, num_records))
    by_bytes = max(1, math.ceil(est_bytes / TARGET_SHARD_BYTES))
    by_bytes = math.ceil(by_bytes / SHARD_MULTIPLE) * SHARD_MULTIPLE
    most = num_records // MIN_SHARD_RECORDS
    if most < SHARD_MULTIPLE:
        return max(1, min(by_bytes, most))
    return min(by_bytes, most // SHARD_MULTIPLE * SHARD_MULTIPLE)


def split_evenly(n: int, parts: int) -> list[int]:
    """Sizes of ``parts`` consecutive chunks of ``n`` items, differing by at most one."""
    return [n // parts + (1 if i < n % parts else 0) for i in range(parts)]


def plan(fold_sizes: Sequence[int], total_shards: int) -> list[PlannedShard]:
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
    shards: list[PlannedShard] = []
    start = 0
    for fold, size in enumerate(fold_sizes):
        for part in split_evenly(size, min(per_fold, max(size, 1))):
            shards.append({"fold": fold if with_folds else None, "start": start, "size": part, "index": len(shards)})
            start += part
    return shards


def estimate_bytes(items: Sequence[Item], spec: ImageSpec, identities: Sequence[Identity]) -> int:
    """The dataset's size for planning shards: the files' sizes when they are copied as they are (a file that
    cannot be stat'ed counts 0; its record reports it), else pixels times a typical ratio."""
    if spec.image_size is None:
        return sum(
            len(item.data) if item.data is not None else (ident[0] if isinstance(ident, tuple) else 0)
            for item, ident in zip(items, identities)
        )
    return int(len(items) * spec.image_size * spec.image_size * EST_BYTES_PER_PIXEL[spec.format])


def job_fingerprint(
    items: Sequence[Item],
    item_targets: Sequence[Sequence[int]] | None,
    names: Sequence[str],
    shard_plan: Sequence[PlannedShard],
    spec: ImageSpec,
    split: str,
    identities: Sequence[Identity],
    group_column: str | None = None,
    kept: KeptCopies | None = None,
) -> str:
    """A hash of everything that decides the output bytes, so --resume never mixes two different jobs: settings,
    classes, plan, the group column, the copies kept in one fold (which move folds), and per image its id, path,
    labels, group and ``identities`` (the file's size and modification time; the bytes' hash for in-memory
    images), so an image changed since an earlier write is a new job. (Groups and copies enter the hash only when
    there, so a write without them hashes as one that knows neither.)"""
    settings: list[Any] = [split, names, dataclasses.asdict(spec), shard_plan, schema.describe()]
    settings += [group_column] if group_column else []
    settings += [["copies", [list(pair) for pair in kept.pairs]]] if kept else []
    h = hashlib.sha256(json.dumps(settings).encode())
    for i, (item, identity) in enumerate(zip(items, identities)):
        group = f"\0{item.group}" if item.group is not None else ""
        h.update(
            f"{item.name}\0{item.path}\0{list(item_targets[i]) if item_targets else ''}\0{identity}{group}\n".encode()
        )
    return h.hexdigest()


def input_identities(items: Sequence[Item]) -> list[Identity]:
    """(size, mtime_ns) of every input file, in order (threads: one request each is slow on a bucket); None for a
    file that cannot be stat'ed now (its record reports the problem). In-memory images: a hash of their bytes."""

    def identity(item: Item) -> Identity:
        if item.data is not None:
            return hashlib.sha1(item.data).hexdigest()
        try:
            return fs.identity(item.path)
        except OSError:
            return None

    if not any(fs.is_remote(item.path) for item in items[:1]):
        return [identity(item) for item in items]
    with ThreadPoolExecutor(STAT_THREADS) as pool:
        return list(pool.map(identity, items))


@dataclasses.dataclass(frozen=True)
class Job:
    """Everything decided before any image is touched: items in write order, their targets, the classes, the
    shard plan and the fingerprint that ``--resume`` checks."""

    source: SourceProtocol
    split: str
    items: list[Item]
    targets: list[list[int]] | None
    classes: list[str]
    skipped: list[dict[str, str]]
    num_folds: int | None
    seed: int
    shard_plan: list[PlannedShard]
    fingerprint: str
    balance: Balance | None = None  # how evenly folds by group split the images (None: not by group)
    group_column: str | None = None  # what the groups are called: the CSV column, or "group" for one's own source
    kept: KeptCopies | None = None  # byte-identical images kept in one fold (None: no folds, or no copies)

    @property
    def shard_of(self) -> list[int]:
        return [s["index"] for s in self.shard_plan for _ in range(s["size"])]

    @property
    def last_of_shard(self) -> dict[int, int]:
        return {s["start"] + s["size"] - 1: s["index"] for s in self.shard_plan}


def plan_job(
    source: SourceProtocol,
    spec: ImageSpec,
    classes: Sequence[str] | None,
    split: str,
    requested_shards: int | None,
    num_folds: int | None,
    seed: int,
    skip_bad: bool,
) -> Job:
    """Reads the source and decides classes, folds (records grouped by fold, input order within) and shards
    (``requested_shards``: the user's ``num_shards``, or None)."""
    items, skipped = checked_items(source, skip_bad)
    classes = classes or source.classes
    names = class_names(items, classes) if source.labeled else list(classes or [])
    item_targets = targets(items, names) if source.labeled else None
    if source.labeled and not any(item.labels for item in items):
        raise TfpipeError(
            f"{source.origin}: no image has a label (every label list is empty); for images "
            f"without labels pass {option('unlabeled', True, python='Source(..., labeled=False)')}"
        )
    groups = _groups(items, num_folds)
    identities = input_identities(items)  # one stat per file: milliseconds for thousands of local files
    fold_of, kept = _folds(items, item_targets, len(names), num_folds, seed, groups, identities)
    balance = fold_balance(item_targets or [], fold_of, len(names), num_folds) if groups and num_folds else None
    group_column = (getattr(source, "group_col", None) or "group") if groups else None
    order = sorted(range(len(items)), key=lambda i: fold_of[i])  # stable: input order within a fold
    items, identities = [items[i] for i in order], [identities[i] for i in order]
    item_targets = [item_targets[i] for i in order] if item_targets is not None else None  # None: unlabeled
    fold_sizes = [fold_of.count(f) for f in range(num_folds or 1)]
    shard_plan = plan(fold_sizes, num_shards(len(items), estimate_bytes(items, spec, identities), requested_shards))
    return Job(
        source,
        split,
        items,
        item_targets,
        names,
        skipped,
        num_folds,
        seed,
        shard_plan,
        job_fingerprint(items, item_targets, names, shard_plan, spec, split, identities, group_column, kept),
        balance,
        group_column,
        kept,
    )


def _groups(items: Sequence[Item], num_folds: int | None) -> list[str] | None:
    """Every item's group, or None when the source gives none; groups only decide folds."""
    given = [item.group for item in items if item.group is not None]
    if not given:
        return None
    bad = next((item for item in items if not (isinstance(item.group, str) and item.group)), None)
    if bad is not None:
        raise TfpipeError(
            f"image {bad.name!r} has the group {bad.group!r}, and other images have one: every image needs a group, "
            "a non-empty string"
        )
    if not num_folds:
        raise TfpipeError(
            f"{option('group_col')} keeps each group in one fold, and no folds are asked for; give "
            f"{option('num_folds')}"
        )
    return given


def check_source(source: object) -> None:
    """A source is a ``Source``, a ``TfdsSource`` or one's own with every member ``SourceProtocol`` lists, of
    the right kind: a source of one's own is input too."""
    if isinstance(source, str):
        raise TfpipeError(
            f"source must be a tfpipe Source or TfdsSource, not the path {source!r}: write_shards(source, out) "
            "(tfpipe 0.1's write_shards(out, source) was removed in 1.0)"
        )
    members = [name for name in dir(SourceProtocol) if not name.startswith("_")]
    missing = [name for name in members if not hasattr(source, name)]
    if missing:
        raise TfpipeError(
            f"source must be a tfpipe Source or TfdsSource (tfpipe.open_source), or have every member of "
            f"tfpipe.SourceProtocol; a {type(source).__name__} has no {', '.join(missing)}"
        )
    kinds = {"labeled": bool, "single_label": bool, "id_column": str, "origin": str}
    for name, kind in kinds.items():
        if not isinstance(getattr(source, name), kind):
            raise TfpipeError(f"source.{name} must be a {kind.__name__} (got {getattr(source, name)!r})")
    classes = source.classes  # type: ignore[attr-defined]  # present: checked above
    if classes is not None and (isinstance(classes, str) or not all(isinstance(c, str) for c in classes)):
        raise TfpipeError(f"source.classes must be None or a list of class names (got {classes!r})")


def checked_items(source: SourceProtocol, skip_bad: bool) -> tuple[list[Item], list[dict[str, str]]]:
    """The source's items, checked like its other members: tfpipe's own sources pass by construction."""
    got = source.items(skip_bad)
    if not (isinstance(got, tuple) and len(got) == 2):
        raise TfpipeError(f"{source.origin}: items() must return (items, skipped), got a {type(got).__name__}")
    items, skipped = list(got[0]), list(got[1])
    seen: set[str] = set()
    for i, item in enumerate(items):
        where = f"{source.origin}: item {i}"
        if not isinstance(item, Item):
            raise TfpipeError(f"{where} is a {type(item).__name__}, not a tfpipe Item")
        if isinstance(item.labels, str) or not all(isinstance(label, str) for label in item.labels):
            raise TfpipeError(f"{where} ({item.name!r}): labels must be a tuple of class names (got {item.labels!r})")
        if source.single_label and len(item.labels) > 1:
            raise TfpipeError(
                f"{where} ({item.name!r}): the source is single-label but the item has {len(item.labels)} labels"
            )
        if item.name in seen:
            raise TfpipeError(f"{where}: the id {item.name!r} comes twice (ids key a submission's rows)")
        seen.add(item.name)
    return items, skipped


def _folds(
    items: Sequence[Item],
    item_targets: Sequence[Sequence[int]] | None,
    num_classes: int,
    k: int | None,
    seed: int,
    groups: Sequence[str] | None,
    identities: Sequence[Identity],
) -> tuple[list[int], KeptCopies | None]:
    """Every item's fold (all 0 without ``k``), byte-identical source images in the fold of the first of them,
    and what was kept together (None: no copy)."""
    if not k:
        return [0] * len(items), None
    if item_targets is None:
        raise TfpipeError(f"{option('num_folds')} needs labels; an unlabeled source cannot be stratified")
    sizes = [len(item.data) if item.data is not None else _size(ident) for item, ident in zip(items, identities)]
    first_of = source_copies(items, sizes)
    pairs = tuple((items[i].name, items[first].name) for i, first in enumerate(first_of) if first != i)
    if not pairs:
        return assign_folds(item_targets, num_classes, k, seed, groups), None
    merged = merge_groups(groups, first_of) if groups is not None else None
    kept = KeptCopies(pairs, merged.merged, merged.into) if merged is not None else KeptCopies(pairs)
    return assign_folds(item_targets, num_classes, k, seed, groups, first_of), kept


def _size(identity: Identity) -> int | None:
    """A file's size from its identity (None: it could not be stat'ed)."""
    return identity[0] if isinstance(identity, tuple) else None
