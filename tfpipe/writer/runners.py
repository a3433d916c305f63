"""Runners: how a write turns its planned records into staged shards (``tfpipe.writer.engine.write_shards`` chooses
one, once, by name). Both write the same records into the same shards, so the manifest and the bytes are equal:

- ``local``: a torch DataLoader on this machine (workers decode, resize and encode; this process writes the
  records in input order, marking each shard finished after its last record -- what ``--resume`` builds on);
- ``beam``: an Apache Beam pipeline (``tfpipe.writer.beam``), one bundle per shard, on any Beam runner.

A runner of one's own implements ``Runner``: ``start`` (as early as possible: the local runner's workers fork
before this process may import TensorFlow) and ``encode`` (fill the staged shards, apply the error policy).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import os
import sys
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import TYPE_CHECKING, Any, Protocol, TypeAlias

from tfpipe.runtime import fs
from tfpipe.runtime.deps import require
from tfpipe.runtime.errors import TfpipeError, option
from tfpipe.runtime.lifecycle import dead_worker_line, loader_dies_with_this_process, stop_behind, with_detail
from tfpipe.sources.source import Item
from tfpipe.writer.encode import encode_item
from tfpipe.writer.images import ImageSpec
from tfpipe.writer.job import Job
from tfpipe.writer.staging import StagedShards

if TYPE_CHECKING:
    from apache_beam.options.pipeline_options import PipelineOptions
    from tqdm import tqdm

LOADER_BATCH = 16  # images per DataLoader batch: amortises inter-process overhead

Encoded: TypeAlias = tuple[int, bytes | None, str | None]  # (index, record, error): a record or an error
Pace: TypeAlias = tuple[int, float]  # (images after the first batch, seconds since it arrived)
# What a write does with an image it cannot use (error, image id): raises, or returns the manifest's entry of it
OnBadImage: TypeAlias = Callable[[str, str], dict[str, str]]


def stop_on_bad_image(error: str, name: str) -> dict[str, str]:
    """The default policy: the first image that cannot be used stops the write, naming it."""
    raise TfpipeError(error)


def skip_bad_image(error: str, name: str) -> dict[str, str]:
    """``skip_bad``: the image is left out and listed in the manifest's ``skipped``, with why."""
    return {"image": name, "reason": error}


@dataclasses.dataclass(frozen=True)
class RunnerSettings:
    """What the runners take from ``write_shards``; each reads its own (Beam has no workers, the DataLoader no
    pipeline options)."""

    workers: int | None = None  # DataLoader workers; None: one per core (0 for JPEGs copied as they are)
    start_method: str = "auto"
    pipeline_args: Sequence[str] = ()  # Beam's pipeline options
    progress: bool = True
    resume: bool = False
    on_bad_image: OnBadImage = stop_on_bad_image  # or skip_bad_image: one policy, for every runner


class Runner(Protocol):
    def start(self, job: Job, spec: ImageSpec, stack: contextlib.ExitStack) -> None:
        """Begins work that may start before the output folder is locked; it stops when ``stack`` closes."""

    def encode(self, staged: StagedShards, job: Job, spec: ImageSpec, out: str) -> Pace | None:
        """Fills every shard of ``staged`` not yet finished; an image that fails goes to the settings'
        ``on_bad_image`` (stop, or skip and list it), in input order. Returns the pace of the work (None: not
        measured)."""


class LocalRunner:
    """A torch DataLoader on this machine; a resumed write starts at the first unfinished record."""

    def __init__(self, settings: RunnerSettings) -> None:
        self.settings = settings
        self.batches: Iterator[list[Encoded]] | None = None
        self.stack: contextlib.ExitStack | None = None

    def start(self, job: Job, spec: ImageSpec, stack: contextlib.ExitStack) -> None:
        self.stack = stack
        if not self.settings.resume:  # a resumed write learns from the staging folder where to start
            self.batches = self._begin(job, spec, 0)

    def _begin(self, job: Job, spec: ImageSpec, first: int) -> Iterator[list[Encoded]]:
        assert self.stack is not None  # start() came first
        workers = default_workers(job.items, spec) if self.settings.workers is None else self.settings.workers
        batches = start_encoding(
            EncodeDataset(job.items, job.targets, spec, first), workers, self.settings.start_method
        )
        self.stack.callback(shutdown, batches)  # no orphan workers after an error or Ctrl-C
        return batches

    def encode(self, staged: StagedShards, job: Job, spec: ImageSpec, out: str) -> Pace:
        first = staged.first_unfinished_record()
        batches = self.batches if self.batches is not None else self._begin(job, spec, first)
        return _write_local(batches, staged, job, self.settings, first, out)


