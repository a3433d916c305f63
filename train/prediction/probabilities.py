"""The one rule every reader of a predictions file applies (``train.blend``'s OOF and test files, the validation
and out-of-fold predictions a run or a CV folder holds, read back by ``train.predict``, ``train.cv`` and
``train.inspect``): every value is a probability in [0, 1], and each row of single-label predictions (a softmax's)
sums to 1 within ``SUM_TOLERANCE``. A file whose kind is not recorded is read from its rows by the same rule, and
predictions of one job are all of one kind. No TensorFlow here."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from tfpipe.runtime.errors import TfpipeError

# A softmax's row, written as float32 with 8 significant digits, sums to 1 within 1e-6; a file rounded to 4
# decimals within C x 5e-5. Sigmoid rows of a multi-label model sum to 1 by chance only: never every row.
SUM_TOLERANCE = 1e-3


def check_probabilities(
    path: str, values: Any, classes: Sequence[str], single_label: bool | None = None, cells: Any = None
) -> Any:
    """``values`` [N, C] (from ``path``, columns ``classes``; ``cells``: the file's text of them, to name a bad
    one as written), checked: each a probability in [0, 1] (NaN, a cell that is no number, too), and with
    ``single_label`` each row summing to 1 (``check_sums``); one line naming the first row that is not. Returns
    them."""
    bad = np.argwhere(~((values >= 0) & (values <= 1)))
    if len(bad):
        row, column = int(bad[0][0]), int(bad[0][1])
        cell = cells[row, column] if cells is not None else float(values[row, column])
        raise TfpipeError(f"{path}: row {row + 1}, column {classes[column]!r}: {cell!r} is not a probability in [0, 1]")
    if single_label:
        check_sums(path, values)
    return values


def off_row(values: Any) -> int | None:
    """The first row whose probabilities do not sum to 1 (None: every row does)."""
    off = np.flatnonzero(np.abs(np.asarray(values, np.float64).sum(axis=1) - 1) > SUM_TOLERANCE)
    return int(off[0]) if len(off) else None


def check_sums(path: str, values: Any) -> None:
    """Each row of single-label predictions sums to 1, or one line naming the first that does not."""
    row = off_row(values)
    if row is not None:
        total = float(np.asarray(values[row], np.float64).sum())
        raise TfpipeError(
            f"{path}: row {row + 1}: its probabilities sum to {total:.4g}, and single-label predictions (a "
            f"softmax's) sum to 1 in every row; these are not one model's single-label probabilities (a "
            "multi-label model's, or scaled) -- write them again from the model"
        )


def kind_of(values: Any, truth: Any) -> tuple[bool, str]:
    """Single-label (True) or not, read from predictions whose kind nobody recorded, and why: rows with no or
    several true labels are multi-label; otherwise every row summing to 1 is single-label (a softmax's)."""
    several = np.flatnonzero(np.asarray(truth).sum(axis=1) != 1) if truth is not None else np.zeros(0, int)
    if len(several):
        return False, f"row {int(several[0]) + 1} holds {int(np.asarray(truth)[several[0]].sum())} true labels"
    row = off_row(values)
    if row is None:
        return True, "every row's probabilities sum to 1"
    return False, f"row {row + 1}'s probabilities sum to {float(np.asarray(values[row], np.float64).sum()):.4g}"


def agreed_kind(paths: Sequence[str], values: Sequence[Any], recorded: Sequence[bool | None], truth: Any) -> bool:
    """The one kind of the predictions files ``paths`` (their ``values``): each file's as ``recorded`` (its CV
    folder's), else read from its rows (``kind_of``); files of both kinds are one line naming one of each."""
    kinds = [
        (known, "its CV's cv.json says so") if known is not None else kind_of(v, truth)
        for v, known in zip(values, recorded)
    ]
    single = [i for i, (k, _) in enumerate(kinds) if k]
    multi = [i for i, (k, _) in enumerate(kinds) if not k]
    if single and multi:
        s, m = single[0], multi[0]
        raise TfpipeError(
            f"{paths[m]} holds multi-label predictions ({kinds[m][1]}) and {paths[s]} single-label ones "
            f"({kinds[s][1]}); a blend mixes predictions of one kind: a softmax model's with softmax models', "
            "sigmoid's with sigmoid's"
        )
    if single:
        for path, v in zip(paths, values):
            check_sums(path, v)  # a CV recorded single-label: its rows, and the others', are a softmax's
    return bool(single)
