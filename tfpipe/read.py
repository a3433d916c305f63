"""The reader: ``make_dataset`` turns shards into TPU-ready ``(images, targets)`` batches.

Evaluation (``training=False``) keeps the written order: shards sorted by name,
records in file order. Training shuffles files and records, interleaves reads
across shards, augments, repeats, and drops the last partial batch so every
shape is static (TPUs need that). Both parse a whole batch of records in one
vectorised ``tf.io.parse_example`` call; images stay uint8 until they reach
the model (normalising there moves 4x fewer bytes to the accelerator).
"""

from __future__ import annotations

import contextlib
import dataclasses
import posixpath
import re
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any, Literal

from tfpipe.deps import require

if TYPE_CHECKING:
    import numpy as np
    import tensorflow as tf
else:
    tf = require("tensorflow")  # or one line saying what to install
from tfpipe import augment as aug_lib
from tfpipe import schema
from tfpipe.deprecations import removed_arguments
from tfpipe.errors import TfpipeError, check_count
from tfpipe.shard_names import SHARD_NAMES
from tfpipe.shards import MANIFEST, Records, Shards, checked_num_classes, fold_split, open_shards, verify

AUTOTUNE = tf.data.AUTOTUNE
LABEL_MODES = ("multi_hot", "one_hot", "class_id")


@dataclasses.dataclass(frozen=True)
class ReadOptions:
    """How ``make_dataset`` reads: the defaults suit 100-200 MB shards on a local disk or a bucket."""

    read_buffer: int = 8 * 2**20  # bytes of read-ahead per file: large sequential reads suit buckets
    cycle_length: int = 16  # shards read at once in training: enough to mix, few enough to keep buffers small
    parse_batch: int = 256  # records parsed per vectorised call in training, before per-image augmentation
    shuffle_buffer: int = 2048  # records, on top of the shuffled file order (training)
    cache_budget: int = 2 * 2**30  # bytes of decoded images that cache="auto" may keep in memory

    def __post_init__(self) -> None:
        check_count(1, read_buffer=self.read_buffer, cycle_length=self.cycle_length, parse_batch=self.parse_batch)
        check_count(1, shuffle_buffer=self.shuffle_buffer)
        check_count(0, cache_budget=self.cache_budget)


@contextlib.contextmanager
def naming_corrupt_shards(records: Records) -> Iterator[None]:
    """Turns TensorFlow's ``DataLossError`` (which names no file) into a ``TfpipeError`` naming the bad shard, and
    its ``PermissionDeniedError`` (a shard this user cannot read) into one line naming it.

    Example::

        with tfpipe.naming_corrupt_shards("records/train"):
            model.fit(tfpipe.make_dataset("records/train", 64, training=True), ...)
    """
    try:
        yield
    except tf.errors.DataLossError as e:
        problems = verify(open_shards(records))
        raise TfpipeError(
            problems[0] if problems else f"{records}: corrupt data ({e.message.splitlines()[0]})"
        ) from None
    except tf.errors.InvalidArgumentError as e:  # shard_reader's assertion: the folder was rewritten meanwhile
        if REWRITTEN not in e.message:
            raise
        said = re.search(rf"\[([^\[\]]* {REWRITTEN} [^\[\]]*)\]", e.message)
        what = said.group(1) if said else f"{records} {REWRITTEN}"
        raise TfpipeError(f"{what}; nothing of this pass counts -- run it again on the new shards") from None
    except tf.errors.NotFoundError as e:  # a shard or the manifest gone from under a pass (a rewrite renamed them)
        names = re.escape(SHARD_NAMES.suffix) + "|" + re.escape(MANIFEST)  # a shard's or the manifest's
        gone = re.search(r"(\S+(?:" + names + r")); No such file", e.message)
        if gone is None:
            raise
        raise TfpipeError(
            f"{gone.group(1)} vanished while this job read it: {records} {REWRITTEN} or deleted"
        ) from None
    except tf.errors.PermissionDeniedError as e:  # its message names the file among graph and op names
        named = next((f for f in open_shards(records).files if f in e.message), f"a shard of {records}")
        raise TfpipeError(f"{named}: this user cannot read it (permission denied); give it read access") from None


