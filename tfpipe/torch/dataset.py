"""Read tfpipe shards from PyTorch: ``RecordDataset``, a ``torch.utils.data.IterableDataset``.

    from tfpipe.torch import RecordDataset
    ds = RecordDataset("records/demo/train", folds=[1, 2, 3, 4], shuffle=True, seed=0)
    loader = torch.utils.data.DataLoader(ds, batch_size=64, num_workers=4, persistent_workers=True)
    for epoch in range(10):
        ds.set_epoch(epoch)
        for images, targets in loader:  # uint8 [B, 3, S, S], float32 [B, C]
            ...

No TensorFlow anywhere (so DataLoader workers may fork): the TFRecord framing
is read and CRC-checked by ``tfpipe.format.tfrecord``, records are parsed with the
schema's own protobuf classes and images decoded with OpenCV.

Distributed ranks get what ``DistributedSampler`` gives them: the same number
of records each (the epoch's records padded by repeating from its start, or
cut with ``drop_last``), every record at least once per epoch across ranks
(exactly once when the count divides), a new order every epoch through
``set_epoch`` (also in ``persistent_workers``), and ``len()``. The records
are dealt from the shard counts of the manifest: rank r reads the r-th
contiguous slice of the epoch's stream (the shards in a shuffled order, from a
shifted start: both new every epoch), skipping by the TFRecord framing to
where its slice starts, and its DataLoader workers split that slice at batch
boundaries.

``sampling="balanced"`` (single-label) draws each reader's share evenly over the classes instead: records of
the common classes are rejected by the rule the TF reader uses (``tfpipe.format.sampling``), reading on around the
epoch's stream until the share is full, so ``len()`` and the ranks' equal counts hold and a rare image comes
several times an epoch.
"""

from __future__ import annotations

import math
import random
from collections.abc import Iterable, Iterator, Sequence
from typing import Any, NamedTuple, TypeAlias, TypeVar

import cv2
import numpy as np

from tfpipe.runtime.deps import require

require("torch")  # or one line saying what to install
import torch
from torch.utils.data import IterableDataset, get_worker_info

from tfpipe.format import schema
from tfpipe.format.sampling import check_sampling, class_counts, keep_shares
from tfpipe.format.shards import Records, Shards, check_fold_ids, checked_num_classes, open_shards
from tfpipe.format.tfrecord import count_records, read_records
from tfpipe.runtime.errors import TfpipeError, check_count, check_seed, option

# (image uint8 [3, H, W], target float32 [C]), and the record's image_name with ``with_ids``
Sample: TypeAlias = tuple[torch.Tensor, torch.Tensor] | tuple[torch.Tensor, torch.Tensor, str]
T = TypeVar("T")


class Segment(NamedTuple):
    """Records ``start`` to ``stop`` of one shard file, which holds ``file_records`` records in all."""

    file: str
    start: int
    stop: int
    file_records: int


def distributed_rank() -> tuple[int, int]:
    """(rank, world size) of this process in ``torch.distributed``: (0, 1) when it is not initialised."""
    dist = torch.distributed
    return (dist.get_rank(), dist.get_world_size()) if dist.is_available() and dist.is_initialized() else (0, 1)


def per_rank(total: int, world_size: int, drop_last: bool) -> int:
    """Records each rank reads in an epoch: ``total`` over the ranks, rounded up (the rest padded by repeating
    records) or down with ``drop_last`` (the rest left out), as ``DistributedSampler`` does."""
    return total // world_size if drop_last else math.ceil(total / world_size)


def worker_range(size: int, worker: int, workers: int, batch_size: int) -> tuple[int, int]:
    """This DataLoader worker's part of a rank's ``size`` records: whole batches, contiguous, so that only the
    last worker ends on a short batch and the loader yields exactly ``ceil(size / batch_size)`` batches."""
    batches = math.ceil(size / batch_size)
    first, last = batches * worker // workers, batches * (worker + 1) // workers
    return min(first * batch_size, size), min(last * batch_size, size)


def deal(files: Sequence[str], counts: Sequence[int], start: int, stop: int) -> list[Segment]:
    """The segments of positions ``start`` to ``stop`` in the stream of ``files`` read one after another,
    wrapping around to the first record past the end (the padding of the last ranks)."""
    total, segments = sum(counts), []
    while start < stop and total:
        wrap, first = divmod(start, total)
        end = min(stop, (wrap + 1) * total) - wrap * total  # this pass over the stream: [first, end)
        offset = 0
        for file, count in zip(files, counts):
            lo, hi = max(first, offset), min(end, offset + count)
            if lo < hi:
                segments.append(Segment(file, lo - offset, hi - offset, count))
            offset += count
        start = wrap * total + end
    return segments


