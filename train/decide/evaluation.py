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
from typing import Any

import numpy as np
import numpy.typing as npt

TABLE_ROWS = 10  # classes shown in a terminal; the file holds them all

Array = npt.NDArray[Any]


def predicted_hits(probs: Array, thresholds: Sequence[float], single_label: bool) -> Array:
    """Boolean [N, C]: the argmax of each row (single-label), else every class at or above its threshold."""
    if single_label:
        hits = np.zeros(probs.shape, bool)
        hits[np.arange(len(probs)), probs.argmax(axis=1)] = True
        return hits
    return probs >= np.asarray(thresholds, np.float64)[None, :]


def score(
    probs: Array, targets: Array, classes: Sequence[str], thresholds: Sequence[float], single_label: bool
) -> dict[str, Any]:
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
        name: {
            "positives": int(truth[:, c].sum()),
            "roc_auc": float(roc_auc_score(truth[:, c], probs[:, c])) if c in both else None,
            "f1": _number(f1[c]),
            "precision": _number(precision[c]),
            "recall": _number(recall[c]),
            "threshold": None if single_label else float(thresholds[c]),
        }
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
