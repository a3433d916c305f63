"""Multi-label stratified K-fold assignment (iterative stratification)."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from tfpipe.errors import TfpipeError, check_count, option
from tfpipe.schema import multi_hot


def assign_folds(targets: Sequence[Sequence[int]], num_classes: int, k: int, seed: int = 0) -> list[int]:
    """Gives every record a fold in [0, k) so each fold has a similar label mix.

    Uses ``iterstrat.MultilabelStratifiedKFold`` (Sechidis et al. 2011), which
    balances every label's frequency across folds; records with an empty
    label list are balanced as if "no label" were one more class.

    Returns:
      A list of fold numbers, one per record, in input order.
    """
    from iterstrat.ml_stratifiers import MultilabelStratifiedKFold

    n = len(targets)
    check_count(2, num_folds=k)
    if k > n:
        raise TfpipeError(f"{option('num_folds', k)} is more than the {n} images")
    y = multi_hot(targets, num_classes, np.int8)
    y = np.concatenate([y, (y.sum(axis=1, keepdims=True) == 0)], axis=1)  # stratify "no label" like a class
    folds = np.zeros(n, np.int64)
    splitter = MultilabelStratifiedKFold(n_splits=k, shuffle=True, random_state=seed)
    for fold, (_, val) in enumerate(splitter.split(np.zeros((n, 1)), y)):
        folds[val] = fold
    return folds.tolist()
