"""Scores of predictions against labels: what ``train.fit``'s report and ``train.predict`` on labeled shards print.

Every figure is exact (scikit-learn over all the rows, not Keras' binned per-batch estimates):

- ``roc_auc_macro`` / ``roc_auc_micro``: ROC AUC, macro over the classes with both positive and negative rows
  (no AUC exists for the others), micro over every (row, class) pair.
- ``exact_match``: the fraction of rows whose predicted label set is exactly the true one (an image with no
  label is right when nothing is predicted). For single-label runs it is the accuracy of the argmax.
- ``f1_micro`` / ``f1_macro``: F1 of the predicted labels at the thresholds used; macro over the classes that
  occur in the labels or the predictions (a class absent from both has no F1 and is left out).
- ``per_class``: for each class its positives, AUC, F1, precision, recall and threshold.

No TensorFlow here: the functions take NumPy arrays.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any, TypedDict

import numpy as np
import numpy.typing as npt

TABLE_ROWS = 10  # classes shown in a terminal; the file holds them all

Array = npt.NDArray[Any]


class ClassScores(TypedDict):
    """One class's row of ``Scores.per_class`` (None: not defined, e.g. no AUC without both kinds of row)."""

    positives: int
    roc_auc: float | None
    f1: float | None
    precision: float | None
    recall: float | None
    threshold: float | None  # None: single-label (argmax)


class Scores(TypedDict):
    """``score``'s result, as JSON holds it (metrics.json's ``report``, cv.json's models' ``scores``, predict's
    evaluation): a type checker knows every key a caller reads."""

    examples: int
    roc_auc_macro: float | None
    roc_auc_micro: float | None
    exact_match: float | None
    f1_micro: float | None
    f1_macro: float | None
    per_class: dict[str, ClassScores]


class Report(Scores, total=False):
    """A run's validation report (metrics.json's ``report`` and ``swa.report``): ``Scores`` and tfpipe 1.0's names
    of two figures, and the model it scores."""

    accuracy: float | None  # the exact-match accuracy
    f1_macro_tuned: float | None  # sklearn's macro F1 over every class (0 for a class nobody has)
    model: str


def predicted_hits(probs: Array, thresholds: Sequence[float], single_label: bool) -> Array:
    """Boolean [N, C]: the argmax of each row (single-label), else every class at or above its threshold."""
    if single_label:
        hits = np.zeros(probs.shape, bool)
        hits[np.arange(len(probs)), probs.argmax(axis=1)] = True
        return hits
    return probs >= np.asarray(thresholds, np.float64)[None, :]


FRACTIONS = ("roc_auc_macro", "roc_auc_micro", "exact_match", "f1_micro", "f1_macro")  # a report's figures in [0, 1]
ROW = ("roc_auc", "f1", "precision", "recall", "threshold")  # a class table row's figures in [0, 1]


def scores_problem(scores: Any, classes: Sequence[str] | None = None) -> str | None:
    """What keeps ``scores`` (read from a file) from being ``Scores`` (None: nothing): the per-class table (of
    ``classes``, when given), and every figure a number in its range (fractions in [0, 1], counts whole and >= 0)
    or null. What a type says of a report read back is checked here first."""
    if not isinstance(scores, dict) or not isinstance(scores.get("per_class"), dict):
        return "no per-class table"
    table = scores["per_class"]
    if classes is not None and sorted(table) != sorted(classes):
        return "its classes are not the run's"
    bad = [k for k in FRACTIONS if not is_fraction(scores.get(k))]  # null or absent: not defined
    bad += [k for k in ("examples",) if not is_count(scores.get(k))]
    for name, row in table.items():
        if not isinstance(row, dict):
            return f"class {name!r}: not a row of figures"
        bad += [f"{name}.{k}" for k in ROW if not is_fraction(row.get(k))]
        if not is_count(row.get("positives")):
            bad.append(f"{name}.positives")
    return f"{', '.join(bad[:3])}: not a number in range" if bad else None


