"""The writer's engine: ``write_shards(source, out, ...)`` -- plan the job (``tfpipe.writer.job``), encode it with a
runner (``tfpipe.writer.runners``) into staged shards (``tfpipe.writer.staging``), commit them with
``manifest.json``, and say what was written. ``open_source`` turns the command line's words (or a notebook's) into
a source.

``python -m tfpipe.write`` (``tfpipe/write.py``) is the command over it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import sys
import time
from collections.abc import Sequence

from tfpipe.format import schema
from tfpipe.format.manifest import MANIFEST, Manifest, StoredImages
from tfpipe.format.shards import check_split
from tfpipe.runtime.errors import TfpipeError, check_count, check_path, check_seed, option
from tfpipe.runtime.locks import locked_folder
from tfpipe.sources.csv import group_like_columns, label_columns
from tfpipe.sources.folds import Balance
from tfpipe.sources.labels import LabelFormat
from tfpipe.sources.source import Source, SourceProtocol
from tfpipe.sources.tfds import TfdsSource
from tfpipe.version import __version__
from tfpipe.writer.copies import Copy, copy_lines, find_copies
from tfpipe.writer.images import ImageSpec
from tfpipe.writer.job import Job, check_source, plan_job
from tfpipe.writer.runners import Pace, RunnerSettings, make_runner, skip_bad_image, stop_on_bad_image
from tfpipe.writer.staging import StagedShards, check_destination, finish_commit

MAX_LISTED_SKIPS = 5  # how many skipped files the summary line names


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
        see ``tfpipe.writer.beam``): same records, same shards, same manifest.
      pipeline_args: Beam pipeline options for ``runner="beam"``.

    Returns:
      The ``Manifest`` written (``tfpipe.format.manifest``).
    """
    started = time.perf_counter()
    _check_settings(source, out, spec, split, num_shards, num_folds, workers, seed)
    policy = skip_bad_image if skip_bad else stop_on_bad_image
    settings = RunnerSettings(workers, start_method, tuple(pipeline_args), progress, resume, policy)
    encoder = make_runner(runner, settings)  # chosen once; Beam's options are refused here, before any work
    job = plan_job(source, spec, classes, split, num_shards, num_folds, seed, skip_bad)
    with contextlib.ExitStack() as running:  # no orphan workers after an error or Ctrl-C
        # The local runner's workers start first (before this process may import TensorFlow for gs:// output,
        # so they can fork); a resumed write must first learn from the staging folder where to start.
        encoder.start(job, spec, running)
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
                pace = encoder.encode(staged, job, spec, out)
                if sum(staged.counts) == 0:
                    raise TfpipeError(f"every image was skipped; nothing written to {out}")
                copies = find_copies((staged.staged_path(s["index"]), s["fold"]) for s in job.shard_plan)
                lock.check()
                manifest = staged.commit(_manifest(job, spec, staged), replace=replace)
    _summary(manifest, out, time.perf_counter() - started, pace)
    for line in _after_summary(job, manifest, copies, num_shards):  # what the user reads last
        print(f"tfpipe.write: warning: {line}", file=sys.stderr, flush=True)
    return manifest


def _check_settings(
    source: object,
    out: object,
    spec: object,
    split: object,
    num_shards: int | None,
    num_folds: int | None,
    workers: int | None,
    seed: int,
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
    """Prints the copies kept in one fold and how even the folds by group are; returns the warnings: another shard
    count than ``asked`` (folds share it out evenly), uneven folds, copies."""
    if job.kept is not None:
        print(f"tfpipe.write: {job.kept.line()}")
    warnings = copy_lines(copies, job.classes) + group_hints(job)
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


def group_hints(job: Job) -> list[str]:
    """Folds written from a CSV without ``--group-col`` that has a column reading like a group: one line each,
    saying what validation may over-promise (a hint; the write stands)."""
    source = job.source
    csv = getattr(source, "csv", None)
    if not job.num_folds or job.group_column is not None or not isinstance(csv, str):
        return []
    fmt = getattr(source, "label_format", None)
    used = [getattr(source, "image_col", ""), *(label_columns(fmt) if fmt is not None else ())]
    return [
        f"{csv}: column {column!r} reads like a group ({values} values over {rows} rows) and the folds were drawn "
        f"without it: images of one {' '.join(column.split())} in both training and validation folds make "
        f"validation over-promise; write again with {option('group_col', column)} to keep each in one fold (a hint: "
        "nothing was refused)"
        for column, values, rows in group_like_columns(csv, used, job.num_folds)
    ]


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


def open_source(
    images: str | None = None,
    csv: str | None = None,
    *,
    tfds: str | None = None,
    tfds_split: str = "train",
    data_dir: str | None = None,
    image_col: str = "image",
    label_format: LabelFormat = LabelFormat(),
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
