"""Read tfpipe shards from PyTorch: ``RecordDataset``, a ``torch.utils.data.IterableDataset``.

    from tfpipe.torch import RecordDataset
    ds = RecordDataset("records/demo/train", folds=[1, 2, 3, 4], shuffle=True, seed=0)
    loader = torch.utils.data.DataLoader(ds, batch_size=64, num_workers=4)
    for epoch in range(10):
        ds.set_epoch(epoch)
        for images, targets in loader:  # uint8 [B, 3, S, S], float32 [B, C]
            ...

No TensorFlow anywhere (so DataLoader workers may fork): the TFRecord framing
is read and CRC-checked by ``tfpipe.tfrecord``, records are parsed with the
schema's own protobuf classes and images decoded with OpenCV. Every record is
seen exactly once per epoch across DataLoader workers *and* distributed ranks:
whole shards are dealt to the (rank, worker) readers when there are enough of
them, otherwise every reader scans all shards and keeps every n-th record.
"""

from __future__ import annotations

import random
from collections.abc import Iterable, Iterator, Sequence
from typing import TypeAlias, TypeVar

import cv2
import numpy as np

from tfpipe.deps import require

require("torch")  # or one line saying what to install
import torch
from torch.utils.data import IterableDataset, get_worker_info

from tfpipe import schema
from tfpipe.errors import TfpipeError, check_count
from tfpipe.shards import Records, checked_num_classes, open_shards
from tfpipe.tfrecord import read_records

# (image uint8 [3, H, W], target float32 [C]), and the record's image_name with ``with_ids``
Sample: TypeAlias = tuple[torch.Tensor, torch.Tensor] | tuple[torch.Tensor, torch.Tensor, str]
T = TypeVar("T")


def reader_slot(rank: int | None = None, world_size: int | None = None) -> tuple[int, int]:
    """(index, count) of this reader among all (rank, DataLoader worker) readers."""
    if rank is None or world_size is None:  # RecordDataset takes both or neither
        dist = torch.distributed
        rank, world_size = (
            (dist.get_rank(), dist.get_world_size()) if dist.is_available() and dist.is_initialized() else (0, 1)
        )
    info = get_worker_info()
    worker, workers = (info.id, info.num_workers) if info is not None else (0, 1)
    return rank * workers + worker, world_size * workers


class RecordDataset(IterableDataset[Sample]):
    """Yields ``(image uint8 [3, H, W], target float32 [C])`` from tfpipe shards.

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
    ) -> None:
        super().__init__()
        if (rank is None) != (world_size is None):
            raise TfpipeError(f"RecordDataset: give rank and world_size together (got {rank=}, {world_size=})")
        check_count(1, num_classes=num_classes)  # 0 is a mistake, not "from the manifest" (as in make_dataset)
        shards = open_shards(records, folds)  # the same checks and messages as make_dataset
        self.shards, self.files = shards, shards.files
        self.num_classes = checked_num_classes(records, shards, num_classes)
        self.shuffle, self.seed, self.shuffle_buffer, self.with_ids = shuffle, seed, shuffle_buffer, with_ids
        self.rank, self.world_size = rank, world_size
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def _records(self) -> Iterator[bytes]:
        slot, slots = reader_slot(self.rank, self.world_size)
        files = list(self.files)
        if self.shuffle:  # the same permutation in every reader, so the deal below stays disjoint
            random.Random(self.seed + self.epoch).shuffle(files)
        if len(files) >= slots:  # whole shards per reader
            for path in files[slot::slots]:
                yield from read_records(path)
        else:  # fewer shards than readers: everyone scans, keeps every n-th record
            for i, record in enumerate(r for path in files for r in read_records(path)):
                if i % slots == slot:
                    yield record

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
        self.shards.check_unchanged()  # every epoch: a folder rewritten since would change what an index means
        records = self._records()
        if self.shuffle:
            records = _shuffled(records, self.shuffle_buffer, random.Random(self.seed * 7919 + self.epoch))
        for record in records:
            yield self._decode(record)


def _shuffled(items: Iterable[T], buffer_size: int, rng: random.Random) -> Iterator[T]:
    """A shuffle buffer over a stream (what tf.data's shuffle does)."""
    buffer: list[T] = []

    for item in items:
        buffer.append(item)
        if len(buffer) >= buffer_size:
            yield buffer.pop(rng.randrange(len(buffer)))
    rng.shuffle(buffer)
    yield from buffer