def is_fraction(v: Any) -> bool:
    return v is None or (is_number(v) and 0 <= v <= 1)


def is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def is_count(v: Any) -> bool:
    return v is None or (type(v) is int and v >= 0)


def score(
    probs: Array, targets: Array, classes: Sequence[str], thresholds: Sequence[float], single_label: bool
) -> Scores:
    """The scores above of ``probs`` [N, C] against multi-hot ``targets`` [N, C] (the JSON form)."""
    from sklearn.metrics import f1_score, precision_recall_fscore_support, roc_auc_score

    truth = targets > 0
    hits = predicted_hits(probs, thresholds, single_label)
    both = [c for c in range(truth.shape[1]) if 0 < truth[:, c].sum() < len(truth)]  # AUC defined
    flat_truth = truth.ravel()
    auc_micro = (
        float(roc_auc_score(flat_truth, probs.ravel()))
        if len(truth) and 0 < flat_truth.sum() < flat_truth.size
        else None
    )
    precision, recall, f1, _ = precision_recall_fscore_support(truth, hits, average=None, zero_division=np.nan)
    occurring = [c for c in range(truth.shape[1]) if truth[:, c].any() or hits[:, c].any()]
    per_class = {
        name: ClassScores(
            positives=int(truth[:, c].sum()),
            roc_auc=float(roc_auc_score(truth[:, c], probs[:, c])) if c in both else None,
            f1=_number(f1[c]),
            precision=_number(precision[c]),
            recall=_number(recall[c]),
            threshold=None if single_label else float(thresholds[c]),
        )
        for c, name in enumerate(classes)
    }
    return {
        "examples": len(truth),
        "roc_auc_macro": float(np.mean([per_class[classes[c]]["roc_auc"] for c in both])) if both else None,
        "roc_auc_micro": auc_micro,
        "exact_match": float(np.mean(np.all(truth == hits, axis=1))) if len(truth) else None,
        "f1_micro": float(f1_score(truth, hits, average="micro", zero_division=0)) if len(truth) else None,
        "f1_macro": float(np.mean([f1[c] for c in occurring])) if occurring else None,
        "per_class": per_class,
    }


def _number(x: float) -> float | None:
    return None if math.isnan(x) else float(x)


def headline(scores: Mapping[str, Any]) -> str:
    """One line: exact-match, F1 micro/macro and micro AUC (the macro AUC leads the line it is part of)."""
    return (
        f"exact-match {_f(scores.get('exact_match'), 3)}, F1 micro {_f(scores.get('f1_micro'), 3)} / macro "
        f"{_f(scores.get('f1_macro'), 3)}, micro AUC {_f(scores.get('roc_auc_micro'), 4)}"
    )


def class_table(scores: Mapping[str, Any], most: int = TABLE_ROWS, title: str | None = None) -> list[str]:
    """The per-class table as text lines: every class when there are at most ``most``, else the ``most`` with
    the lowest AUC (the ones to look at), saying so; ``title`` first says whose scores they are (the model, its
    views and thresholds)."""
    per_class: dict[str, dict[str, Any]] = scores["per_class"]
    names = list(per_class)
    if len(names) > most:
        names = sorted(names, key=lambda n: (per_class[n]["roc_auc"] is None, per_class[n]["roc_auc"] or 0.0))[:most]
    width = max([5, *(len(n) for n in names)])
    lines = [f"per class, {title}:"] if title else []
    lines.append(f"  {'class':<{width}}  positives     AUC      F1  threshold")
    for n in names:
        row = per_class[n]
        lines.append(
            f"  {n:<{width}}  {row['positives']:>9}  {_f(row['roc_auc'], 4):>6}  {_f(row['f1'], 3):>6}"
            f"  {_f(row['threshold'], 3):>9}"
        )
    if len(per_class) > most:
        lines.append(f"  (of {len(per_class)} in all, the {most} with the lowest AUC)")
    return lines


def _f(x: float | None, digits: int) -> str:
    return "-" if x is None else f"{x:.{digits}f}"
