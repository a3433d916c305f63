"""How serialized records become examples: ``Parser`` (one vectorised ``parse_example`` per batch, then the
image decoded and, when stored at another side, resized), the label modes, and ``ReadOptions``, the reader's
buffers and parallelism. Used by ``tfpipe.tf.read.make_dataset`` and its stages."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from tfpipe.runtime.deps import require

if TYPE_CHECKING:
    import tensorflow as tf
else:
    tf = require("tensorflow")  # or one line saying what to install
from tfpipe.format import schema
from tfpipe.format.shards import Shards, checked_num_classes
from tfpipe.runtime.errors import TfpipeError, check_at_most, check_count
from tfpipe.tf import augment as aug_lib

AUTOTUNE = tf.data.AUTOTUNE
LABEL_MODES = ("multi_hot", "one_hot", "class_id")


def feature_spec(keys: Iterable[str] = tuple(schema.FEATURES)) -> dict[str, Any]:
    """The ``tf.io.parse_example`` spec for our records (or a subset of keys).

    ``target`` is a ``FixedLenSequenceFeature`` with ``allow_missing=True``:
    a variable-length list per record, padded with -1 when batched, and
    absent (unlabeled) records parse as an empty list. Only ``image`` is
    required; other scalars get a default, so records from other writers
    that lack them still parse.
    """
    dtypes = {"bytes": tf.string, "int64": tf.int64}
    defaults = {"bytes": "", "int64": -1}
    spec: dict[str, Any] = {}
    for key in keys:
        dtype, shape = schema.FEATURES[key]
        if shape == "list":
            spec[key] = tf.io.FixedLenSequenceFeature([], dtypes[dtype], allow_missing=True, default_value=-1)
        elif key == schema.IMAGE:
            spec[key] = tf.io.FixedLenFeature([], dtypes[dtype])
        else:
            spec[key] = tf.io.FixedLenFeature([], dtypes[dtype], default_value=defaults[dtype])
    return spec


@dataclasses.dataclass(frozen=True)
class ReadOptions:
    """How ``make_dataset`` reads: the defaults suit 100-200 MB shards on a local disk or a bucket."""

    read_buffer: int = 8 * 2**20  # bytes of read-ahead per file: large sequential reads suit buckets
    cycle_length: int = 16  # shards read at once in training: enough to mix, few enough to keep buffers small
    parse_batch: int = 256  # records parsed per vectorised call in training, before per-image augmentation
    shuffle_buffer: int = 2048  # records, on top of the shuffled file order (training)
    cache_budget: int = 2 * 2**30  # bytes of decoded images that cache="auto" may keep in memory

    def __post_init__(self) -> None:
        """Each field a whole number in its range (``READ_LIMITS``), refused in one line when made."""
        check_count(1, read_buffer=self.read_buffer, cycle_length=self.cycle_length, parse_batch=self.parse_batch)
        check_count(1, shuffle_buffer=self.shuffle_buffer)
        check_count(0, cache_budget=self.cache_budget)
        for name, high in READ_LIMITS.items():
            check_at_most(high, **{name: getattr(self, name)})


# The largest value of each ReadOptions field: a buffer TensorFlow can allocate per file (1 GiB), shards and
# records a host can hold open or parse at once, decoded bytes within a 64-bit count.
READ_LIMITS = {
    "read_buffer": 2**30,
    "cycle_length": 4096,
    "parse_batch": 2**20,
    "shuffle_buffer": 2**30,
    "cache_budget": 2**62,
}


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
        f = tf.io.parse_example(serialized, feature_spec((schema.IMAGE, schema.TARGET, schema.IMAGE_NAME)))
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


def check_label_mode(records: object, shards: Shards, label_mode: str) -> None:
    """One-hot and class-id targets keep one label per image: on shards whose manifest says an image can hold
    more, that would silently drop the others, so it is refused (shards without a manifest carry no claim)."""
    if label_mode != "multi_hot" and shards.multi_label:
        raise TfpipeError(
            f"{records}: {shards.describe_labels()}, so label_mode={label_mode!r} would keep one "
            "label per image and drop the rest; use label_mode='multi_hot' (sigmoid outputs), or "
            "write the shards with one class per image (--class-col)"
        )