class BeamRunner:
    """An Apache Beam pipeline (``tfpipe.writer.beam``); its options are checked when it is made, before any work."""

    def __init__(self, settings: RunnerSettings) -> None:
        if settings.resume:
            raise TfpipeError(
                f"{option('resume', True)} works with the default runner; with {option('runner', 'beam')} "
                "run the job again (Beam runners retry failed work themselves)"
            )
        from tfpipe.writer.beam import pipeline_options

        self.options: PipelineOptions = pipeline_options(settings.pipeline_args)
        self.on_bad_image = settings.on_bad_image

    def start(self, job: Job, spec: ImageSpec, stack: contextlib.ExitStack) -> None:
        pass  # the pipeline runs in encode()

    def encode(self, staged: StagedShards, job: Job, spec: ImageSpec, out: str) -> None:
        _write_with_beam(staged, job, spec, self.on_bad_image, self.options)


RUNNERS: dict[str, Callable[[RunnerSettings], Runner]] = {"local": LocalRunner, "beam": BeamRunner}


def make_runner(name: str, settings: RunnerSettings) -> Runner:
    """The runner ``name`` names (``RUNNERS``), its settings checked."""
    if name not in RUNNERS:
        raise TfpipeError(f"unknown runner {name!r}: use {' or '.join(RUNNERS)}")
    return RUNNERS[name](settings)


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
    itself until the write ends) -- the script would hang instead of failing."""
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
    more than it saves."""
    if (
        spec.image_size is None
        and spec.format == "jpeg"
        and all(item.path.lower().endswith((".jpg", ".jpeg")) for item in items)
    ):
        return 0
    return os.cpu_count() or 1  # None: the count is unknown


def shutdown(batches: object) -> None:
    """Stops DataLoader workers now (Ctrl-C, errors) instead of whenever the iterator is collected."""
    stop = getattr(batches, "_shutdown_workers", None)
    if stop is not None:
        stop()


def _write_local(
    batches: Iterable[list[Encoded]],
    staged: StagedShards,
    job: Job,
    settings: RunnerSettings,
    start: int,
    out: str,
) -> Pace:
    """The default runner's writing loop, with a progress bar; Ctrl-C says what was kept and how to go on."""
    from tqdm import tqdm

    shown = settings.progress
    bar = tqdm(total=len(job.items), initial=start, unit="img", disable=not shown, desc=f"write {job.split}")
    try:
        return _write_records(batches, staged, job, settings.on_bad_image, bar)
    except KeyboardInterrupt as e:  # Ctrl-C or SIGTERM
        raise with_detail(e, _kept(staged, job, out)) from None
    except Exception as e:  # a worker that died (the out-of-memory killer's SIGKILL): what is kept, too
        stop = stop_behind(e)  # a SIGTERM to the process group ends the workers as well: the stop is the news
        if stop is not None:
            raise with_detail(stop, _kept(staged, job, out)) from None
        line = dead_worker_line(e)
        if line is None:
            raise
        raise TfpipeError(f"{line}; {_kept(staged, job, out)}") from None


def _kept(staged: StagedShards, job: Job, out: str) -> str:
    return (
        f"{len(staged.finished)} of {len(job.shard_plan)} shards were finished and are kept in {out}/.staging; "
        f"continue with {option('resume', True)}"
    )


def _write_records(
    batches: Iterable[list[Encoded]],
    staged: StagedShards,
    job: Job,
    on_bad_image: OnBadImage,
    bar: tqdm[Any],
) -> Pace:
    """Appends encoded records to their shards in input order, marking each shard finished after its last record.
    Returns (images after the first batch, seconds since the first batch arrived): the pace of the work itself,
    without the start-up (workers starting, the first images decoding)."""
    first, after_first = None, 0
    items, shard_of, last_of_shard = job.items, job.shard_of, job.last_of_shard
    with bar:
        for batch in batches:
            if first is None:
                first = time.perf_counter()
            else:
                after_first += len(batch)
            for i, record, error in batch:
                if error is not None:
                    staged.skip(shard_of[i], on_bad_image(error, items[i].name))
                else:
                    assert record is not None  # encode_item gives a record or an error
                    staged.write(shard_of[i], record)
                if i in last_of_shard:
                    staged.finish(last_of_shard[i])
            bar.update(len(batch))
    return after_first, (time.perf_counter() - first) if first is not None else 0.0


def _write_with_beam(
    staged: StagedShards, job: Job, spec: ImageSpec, on_bad_image: OnBadImage, options: PipelineOptions
) -> None:
    """Runs the Beam pipeline into the staging folder, then applies the error policy as ``_write_records`` does:
    to the failures in input order (the first one stops the write by default, as the local runner's would)."""
    from tfpipe.writer.beam import encode_shards

    parts = {s["index"]: staged.staged_path(s["index"]) for s in job.shard_plan}
    results = encode_shards(parts, job.items, job.targets, spec, job.shard_plan, options)
    entries = {
        (i, name): on_bad_image(error, name) for i, name, error in sorted(f for r in results.values() for f in r[1])
    }
    for index, (count, fails) in sorted(results.items()):
        staged.add_finished(index, count, [entries[i, name] for i, name, _ in fails])
