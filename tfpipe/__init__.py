"""tfpipe: fast, correct TFRecord pipelines for image classification on TPUs and GPUs.

Public API (heavy imports are deferred until used):

- ``write_shards(Source(...), out, ...)``: images + CSV -> sharded TFRecords (``tfpipe.write``).
- ``Source``, ``ImageSpec``, ``LabelFormat``: what to read and how to store it.
- ``make_dataset(source, batch_size, ...)``: shards -> ``(images, targets)`` batches (``tfpipe.read``).
- ``Augment``: which training augmentations ``make_dataset`` applies.
- ``open_shards(records, folds)``, ``verify``: a shard folder, glob or list opened and checked; every record's CRCs.
- ``Manifest``: a shard folder's ``manifest.json``, typed and validated (``Manifest.load(folder)``).
- ``fold_split``, ``count_examples``, ``image_names``, ``read_targets``: folds, sizes, row ids, labels of shards.
- ``inspect_shards(path, ...)``: schema, counts, labels, contact sheet, ``verify`` (``tfpipe.inspect``).
- ``naming_corrupt_shards(source)``: a context that names the shard behind TensorFlow's ``DataLossError``.
- ``TfpipeError``: the one exception type for problems in user input.
"""

__version__ = "0.3.0"

_LAZY = {
    "write_shards": "tfpipe.write",
    "Source": "tfpipe.sources",
    "ImageSpec": "tfpipe.images",
    "LabelFormat": "tfpipe.sources",
    "TfpipeError": "tfpipe.errors",
    "make_dataset": "tfpipe.read",
    "ReadOptions": "tfpipe.read",
    "fold_split": "tfpipe.shards",
    "open_shards": "tfpipe.shards",
    "Manifest": "tfpipe.manifest",
    "verify": "tfpipe.shards",
    "count_examples": "tfpipe.read",
    "image_names": "tfpipe.read",
    "read_targets": "tfpipe.read",
    "naming_corrupt_shards": "tfpipe.read",
    "Augment": "tfpipe.augment",
    "inspect_shards": "tfpipe.inspect",
}


def __getattr__(name):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'tfpipe' has no attribute {name!r}")


__all__ = sorted(_LAZY)
