"""Balanced sampling's one rule, for the TF reader (``tfpipe.make_dataset(..., sampling="balanced")``) and the
PyTorch reader (``tfpipe.torch.RecordDataset(..., sampling="balanced")``) alike: each single-label record is kept
with its class's target share over its share, scaled so the rarest class keeps all -- rejection sampling with
known class shares, the rule of ``tf.data.Dataset.rejection_resample``. No TensorFlow.

    keep = keep_shares(class_counts(targets))      # [C] probabilities, the rarest class 1.0
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from tfpipe.runtime.errors import TfpipeError, option

SAMPLINGS = ("balanced",)


def check_sampling(sampling: str | None) -> None:
    if sampling is not None and sampling not in SAMPLINGS:
        raise TfpipeError(f"sampling must be None or 'balanced' (got {sampling!r})")


def check_sampling_fits(sampling: str | None, single_label: bool, records: object) -> None:
    """``--sampling balanced`` (train.fit's, the PyTorch recipes') of a run whose ``records`` are multi-label is
    refused in one line: no class sampling balances images of several classes."""
    if sampling == "balanced" and not single_label:
        raise TfpipeError(
            f"{option('sampling', 'balanced')} draws batches evenly over the classes of single-label images; "
            f"{records} is multi-label (an image of several classes) -- use {option('class_weight', 'balanced')}"
        )


def class_counts(targets: np.ndarray, described: object) -> list[int]:
    """The records of each class of multi-hot ``targets`` [N, C] (a record without a label counts as class 0,
    as its argmax does); refused for records of several labels (``described``: the shards), which no class
    sampling can balance."""
    if (targets.sum(axis=1) > 1).any():
        raise TfpipeError(
            f"{described}: sampling='balanced' balances single-label images, and some have several labels; weigh "
            "the classes' loss instead (train.fit --class-weight balanced)"
        )
    counts = targets.sum(axis=0).astype(np.int64)
    counts[0] += int((targets.sum(axis=1) == 0).sum())
    return [int(c) for c in counts]


def keep_shares(class_counts: Sequence[int]) -> np.ndarray:
    """The probability of keeping a record of each class: 1 / its count, scaled so the rarest class present keeps
    every record (0 for a class with none: it never comes)."""
    counts = np.asarray(class_counts, np.float64)
    if counts.sum() == 0:
        return np.ones(len(counts), np.float64)
    ratio = np.where(counts > 0, 1.0 / np.maximum(counts, 1), 0.0)
    return ratio / ratio.max()