def folds_apart(shards: Shards, val_folds: Sequence[int]) -> list[int]:
    """The training folds: all but ``val_folds``, which must be some (not all) folds of ``shards``."""
    if not shards.num_folds:
        raise TfpipeError(f"{shards} has no folds: write it with {option('num_folds', 4)} to validate on some of them")
    try:
        ids = check_fold_ids(val_folds)
    except TfpipeError:
        raise TfpipeError(f"val_folds are the fold ids to validate on, such as [0] (got {val_folds!r})") from None
    if any(not 0 <= k < shards.num_folds for k in ids) or len(set(ids)) >= shards.num_folds:
        raise TfpipeError(
            f"validation folds {ids}: {shards} has folds 0..{shards.num_folds - 1}; validate on some, "
            "train on the others"
        )
    return [k for k in range(shards.num_folds) if k not in ids]


class RecordDataset(IterableDataset[Sample]):
    """Yields ``(image uint8 [3, H, W], target float32 [C])`` from tfpipe shards, each rank its share.

    Args:
      records: shard folder (with ``manifest.json``), glob pattern, or list of files.
      folds: fold numbers to read (folded shard folders); None reads all.
      num_classes: needed only without a manifest.
      shuffle: shuffle shard order and records (within a buffer) every epoch;
        call ``set_epoch(e)`` before each epoch for a new order.
      seed: base seed of the shuffle.
      shuffle_buffer: records held for shuffling, per reader.
      with_ids: also yield the record's ``image_name``.
      rank: this process's rank among distributed ranks (give both or neither; default: from
        ``torch.distributed`` when it is initialised, else 0).
      world_size: the number of ranks (default: from ``torch.distributed``, else 1).
      drop_last: leave out the records past the ranks' last whole share instead of padding each
        epoch by repeating records from its start (``DistributedSampler``'s ``drop_last``).
      batch_size: the DataLoader's batch size: its workers then split a rank's records at batch
        boundaries, so the loader yields exactly ``len(loader)`` batches and every rank as many.
      sampling: ``"balanced"`` (single-label records): each reader's share drawn evenly over the classes
        present (rejection sampling with the files' class counts, read when the dataset is made).
    """

    def __init__(
        self,
        records: Records,
        *,
        folds: Sequence[int] | None = None,
        num_classes: int | None = None,
        shuffle: bool = False,
        seed: int = 0,
        shuffle_buffer: int = 1024,
        with_ids: bool = False,
        rank: int | None = None,
        world_size: int | None = None,
        drop_last: bool = False,
        batch_size: int | None = None,
        sampling: str | None = None,
    ) -> None:
        super().__init__()
        check_sampling(sampling)
        if (rank is None) != (world_size is None):
            raise TfpipeError(f"RecordDataset: give rank and world_size together (got {rank=}, {world_size=})")
        check_count(
            1, num_classes=num_classes, world_size=world_size, batch_size=batch_size, shuffle_buffer=shuffle_buffer
        )
        check_count(0, rank=rank)
        check_seed(seed=seed)
        if rank is not None and world_size is not None and not 0 <= rank < world_size:
            raise TfpipeError(f"RecordDataset: rank must be in 0..{world_size - 1} (got {rank=})")
        shards = open_shards(records, folds)  # the same checks and messages as make_dataset
        self.shards, self.files = shards, shards.files
        self.num_classes = checked_num_classes(records, shards, num_classes)
        # the manifest's counts (each shard's size checked when opened); files without one are counted by their
        # framing: a count in a foreign file's name may be anything ("isic-2020.tfrec")
        counts = shards.counts if shards.manifest else {f: count_records(f) for f in shards.files}
        self.counts = tuple(int(n or 0) for n in counts.values())
        self.shuffle, self.seed, self.shuffle_buffer, self.with_ids = shuffle, seed, shuffle_buffer, with_ids
        self.rank, self.world_size, self.drop_last, self.batch_size = rank, world_size, drop_last, batch_size
        # in shared memory: DataLoader workers (persistent ones too) read the epoch set after they started
        self._epoch = torch.zeros((), dtype=torch.int64).share_memory_()
        # with sampling: the probability of keeping a record of each class, from every file's labels
        self.keep = keep_shares(class_counts(self.targets(), shards)) if sampling else None
        if rank is not None:
            self.share()  # refuses here what no rank could read

    @property
    def epoch(self) -> int:
        return int(self._epoch)

    def set_epoch(self, epoch: int) -> None:
        """The epoch whose order to read next (with ``shuffle``): call it before each epoch, on every rank."""
        check_count(0, epoch=epoch)
        if epoch >= 2**62:
            raise TfpipeError(f"set_epoch: epoch {epoch} is beyond any run (below 2**62)")
        self._epoch.fill_(epoch)

    def ranks(self) -> tuple[int, int]:
        """(rank, world size): as given, else from ``torch.distributed``."""
        if self.rank is not None and self.world_size is not None:
            return self.rank, self.world_size
        return distributed_rank()

    @property
    def num_records(self) -> int:
        """Records in the files read (every rank's together, no padding)."""
        return sum(self.counts)

    def share(self) -> int:
        """Records each rank reads per epoch; refuses ``drop_last`` with fewer records than ranks."""
        world_size = self.ranks()[1]
        size = per_rank(self.num_records, world_size, self.drop_last)
        if self.num_records and not size:
            raise TfpipeError(
                f"{self.shards}: {self.num_records} records cannot give each of {world_size} ranks one with "
                "drop_last=True; pad instead (drop_last=False) or use fewer ranks"
            )
        return size

    def __len__(self) -> int:
        """Records this rank reads per epoch (the same on every rank)."""
        return self.share()

    def __getstate__(self) -> dict[str, Any]:
        """What a spawned DataLoader worker gets: the rank as this process knows it (the worker has no
        ``torch.distributed``)."""
        state = self.__dict__.copy()
        if self.rank is None and distributed_rank()[1] > 1:
            state["rank"], state["world_size"] = distributed_rank()
        return state

    def segments(self, epoch: int, worker: int = 0, workers: int = 1) -> list[Segment]:
        """What one reader (this rank's DataLoader ``worker`` of ``workers``) reads in ``epoch``."""
        files, counts, start, stop = self._slice(epoch, worker, workers)
        return deal(files, counts, start, stop)

    def _slice(self, epoch: int, worker: int, workers: int) -> tuple[list[str], list[int], int, int]:
        """The epoch's stream (its files in order, their counts) and one reader's positions in it."""
        rank, size = self.ranks()[0], self.share()
        total, order, shift = self.num_records, list(range(len(self.files))), 0
        if self.shuffle and total:  # the same on every rank and worker, so the slices stay disjoint
            rng = random.Random(f"{self.seed}/{epoch}")  # str seeds: seed 0 epoch 1 is not seed 1 epoch 0
            rng.shuffle(order)
            shift = rng.randrange(total)  # the slices start elsewhere every epoch, also with one shard
        lo, hi = worker_range(size, worker, workers, self.batch_size or 1)
        files, counts = [self.files[i] for i in order], [self.counts[i] for i in order]
        return files, counts, shift + rank * size + lo, shift + rank * size + hi

    def _balanced(self, epoch: int, worker: int, workers: int) -> Iterator[bytes]:
        """One reader's share drawn evenly over the classes: the epoch's stream read from the reader's start,
        around and around, each record kept with its class's share (``self.keep``) until the share is full."""
        assert self.keep is not None
        files, counts, start, stop = self._slice(epoch, worker, workers)
        rng = random.Random(f"{self.seed}/{epoch}/{self.ranks()[0]}/{worker}/balanced")
        wanted, total = stop - start, sum(counts)
        while wanted > 0 and total:
            for record in self._records(deal(files, counts, start, start + total)):
                target = schema.decode_example(record).get(schema.TARGET, [0])
                if rng.random() < self.keep[int(target[0]) if len(target) else 0]:
                    yield record
                    wanted -= 1
                    if not wanted:
                        return

    def targets(self) -> np.ndarray:
        """Multi-hot float32 [N, C] targets of every record of the files read, in their written order (the class
        counts of balanced sampling and class weights; images not decoded)."""
        every = deal(list(self.files), list(self.counts), 0, self.num_records)
        rows = [schema.decode_example(r).get(schema.TARGET, []) for r in self._records(every)]
        return schema.multi_hot([list(r) for r in rows], self.num_classes)

    def _records(self, segments: Iterable[Segment]) -> Iterator[bytes]:
        for seg in segments:
            last = (
                seg.stop == seg.file_records
            )  # this reader has the shard's last record: it reads on to the file's end
            seen = seg.start
            for record in read_records(seg.file, seg.start, None if last else seg.stop):
                if seen == seg.file_records:
                    raise miscounted(seg, "more")
                seen += 1
                yield record
            if seen < seg.stop:
                raise miscounted(seg, "fewer")

    def _decode(self, record: bytes) -> Sample:
        ex = schema.decode_example(record)
        pixels = cv2.imdecode(np.frombuffer(ex[schema.IMAGE], np.uint8), cv2.IMREAD_COLOR)
        if pixels is None:
            raise TfpipeError(f"record {ex.get(schema.IMAGE_NAME, b'?')!r}: image does not decode")
        image = torch.from_numpy(np.ascontiguousarray(pixels[:, :, ::-1].transpose(2, 0, 1)))  # BGR HWC -> RGB CHW
        target = torch.from_numpy(schema.multi_hot([ex.get(schema.TARGET, [])], self.num_classes)[0])
        name = ex.get(schema.IMAGE_NAME, b"")
        return (
            (image, target, name.decode("utf-8") if isinstance(name, bytes) else name)
            if self.with_ids
            else (image, target)
        )

    def __iter__(self) -> Iterator[Sample]:
        self.shards.check_unchanged()  # every pass, at its start and end: a rewrite changes what an index means
        info = get_worker_info()
        worker, workers = (info.id, info.num_workers) if info is not None else (0, 1)
        epoch = self.epoch
        if self.keep is not None:
            records = self._balanced(epoch, worker, workers)
        else:
            records = self._records(self.segments(epoch, worker, workers))
        if self.shuffle:
            rng = random.Random(f"{self.seed}/{epoch}/{self.ranks()[0]}/{worker}")  # str seeds: the same every run
            records = _shuffled(records, self.shuffle_buffer, rng)
        try:
            for record in records:
                yield self._decode(record)
        except (OSError, TfpipeError):  # a shard gone or cut short mid-epoch: a rewrite says so, else as it is
            self.shards.check_unchanged()
            raise
        self.shards.check_unchanged()  # and at its end: records read across a rewrite are no epoch of either


