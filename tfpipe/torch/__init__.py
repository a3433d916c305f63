"""Read tfpipe shards from PyTorch, without TensorFlow: ``RecordDataset`` and its helpers for the recipes
(``tfpipe.torch.dataset``), and a Lightning ``ShardDataModule`` (``tfpipe.torch.lightning``).

    from tfpipe.torch import RecordDataset
"""

from tfpipe.torch.dataset import RecordDataset, folds_apart, gather_rows, sync_buffers, unique_rows

__all__ = ["RecordDataset", "folds_apart", "gather_rows", "sync_buffers", "unique_rows"]
