"""Write a Kaggle-style image folder + CSV as sharded TFRecords.

    python -m tfpipe.write --csv data/demo/train.csv --images data/demo/images \
        --out records/demo/train --image-size 128 --num-folds 5

Steps: read the source (CSV or folder-per-class) -> fix the classes -> assign
folds -> plan shards -> decode/resize/encode/serialize in a torch DataLoader
-> write shards in input order under staging names -> rename them into place
and write ``manifest.json``. See ``python -m tfpipe.write --help``.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import hashlib
import json
import os
import sys
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any, TypeAlias

from tfpipe import __version__, fs, schema
from tfpipe.copies import Copy, copy_lines, find_copies
from tfpipe.deprecations import add_deprecated_flag, changed_arguments
from tfpipe.deps import require
from tfpipe.encode import encode_item
from tfpipe.errors import ArgumentParser, TfpipeError, check_count, check_path, check_seed, option, run_cli
from tfpipe.folds import Balance, assign_folds, fold_balance
from tfpipe.images import FITS, FORMATS, ImageSpec, from_millions
from tfpipe.manifest import MANIFEST, Manifest, StoredImages
from tfpipe.processes import loader_dies_with_this_process
from tfpipe.shards import STAT_THREADS, check_split
from tfpipe.sources import Item, LabelFormat, Source, SourceProtocol, class_names, targets
from tfpipe.staging import PlannedShard, StagedShards, check_destination, finish_commit, locked_folder, plan
from tfpipe.staging import num_shards as shard_count
from tfpipe.tfds_source import TfdsSource

if TYPE_CHECKING:
    from apache_beam.options.pipeline_options import PipelineOptions
    from tqdm import tqdm

RUNNERS = ("local", "beam")
LOADER_BATCH = 16  # images per DataLoader batch: amortises inter-process overhead
EST_BYTES_PER_PIXEL = {"jpeg": 0.5, "png": 2.0}  # for shard planning before any image is encoded
MAX_LISTED_SKIPS = 5  # how many skipped files the summary line names

Encoded: TypeAlias = tuple[int, bytes | None, str | None]  # (index, record, error): a record or an error
Identity: TypeAlias = tuple[int, int] | str | None  # (size, mtime_ns) of a file, a hash of in-memory bytes, None
Pace: TypeAlias = tuple[int, float]  # (images after the first batch, seconds since it arrived)


class EncodeDataset:
    """Map-style dataset for the DataLoader: index -> (index, record bytes, error), run in worker processes."""

    def __init__(
        self, items: Sequence[Item], item_targets: Sequence[Sequence[int]] | None, spec: ImageSpec, start: int = 0
    ) -> None:
        self.items, self.targets, self.spec, self.start = items, item_targets, spec, start

    def __len__(self) -> int:
        return len(self.items) - self.start

    def __getitem__(self, i: int) -> Encoded:
        i += self.start  # --resume: records of finished shards are not encoded again
        return (i, *encode_item(self.items[i], None if self.targets is None else self.targets[i], self.spec))


def _keep_batch(batch: list[Encoded]) -> list[Encoded]:
    return batch  # a list of (index, record, error); no tensors involved


def _worker_init(dies_with_parent: Callable[[int], None], worker_id: int) -> None:
    import cv2

    dies_with_parent(worker_id)
    cv2.setNumThreads(1)  # one process per core already; OpenCV threads would oversubscribe


def start_encoding(dataset: EncodeDataset, num_workers: int, start_method: str) -> Iterator[list[Encoded]]:
    """Starts DataLoader workers and returns an iterator of batches in input order.

    Each batch is a list of (index, record, error). The workers start (and
    begin encoding) at once, so their start-up overlaps the main process's own
    (importing TensorFlow, for remote output only). ``start_method="auto"`` forks
    while TensorFlow is not yet imported here (fast: nothing to re-import) and
    otherwise spawns, because a fork of a process where TensorFlow runs threads
    can hang (e.g. in a notebook that already trained a model).
    """
    DataLoader = require("torch.utils.data").DataLoader

    if start_method == "auto":
        remote = fs.is_remote(dataset.items[0].path) if dataset.items else False  # workers then use TensorFlow
        start_method = "spawn" if "tensorflow" in sys.modules or remote else "fork"

    loader = DataLoader(
        dataset,
        batch_size=LOADER_BATCH,
        shuffle=False,
        num_workers=num_workers,
        collate_fn=_keep_batch,
        worker_init_fn=functools.partial(_worker_init, loader_dies_with_this_process(start_method))
        if num_workers
        else None,
        multiprocessing_context=start_method if num_workers else None,
        prefetch_factor=4 if num_workers else None,
    )
    if num_workers and start_method in ("spawn", "forkserver"):
        check_main_guard()
    return iter(loader)


MAIN_GUARD = (
    "with the 'spawn' start method (used once TensorFlow is imported) every DataLoader worker imports your script "
    'again, so a call at its top level runs again there: put it under `if __name__ == "__main__":`, or pass '
    "workers=0"
)


def check_main_guard() -> None:
    """Before spawning workers: refuses a call from the top level of a script (``python script.py``) outside an
    ``if __name__ == "__main__":`` block. Each spawned worker runs such a script again, fails as it starts, and
    Python's spawn then waits for good writing the job to the dead worker (it keeps the pipe's other end open
    itself until the write ends) -- the script hung instead of failing."""
    import ast
    import inspect

    main = sys.modules.get("__main__")
    path = getattr(main, "__file__", None)
    if main is None or not path:  # a notebook, python -c: nothing re-runs
        return
    if not os.path.isfile(path):  # python - < script.py: every worker would fail to find <stdin>
        raise TfpipeError(f"the main script is {path}, which spawned DataLoader workers cannot import; pass workers=0")
    lines = [f.lineno for f in inspect.stack(0) if f.frame.f_globals is vars(main) and f.function == "<module>"]
    if not lines:
        return
    try:
        tree = ast.parse(fs.read_text(path))
    except (SyntaxError, ValueError, OSError):
        return
    guards = [
        node
        for node in ast.walk(tree)
        if isinstance(node, ast.If) and "__name__" in ast.unparse(node.test) and "__main__" in ast.unparse(node.test)
    ]
    if not any(g.lineno <= lines[-1] <= (g.end_lineno or g.lineno) for g in guards):
        raise TfpipeError(f"{path}, line {lines[-1]}: {MAIN_GUARD}")


def default_workers(items: Sequence[Item], spec: ImageSpec) -> int:
    """One worker per core, except when JPEGs will mostly be copied as they are (no ``--image-size``):
    then there is no codec work to spread, and moving each file's bytes through a worker process costs
    more than it saves (measured: 700 vs 490 images/s on 2 cores)."""
    if (
        spec.image_size is None
        and spec.format == "jpeg"
        and all(item.path.lower().endswith((".jpg", ".jpeg")) for item in items)
    ):
        return 0
    return os.cpu_count() or 1  # None: the count is unknown


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
) -> str:
    """A hash of everything that decides the output bytes, so --resume never mixes two different jobs: settings,
    classes, plan, the group column, and per image its id, path, labels, group and ``identities`` (the file's
    size and modification time; the bytes' hash for in-memory images), so an image changed since an earlier
    write is a new job. (Writes without groups hash as before groups existed.)"""
    settings: list[Any] = [split, names, dataclasses.asdict(spec), shard_plan, schema.describe()]
    h = hashlib.sha256(json.dumps(settings + ([group_column] if group_column else [])).encode())
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


def shutdown(batches: object) -> None:
    """Stops DataLoader workers now (Ctrl-C, errors) instead of whenever the iterator is collected."""
    stop = getattr(batches, "_shutdown_workers", None)
    if stop is not None:
        stop()


@changed_arguments(renamed={"shards": "num_shards", "folds": "num_folds"}, removed={"num_workers": "workers="})
def write_shards(
    source: SourceProtocol,
    out: str,
    *,
    spec: ImageSpec = ImageSpec(),  # noqa: B008 (frozen dataclass: one shared default is safe)
    classes: Sequence[str] | None = None,
    split: str = "train",
    num_shards: int | None = None,
    num_folds: int | None = None,
    seed: int = 0,
    skip_bad: bool = False,
    overwrite: bool = False,
    resume: bool = False,
    workers: int | None = None,
    start_method: str = "auto",
    progress: bool = True,
    runner: str = "local",
    pipeline_args: Sequence[str] = (),
) -> Manifest:
    """Writes a source as sharded TFRecords plus ``manifest.json`` into ``out`` (what a call writes comes last).

    Example::

        import tfpipe
        manifest = tfpipe.write_shards(tfpipe.Source("images", csv="train.csv"), "records/train", num_folds=5)

    Args:
      source: a ``Source`` (images + CSV, or a folder per class) or a ``TfdsSource``.
      out: output folder, local or ``gs://``.
      spec: an ``ImageSpec`` (image_size, fit, format, quality).
      classes: class names in index order, or None for sorted unique labels.
      split: name prefix of the shards; a split written with an unlabeled
        ``Source`` has no ``target`` feature.
      num_shards: number of shards (default: a multiple of 8 giving ~150 MB shards).
      num_folds: K, the number of stratified folds to assign; shards never mix folds.
      seed: seed of the fold assignment.
      skip_bad: skip unreadable or missing images (listed in the manifest) instead of stopping.
      overwrite: replace the dataset an earlier ``tfpipe.write`` left in ``out`` (only the files its
        manifest lists are deleted), or start over after an interrupted write. Never replaces another
        split's dataset or ``*.tfrec`` files tfpipe did not write: those are refused.
      resume: continue an interrupted write of the same job into ``out``: shards
        it finished are kept, the rest are written; the result is identical to
        an uninterrupted write. If the same job already finished there, nothing is done; a finished
        write of other inputs is refused. One writer at a time per folder (a lock file).
      workers: DataLoader workers (default: CPU count; 0 runs in this process, the default when
        every input is a JPEG and no ``spec.image_size`` is set, i.e. bytes are mostly copied as they are).
      start_method: "auto" (fork unless TensorFlow is already imported, else
        spawn), or a multiprocessing start method.
      progress: show a tqdm progress bar.
      runner: "local" (a torch DataLoader on this machine) or "beam" (Apache Beam;
        see ``tfpipe.beam``): same records, same shards, same manifest.
      pipeline_args: Beam pipeline options for ``runner="beam"``.

    ``shards=`` and ``folds=`` (tfpipe 0.x's names of ``num_shards`` and ``num_folds``) still work and warn.

    Returns:
      The ``Manifest`` written (``tfpipe.manifest``).
    """
    started = time.perf_counter()
    _check_settings(source, out, spec, split, num_shards, num_folds, workers, seed, runner, resume)
    job = plan_job(source, spec, classes, split, num_shards, num_folds, seed, skip_bad)
    beam_options = _beam_options(pipeline_args) if runner == "beam" else None  # refuse bad options before work
    workers = default_workers(job.items, spec) if workers is None else workers
    with contextlib.ExitStack() as workers_running:  # no orphan workers after an error or Ctrl-C
        # Start the workers first (before this process may import TensorFlow for gs:// output, so they can fork);
        # a resumed write must first learn from the staging folder where to start.
        batches: Iterator[list[Encoded]] | None = None
        if runner == "local" and not resume:
            batches = _start(workers_running, EncodeDataset(job.items, job.targets, spec), workers, start_method)
        # One writer per folder, locked before anything in it is touched.
        with locked_folder(out, "tfpipe.write", job.fingerprint) as lock:
            committed = finish_commit(out, job.fingerprint) if resume else None  # a commit killed half-way
            finished, replace = (
                (committed, None) if committed else check_destination(out, split, job.fingerprint, overwrite, resume)
            )
            if finished is not None:
                done = "its commit, killed half-way, is finished now" if committed else "nothing to do"
                print(f"{out}: this write already finished ({finished.num_examples} images, same inputs); {done}")
                return finished
            with StagedShards(out, split, job.shard_plan, job.fingerprint, resume=resume, discard=overwrite) as staged:
                if runner == "local" and batches is None:  # a resumed write starts at the first unfinished record
                    first = staged.first_unfinished_record()
                    batches = _start(
                        workers_running, EncodeDataset(job.items, job.targets, spec, first), workers, start_method
                    )
                pace = _encode(staged, job, spec, runner, batches, skip_bad, beam_options, progress, out)
                if sum(staged.counts) == 0:
                    raise TfpipeError(f"every image was skipped; nothing written to {out}")
                copies = find_copies((staged.staged_path(s["index"]), s["fold"]) for s in job.shard_plan)
                lock.check()
                manifest = staged.commit(_manifest(job, spec, staged), replace=replace)
    _summary(manifest, out, time.perf_counter() - started, pace)
    for line in _after_summary(job, manifest, copies, num_shards):  # what the user reads last
        print(f"tfpipe.write: warning: {line}", file=sys.stderr, flush=True)
    return manifest


def _start(
    stack: contextlib.ExitStack, dataset: EncodeDataset, workers: int, start_method: str
) -> Iterator[list[Encoded]]:
    """Starts encoding ``dataset``; its workers stop when ``stack`` closes."""
    batches = start_encoding(dataset, workers, start_method)
    stack.callback(shutdown, batches)
    return batches


def _encode(
    staged: StagedShards,
    job: Job,
    spec: ImageSpec,
    runner: str,
    batches: Iterator[list[Encoded]] | None,
    skip_bad: bool,
    beam_options: PipelineOptions | None,
    progress: bool,
    out: str,
) -> Pace | None:
    """Encodes every record not yet finished into ``staged`` with the chosen runner. Returns the writing pace
    (images after the first batch, seconds since it arrived) of the default runner, None for Beam."""
    if runner == "beam":
        assert beam_options is not None  # write_shards makes them for runner="beam"
        _write_with_beam(staged, job, spec, skip_bad, beam_options)
        return None
    assert batches is not None  # write_shards starts the workers for the default runner
    return _write_local(batches, staged, job, skip_bad, progress, staged.first_unfinished_record(), out)


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
    num_shards: int | None,
    num_folds: int | None,
    seed: int,
    skip_bad: bool,
) -> Job:
    """Reads the source and decides classes, folds (records grouped by fold, input order within) and shards."""
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
    fold_of = _folds(item_targets, len(names), num_folds, seed, groups) if num_folds else [0] * len(items)
    balance = fold_balance(item_targets or [], fold_of, len(names), num_folds) if groups and num_folds else None
    group_column = (getattr(source, "group_col", None) or "group") if groups else None
    order = sorted(range(len(items)), key=lambda i: fold_of[i])  # stable: input order within a fold
    items = [items[i] for i in order]
    item_targets = [item_targets[i] for i in order] if item_targets is not None else None  # None: unlabeled
    fold_sizes = [fold_of.count(f) for f in range(num_folds or 1)]
    identities = input_identities(items)  # one stat per file (measured: 14 ms for 5,000 local files)
    shard_plan = plan(fold_sizes, shard_count(len(items), estimate_bytes(items, spec, identities), num_shards))
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
        job_fingerprint(items, item_targets, names, shard_plan, spec, split, identities, group_column),
        balance,
        group_column,
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


def _check_settings(
    source: object,
    out: object,
    spec: object,
    split: object,
    num_shards: int | None,
    num_folds: int | None,
    workers: int | None,
    seed: int,
    runner: str,
    resume: bool,
) -> None:
    """Every setting of ``write_shards`` checked before any worker starts or ``out`` is made."""
    check_source(source)
    if not isinstance(spec, ImageSpec):
        raise TfpipeError(f"spec must be an ImageSpec, e.g. ImageSpec(image_size={spec!r}) (got {spec!r})")
    check_path(out=out)
    check_split(split)
    check_count(1, num_shards=num_shards)
    check_count(2, num_folds=num_folds)
    if num_shards and num_folds and num_shards < num_folds:
        raise TfpipeError(
            f"{option('num_shards', num_shards)} is fewer than {option('num_folds', num_folds)}: shards never mix "
            "folds, so each fold needs a shard of its own"
        )
    check_count(0, workers=workers)
    check_seed(seed=seed)
    _check_runner(runner, resume)


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


def _check_runner(runner: str, resume: bool) -> None:
    if runner not in RUNNERS:
        raise TfpipeError(f"unknown runner {runner!r}: use {' or '.join(RUNNERS)}")
    if runner == "beam" and resume:
        raise TfpipeError(
            f"{option('resume', True)} works with the default runner; with {option('runner', 'beam')} "
            "run the job again (Beam runners retry failed work themselves)"
        )


def _write_local(
    batches: Iterable[list[Encoded]],
    staged: StagedShards,
    job: Job,
    skip_bad: bool,
    progress: bool,
    start: int,
    out: str,
) -> Pace:
    """The default runner's writing loop, with a progress bar; Ctrl-C says what was kept and how to go on."""
    from tqdm import tqdm

    bar = tqdm(total=len(job.items), initial=start, unit="img", disable=not progress, desc=f"write {job.split}")
    try:
        return _write_records(batches, staged, job.items, job.shard_of, job.last_of_shard, skip_bad, bar)
    except KeyboardInterrupt:
        raise KeyboardInterrupt(
            f"{len(staged.finished)} of {len(job.shard_plan)} shards were finished and "
            f"are kept in {out}/.staging; continue with {option('resume', True)}"
        ) from None


def _write_records(
    batches: Iterable[list[Encoded]],
    staged: StagedShards,
    items: Sequence[Item],
    shard_of: Sequence[int],
    last_of_shard: Mapping[int, int],
    skip_bad: bool,
    bar: tqdm[Any],
) -> Pace:
    """Appends encoded records to their shards in input order, marking each shard finished after its last record.
    Returns (images after the first batch, seconds since the first batch arrived): the pace of the work itself,
    without the start-up (workers starting, the first images decoding)."""
    first, after_first = None, 0
    with bar:
        for batch in batches:
            if first is None:
                first = time.perf_counter()
            else:
                after_first += len(batch)
            for i, record, error in batch:
                if error is not None:
                    if not skip_bad:
                        raise TfpipeError(error)
                    staged.skip(shard_of[i], {"image": items[i].name, "reason": error})
                else:
                    assert record is not None  # encode_item gives a record or an error
                    staged.write(shard_of[i], record)
                if i in last_of_shard:
                    staged.finish(last_of_shard[i])
            bar.update(len(batch))
    return after_first, (time.perf_counter() - first) if first is not None else 0.0


def _beam_options(pipeline_args: Sequence[str]) -> PipelineOptions:
    from tfpipe.beam import pipeline_options

    return pipeline_options(pipeline_args)


def _write_with_beam(staged: StagedShards, job: Job, spec: ImageSpec, skip_bad: bool, options: PipelineOptions) -> None:
    """Runs the Beam pipeline into the staging folder, then applies the error policy as ``_write_records`` does."""
    from tfpipe.beam import encode_shards

    parts = {s["index"]: staged.staged_path(s["index"]) for s in job.shard_plan}
    results = encode_shards(parts, job.items, job.targets, spec, job.shard_plan, options)
    failed = sorted(f for _, fails in results.values() for f in fails)
    if failed and not skip_bad:
        raise TfpipeError(failed[0][2])  # the first bad image in input order, as the default runner reports
    for index, (count, fails) in sorted(results.items()):
        staged.add_finished(index, count, [{"image": name, "reason": error} for _, name, error in fails])


def _folds(
    item_targets: Sequence[Sequence[int]] | None, num_classes: int, k: int, seed: int, groups: Sequence[str] | None
) -> list[int]:
    if item_targets is None:
        raise TfpipeError(f"{option('num_folds')} needs labels; an unlabeled source cannot be stratified")
    return assign_folds(item_targets, num_classes, k, seed, groups)


def _manifest(job: Job, spec: ImageSpec, staged: StagedShards) -> Manifest:
    """The manifest of this write (its shards are filled in when they are committed)."""
    label_format = job.source.label_format
    return Manifest(
        split=job.split,
        classes=tuple(job.classes),
        shards=(),
        labeled=job.source.labeled,
        single_label=job.source.single_label,
        max_labels=max((len(t) for t in job.targets), default=0) if job.targets is not None else None,
        id_column=job.source.id_column,  # the submission's key column
        image=StoredImages(**{f.name: getattr(spec, f.name) for f in dataclasses.fields(StoredImages)}),
        num_folds=job.num_folds,
        group_column=job.group_column,
        seed=job.seed,
        fingerprint=job.fingerprint,  # --resume on a finished folder: the same job (nothing to do) or refused
        skipped=tuple(job.skipped + staged.all_skipped()),
        label_format=dataclasses.asdict(label_format) if label_format is not None else None,
        schema=schema.describe(),
        tfpipe_version=__version__,
    )


def _summary(manifest: Manifest, out: str, seconds: float, pace: Pace | None) -> None:
    """``wrote 2000 images in 8 shards, 2.4 MB, in 1.6 s: 0.9 s start-up, then 2,950 images/s -> OUT``: the rate
    counts the work (from the first encoded batch on), start-up (reading the source, starting workers, the first
    batch) apart; a write too short to measure a pace says only its time."""
    n, shards = manifest.num_examples, len(manifest.shards)
    size = sum(s.bytes or 0 for s in manifest.shards)
    images, work = pace if pace is not None else (0, 0.0)
    rate = f": {seconds - work:.1f} s start-up, then {images / work:,.0f} images/s" if images and work > 0.05 else ""
    print(
        f"wrote {n} image{'s' * (n != 1)} in {shards} shard{'s' * (shards != 1)}, {size / 1e6:.1f} MB, "
        f"in {seconds:.1f} s{rate} -> {out}"
    )
    skipped = manifest.skipped
    if skipped:
        listed = ", ".join(s["image"] for s in skipped[:MAX_LISTED_SKIPS])
        more = f" and {len(skipped) - MAX_LISTED_SKIPS} more" if len(skipped) > MAX_LISTED_SKIPS else ""
        print(f"skipped {len(skipped)} images: {listed}{more} (reasons in {out}/{MANIFEST})")


def _after_summary(job: Job, manifest: Manifest, copies: Sequence[Copy], asked: int | None) -> list[str]:
    """Prints how even the folds by group are; returns the warnings: another shard count than ``asked`` (folds
    share it out evenly), uneven folds, copies."""
    warnings = copy_lines(copies, job.classes)
    if asked and len(job.shard_plan) != asked:
        warnings.insert(
            0,
            f"{len(job.shard_plan)} shards written where {option('num_shards', asked)} asked for {asked}: "
            f"{job.num_folds} folds get an equal share each (shards never mix folds); ask for a multiple of "
            f"{job.num_folds}",
        )
    if job.balance is None:
        return warnings
    line, uneven = _balance_lines(job.balance, manifest, job.classes)
    print(line)
    return [uneven, *warnings] if uneven else warnings


UNEVEN_FOLDS = 1.5  # a fold this many times larger (or smaller) than an even split is worth a warning


def _balance_lines(balance: Balance, manifest: Manifest, classes: Sequence[str]) -> tuple[str, str | None]:
    """(``folds by group 'patient': 5 folds of 296-319 images, no group in two; the class furthest from an even
    share: 'c', 4% off in fold 0``, a warning when groups too large make folds far from an even split)."""
    worst = (
        f"; the class furthest from an even share of its images: {classes[balance.worst_class]!r}, "
        f"{balance.deviation:.0%} off in fold {balance.worst_fold}"
        if balance.worst_class is not None
        else ""
    )
    k = manifest.num_folds or 1
    even = manifest.num_examples / k
    line = (
        f"folds by group {manifest.group_column!r}: {k} folds of {balance.smallest}-{balance.largest} images, no "
        f"group in two{worst}"
    )
    if balance.largest <= UNEVEN_FOLDS * even and balance.smallest >= even / UNEVEN_FOLDS:
        return line, None
    return line, (
        f"folds of {balance.smallest} to {balance.largest} images where an even split is {even:.0f}: some groups "
        f"are too large for {k} even folds, so a validation fold may hold few images or most of them; fewer "
        "folds, or smaller groups, even it out"
    )


def build_parser() -> ArgumentParser:
    p = ArgumentParser(prog="python -m tfpipe.write", description=(__doc__ or "").split("\n\n")[0])
    src = p.add_argument_group("source")
    src.add_argument("--csv", help="Kaggle-style CSV; without it --images is a folder per class")
    src.add_argument("--images", help="folder holding the images")
    src.add_argument("--image-col", default="image", help="CSV column with the file name or id (default: image)")
    src.add_argument("--labels-col", default="labels", help="CSV column with a separated label list (default: labels)")
    src.add_argument(
        "--sep", default=" ", help="separator of --labels-col (default: space); 'list' for cells like ['cat', 'dog']"
    )
    src.add_argument(
        "--spaces-in-names",
        action="store_true",
        help="class names contain spaces: with a --sep that is not whitespace (e.g. ','), a label such "
        "as 'golden retriever' is then read as one name (without it, it is refused: lists "
        "separated by spaces, read with --sep ,, look the same)",
    )
    src.add_argument("--label-cols", help="one-hot label columns, comma-separated (e.g. healthy,rust,scab)")
    src.add_argument("--class-col", help="CSV column with a single class per row (single-label data)")
    src.add_argument("--classes", help="class names in index order, comma-separated (default: sorted labels)")
    src.add_argument("--split", default="train", help="the split's name (train, test, ...): the shards' name prefix")
    src.add_argument(
        "--unlabeled",
        action="store_true",
        help="test images without labels: records carry no target, label columns are not read",
    )
    src.add_argument("--tfds", metavar="NAME", help="read a TensorFlow Datasets dataset instead (e.g. cifar10)")
    src.add_argument("--tfds-split", default="train", help="TFDS split, e.g. train or 'train[:90%%]' (default: train)")
    src.add_argument("--data-dir", help="TFDS data directory (default: TFDS's own)")
    _image_args(p)
    _output_args(p)
    _run_args(p)
    return p


def _image_args(p: argparse.ArgumentParser) -> None:
    img = p.add_argument_group("images")
    img.add_argument("--image-size", type=int, help="resize to S x S (default: keep size, copy JPEGs as they are)")
    img.add_argument(
        "--fit",
        choices=FITS,
        default="stretch",
        help="non-square images: stretch (default, nothing cut off), crop (centre) or pad",
    )
    img.add_argument("--format", choices=FORMATS, default="jpeg", help="stored encoding (default: jpeg)")
    img.add_argument("--quality", type=int, default=95, help="JPEG quality (default: 95)")
    img.add_argument(
        "--max-pixels",
        type=float,
        default=100.0,
        help="refuse source images whose header declares more megapixels, before the rest of the file "
        "is read (default: 100)",
    )
    img.add_argument(
        "--max-bytes",
        type=float,
        default=1000.0,
        help="refuse source files above this many megabytes, before they are opened; no more is ever "
        "read (default: 1000, which holds any 100 MP image)",
    )


def _output_args(p: argparse.ArgumentParser) -> None:
    out = p.add_argument_group("output")
    out.add_argument("--out", required=True, help="the shard folder to write (local or gs://)")
    out.add_argument("--num-shards", type=int, help="number of shards (default: multiple of 8, ~150 MB each)")
    out.add_argument("--num-folds", type=int, metavar="K", help="number of stratified folds; shards never mix folds")
    out.add_argument(
        "--group-col",
        metavar="NAME",
        help="CSV column of each image's group (patient, video, site): every image of a group in one fold",
    )
    add_deprecated_flag(out, "--shards", "--num-shards")
    add_deprecated_flag(out, "--folds", "--num-folds")
    out.add_argument("--seed", type=int, default=0, help="seed of the fold assignment (default: 0)")
    out.add_argument("--skip-bad", action="store_true", help="skip unreadable/missing images and list them")
    out.add_argument(
        "--overwrite",
        action="store_true",
        help="replace the dataset tfpipe.write wrote in --out (only files its manifest lists)",
    )
    out.add_argument(
        "--resume",
        action="store_true",
        help="continue an interrupted write into --out (same command): keep its finished shards",
    )


def _run_args(p: argparse.ArgumentParser) -> None:
    run = p.add_argument_group("run")
    run.add_argument(
        "--workers",
        type=int,
        help="DataLoader workers (default: CPU count; 0 = in-process, the default for JPEG pass-through)",
    )
    run.add_argument(
        "--start-method",
        choices=("auto", "spawn", "forkserver", "fork"),
        default="auto",
        help="how workers start (default: auto = fork unless TensorFlow is already loaded)",
    )
    run.add_argument("--no-progress", action="store_true", help="no progress bar")
    run.add_argument(
        "--runner",
        choices=RUNNERS,
        default="local",
        help="local (default: a torch DataLoader here) or beam (Apache Beam; Beam's own pipeline "
        "options go after --, e.g. -- --runner=DataflowRunner --project=P ...)",
    )


def _csv_list(value: str | None) -> tuple[str, ...]:
    return tuple(v.strip() for v in value.split(",") if v.strip()) if value else ()


def open_source(
    images: str | None = None,
    csv: str | None = None,
    *,
    tfds: str | None = None,
    tfds_split: str = "train",
    data_dir: str | None = None,
    image_col: str = "image",
    label_format: LabelFormat = LabelFormat(),  # noqa: B008 (frozen dataclass: one shared default is safe)
    labeled: bool = True,
    group_col: str | None = None,
) -> SourceProtocol:
    """The source the words name: ``tfds=NAME`` a TFDS dataset, else images (with ``csv``, or a folder per class).

    The command line (``--images``, ``--csv``, ``--tfds``, ...) makes its source here too, so both check alike.

    Example::

        source = tfpipe.open_source("images", csv="train.csv", label_format=tfpipe.LabelFormat(sep=","))
    """
    if tfds:
        unused = {
            "images": images,
            "csv": csv,
            "image_col": image_col != "image",
            "label_format": label_format != LabelFormat(),
            "group_col": group_col is not None,
        }
        given = [option(name) for name, value in unused.items() if value]
        if given:
            raise TfpipeError(f"{option('tfds')} reads a TFDS dataset, which has no {', '.join(given)}")
        return TfdsSource(tfds, split=tfds_split, data_dir=data_dir, labeled=labeled)
    tfds_only = [
        option(name) for name, value in (("tfds_split", tfds_split != "train"), ("data_dir", data_dir)) if value
    ]
    if tfds_only:
        raise TfpipeError(f"{', '.join(tfds_only)} belong to {option('tfds')} NAME, which is not given")
    if not images:
        raise TfpipeError(
            f"give {option('images')} (a folder, with {option('csv')} or a folder per class) or {option('tfds')} NAME"
        )
    return Source(
        images=images, csv=csv, image_col=image_col, label_format=label_format, labeled=labeled, group_col=group_col
    )


def source_from_args(args: argparse.Namespace) -> SourceProtocol:
    """The source the flags name (``tfpipe.open_source``, as from Python)."""
    if args.label_cols and args.class_col:
        raise TfpipeError("--label-cols and --class-col are two label layouts; give one")
    label_format = LabelFormat(
        labels_col=args.labels_col,
        sep=args.sep,
        label_cols=_csv_list(args.label_cols),
        class_col=args.class_col,
        spaces_in_names=args.spaces_in_names,
    )
    return open_source(
        args.images,
        args.csv,
        tfds=args.tfds,
        tfds_split=args.tfds_split,
        data_dir=args.data_dir,
        image_col=args.image_col,
        label_format=label_format,
        labeled=not args.unlabeled,
        group_col=args.group_col,
    )


def run_command(args: argparse.Namespace, pipeline_args: Sequence[str] = ()) -> None:
    """Turns parsed arguments (and Beam options, given after ``--``) into a ``write_shards`` call."""
    check_path(csv=args.csv, images=args.images, data_dir=args.data_dir)
    if pipeline_args and args.runner != "beam":
        raise TfpipeError(
            f"options after -- ({' '.join(pipeline_args)}) are Beam pipeline options; they need --runner beam"
        )
    source = source_from_args(args)
    spec = ImageSpec(
        image_size=args.image_size,
        fit=args.fit,
        format=args.format,
        quality=args.quality,
        max_pixels=from_millions(args.max_pixels, "max_pixels"),
        max_bytes=from_millions(args.max_bytes, "max_bytes"),
    )  # checks every setting, before any work
    label_cols = list(source.label_format.label_cols) if source.label_format else []
    write_shards(
        source,
        args.out,
        spec=spec,
        classes=list(_csv_list(args.classes)) or label_cols or None,
        split=args.split,
        num_shards=args.num_shards,
        num_folds=args.num_folds,
        seed=args.seed,
        skip_bad=args.skip_bad,
        overwrite=args.overwrite,
        resume=args.resume,
        workers=args.workers,
        start_method=args.start_method,
        progress=not args.no_progress,
        runner=args.runner,
        pipeline_args=pipeline_args,
    )


def main(argv: Sequence[str] | None = None) -> int:

    argv = list(sys.argv[1:] if argv is None else argv)
    cut = argv.index("--") if "--" in argv else len(argv)  # after "--": Beam's options (it has its own --runner)
    return run_cli("tfpipe.write", run_command, build_parser().parse_args(argv[:cut]), argv[cut + 1 :])


if __name__ == "__main__":
    sys.exit(main())
