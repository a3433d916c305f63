"""The batch stages of the reader, each a ``tf.data.Dataset -> tf.data.Dataset`` step of
``tfpipe.tf.read.make_dataset``'s column: evaluation batches (order kept), training batches (shuffled, repeated,
augmented per image and per batch), padding the last batch so every replica gets one (``pad_to_replicas``), and
dicts to Keras' tuples at the edge (``as_tuples``)."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import TYPE_CHECKING

from tfpipe.runtime.deps import require

if TYPE_CHECKING:
    import tensorflow as tf
else:
    tf = require("tensorflow")  # or one line saying what to install
from tfpipe.format.sampling import keep_shares
from tfpipe.format.shards import Shards
from tfpipe.runtime.errors import TfpipeError
from tfpipe.tf import augment as aug_lib
from tfpipe.tf.data_service import served
from tfpipe.tf.parse import AUTOTUNE, Parser, ReadOptions
from tfpipe.tf.passes import shard_for_input


def evaluation_batches(
    ds: tf.data.Dataset, parser: Parser, batch_size: int, *, cached: bool = False, drop_remainder: bool = False
) -> tf.data.Dataset:
    """Serialized records -> batches of decoded examples (dicts), order kept."""
    size = parser.image_size
    ds = ds.batch(batch_size, drop_remainder=drop_remainder)
    ds = ds.map(parser.parse, num_parallel_calls=AUTOTUNE)  # one vectorised parse per batch

    def decode_batch(b: dict[str, tf.Tensor]) -> dict[str, tf.Tensor]:
        images = tf.map_fn(parser.decode, b["image"], fn_output_signature=tf.TensorSpec([size, size, 3], tf.uint8))
        return dict(b, image=images)

    ds = ds.map(decode_batch, num_parallel_calls=AUTOTUNE)  # batches decode in parallel, order kept
    if cached:
        ds = ds.cache()  # the next pass (e.g. validation after every epoch) skips reading and decoding
    return ds


def training_batches(
    ds: tf.data.Dataset,
    parser: Parser,
    batch_size: int,
    *,
    augment: aug_lib.Augment,
    cached: bool = False,
    seed: int | None = None,
    deterministic: bool = False,
    drop_remainder: bool = True,
    options: ReadOptions = ReadOptions(),
    service: str | None = None,
    class_counts: Sequence[int] | None = None,
) -> tf.data.Dataset:
    """Serialized records -> shuffled, repeated, augmented batches of examples (dicts), drawn evenly over the
    classes with ``class_counts`` (``balanced``); with ``service``
    (``grpc://HOST:PORT``), every stage up to whole augmented batches runs on a tf.data service's workers
    (``tfpipe.tf.data_service.served``): this process only receives them."""
    ds = ds.batch(options.parse_batch)
    ds = ds.map(parser.parse, num_parallel_calls=AUTOTUNE, deterministic=deterministic)
    ds = ds.unbatch()
    if cached:
        ds = ds.map(
            lambda e: dict(e, image=parser.decode(e["image"])), num_parallel_calls=AUTOTUNE, deterministic=deterministic
        )
        ds = ds.cache()  # decode once: later epochs start from pixels in memory
    here = seed if service is None else None  # each epoch a new job on the workers: a seed would replay its order
    ds = ds.shuffle(options.shuffle_buffer, seed=here)  # before decoding (when not cached): a buffer of small JPEGs
    if service is None:
        ds = ds.repeat()
        if class_counts is not None:
            ds = balanced(ds, class_counts, seed)
        ds = _augment_images(ds, parser, augment, cached, seed, deterministic)
        ds = ds.batch(batch_size, drop_remainder=drop_remainder)  # static shapes for the TPU
        return _augment_batches(ds, parser, augment, seed, deterministic)
    # One epoch as a job of the workers (each epoch a new job: every record once), whole batches made and augmented
    # there, so this process does no work per image or per batch: a worker's last batch of an epoch may be short,
    # and rebatch joins it to the next batches (the whole ones pass as they are).
    ds = _augment_images(ds, parser, augment, cached, None, deterministic)
    ds = ds.batch(batch_size)
    ds = _augment_batches(ds, parser, augment, None, deterministic)
    ds = served(ds, service)
    ds = ds.repeat()
    return ds.rebatch(batch_size, drop_remainder=drop_remainder)  # static shapes for the TPU


def _augment_batches(
    ds: tf.data.Dataset, parser: Parser, augment: aug_lib.Augment, seed: int | None, deterministic: bool
) -> tf.data.Dataset:
    """The batch ops of ``augment``: pad crop, flip, colour (one XLA op a batch); MixUp / CutMix pair images
    within a batch."""
    per_batch = aug_lib.make_batch_augment(augment, parser.image_size)
    mix = aug_lib.batch_mix(augment)
    if per_batch is not None or mix is not None:
        ds = tf.data.Dataset.zip((ds, tf.data.Dataset.random(seed=None if seed is None else seed + 1).batch(2)))
        ds = ds.map(
            lambda b, s: _augment_batch(b, s, per_batch, mix), num_parallel_calls=AUTOTUNE, deterministic=deterministic
        )
    return ds


def balanced(ds: tf.data.Dataset, class_counts: Sequence[int], seed: int | None) -> tf.data.Dataset:
    """Examples of a repeated stream kept or rejected so that the classes present come evenly: rejection
    sampling with the known class shares of ``class_counts`` (each example kept with its class's target share over
    its share, scaled so the rarest class keeps all: the rule of ``tf.data.Dataset.rejection_resample``, which
    also prints a line on every call where most examples are rejected, as here they are meant to be); a record
    without a label counts as class 0, as its argmax does."""
    keep = tf.constant(keep_shares(class_counts), tf.float32)  # tfpipe.format.sampling: the PyTorch reader's rule too

    def kept(e: dict[str, tf.Tensor], draw: tf.Tensor) -> tf.Tensor:
        t = e["target"]
        c = tf.maximum(tf.cast(t, tf.int32), 0) if t.shape.rank == 0 else tf.argmax(t, output_type=tf.int32)
        return tf.cast(draw % 2**24, tf.float32) / 2**24 < keep[c]

    ds = tf.data.Dataset.zip((ds, tf.data.Dataset.random(seed=seed)))
    return ds.filter(kept).map(lambda e, _: e, num_parallel_calls=AUTOTUNE)


def _augment_images(
    ds: tf.data.Dataset,
    parser: Parser,
    augment: aug_lib.Augment,
    cached: bool,
    seed: int | None,
    deterministic: bool,
) -> tf.data.Dataset:
    """Decoding (unless cached) and per-image ops (resized crop, erasing), each image with its own seed."""
    size = parser.image_size
    crop_on_decode = augment.crop == "resized" and parser.image_format == "jpeg" and not cached
    per_image = aug_lib.image_ops(augment, size, crop_done=crop_on_decode)
    if not per_image and cached:  # pixels in memory and nothing to do per image
        return ds
    ds = tf.data.Dataset.zip((ds, tf.data.Dataset.random(seed=seed).batch(2)))  # a stateless seed per image

    def augment_one(e: dict[str, tf.Tensor], s: tf.Tensor) -> dict[str, tf.Tensor]:
        seeds = tf.random.experimental.stateless_split(s, 2)
        if crop_on_decode:  # random resized crop while decoding: only the window's pixels are decoded
            image = _crop_decode(e["image"], size, augment, seeds[0])
        else:
            image = e["image"] if cached else parser.decode(e["image"])
        image = aug_lib.augment_image(image, seeds[1], per_image)
        return dict(e, image=tf.ensure_shape(image, [size, size, 3]))

    return ds.map(augment_one, num_parallel_calls=AUTOTUNE, deterministic=deterministic)


def pad_to_replicas(
    ds: tf.data.Dataset, batch_size: int, shards: Shards, input_context: tf.distribute.InputContext | None = None
) -> tf.data.Dataset:
    """Pads the last batch to ``batch_size`` (``weight`` 0) and appends blank batches until every replica this
    input pipeline feeds gets one on the last step; real rows get ``weight`` 1. ``ds`` may hold fewer batches
    than ``shards`` (a ``take`` or ``filter`` before it): the count is rounded up to whole steps all the same.
    With several input pipelines (hosts, workers) every pipeline yields ``evaluation_steps`` steps, the most any
    of them needs: each host runs the same number of steps, and none stops before its last record."""
    multiple = _replicas_per_pipeline(input_context)
    if input_context is None or input_context.num_input_pipelines == 1:
        return _pad_batches(ds, batch_size, local_count(shards, input_context), multiple)
    batches = padded_batches(shards, batch_size, input_context)
    return (
        _pad_batches(ds, batch_size, local_count(shards, input_context), multiple)
        .concatenate(_blank_batches(ds, batch_size).repeat())
        .take(batches)
    )


def padded_batches(shards: Shards, batch_size: int, input_context: tf.distribute.InputContext | None = None) -> int:
    """The batches ``pad_to_replicas`` yields for a pass over every record of ``shards`` (this pipeline's): the
    evaluation's steps, a batch for each replica this pipeline feeds."""
    return evaluation_steps(shards, batch_size, input_context) * _replicas_per_pipeline(input_context)


def evaluation_steps(shards: Shards, batch_size: int, input_context: tf.distribute.InputContext | None = None) -> int:
    """Steps of an evaluation over ``shards`` at ``batch_size`` a replica: every record once, each step a batch
    for every replica. With several input pipelines, the most steps any pipeline's share needs (their shares
    may differ by whole files)."""
    multiple = _replicas_per_pipeline(input_context)
    pipelines = 1 if input_context is None else input_context.num_input_pipelines
    counts = [_pipeline_count(shards, pipelines, i) for i in range(pipelines)]
    return max(1, max(math.ceil(math.ceil(n / batch_size) / multiple) for n in counts))


def as_tuples(ds: tf.data.Dataset, *, weights: bool = False, ids: bool = False) -> tf.data.Dataset:
    """Dicts inside, tuples at the edge (Keras): ``(image, target[, weight][, image_name])``."""
    keys = ("image", "target") + (("weight",) if weights else ()) + (("image_name",) if ids else ())
    missing = [k for k in keys if k not in ds.element_spec]
    if missing:
        raise TfpipeError(f"as_tuples: the batches have no {', '.join(missing)} (weight comes from pad_to_replicas)")
    return ds.map(lambda b: tuple(b[k] for k in keys))


def _replicas_per_pipeline(ctx: tf.distribute.InputContext | None) -> int:
    return 1 if ctx is None else max(1, ctx.num_replicas_in_sync // ctx.num_input_pipelines)


def local_count(shards: Shards, ctx: tf.distribute.InputContext | None) -> int:
    """Records this input pipeline reads."""
    if ctx is None:
        return _pipeline_count(shards, 1, 0)
    return _pipeline_count(shards, ctx.num_input_pipelines, ctx.input_pipeline_id)


def _pipeline_count(shards: Shards, pipelines: int, pipeline: int) -> int:
    """Records input pipeline ``pipeline`` of ``pipelines`` reads (``shard_for_input``'s split)."""
    ctx = tf.distribute.InputContext(num_input_pipelines=pipelines, input_pipeline_id=pipeline)
    files, shard_records = shard_for_input(shards.files, ctx)
    total = dataclasses.replace(shards, files=tuple(files)).num_examples if not shard_records else shards.num_examples
    if total is None:
        raise TfpipeError("pad_batches needs record counts (a manifest or counts in the shard names)")
    if shard_records:  # several pipelines reading every file, each keeping every n-th record
        return len(range(pipeline, total, pipelines))
    return total


def _blank_batches(ds: tf.data.Dataset, batch_size: int) -> tf.data.Dataset:
    """One batch of ``batch_size`` zeros (``weight`` 0) of ``ds``'s structure."""
    spec = dict(ds.element_spec, weight=tf.TensorSpec([None], tf.float32))
    return tf.data.Dataset.from_tensors({k: tf.zeros([batch_size, *s.shape[1:]], s.dtype) for k, s in spec.items()})


def _pad_batches(ds: tf.data.Dataset, batch_size: int, count: int, multiple: int) -> tf.data.Dataset:
    """Pads the last batch to ``batch_size`` (weight 0) and appends blank batches up to a multiple of ``multiple``
    batches, whatever ``ds`` holds (a ``take`` or ``filter`` before it included); ``count`` 0: only blanks."""
    spec = ds.element_spec

    def pad(b: dict[str, tf.Tensor]) -> dict[str, tf.Tensor]:
        n = tf.shape(b["image"])[0]
        padded = {k: tf.pad(v, [[0, batch_size - n]] + [[0, 0]] * (len(spec[k].shape) - 1)) for k, v in b.items()}
        padded["weight"] = tf.sequence_mask(n, batch_size, dtype=tf.float32)
        return {k: tf.ensure_shape(v, [batch_size, *v.shape[1:]]) for k, v in padded.items()}

    ds = ds.map(pad, num_parallel_calls=AUTOTUNE)
    blanks = _blank_batches(ds, batch_size)
    if count == 0:  # this pipeline reads nothing, yet each of its replicas needs a batch on the last step
        return blanks.repeat(multiple)
    if multiple == 1:
        return ds
    # Up to multiple-1 blanks, then whole groups only: the batch count rounds up to a multiple.
    return ds.concatenate(blanks.repeat(multiple - 1)).batch(multiple, drop_remainder=True).unbatch()


def _augment_batch(
    batch: dict[str, tf.Tensor], seed: tf.Tensor, per_batch: aug_lib.ImageOp | None, mix: aug_lib.MixOp | None
) -> dict[str, tf.Tensor]:
    seeds = tf.random.experimental.stateless_split(seed, 2)
    images, targets = batch["image"], batch["target"]
    if per_batch is not None:
        images = per_batch(images, seeds[0])
    if mix is not None:
        images, targets = mix(images, targets, seeds[1])
    return dict(batch, image=images, target=targets)


def _crop_decode(data: tf.Tensor, size: int, augment: aug_lib.Augment, seed: tf.Tensor) -> tf.Tensor:
    """A random resized crop of a JPEG, decoding only the window (``decode_and_crop_jpeg``)."""
    begin, crop = aug_lib.crop_window(tf.io.extract_jpeg_shape(data), augment.crop_scale, augment.crop_ratio, seed)
    window = tf.stack([begin[0], begin[1], crop[0], crop[1]])
    return aug_lib.resize(tf.io.decode_and_crop_jpeg(data, window, channels=3), size, tf.uint8)
