"""The one shard-name template: every shard name is written and read back through ``SHARD_NAMES`` (as TFDS's
``ShardedFileTemplate``), never spelt by hand.

    from tfpipe.format.names import SHARD_NAMES
    SHARD_NAMES.name("train", 7, 20, 512, fold=3)        # 'train-fold3-07-of-20-512.tfrec'
    SHARD_NAMES.parse("train-fold3-07-of-20-512.tfrec")  # ShardName(split='train', fold=3, index=7, ...)
    SHARD_NAMES.count("ld_train00-1338.tfrec")           # 1338: the Kaggle convention of a count at the end

The record count at the end of the name is the convention Kaggle notebooks read with a regex; ``count`` reads it
from any name that follows it, tfpipe's or not.
"""

from __future__ import annotations

import dataclasses
import re


@dataclasses.dataclass(frozen=True)
class ShardName:
    """The parts of a tfpipe shard name."""

    split: str
    fold: int | None
    index: int
    total: int
    count: int


@dataclasses.dataclass(frozen=True)
class ShardTemplate:
    """``{split}[-fold{f}]-{index}-of-{total}-{count}{suffix}``, the index and total zero-padded to one width."""

    suffix: str = ".tfrec"

    def name(self, split: str, index: int, total: int, count: int, fold: int | None = None) -> str:
        """``train-00-of-16-2071.tfrec``, or ``train-fold3-07-of-20-512.tfrec`` with folds."""
        width = max(2, len(str(total - 1)))
        fold_part = "" if fold is None else f"-fold{fold}"
        return f"{split}{fold_part}-{index:0{width}d}-of-{total:0{width}d}-{count}{self.suffix}"

    def parse(self, name: str) -> ShardName | None:
        """The parts of a name ``name()`` writes; None for any other name."""
        m = self._full().match(name)
        if m is None:
            return None
        fold = None if m["fold"] is None else int(m["fold"])
        return ShardName(m["split"], fold, int(m["index"]), int(m["total"]), int(m["count"]))

    def count(self, name: str) -> int | None:
        """The record count at the end of a shard's name (``...-1338.tfrec``), tfpipe's or another's; None without.
        A zero-padded number (``train-07.tfrec``) is a shard's index, not a count: counts are never padded."""
        m = re.search(r"-(0|[1-9]\d*)" + re.escape(self.suffix) + "$", name)
        return int(m.group(1)) if m else None

    def is_shard(self, name: str) -> bool:
        """Whether ``name`` is a shard's by its suffix (what a folder's glob picks up)."""
        return name.endswith(self.suffix)

    @property
    def glob(self) -> str:
        """The pattern of every shard in a folder: ``*.tfrec``."""
        return "*" + self.suffix

    def _full(self) -> re.Pattern[str]:
        return re.compile(
            r"^(?P<split>.+?)(?:-fold(?P<fold>\d+))?-(?P<index>\d+)-of-(?P<total>\d+)-(?P<count>\d+)"
            + re.escape(self.suffix)
            + "$"
        )


SHARD_NAMES = ShardTemplate()