def unique_rows(ids: Sequence[str], *columns: np.ndarray, expected: int | None = None) -> tuple[Any, ...]:
    """Rows ordered by id, each id once: what is left of a padded epoch's predictions (``RecordDataset``
    repeats records so that every rank reads as many) once the repeats are taken out.

    A repeat must be the same image: rows of one name that differ (two folders holding the same names), rows
    without a name, or other than ``expected`` images in the end are an error, never a merge."""
    if any(not name for name in ids):
        raise TfpipeError("rows without an image_name cannot be told apart from the padding's repeats")
    first: dict[str, int] = {}
    for i, name in enumerate(ids):
        j = first.setdefault(name, i)
        if j != i and not all(np.allclose(np.asarray(c)[i], np.asarray(c)[j], atol=1e-3) for c in columns):
            raise TfpipeError(f"image name {name!r} is read twice with other targets or scores: names must be unique")
    if expected is not None and len(first) != expected:
        raise TfpipeError(f"{len(first)} distinct image names where {expected} images were read: names repeat")
    order = [first[name] for name in sorted(first)]
    return (sorted(first), *(np.asarray(c)[order] for c in columns))


def gather_rows(ids: Sequence[str], *columns: np.ndarray, expected: int | None = None) -> tuple[Any, ...]:
    """Every rank's rows (``with_ids``' names and arrays such as probabilities and targets) on every rank, each
    image once (``unique_rows``): validation scores over the whole fold, not over one rank's share. ``expected``:
    the images read (``RecordDataset.num_records``)."""
    world_size = distributed_rank()[1]
    if world_size == 1:
        return unique_rows(ids, *columns, expected=expected)
    parts: list[Any] = [None] * world_size
    torch.distributed.all_gather_object(parts, (list(ids), *columns))
    return unique_rows(
        [name for part in parts for name in part[0]],
        *(np.concatenate([part[k + 1] for part in parts]) for k in range(len(columns))),
        expected=expected,
    )


def sync_buffers(module: torch.nn.Module) -> None:
    """Rank 0's buffers (batch-norm statistics) on every rank, as DDP's training step leaves them before each
    rank's own update: validation then scores one model on every rank."""
    if distributed_rank()[1] > 1:
        for buffer in module.buffers():
            torch.distributed.broadcast(buffer, src=0)


def miscounted(seg: Segment, more_or_fewer: str) -> TfpipeError:
    return TfpipeError(
        f"{seg.file} holds {more_or_fewer} than the {seg.file_records} records counted when it was opened (its "
        "manifest's count): the shards changed since (python -m tfpipe.inspect --verify names what is wrong)"
    )


def _shuffled(items: Iterable[T], buffer_size: int, rng: random.Random) -> Iterator[T]:
    """A shuffle buffer over a stream (what tf.data's shuffle does)."""
    buffer: list[T] = []

    for item in items:
        buffer.append(item)
        if len(buffer) >= buffer_size:
            yield buffer.pop(rng.randrange(len(buffer)))
    rng.shuffle(buffer)
    yield from buffer
