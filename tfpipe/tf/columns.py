"""Columns of the shards read without decoding an image (the count, the ids, the digests, the targets), and
``naming_corrupt_shards``, which turns TensorFlow's errors about a shard into one line naming it."""

from __future__ import annotations

import contextlib
import re
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any

from tfpipe.runtime.deps import require

if TYPE_CHECKING:
    import numpy as np
    import tensorflow as tf
else:
    tf = require("tensorflow")  # or one line saying what to install
from tfpipe.format import schema
from tfpipe.format.names import SHARD_NAMES
from tfpipe.format.shards import MANIFEST, UNKNOWN_COUNT, Records, Shards, open_shards, verify
from tfpipe.runtime import fs
from tfpipe.runtime.errors import TfpipeError
from tfpipe.tf.parse import AUTOTUNE, feature_spec
from tfpipe.tf.passes import REWRITTEN, read_in_order


@contextlib.contextmanager
def naming_corrupt_shards(records: Records) -> Iterator[None]:
    """Turns TensorFlow's errors about a shard into one line naming it (``TfpipeError``): ``DataLossError``
    (which names no file), ``shard_reader``'s checks (the folder rewritten, a shard's count changed while a pass
    read it), a shard gone (or not found by another process reading for this job) and one this user cannot read.

    Example::

        with tfpipe.naming_corrupt_shards("records/train"):
            model.fit(tfpipe.make_dataset("records/train", 64, training=True), ...)
    """
    try:
        yield
    except tf.errors.OpError as e:
        line = shard_error_line(e, records)
        if line is None:
            raise
        raise TfpipeError(line) from None


def shard_error_line(e: tf.errors.OpError, records: Records) -> str | None:
    """The line ``naming_corrupt_shards`` says for ``e``; None for an error that is not about a shard."""
    if isinstance(e, tf.errors.DataLossError):
        problems = verify(open_shards(records))
        return problems[0] if problems else f"{records}: corrupt data ({e.message.splitlines()[0]})"
    if isinstance(e, tf.errors.InvalidArgumentError) and REWRITTEN in e.message:  # shard_reader's identity check
        said = re.search(rf"\[([^\[\]]* {REWRITTEN} [^\[\]]*)\]", e.message)
        what = said.group(1) if said else f"{records} {REWRITTEN}"
        return f"{what}; nothing of this pass counts -- run it again on the new shards"
    if isinstance(e, tf.errors.FailedPreconditionError):
        return _count_changed(e.message, records)
    if isinstance(e, tf.errors.NotFoundError):
        return _not_found(e.message, records)
    if isinstance(e, tf.errors.PermissionDeniedError):  # its message names the file among graph and op names
        named = next((f for f in open_shards(records).files if f in e.message), f"a shard of {records}")
        return f"{named}: this user cannot read it (permission denied); give it read access"
    return None


def _count_changed(message: str, records: Records) -> str | None:
    """``shard_reader``'s count check: a shard cut short or grown while a pass read it, named by reading the
    shards again (``verify``), with both counts."""
    counts = re.search(r"expected to contain (\d+) elements but contained (only|at least) (\d+)", message)
    if counts is None:
        return None
    shards = open_shards(records)
    problems = [p for p in verify(shards) if "records, expected" in p]
    if problems and not shards.manifest:  # the count came from the name: more likely a name than a change
        return f"{problems[0]}; nothing of this pass counts"
    more = counts.group(2) == "at least"
    what = problems[0] if problems else (
        f"a shard of {records} held {'more than ' * more}{int(counts.group(3)) - more} records while this job read "
        f"it, its count says {counts.group(1)}"
    )  # fmt: skip
    return (
        f"{what}: it changed while this job read it (copied in place? still being written?); nothing of this "
        "pass counts -- run it again once the shards are whole (python -m tfpipe.inspect --verify)"
    )


def _not_found(message: str, records: Records) -> str | None:
    """A shard or the manifest gone from under a pass (a rewrite renamed them), or not found by another process
    reading for this job (a service's worker) though it is here."""
    names = re.escape(SHARD_NAMES.suffix) + "|" + re.escape(MANIFEST)  # a shard's or the manifest's
    gone = re.search(r"(\S+(?:" + names + r")); No such file", message)
    if gone is None:
        return None
    if fs.exists(gone.group(1)):
        return (
            f"{gone.group(1)}: a process reading for this job found no such file, though it is here: a tf.data "
            "service worker on another machine or in another folder? every worker needs the shards at the same "
            "path (a shared disk, gs://)"
        )
    return f"{gone.group(1)} vanished while this job read it: {records} {REWRITTEN} or deleted"


def count_examples(records: Records, folds: Sequence[int] | None = None) -> int:
    """Number of records in ``records`` (from the manifest or the counts in shard names)."""
    n = open_shards(records, folds).num_examples
    if n is None:
        raise TfpipeError(f"{records}: {UNKNOWN_COUNT}")
    return n


def _read_column(records: Records, folds: Sequence[int] | None, key: str) -> list[Any]:
    """One parsed feature of every record, in written order (no image decoding)."""
    spec = feature_spec((key,))
    ds = read_in_order(open_shards(records, folds)).batch(1024)
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
