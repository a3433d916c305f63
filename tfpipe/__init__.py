"""tfpipe: fast, correct TFRecord pipelines for image classification on TPUs and GPUs.

Public API (heavy imports are deferred until used; the words follow docs/glossary.md):

- ``write_shards(source, out, ...)``: a source -> a shard folder of TFRecords + ``manifest.json`` (``tfpipe.write``).
- ``open_source(...)``, ``Source``, ``TfdsSource``, ``SourceProtocol``, ``LabelFormat``: what the writer reads.
- ``ImageSpec``: how images are stored (size, fit, format, quality, input limits).
- ``make_dataset(records, batch_size, ...)``: shards -> ``(images, targets)`` batches (``tfpipe.tf.read``, whose
  stages ``Parser``, ``read_shuffled``, ``read_in_order``, ``training_batches``, ... are public too).
- ``Augment``, ``ReadOptions``: which training augmentations ``make_dataset`` applies; how it reads.
- ``open_shards(records, folds)``, ``Shards``, ``verify``: shards opened and checked; every record's CRCs.
- ``Manifest``: a shard folder's ``manifest.json``, typed and validated (``Manifest.load(folder)``).
- ``fold_split``, ``count_examples``, ``image_names``, ``read_targets``: folds, sizes, row ids, labels of shards;
  ``image_digests``: each stored image's content digest (its identity, which its name is not).
- ``inspect_shards(records, ...)``: schema, counts, labels, contact sheet, ``verify`` (``tfpipe.inspect``).
- ``naming_corrupt_shards(records)``: a context that names the shard behind TensorFlow's ``DataLossError``.
- ``TfpipeError``: the one exception type for problems in user input.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from tfpipe.version import __version__ as __version__

if TYPE_CHECKING:  # what type checkers and IDEs see; at run time each name is imported when first used
    from tfpipe.format.manifest import Manifest
    from tfpipe.format.shards import Shards, fold_split, open_shards, verify
    from tfpipe.inspect import inspect_shards
    from tfpipe.runtime.errors import TfpipeError
    from tfpipe.sources.labels import LabelFormat
    from tfpipe.sources.source import Item, Source, SourceProtocol
    from tfpipe.sources.tfds import TfdsSource
    from tfpipe.tf.augment import Augment
    from tfpipe.tf.columns import count_examples, image_digests, image_names, naming_corrupt_shards, read_targets
    from tfpipe.tf.read import ReadOptions, make_dataset
    from tfpipe.writer.engine import open_source, write_shards
    from tfpipe.writer.images import ImageSpec

_LAZY = {
    "write_shards": "tfpipe.writer.engine",
    "Source": "tfpipe.sources.source",
    "SourceProtocol": "tfpipe.sources.source",
    "Item": "tfpipe.sources.source",
    "open_source": "tfpipe.writer.engine",
    "TfdsSource": "tfpipe.sources.tfds",
    "Shards": "tfpipe.format.shards",
    "ImageSpec": "tfpipe.writer.images",
    "LabelFormat": "tfpipe.sources.labels",
    "TfpipeError": "tfpipe.runtime.errors",
    "make_dataset": "tfpipe.tf.read",
    "ReadOptions": "tfpipe.tf.read",
    "fold_split": "tfpipe.format.shards",
    "open_shards": "tfpipe.format.shards",
    "Manifest": "tfpipe.format.manifest",
    "verify": "tfpipe.format.shards",
    "count_examples": "tfpipe.tf.columns",
    "image_digests": "tfpipe.tf.columns",
    "image_names": "tfpipe.tf.columns",
    "read_targets": "tfpipe.tf.columns",
    "naming_corrupt_shards": "tfpipe.tf.columns",
    "Augment": "tfpipe.tf.augment",
    "inspect_shards": "tfpipe.inspect",
}


def __dir__() -> list[str]:
    """The public names (tab completion in a notebook), though most are imported only when first used."""
    return sorted({*__all__, "__version__"})


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'tfpipe' has no attribute {name!r}")


__all__ = [  # the same names as _LAZY (a test checks)
    "Augment",
    "ImageSpec",
    "Item",
    "LabelFormat",
    "Manifest",
    "ReadOptions",
    "Shards",
    "Source",
    "SourceProtocol",
    "TfdsSource",
    "TfpipeError",
    "count_examples",
    "fold_split",
    "image_digests",
    "image_names",
    "inspect_shards",
    "make_dataset",
    "naming_corrupt_shards",
    "open_shards",
    "open_source",
    "read_targets",
    "verify",
    "write_shards",
]
