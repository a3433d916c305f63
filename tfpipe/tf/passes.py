"""Passes over shard files: ``read_in_order`` (evaluation, the written order) and ``read_shuffled`` (training),
both through ``shard_reader``, which checks each shard in TensorFlow ops as it is read -- the folder still holds
the dataset opened, the shard holds exactly the records its manifest counts. Every reader of records in
TensorFlow goes through here (``make_dataset``, the columns of ``tfpipe.tf.columns``), so no pass skips a check."""

from __future__ import annotations

import posixpath
import warnings
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from tfpipe.runtime.deps import require

if TYPE_CHECKING:
    import tensorflow as tf
else:
    tf = require("tensorflow")  # or one line saying what to install
from tfpipe.format.shards import MANIFEST, Shards
from tfpipe.tf.parse import AUTOTUNE, ReadOptions

REWRITTEN = "was rewritten while this job read it"


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


END_OF_PASS = ""  # no shard's name: a pass's last file name, read as no records, there to check the folder again


def shard_names(files: Sequence[str], shards: Shards) -> tf.data.Dataset:
    """(file name, the folder's manifest path, its record count) triples, ``shard_reader``'s input. The path
    travels as data: a constant path would let TensorFlow fold the manifest's read into the function once,
    checking nothing later. The count is the manifest's (else the one in the file's name; -1: unknown)."""
    manifest = posixpath.join(shards.folder, MANIFEST) if shards.folder and shards.manifest else ""
    counts = shards.counts
    expected = [0 if f == END_OF_PASS else _known(counts.get(f)) for f in files]
    return tf.data.Dataset.from_tensor_slices((list(files), [manifest] * len(files), tf.constant(expected, tf.int64)))


def _known(count: int | None) -> int:
    return -1 if count is None else count


def shard_reader(shards: Shards, options: ReadOptions) -> Callable[[tf.Tensor, tf.Tensor, tf.Tensor], tf.data.Dataset]:
    """A shard file name -> its records, checked in TensorFlow ops (no Python: fine on a TPU host or a tf.data
    service worker):

    - as the file is opened (when ``flat_map`` or ``interleave`` asks for its records, not ahead), the folder
      still holds the dataset opened: its ``manifest.json`` still names its dataset id; ``END_OF_PASS`` (no
      records) checks once more after a sequential pass's last record;
    - as the file ends, it held exactly the records its manifest entry (or name) counts: a shard cut short or
      grown while the job ran (a copy in place, a file still being written) is an error, never a pass that
      quietly reads fewer or more records (``assert_cardinality``: one counting stage, no copy).

    ``naming_corrupt_shards`` makes either failure a ``TfpipeError`` naming the folder or the shard and both
    counts, as ``RecordDataset``'s passes do. Files without a folder's manifest are not checked for identity,
    files without a count (not named by ``tfpipe.write``, no manifest) not for their count: said once, here."""
    checked = bool(shards.folder and shards.manifest)
    counted = all(n is not None for n in shards.counts.values())
    if not counted:
        warnings.warn(UNCOUNTED.format(shards=shards), stacklevel=4)
    dataset_id = shards.manifest.dataset_id if shards.manifest else ""
    said = f"{shards.folder} {REWRITTEN} (its {MANIFEST} no longer names dataset id {dataset_id})"

    def read(name: tf.Tensor, manifest: tf.Tensor, expected: tf.Tensor) -> tf.data.Dataset:
        if checked:
            text = tf.io.read_file(manifest)
            unchanged = tf.strings.regex_full_match(text, f'(?s).*"dataset_id": "{dataset_id}".*')
            with tf.control_dependencies([tf.debugging.Assert(unchanged, [said])]):
                name = tf.identity(name)
        records = _records_of(name, options.read_buffer)
        return records.apply(tf.data.experimental.assert_cardinality(expected)) if counted else records

    return read


TF_READ_BUFFER = 256 * 1024  # tf.data.TFRecordDataset's read-ahead when buffer_size is None


def _records_of(name: tf.Tensor, read_buffer: int | None) -> tf.data.Dataset:
    """The records of file ``name``; none, opening nothing, for ``END_OF_PASS``. One dataset stage: TensorFlow's
    reader op itself, over a vector of zero or one file names. ``tf.data.TFRecordDataset(name)`` would wrap the
    file in a ``flat_map`` of its own (and ``END_OF_PASS`` needed a ``take``): two more stages every record passes,
    about a quarter of a bare read's time. ``read_buffer`` None: TensorFlow's default."""
    names = tf.reshape(name, [1])[: tf.cast(tf.not_equal(name, END_OF_PASS), tf.int32)]
    buffer = TF_READ_BUFFER if read_buffer is None else read_buffer
    variant = tf.raw_ops.TFRecordDataset(filenames=names, compression_type="", buffer_size=buffer)
    return tf.data.experimental.from_variant(variant, tf.TensorSpec([], tf.string))


UNCOUNTED = (
    "{shards}: some files carry no record count (no manifest, no count in their names): a pass over them cannot "
    "check that it read each file whole"
)