def targets_from_indices(indices: tf.Tensor, num_classes: int, label_mode: str) -> tf.Tensor:
    """[B, L] class indices padded with -1 -> [B, C] multi-hot / one-hot float32, or [B] int32 class ids.

    An index >= ``num_classes`` stops the pipeline (``tf.one_hot`` would silently give it a zero row).
    """
    tf.debugging.assert_less(
        indices,
        tf.constant(num_classes, indices.dtype),
        message=f"a record holds a class index >= num_classes={num_classes}; labels would be lost",
    )
    if label_mode == "multi_hot":
        return tf.minimum(tf.reduce_sum(tf.one_hot(indices, num_classes), axis=1), 1.0)
    first = tf.pad(indices, [[0, 0], [0, 1]], constant_values=-1)[:, 0]  # -1 when the list is empty
    if label_mode == "one_hot":
        return tf.one_hot(first, num_classes)
    return tf.cast(first, tf.int32)


@dataclasses.dataclass(frozen=True)
class Parser:
    """How serialized records become examples: the output side, the classes, the label mode, and how the
    images are stored. ``Parser.for_shards`` checks the wanted output against the manifest."""

    image_size: int
    num_classes: int
    label_mode: str = "multi_hot"
    stored_size: int | None = None  # the manifest's stored side; another side is resized in the pipeline
    image_format: str | None = None  # "jpeg", "png", or None (records from other writers: any format)

    @classmethod
    def for_shards(
        cls,
        shards: Shards,
        *,
        image_size: int | None = None,
        num_classes: int | None = None,
        label_mode: str = "multi_hot",
        records: object = None,
    ) -> Parser:
        """Given settings, or the manifest's; a disagreement with the manifest is an error naming ``records``."""
        records = records if records is not None else shards.folder or list(shards.files)
        if label_mode not in LABEL_MODES:
            raise TfpipeError(f"label_mode must be one of {', '.join(LABEL_MODES)} (got {label_mode!r})")
        check_count(1, image_size=image_size, num_classes=num_classes)  # 0 is a mistake, not "from the manifest"
        size = image_size or shards.image_size
        if not size:
            raise TfpipeError(f"{records}: stored images have no fixed size; pass image_size")
        classes = checked_num_classes(records, shards, num_classes)
        check_label_mode(records, shards, label_mode)
        return cls(size, classes, label_mode, shards.image_size, shards.image_format)

    def parse(self, serialized: tf.Tensor) -> dict[str, tf.Tensor]:
        """A batch of serialized records -> ``image`` (still encoded), ``target``, ``image_name``: one vectorised
        ``parse_example`` call."""
        f = tf.io.parse_example(serialized, schema.feature_spec((schema.IMAGE, schema.TARGET, schema.IMAGE_NAME)))
        return {
            "image": f[schema.IMAGE],
            "target": targets_from_indices(f[schema.TARGET], self.num_classes, self.label_mode),
            "image_name": f[schema.IMAGE_NAME],
        }

    def decode(self, data: tf.Tensor) -> tf.Tensor:
        """Encoded bytes -> uint8 [size, size, 3], resizing only when the stored size differs."""
        image = decode(data, self.image_format)
        if self.stored_size != self.image_size:
            image = aug_lib.resize(image, self.image_size, tf.uint8)
        return tf.ensure_shape(image, [self.image_size, self.image_size, 3])


def decode(data: tf.Tensor, image_format: str | None) -> tf.Tensor:
    """Encoded bytes -> uint8 [H, W, 3]."""
    if image_format == "jpeg":
        return tf.io.decode_jpeg(data, channels=3)
    if image_format == "png":
        return tf.io.decode_png(data, channels=3)
    return tf.io.decode_image(data, channels=3, expand_animations=False)  # records from other writers


def shard_for_input(files: Sequence[str], input_context: tf.distribute.InputContext | None) -> tuple[list[str], bool]:
    """Splits work between input pipelines (hosts) of a distribution strategy.

    Returns (files for this pipeline, whether records must be sharded instead):
    whole files when there are at least as many files as pipelines, else every
    pipeline reads all files and keeps every n-th record, so no record is
    duplicated or dropped.
    """
    if input_context is None or input_context.num_input_pipelines == 1:
        return list(files), False
    n, i = input_context.num_input_pipelines, input_context.input_pipeline_id
    if len(files) >= n:
        return list(files[i::n]), False
    return list(files), True


def use_cache(cache: bool | Literal["auto"], shards: Shards, size: int, budget: int) -> bool:
    """``cache="auto"``: when the decoded images of ``shards`` fit in ``budget`` bytes."""
    if cache != "auto":
        return bool(cache)
    n = shards.num_examples
    return n is not None and n * size * size * 3 <= budget


