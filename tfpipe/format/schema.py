"""The record schema: defined once, used by the writer and the reader.

Every record is a ``tf.train.Example`` with the features in ``FEATURES``.
The writer serializes it with ``encode_example`` using protobuf classes that
are wire-identical to TensorFlow's ``example.proto`` but live in a private
descriptor pool, so DataLoader workers never import TensorFlow (forking or
importing TensorFlow in workers is slow and can hang). The reader turns the
same table into ``tf.io.parse_example`` specs with ``tfpipe.tf.parse.feature_spec``.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any, TypeAlias

import numpy as np
import numpy.typing as npt
from google.protobuf import descriptor_pb2, descriptor_pool, message_factory
from google.protobuf.descriptor_pb2 import FieldDescriptorProto
from google.protobuf.message import Message

from tfpipe.runtime.errors import TfpipeError

SCHEMA_VERSION = 1

IMAGE = "image"  # bytes: encoded JPEG (or PNG), 3-channel RGB
TARGET = "target"  # int64 list: class indices, variable length, empty allowed
IMAGE_NAME = "image_name"  # bytes: the source CSV's id, utf-8
HEIGHT = "height"  # int64: height of the stored image
WIDTH = "width"  # int64: width of the stored image

# key -> (type, "scalar" | "list"); the order is the order in each record.
FEATURES = {
    IMAGE: ("bytes", "scalar"),
    TARGET: ("int64", "list"),
    IMAGE_NAME: ("bytes", "scalar"),
    HEIGHT: ("int64", "scalar"),
    WIDTH: ("int64", "scalar"),
}
# A value of one feature in ``encode_example``: bytes or str (bytes features), an int (int64 scalars), ints (lists).
FeatureValue: TypeAlias = bytes | str | int | Sequence[int]


# (name, number, type, label, type name) of one field of a message in example.proto
FieldSpec: TypeAlias = tuple[
    str, int, "FieldDescriptorProto.Type.ValueType", "FieldDescriptorProto.Label.ValueType", "str | None"
]


def _example_classes() -> type[Message]:
    """Builds Example/Features/Feature message classes matching example.proto.

    Field numbers and types are those of tensorflow/core/example/*.proto; the
    package name differs so both can be loaded in one process.
    """
    f = descriptor_pb2.FileDescriptorProto(name="tfpipe_example.proto", package="tfpipe", syntax="proto3")
    T = descriptor_pb2.FieldDescriptorProto
    rep, opt = T.LABEL_REPEATED, T.LABEL_OPTIONAL

    def message(
        name: str, fields: Iterable[FieldSpec], nested: Iterable[descriptor_pb2.DescriptorProto] = ()
    ) -> descriptor_pb2.DescriptorProto:
        m = f.message_type.add(name=name)
        for fname, number, ftype, label, type_name in fields:
            m.field.add(name=fname, number=number, type=ftype, label=label, type_name=type_name)
        for n in nested:
            m.nested_type.add().CopyFrom(n)
        return m

    message("BytesList", [("value", 1, T.TYPE_BYTES, rep, None)])
    message("FloatList", [("value", 1, T.TYPE_FLOAT, rep, None)])
    message("Int64List", [("value", 1, T.TYPE_INT64, rep, None)])
    kinds = [("bytes_list", 1, "BytesList"), ("float_list", 2, "FloatList"), ("int64_list", 3, "Int64List")]
    message("Feature", [(name, n, T.TYPE_MESSAGE, opt, f".tfpipe.{kind}") for name, n, kind in kinds])
    m = f.message_type[-1]
    m.oneof_decl.add(name="kind")
    for field in m.field:
        field.oneof_index = 0
    entry = descriptor_pb2.DescriptorProto(name="FeatureEntry")
    entry.field.add(name="key", number=1, type=T.TYPE_STRING, label=opt)
    entry.field.add(name="value", number=2, type=T.TYPE_MESSAGE, label=opt, type_name=".tfpipe.Feature")
    entry.options.map_entry = True
    message("Features", [("feature", 1, T.TYPE_MESSAGE, rep, ".tfpipe.Features.FeatureEntry")], [entry])
    message("Example", [("features", 1, T.TYPE_MESSAGE, opt, ".tfpipe.Features")])
    pool = descriptor_pool.DescriptorPool()
    pool.Add(f)
    return message_factory.GetMessageClass(pool.FindMessageTypeByName("tfpipe.Example"))


# The class is built at run time: its fields (``example.features.feature``) are unknown to a type checker.
Example: Any = _example_classes()


def encode_example(values: Mapping[str, FeatureValue]) -> bytes:
    """Serializes one record.

    Args:
      values: dict from feature key (see ``FEATURES``) to a value: ``bytes`` or
        ``str`` for bytes features, ``int`` for int64 scalars, a sequence of
        ints for int64 lists. Keys that are absent are left out of the record
        (for example ``target`` in unlabeled test records).

    Returns:
      The serialized ``tf.train.Example`` as bytes (deterministic).
    """
    example = Example()
    for key, (dtype, _) in FEATURES.items():
        if key not in values:
            continue
        value = values[key]
        feature = example.features.feature[key]
        if dtype == "bytes":
            feature.bytes_list.value.append(value.encode("utf-8") if isinstance(value, str) else value)
        elif isinstance(value, int):
            feature.int64_list.value.append(value)
        else:
            feature.int64_list.value.extend(int(v) for v in value)
    return example.SerializeToString(deterministic=True)


def parse_record(raw: bytes, path: str) -> Any:
    """A record's bytes -> ``Example`` (no TensorFlow); bytes that are not an Example are an error naming ``path``."""
    from google.protobuf.message import DecodeError

    try:
        return Example.FromString(raw)
    except DecodeError:
        raise TfpipeError(f"{path}: its records are not tf.train.Example protos; tfpipe reads only those") from None


def image_digest(image: bytes) -> str:
    """A stored image's identity: the first 16 hex digits of the SHA-256 of its bytes (``tfpipe.image_digests``)."""
    import hashlib

    return hashlib.sha256(image).hexdigest()[:16]


def decode_example(data: bytes) -> dict[str, Any]:
    """Parses a serialized record into a dict (no TensorFlow; for tools and tests)."""
    example = Example.FromString(data)
    out: dict[str, Any] = {}
    for key, feature in example.features.feature.items():
        kind = feature.WhichOneof("kind")
        values = list(getattr(feature, kind).value) if kind else []
        scalar = FEATURES.get(key, (None, "list"))[1] == "scalar"
        out[key] = values[0] if scalar and len(values) == 1 else values
    return out


def multi_hot(targets: Sequence[npt.ArrayLike], num_classes: int, dtype: npt.DTypeLike = np.float32) -> np.ndarray:
    """[N, C] rows of 0/1 from N lists of class indices (the ``target`` feature): the one such conversion
    outside TensorFlow graphs (``tfpipe.tf.read.targets_from_indices`` is its in-graph twin).

    Raises:
      TfpipeError: an index outside 0..C-1: records and class list disagree, and a label would be lost.
    """
    out = np.zeros((len(targets), num_classes), dtype)
    for row, indices in enumerate(targets):
        indices = np.asarray(indices, np.int64)
        if indices.size and (indices.min() < 0 or indices.max() >= num_classes):
            bad = int(indices[(indices < 0) | (indices >= num_classes)][0])
            raise TfpipeError(
                f"class index {bad} outside 0..{num_classes - 1}: the records hold more classes than "
                f"the {num_classes} given"
            )
        out[row, indices] = 1
    return out


def describe() -> dict[str, Any]:
    """The schema as plain data, for the manifest."""
    return {"version": SCHEMA_VERSION, "features": {k: {"type": t, "shape": s} for k, (t, s) in FEATURES.items()}}
