"""A shard folder as a PyTorch Lightning ``LightningDataModule``: folds -> training and validation.

    import pytorch_lightning as pl
    from tfpipe.torch.lightning import ShardDataModule

    data = ShardDataModule("records/demo/train", val_folds=[0], batch_size=32, workers=2)
    trainer = pl.Trainer(accelerator="cpu", devices=8, strategy="ddp", max_epochs=10)
    trainer.fit(model, datamodule=data)

Training batches are ``(images uint8 [B, 3, S, S], targets float32 multi-hot [B, C])``, validation batches add the
images' names (``with_ids``: each rank's share is padded to equal length, ``tfpipe.torch.dataset.gather_rows`` takes the
repeats out). Each rank reads its share through ``tfpipe.torch.dataset.RecordDataset``: the same number of batches on
every rank (DDP does not hang at an epoch's end), a new order every epoch (Lightning tells samplers the epoch,
and an ``IterableDataset`` has none: ``EpochLoader`` passes it on), and ``len()``, which Lightning's
``StochasticWeightAveraging`` needs for its batch-norm pass. Install with ``pip install 'tfpipe[lightning]'``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from tfpipe.runtime.deps import require

require("pytorch_lightning")
import pytorch_lightning as pl
from torch.utils.data import DataLoader
from torch.utils.data.dataloader import _BaseDataLoaderIter

from tfpipe.format.shards import Records, open_shards
from tfpipe.runtime.errors import check_count, check_seed
from tfpipe.runtime.lifecycle import loader_dies_with_this_process
from tfpipe.torch.dataset import RecordDataset, folds_apart


class EpochLoader(DataLoader):
    """A DataLoader that sets its ``RecordDataset``'s epoch before each pass, from ``epoch()``."""

    def __init__(self, dataset: RecordDataset, epoch: Callable[[], int], **kwargs: Any) -> None:
        super().__init__(dataset, **kwargs)
        self.epoch_now = epoch

    def __iter__(self) -> _BaseDataLoaderIter:
        self.dataset.set_epoch(self.epoch_now())  # type: ignore[attr-defined]
        return super().__iter__()


class ShardDataModule(pl.LightningDataModule):
    """Training and validation ``DataLoader``s over the folds of a shard folder, each rank its share.

    Args:
      records: shard folder written with ``num_folds`` (opened and checked here, in the main process).
      val_folds: the folds validated on; the others are trained on.
      batch_size: per process (rank).
      workers: DataLoader workers per process (persistent: they live across epochs).
      seed: seed of the training order (a new order every epoch).
      shuffle_buffer: records held for shuffling, per reader.
      drop_last: cut the training records to a multiple of the ranks instead of padding (validation pads).
      sampling: ``"balanced"`` (single-label records): training batches drawn evenly over the classes
        (``RecordDataset``'s ``sampling``).
    """

    def __init__(
        self,
        records: Records,
        *,
        val_folds: Sequence[int] = (0,),
        batch_size: int = 32,
        workers: int = 0,
        seed: int = 0,
        shuffle_buffer: int = 1024,
        drop_last: bool = False,
        sampling: str | None = None,
    ) -> None:
        super().__init__()
        check_count(1, batch_size=batch_size, shuffle_buffer=shuffle_buffer)
        check_count(0, workers=workers)
        self.shards = open_shards(records)
        check_seed(seed=seed)
        self.train_folds = folds_apart(self.shards, val_folds)
        self.val_folds = [k for k in range(self.shards.num_folds or 0) if k not in self.train_folds]
        self.batch_size, self.workers, self.seed = batch_size, workers, seed
        self.shuffle_buffer, self.drop_last, self.sampling = shuffle_buffer, drop_last, sampling
        self.num_classes = self.shards.num_classes or 0
        self.train_set: RecordDataset | None = None
        self.val_set: RecordDataset | None = None

    def setup(self, stage: str) -> None:
        """Builds this rank's datasets (the trainer knows the rank by now)."""
        ranks = {"rank": self.trainer.global_rank, "world_size": self.trainer.world_size} if self.trainer else {}
        common: dict[str, Any] = dict(batch_size=self.batch_size, **ranks)
        self.train_set = RecordDataset(
            self.shards, folds=self.train_folds, shuffle=True, seed=self.seed, shuffle_buffer=self.shuffle_buffer,
            drop_last=self.drop_last, sampling=self.sampling, **common,
        )  # fmt: skip
        self.val_set = RecordDataset(self.shards, folds=self.val_folds, with_ids=True, **common)

    def _loader_args(self) -> dict[str, Any]:
        return {
            "batch_size": self.batch_size,
            "num_workers": self.workers,
            "persistent_workers": self.workers > 0,
            "worker_init_fn": loader_dies_with_this_process() if self.workers else None,
        }

    def train_dataloader(self) -> DataLoader:
        if self.train_set is None:
            self.setup("fit")
        assert self.train_set is not None
        return EpochLoader(
            self.train_set, lambda: self.trainer.current_epoch if self.trainer else 0, **self._loader_args()
        )

    def val_dataloader(self) -> DataLoader:
        if self.val_set is None:
            self.setup("validate")
        assert self.val_set is not None
        return DataLoader(self.val_set, **self._loader_args())
