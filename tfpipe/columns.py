"""Columns of the shards read without decoding an image (the count, the ids, the digests, the targets), and
``naming_corrupt_shards``, which turns TensorFlow's errors about a shard into one line naming it."""

from __future__ import annotations

import contextlib
import re
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any

from tfpipe.deps import require

if TYPE_CHECKING:
    import numpy as np
    import tensorflow as tf
else:
    tf = require("tensorflow")  # or one line saying what to install
from tfpipe import schema
from tfpipe.errors import TfpipeError
from tfpipe.parse import AUTOTUNE, ReadOptions
from tfpipe.shard_names import SHARD_NAMES
from tfpipe.shards import MANIFEST, Records, Shards, open_shards, verify

REWRITTEN = "was rewritten while this job read it"


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