@removed_arguments(
    shuffle_buffer="options=ReadOptions(shuffle_buffer=...)", cache_budget="options=ReadOptions(cache_budget=...)"
)
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
      batch_size: images per batch (per replica, under a strategy).
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

    Returns:
      A dataset of ``(images uint8 [B, S, S, 3], targets)`` (plus ``weights`` with
      ``pad_batches``, then ``image_names`` with ``with_ids``).
    """
    check_count(1, batch_size=batch_size)
    _check_modes(training, pad_batches, cache)
    shards = open_shards(records, folds)
    if training and not shards.labeled:
        raise TfpipeError(f"{records}: written unlabeled ({MANIFEST}: labeled false); training needs labels")
    parser = Parser.for_shards(
        shards, image_size=image_size, num_classes=num_classes, label_mode=label_mode, records=records
    )
    cached = use_cache(cache, shards, parser.image_size, options.cache_budget)
    deterministic = deterministic if deterministic is not None else seed is not None
    if training:
        ds = read_shuffled(shards, seed=seed, deterministic=deterministic, input_context=input_context, options=options)
        ds = training_batches(
            ds, parser, batch_size, augment=augment or aug_lib.Augment(), cached=cached, seed=seed,
            deterministic=deterministic, drop_remainder=drop_remainder is not False, options=options,
        )  # fmt: skip
    else:
        ds = read_in_order(shards, input_context=input_context, options=options)
        ds = evaluation_batches(ds, parser, batch_size, cached=cached, drop_remainder=bool(drop_remainder))
        if pad_batches:  # static shapes for every replica; weight 0 marks the padding
            ds = pad_to_replicas(ds, batch_size, shards, input_context)
    ds = as_tuples(ds, weights=pad_batches and not training, ids=with_ids)
    return ds.prefetch(AUTOTUNE)  # last: overlap the input pipeline with the training step


def _check_modes(training: bool, pad_batches: bool, cache: object) -> None:
    if training and pad_batches:
        raise TfpipeError("pad_batches is for evaluation (training=False): training batches are never partial")
    if cache not in (True, False, "auto"):
        raise TfpipeError(f"cache must be True, False or 'auto' (got {cache!r})")


def check_label_mode(records: object, shards: Shards, label_mode: str) -> None:
    """One-hot and class-id targets keep one label per image: on shards whose manifest says an image can hold
    more, that would silently drop the others, so it is refused (shards without a manifest carry no claim)."""
    if label_mode != "multi_hot" and shards.multi_label:
        raise TfpipeError(
            f"{records}: {shards.describe_labels()}, so label_mode={label_mode!r} would keep one "
            "label per image and drop the rest; use label_mode='multi_hot' (sigmoid outputs), or "
            "write the shards with one class per image (--class-col)"
        )


def read_in_order(
    shards: Shards,
    *,
    input_context: tf.distribute.InputContext | None = None,
    options: ReadOptions = ReadOptions(),
) -> tf.data.Dataset:
    """Serialized records in the written order (shards sorted by name, records in file order); under a
    strategy, this input pipeline's part of them. The folder is checked as each shard opens and after the last
    record (``shard_reader``)."""
    files, shard_records = shard_for_input(shards.files, input_context)
    ds = shard_names([*files, END_OF_PASS], shards)
    ds = ds.flat_map(shard_reader(shards, options))  # file after file: the written order
    if shard_records and input_context is not None:  # shard_records: several pipelines, so a context
        ds = ds.shard(input_context.num_input_pipelines, input_context.input_pipeline_id)
    return ds


def read_shuffled(
    shards: Shards,
    *,
    seed: int | None = None,
    deterministic: bool = False,
    input_context: tf.distribute.InputContext | None = None,
    options: ReadOptions = ReadOptions(),
) -> tf.data.Dataset:
    """Serialized records for training: files in a new order every epoch, read interleaved (each shard checked
    as it opens, ``shard_reader``; train.fit checks the folder at every epoch's end)."""
    files, shard_records = shard_for_input(shards.files, input_context)
    ds = shard_names(files, shards)
    if shard_records and input_context is not None:  # pipelines share files: a fixed order, every n-th record kept
        ds = ds.flat_map(shard_reader(shards, options))
        return ds.shard(input_context.num_input_pipelines, input_context.input_pipeline_id)
    ds = ds.shuffle(len(files), seed=seed)  # a new file order every epoch
    return ds.interleave(
        shard_reader(shards, options),
        cycle_length=min(len(files), options.cycle_length),
        num_parallel_calls=AUTOTUNE,
        deterministic=deterministic,
    )


REWRITTEN = "was rewritten while this job read it"
END_OF_PASS = ""  # no shard's name: a pass's last file name, read as no records, there to check the folder again


def shard_names(files: Sequence[str], shards: Shards) -> tf.data.Dataset:
    """(file name, the folder's manifest path) pairs, ``shard_reader``'s input. The path travels as data: a
    constant path would let TensorFlow fold the manifest's read into the function once, checking nothing later."""
    manifest = posixpath.join(shards.folder, MANIFEST) if shards.folder and shards.manifest else ""
    return tf.data.Dataset.from_tensor_slices((list(files), [manifest] * len(files)))


def shard_reader(shards: Shards, options: ReadOptions) -> Callable[[tf.Tensor, tf.Tensor], tf.data.Dataset]:
    """A shard file name -> its records, after checking in TensorFlow ops (no Python: fine on a TPU host or a
    tf.data service worker) that the folder still holds the dataset opened: its ``manifest.json`` still names
    its dataset id. The check runs as the file is opened (when ``flat_map`` or ``interleave`` asks for its
    records, not ahead), and ``END_OF_PASS`` (no records) checks once more after a sequential pass's last
    record: a pass read across a rewrite ends in an error naming the folder (``naming_corrupt_shards`` makes it
    a ``TfpipeError``), as ``RecordDataset``'s passes do. Files without a folder's manifest are not checked."""
    checked = bool(shards.folder and shards.manifest)
    dataset_id = shards.manifest.dataset_id if shards.manifest else ""
    said = f"{shards.folder} {REWRITTEN} (its {MANIFEST} no longer names dataset id {dataset_id})"

    def read(name: tf.Tensor, manifest: tf.Tensor) -> tf.data.Dataset:
        if checked:
            text = tf.io.read_file(manifest)
            unchanged = tf.strings.regex_full_match(text, f'(?s).*"dataset_id": "{dataset_id}".*')
            with tf.control_dependencies([tf.debugging.Assert(unchanged, [said])]):
                name = tf.identity(name)
        records = tf.data.TFRecordDataset(name, buffer_size=options.read_buffer)
        nothing = tf.equal(name, END_OF_PASS)
        return records.take(tf.where(nothing, tf.constant(0, tf.int64), tf.constant(-1, tf.int64)))

    return read


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
) -> tf.data.Dataset:
    """Serialized records -> shuffled, repeated, augmented batches of examples (dicts)."""
    ds = ds.batch(options.parse_batch)
    ds = ds.map(parser.parse, num_parallel_calls=AUTOTUNE, deterministic=deterministic)
    ds = ds.unbatch()
    if cached:
        ds = ds.map(
            lambda e: dict(e, image=parser.decode(e["image"])), num_parallel_calls=AUTOTUNE, deterministic=deterministic
        )
        ds = ds.cache()  # decode once: later epochs start from pixels in memory
    ds = ds.shuffle(options.shuffle_buffer, seed=seed)  # before decoding (when not cached): a buffer of small JPEGs
    ds = ds.repeat()
    ds = _augment_images(ds, parser, augment, cached, seed, deterministic)
    ds = ds.batch(batch_size, drop_remainder=drop_remainder)  # static shapes for the TPU
    per_batch = aug_lib.make_batch_augment(augment, parser.image_size)  # pad crop, flip, colour: one XLA op a batch
    mix = aug_lib.batch_mix(augment)
    if per_batch is not None or mix is not None:  # batch ops; MixUp / CutMix pair images within a batch
        ds = tf.data.Dataset.zip((ds, tf.data.Dataset.random(seed=None if seed is None else seed + 1).batch(2)))
        ds = ds.map(
            lambda b, s: _augment_batch(b, s, per_batch, mix), num_parallel_calls=AUTOTUNE, deterministic=deterministic
        )
    return ds


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
    than ``shards`` (a ``take`` or ``filter`` before it): the count is rounded up to whole steps all the same."""
    multiple = (
        1 if input_context is None else max(1, input_context.num_replicas_in_sync // input_context.num_input_pipelines)
    )
    return _pad_batches(ds, batch_size, _local_count(shards, input_context), multiple)


def as_tuples(ds: tf.data.Dataset, *, weights: bool = False, ids: bool = False) -> tf.data.Dataset:
    """Dicts inside, tuples at the edge (Keras): ``(image, target[, weight][, image_name])``."""
    keys = ("image", "target") + (("weight",) if weights else ()) + (("image_name",) if ids else ())
    missing = [k for k in keys if k not in ds.element_spec]
    if missing:
        raise TfpipeError(f"as_tuples: the batches have no {', '.join(missing)} (weight comes from pad_to_replicas)")
    return ds.map(lambda b: tuple(b[k] for k in keys))


def _local_count(shards: Shards, ctx: tf.distribute.InputContext | None) -> int:
    """Records this input pipeline reads."""
    files, shard_records = shard_for_input(shards.files, ctx)
    total = dataclasses.replace(shards, files=tuple(files)).num_examples if not shard_records else shards.num_examples
    if total is None:
        raise TfpipeError("pad_batches needs record counts (a manifest or counts in the shard names)")
    if shard_records and ctx is not None:  # shard_records: several pipelines, so a context
        return len(range(ctx.input_pipeline_id, total, ctx.num_input_pipelines))
    return total


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
    blank = {k: tf.zeros([batch_size, *s.shape[1:]], s.dtype) for k, s in ds.element_spec.items()}
    blanks = tf.data.Dataset.from_tensors(blank)
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


def count_examples(records: Records, folds: Sequence[int] | None = None) -> int:
    """Number of records in ``records`` (from the manifest or the counts in shard names)."""
    n = open_shards(records, folds).num_examples
    if n is None:
        raise TfpipeError(f"{records}: record count unknown (no manifest and no count in the file names)")
    return n


def _read_column(records: Records, folds: Sequence[int] | None, key: str) -> list[Any]:
    """One parsed feature of every record, in written order (no image decoding)."""
    spec = schema.feature_spec((key,))
    files = list(open_shards(records, folds).files)
    ds = tf.data.TFRecordDataset(files, buffer_size=ReadOptions().read_buffer).batch(1024)
    ds = ds.map(lambda s: tf.io.parse_example(s, spec)[key], num_parallel_calls=AUTOTUNE)
    return [row for batch in ds.as_numpy_iterator() for row in batch]


def image_names(records: Records, folds: Sequence[int] | None = None) -> list[str]:
    """The ``image_name`` of every record in written order (the row order of evaluation batches)."""
    with naming_corrupt_shards(records):
        return [n.decode("utf-8") for n in _read_column(records, folds, schema.IMAGE_NAME)]


def image_digests(records: Records, folds: Sequence[int] | None = None) -> list[str]:
    """A digest of every record's stored image (the first 16 hex digits of the SHA-256 of its bytes), in written
    order: an image's identity, which its name is not (two datasets may both hold an ``img_0001``). The same
    image written again with the same settings has the same digest."""
    with naming_corrupt_shards(records):
        return [schema.image_digest(data) for data in _read_column(records, folds, schema.IMAGE)]


def check_no_image_twice(shards: Shards) -> None:
    """Files of several shard folders read together (a glob or list spanning them) must not hold one stored image
    twice: two writes of one dataset (another ``--seed``, another shard count) put its images in other folds, so
    validation would score images training saw. Reads every image's bytes once, only for such reads."""
    if shards.folder is not None or shards.manifest is None:  # one folder, or files that claim nothing
        return
    first: dict[str, int] = {}
    twice: list[tuple[int, int]] = []
    for i, digest in enumerate(image_digests(shards)):
        if digest in first:
            twice.append((first[digest], i))
        first.setdefault(digest, i)
    if twice:
        files = [f for f in shards.files for _ in range(shards.counts[f] or 0)]
        names = image_names(shards)
        a, b = twice[0]
        raise TfpipeError(
            f"the files given hold {len(twice)} image{'s' * (len(twice) > 1)} twice (e.g. {names[a]} in {files[a]} "
            f"and {names[b]} in {files[b]}): read together, validation would score images training saw (two writes "
            "of one dataset?) -- read one folder, or drop the copies from one folder's CSV"
        )


def read_targets(records: Records, num_classes: int, folds: Sequence[int] | None = None) -> np.ndarray:
    """Multi-hot float32 [N, C] targets of every record in written order, without decoding images."""
    with naming_corrupt_shards(records):
        rows = _read_column(records, folds, schema.TARGET)
    return schema.multi_hot([row[row >= 0] for row in rows], num_classes)  # -1 pads the batched lists


__all__ = [
    "Parser",
    "ReadOptions",
    "as_tuples",
    "check_no_image_twice",
    "count_examples",
    "evaluation_batches",
    "fold_split",
    "image_digests",
    "image_names",
    "make_dataset",
    "naming_corrupt_shards",
    "pad_to_replicas",
    "read_in_order",
    "read_shuffled",
    "read_targets",
    "training_batches",
]
