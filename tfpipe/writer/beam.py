"""The writer's Apache Beam runner: the same per-image encode, spread over a Beam runner's workers.

    python -m tfpipe.write --csv train.csv --images images --out records/train --image-size 256 --num-folds 5 \
        --runner beam -- --direct_num_workers=2 --direct_running_mode=multi_processing

Everything after ``--`` is a Beam pipeline option (DirectRunner locally by default; e.g.
``--runner=DataflowRunner --project=P --region=R --temp_location=gs://B/tmp --setup_file=./setup.py``
on Dataflow, where tfpipe must be installed on the workers and paths are ``gs://``).

The driver (``tfpipe.write``) plans exactly as for the default runner: classes,
folds, the shard plan. It writes each shard's slice of the input list to
``.staging/<shard>.plan`` (so the pipeline graph stays small however many
images there are), runs the pipeline below, then renames the shards into place
and writes the manifest as the default runner does. Records are written in
input order within each shard, so the output is byte-identical to the default
writer's on the same input (tested).

Pipeline, one element per shard, then per image::

    shard plans -> read plan (one element per image) -> Reshuffle (spread images over workers)
      -> encode (tfpipe.writer.encode.encode_item) -> group by shard -> write the shard in input order
      + .staging/<shard>.done (count, and images that failed: the driver applies the error policy)

Not supported: ``--resume`` (a Beam runner retries failed work itself; a failed
job is run again whole). Each shard's records meet in one worker's memory when
it is written (~150 MB at the default shard size).
"""

from __future__ import annotations

import contextlib
import io
import json
import logging
import pickle
import posixpath
from collections.abc import Iterable, Iterator, Mapping, Sequence
from types import ModuleType
from typing import TYPE_CHECKING, TypeAlias

from tfpipe.runtime import fs
from tfpipe.runtime.errors import TfpipeError
from tfpipe.writer.encode import encode_item

if TYPE_CHECKING:
    from apache_beam.options.pipeline_options import PipelineOptions

    from tfpipe.sources.source import Item
    from tfpipe.writer.images import ImageSpec
    from tfpipe.writer.job import PlannedShard

# (record index, item, target) of one image of a shard's plan; its encoded form: (record index, image name,
# record or None, error or None).
PlanEntry: TypeAlias = "tuple[int, Item, Sequence[int] | None]"
Encoded: TypeAlias = tuple[int, str, bytes | None, str | None]


def _side_path(part: str, suffix: str) -> str:
    return posixpath.splitext(part)[0] + suffix


def _read_plan(part: str) -> Iterator[tuple[str, PlanEntry]]:
    """Yields (part, (record index, item, target)) for every image of one shard."""
    with fs.open(_side_path(part, ".plan"), "rb") as f:
        for entry in pickle.loads(f.read()):
            yield part, entry


def _encode(element: tuple[str, PlanEntry], spec: ImageSpec) -> tuple[str, Encoded]:
    part, (i, item, target) = element
    record, error = encode_item(item, target, spec)
    return part, (i, item.name, record, error)


def _write_shard(element: tuple[str, Iterable[Encoded]]) -> None:
    """Writes one shard's records in input order; records the count and the failures beside it."""
    from tfpipe.format.tfrecord import RecordWriter

    part, encoded = element
    encoded = sorted(encoded, key=lambda e: e[0])
    failed = [(i, name, error) for i, name, record, error in encoded if error is not None]
    writer = RecordWriter(part)
    try:
        for _, _, record, error in encoded:
            if error is None:
                assert record is not None  # encode_item gives a record exactly when it gives no error
                writer.write(record)
    finally:
        writer.close()
    fs.write_atomic(_side_path(part, ".done"), json.dumps({"count": len(encoded) - len(failed), "failed": failed}))


QUIET = ("--default_sdk_harness_log_level=WARNING",)  # Beam's workers otherwise log every start-up step


def _import_beam() -> ModuleType:
    from tfpipe.runtime.deps import require

    logging.disable(logging.WARNING)  # Beam's import warns about optional Google Cloud clients we do not use
    try:
        return require("apache_beam")
    finally:
        logging.disable(logging.NOTSET)


def pipeline_options(pipeline_args: Iterable[str]) -> PipelineOptions:
    """Beam's ``PipelineOptions`` from command-line flags; a flag Beam does not know is an error here
    (Beam itself would only log that it discards it)."""
    options_class = _import_beam().options.pipeline_options.PipelineOptions
    args = list(pipeline_args)
    if not any(a.startswith("--default_sdk_harness_log_level") for a in args):
        args += QUIET
    captured = io.StringIO()
    logging.disable(logging.WARNING)
    try:
        with contextlib.redirect_stderr(captured):
            options = options_class(args)
            known = options.get_all_options()
            unknown = sorted(set(options.get_all_options(retain_unknown_options=True)) - set(known))
    except SystemExit:  # argparse refused a value
        lines = captured.getvalue().strip().splitlines() or ["bad value"]
        raise TfpipeError(f"Beam pipeline options: {lines[-1].split('error: ', 1)[-1]}") from None
    finally:
        logging.disable(logging.NOTSET)
    if unknown:
        raise TfpipeError(f"Beam pipeline options not understood: {', '.join('--' + u for u in unknown)}")
    return options


def encode_shards(
    parts: Mapping[int, str],
    items: Sequence[Item],
    item_targets: Sequence[Sequence[int]] | None,
    spec: ImageSpec,
    shard_plan: Sequence[PlannedShard],
    options: PipelineOptions,
) -> dict[int, tuple[int, list[tuple[int, str, str]]]]:
    """Encodes and writes the shards of ``shard_plan`` with Apache Beam.

    Args:
      parts: the staged file of each shard of the plan, by shard index.
      items, item_targets: the input in write order (targets None when unlabeled).
      spec: the ``ImageSpec``.
      shard_plan: from ``tfpipe.writer.job.plan``.
      options: from ``pipeline_options``.

    Returns:
      ``{shard index: (count, [(record index, image name, error), ...])}``.
    """
    beam = _import_beam()
    for s in shard_plan:
        rows = range(s["start"], s["start"] + s["size"])
        entries = [(i, items[i], None if item_targets is None else item_targets[i]) for i in rows]
        fs.write_atomic(_side_path(parts[s["index"]], ".plan"), pickle.dumps(entries))
    with beam.Pipeline(options=options) as p:
        _ = (
            p
            | "ShardPlans" >> beam.Create([parts[s["index"]] for s in shard_plan])
            | "Images" >> beam.FlatMap(_read_plan)
            | "Spread" >> beam.Reshuffle()  # else a runner fuses each shard's images onto one worker
            | "Encode" >> beam.Map(_encode, spec)
            | "ByShard" >> beam.GroupByKey()
            | "WriteShard" >> beam.Map(_write_shard)
        )
    results: dict[int, tuple[int, list[tuple[int, str, str]]]] = {}
    for s in shard_plan:
        with fs.open(_side_path(parts[s["index"]], ".done"), "r") as f:
            done = json.loads(f.read())
        results[s["index"]] = done["count"], [tuple(e) for e in done["failed"]]
    return results
