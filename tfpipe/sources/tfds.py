"""TensorFlow Datasets as a writer source: ``TfdsSource("cifar10", split="train")``.

    python -m tfpipe.write --tfds cifar10 --tfds-split train --out records/cifar10 --image-size 32 --num-folds 5

The image feature is read still encoded (``SkipDecoding``), so the writer's
workers decode and resize it like a file from disk. A ``ClassLabel`` label
becomes a one-element list (a single-label dataset); a ``Sequence`` of
``ClassLabel`` a variable-length list. Class names and their order are the
dataset's own. Encoded images are held in memory until written, which suits
datasets up to a few GB (cifar10/100, tf_flowers, plant_village).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from tfpipe.runtime.deps import require
from tfpipe.runtime.errors import TfpipeError, option
from tfpipe.sources.source import Item

if TYPE_CHECKING:
    from tfpipe.sources.source import SourceProtocol


@dataclasses.dataclass(frozen=True)
class TfdsSource:
    """A TFDS dataset split; ``label_key``/``image_key`` default to the first ClassLabel / Image feature."""

    name: str
    split: str = "train"
    data_dir: str | None = None
    image_key: str | None = None
    label_key: str | None = None
    labeled: bool = True
    id_column = "id"  # the manifest's id column: TFDS "id" feature, else the record's tfds_id
    label_format = None  # labels come from the dataset's features, not a CSV layout

    @property
    def origin(self) -> str:
        return f"TFDS {self.name}[{self.split}]"

    @functools.cached_property
    def _label_info(self) -> tuple[str | None, list[str], bool]:
        """(label key, class names, single_label) from the dataset's features (no examples are read)."""
        if not self.labeled:
            return None, [], False
        return _label_feature(_builder(self).info.features, self.label_key)

    @property
    def classes(self) -> list[str] | None:
        return self._label_info[1] or None

    @property
    def single_label(self) -> bool:
        return self._label_info[2]

    def items(self, skip_bad: bool = False) -> tuple[list[Item], list[dict[str, str]]]:
        """(items with encoded image bytes, skipped): nothing is skipped, every example has its image."""
        return read_tfds(self)[0], []


def _label_feature(features: Any, key: str | None) -> tuple[str | None, list[str], bool]:
    """(key, class names, single_label) of the label feature, or (None, [], False)."""
    tfds = require("tensorflow_datasets")

    def names_of(feature: Any) -> tuple[Sequence[str] | None, bool]:
        if isinstance(feature, tfds.features.ClassLabel):
            return feature.names, True
        if isinstance(feature, tfds.features.Sequence) and isinstance(feature.feature, tfds.features.ClassLabel):
            return feature.feature.names, False
        return None, False

    keys = [key] if key else list(features.keys())
    for k in keys:
        if k not in features:
            raise TfpipeError(f"TFDS features have no {k!r} (features: {', '.join(features.keys())})")
        names, single = names_of(features[k])
        if names is not None:
            return k, list(names), single
        if key:
            raise TfpipeError(f"TFDS feature {k!r} is not a ClassLabel or a Sequence of ClassLabel")
    return None, [], False


def _builder(source: TfdsSource) -> Any:
    tfds = require("tensorflow_datasets")
    try:
        return tfds.builder(source.name, data_dir=source.data_dir)
    except Exception as e:  # unknown name, bad data_dir
        raise TfpipeError(f"TFDS dataset {source.name!r}: {str(e).splitlines()[0][:200]}") from None


def read_tfds(source: TfdsSource) -> tuple[list[Item], list[str], bool]:
    """(items with encoded image bytes, class names, single_label) for a ``TfdsSource``."""
    tfds = require("tensorflow_datasets")
    builder = _builder(source)
    features = builder.info.features
    image_key = source.image_key or next((k for k, f in features.items() if isinstance(f, tfds.features.Image)), None)
    if image_key is None:
        raise TfpipeError(f"TFDS dataset {source.name!r} has no Image feature")
    label_key, names, single = source._label_info
    try:
        ds = builder.as_dataset(
            split=source.split,
            decoders={image_key: tfds.decode.SkipDecoding()},
            read_config=tfds.ReadConfig(add_tfds_id=True),
            shuffle_files=False,
        )
    except Exception as e:  # not downloaded / prepared (no network at run time), bad split
        raise TfpipeError(
            f"TFDS dataset {source.name!r} split {source.split!r}: {str(e).splitlines()[0][:200]} "
            f"(prepare it first with tfds build, or pass {option('data_dir')})"
        ) from None
    items: list[Item] = []
    for ex in ds.as_numpy_iterator():
        name = ex["id"].decode() if "id" in ex else ex["tfds_id"].decode()
        labels: tuple[str, ...] = ()

        if label_key is not None:
            value = ex[label_key]
            labels = (names[int(value)],) if single else tuple(dict.fromkeys(names[int(v)] for v in value))
        items.append(
            Item(path=f"tfds:{source.name}/{source.split}/{name}", name=name, labels=labels, data=bytes(ex[image_key]))
        )
    if not items:
        raise TfpipeError(f"TFDS dataset {source.name!r} split {source.split!r} is empty")
    return items, names, single


if TYPE_CHECKING:  # the type checker proves that TfdsSource has every member write_shards reads
    _source: type[SourceProtocol] = TfdsSource
