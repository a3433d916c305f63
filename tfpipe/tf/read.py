"""The reader: ``make_dataset`` turns shards into TPU-ready ``(images, targets)`` batches.

Evaluation (``training=False``) keeps the written order: shards sorted by name,
records in file order. Training shuffles files and records, interleaves reads
across shards, augments, repeats, and drops the last partial batch so every
shape is static (TPUs need that). Both parse a whole batch of records in one
vectorised ``tf.io.parse_example`` call; images stay uint8 until they reach
the model (normalising there moves 4x fewer bytes to the accelerator).
"""

from __future__ import annotations

import re
import sys
import warnings
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Literal

from tfpipe.runtime.deps import require

if TYPE_CHECKING:
    import tensorflow as tf
else:
    tf = require("tensorflow")  # or one line saying what to install
from tfpipe.format.sampling import check_sampling
from tfpipe.format.sampling import class_counts as sampling_counts
from tfpipe.format.shards import MANIFEST, Records, Shards, fold_split, open_shards
from tfpipe.runtime.errors import TfpipeError, check_count
from tfpipe.tf import augment as aug_lib
from tfpipe.tf.batches import as_tuples as as_tuples
from tfpipe.tf.batches import evaluation_batches as evaluation_batches
from tfpipe.tf.batches import local_count, padded_batches
from tfpipe.tf.batches import pad_to_replicas as pad_to_replicas
from tfpipe.tf.batches import training_batches as training_batches
from tfpipe.tf.columns import read_targets
from tfpipe.tf.data_service import check_service
from tfpipe.tf.parse import AUTOTUNE
from tfpipe.tf.parse import Parser as Parser
from tfpipe.tf.parse import ReadOptions as ReadOptions
from tfpipe.tf.parse import targets_from_indices as targets_from_indices
from tfpipe.tf.passes import read_in_order as read_in_order
from tfpipe.tf.passes import read_shuffled as read_shuffled


def use_cache(cache: bool | Literal["auto"], shards: Shards, size: int, budget: int) -> bool:
    """``cache="auto"``: when the decoded images of ``shards`` fit in ``budget`` bytes."""
    if cache != "auto":
        return bool(cache)
    n = shards.num_examples
    return n is not None and n * size * size * 3 <= budget


def make_dataset(
    records: Records,
    batch_size: int,
    *,
    image_size: int | None = None,
    training: bool = False,
    folds: Sequence[int] | None = None,
    num_classes: int | None = None,
    label_mode: str = "multi_hot",
    drop_remainder: bool | None = None,
    with_ids: bool = False,
    augment: aug_lib.Augment | None = None,
    cache: bool | Literal["auto"] = "auto",
    seed: int | None = None,
    deterministic: bool | None = None,
    input_context: tf.distribute.InputContext | None = None,
    pad_batches: bool = False,
    options: ReadOptions = ReadOptions(),
    service: str | None = None,
    sampling: str | None = None,
) -> tf.data.Dataset:
    """Builds a ``tf.data.Dataset`` of ``(images, targets)`` batches from shards.

    The stages, each public and usable on its own: ``open_shards`` -> ``Parser.for_shards`` ->
    ``read_shuffled`` / ``read_in_order`` -> ``training_batches`` / ``evaluation_batches`` (->
    ``pad_to_replicas``) -> ``as_tuples``.

    Example::

        ds = tfpipe.make_dataset("records/demo/train", 64, training=True, folds=[0, 1, 2, 3])
        images, targets = next(iter(ds))  # uint8 [64, S, S, 3], float32 [64, C]

    With a distribution strategy, build it per input pipeline::

        ds = strategy.distribute_datasets_from_function(lambda ctx: tfpipe.make_dataset(
            records, ctx.get_per_replica_batch_size(global_batch), training=True, input_context=ctx))

    Args:
      records: folder written by ``tfpipe.write``, glob pattern or list of files (local or ``gs://``).
      batch_size: images per batch (per replica, under a strategy; under Keras 3's ``DataParallel`` on JAX,
        this host's part of the global batch: the global batch over the hosts, a multiple of this host's
        devices).
      image_size: output side; default the stored size. A different size is resized in the pipeline.
      training: shuffle, augment, repeat forever and drop the last partial batch.
      folds: fold ids to read (e.g. all but the validation fold); None reads everything.
      num_classes: needed only for shards without a manifest.
      label_mode: "multi_hot" (default; float32 [B, C], an empty list is a zero row),
        "one_hot" or "class_id" (int32 [B], -1 for no label) for single-label data.
      drop_remainder: default True in training, False otherwise.
      with_ids: also yield each row's ``image_name`` (string [B]), as a third element.
      augment: an ``Augment``; default ``Augment()`` in training; ignored otherwise.
      cache: keep decoded images in memory after the first pass: True, False or
        "auto" (when they fit in ``options.cache_budget`` bytes).
      seed: seed for file order, shuffling and augmentation (training).
      deterministic: fix the element order in training (slower); default: only
        when ``seed`` is given.
      input_context: a ``tf.distribute.InputContext`` (from ``distribute_datasets_from_function``).
      pad_batches: evaluation only: pad the last partial batch with blank rows and
        yield ``(images, targets, weights)`` with weight 0 on the padding, and add
        blank batches until every replica of this pipeline gets one on the last
        step. Every shape is then static (TPUs need that) and weighted metrics
        still count every real record exactly once.
      options: ``ReadOptions`` (read-ahead, interleave width, parse batch, shuffle buffer, cache budget).
      service: training only: ``grpc://HOST:PORT`` of a tf.data service dispatcher (``python -m
        tfpipe.service``); its workers read, decode, augment and batch, and augment the batches; this process
        receives whole batches. Every record comes once an epoch (all but those a dying worker held); the order
        is the workers' race and each epoch is a new job, so ``seed`` fixes nothing of this input (said in a
        warning; ``deterministic=True`` is refused); nothing is cached here.

    Returns:
      A dataset of ``(images uint8 [B, S, S, 3], targets)`` (plus ``weights`` with
      ``pad_batches``, then ``image_names`` with ``with_ids``).
    """
    check_count(1, batch_size=batch_size)
    _check_modes(training, pad_batches, cache, service, deterministic)
    _check_sampling(sampling, training, service)
    if service is not None and input_context is not None and input_context.num_input_pipelines > 1:
        raise TfpipeError(
            "service= with several input pipelines (hosts) is not supported: each would run its own job, and "
            "records shared between pipelines would be kept by each worker's stream; one host consumes a service"
        )
    if service is not None and seed is not None:
        warnings.warn(SEED_SERVED, stacklevel=2)  # the caller's line
        seed = None  # the workers' input is never seeded (each epoch a new job)
    shards = open_shards(records, folds)
    if service is not None:  # the workers open the files: a relative path would be resolved in their own folders
        shards = shards.absolute()
        _check_served_files(shards)
    if training and not shards.labeled:
        raise TfpipeError(f"{records}: written unlabeled ({MANIFEST}: labeled false); training needs labels")
    dropped = drop_remainder is not False if training else bool(drop_remainder)  # the last partial batch
    _check_devices(records, shards, batch_size, dropped, pad_batches, input_context)
    parser = Parser.for_shards(
        shards, image_size=image_size, num_classes=num_classes, label_mode=label_mode, records=records
    )
    cached = service is None and use_cache(cache, shards, parser.image_size, options.cache_budget)
    deterministic = deterministic if deterministic is not None else seed is not None
    if training:
        ds = read_shuffled(shards, seed=seed, deterministic=deterministic, input_context=input_context, options=options)
        ds = training_batches(
            ds, parser, batch_size, augment=augment or aug_lib.Augment(), cached=cached, seed=seed,
            deterministic=deterministic, drop_remainder=drop_remainder is not False, options=options, service=service,
            class_counts=class_counts(shards, parser) if sampling else None,
        )  # fmt: skip
    else:
        ds = read_in_order(shards, input_context=input_context, options=options)
        ds = evaluation_batches(ds, parser, batch_size, cached=cached, drop_remainder=bool(drop_remainder))
        if pad_batches:  # static shapes for every replica; weight 0 marks the padding; the length known (Keras
            ds = pad_to_replicas(ds, batch_size, shards, input_context)  # then ends a pass without a warning)
            ds = ds.apply(tf.data.experimental.assert_cardinality(padded_batches(shards, batch_size, input_context)))
    ds = as_tuples(ds, weights=pad_batches and not training, ids=with_ids)
    return ds.prefetch(AUTOTUNE)  # last: overlap the input pipeline with the training step


def _check_devices(
    records: Records,
    shards: Shards,
    batch_size: int,
    dropped: bool,
    padded: bool,
    ctx: tf.distribute.InputContext | None,
) -> None:
    """Under Keras 3's ``DataParallel`` on JAX (set, or the scope entered), each batch is split over this host's
    devices: one that does not divide fails in ``fit`` with JAX's words. Said here instead, naming the remedy:
    a batch size that divides, and for an evaluation's last partial batch ``pad_batches=True`` (or
    ``drop_remainder=True``, which leaves its images out). ``dropped``: the last partial batch is dropped."""
    devices = data_parallel_devices()
    if not devices:
        return
    if batch_size % devices:
        raise TfpipeError(
            f"batch_size {batch_size} does not divide over the {devices} devices of this host's part of Keras' "
            f"DataParallel: use a multiple of {devices} (per host: the global batch over the hosts)"
        )
    count = local_count(shards, ctx) if not (dropped or padded) and shards.num_examples is not None else 0
    if count % batch_size % devices:
        raise TfpipeError(
            f"{records}: the last batch ({count % batch_size} of {count} images) does not divide over the {devices} "
            "devices of Keras' DataParallel: pass pad_batches=True (the padding weighs 0: compile with "
            "weighted_metrics=) or drop_remainder=True (its images not scored)"
        )


def data_parallel_devices() -> int | None:
    """This host's devices under the ``DataParallel`` of Keras 3 on JAX that is set now; None where Keras 3 on JAX
    is not imported or distributes nothing (nothing is imported here)."""
    keras: Any = sys.modules.get("keras")
    distribution_lib = getattr(keras, "distribution", None)
    if distribution_lib is None or getattr(keras.config, "backend", lambda: "")() != "jax":
        return None
    current = distribution_lib.distribution()
    if type(current).__name__ != "DataParallel":
        return None
    import jax

    names = [str(n) for n in current.device_mesh.devices.flatten()]  # Keras' names: "cpu:5", "tpu:0" (JAX's ids)
    if not all(re.fullmatch(r"\w+:\d+", n) for n in names):
        return None
    ids = {int(n.rpartition(":")[2]) for n in names}
    return sum(d.id in ids for d in jax.local_devices())


def _check_sampling(sampling: str | None, training: bool, service: str | None) -> None:
    check_sampling(sampling)
    if sampling and not training:
        raise TfpipeError("sampling='balanced' draws training batches; evaluation reads every record once")
    if sampling and service is not None:
        raise TfpipeError("sampling='balanced' with service= is not supported: the workers' epochs are their own")


def class_counts(shards: Shards, parser: Parser) -> list[int]:
    """The records of each class (single-label: the class of each record's one label), for balanced sampling;
    refused for records of several labels, which no class sampling can balance."""
    return sampling_counts(read_targets(shards, parser.num_classes), shards.describe_labels())


def _check_served_files(shards: Shards) -> None:
    """Refuses files the service's workers cannot open: ``ram://`` is this process's memory."""
    here = [f for f in shards.files if f.startswith("ram://")]
    if here:
        raise TfpipeError(
            f"{here[0]}: in this process's memory (ram://), which the service's workers cannot read; give them "
            "shards on a disk or bucket they reach"
        )


SEED_SERVED = (
    "seed= with service=: the workers' order and augmentation are not seeded (each epoch is a new job, and a seed "
    "would replay the first epoch's); the seed fixes nothing of this input"
)


def _check_modes(
    training: bool, pad_batches: bool, cache: object, service: str | None, deterministic: bool | None
) -> None:
    if training and pad_batches:
        raise TfpipeError("pad_batches is for evaluation (training=False): training batches are never partial")
    if cache not in (True, False, "auto"):
        raise TfpipeError(f"cache must be True, False or 'auto' (got {cache!r})")
    if service is None:
        return
    if not training:
        raise TfpipeError("service= serves training batches; evaluation is read here (its order, each record once)")
    if cache is True:
        raise TfpipeError("cache=True keeps decoded images in this process; with service= the workers decode")
    if deterministic:
        raise TfpipeError("deterministic=True fixes the input order, and the workers of service= race for it")
    check_service(service)


__all__ = [
    "Parser",
    "ReadOptions",
    "as_tuples",
    "evaluation_batches",
    "fold_split",
    "make_dataset",
    "pad_to_replicas",
    "read_in_order",
    "read_shuffled",
    "training_batches",
]
