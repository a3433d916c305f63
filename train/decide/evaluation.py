"""Scores of predictions against labels: what ``train.fit``'s report and ``train.predict`` on labeled shards print.

Every figure is exact (scikit-learn over all the rows, not Keras' binned per-batch estimates):

- ``roc_auc_macro`` / ``roc_auc_micro``: ROC AUC, macro over the classes with both positive and negative rows
  (no AUC exists for the others), micro over every (row, class) pair.
- ``exact_match``: the fraction of rows whose predicted label set is exactly the true one (an image with no
  label is right when nothing is predicted). For single-label runs it is the accuracy of the argmax.
- ``f1_micro`` / ``f1_macro``: F1 of the predicted labels at the thresholds used; macro over the classes that
  occur in the labels or the predictions (a class absent from both has no F1 and is left out).
- ``balanced_accuracy`` / ``log_loss`` (single-label runs only; None for multi-label): the mean recall over the
  classes with a true row, and the cross-entropy of the true class (what a Kaggle log-loss metric scores).
- ``per_class``: for each class its positives, AUC, F1, precision, recall and threshold.

No TensorFlow here: the functions take NumPy arrays.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Mapping, Sequence
from typing import Any, TypedDict

import numpy as np
import numpy.typing as npt

from train.decide.metrics import DEFAULT, METRICS, Metric

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
    balanced_accuracy: float | None  # single-label only (a metrics.json may lack it: read with .get)
    log_loss: float | None  # single-label only, likewise
    per_class: dict[str, ClassScores]


class Report(Scores, total=False):
    """A run's validation report (metrics.json's ``report`` and ``swa.report``): ``Scores``, two figures under
    metrics.json's own names (``accuracy``, ``f1_macro_tuned``), and the model it scores."""

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


FRACTIONS = (
    "roc_auc_macro",
    "roc_auc_micro",
    "exact_match",
    "f1_micro",
    "f1_macro",
    "balanced_accuracy",
)  # a report's figures in [0, 1]
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
    bad += [k for k in ("log_loss",) if not (scores.get(k) is None or (is_number(scores[k]) and scores[k] >= 0))]
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
    from sklearn.metrics import precision_recall_fscore_support, roc_auc_score

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
        "exact_match": _exact_match(truth, hits),
        "f1_micro": _f1_micro(truth, hits),
        "f1_macro": float(np.mean([f1[c] for c in occurring])) if occurring else None,
        **single_label_figures(probs, truth, single_label),  # type: ignore[typeddict-item]  # its two keys
        "per_class": per_class,
    }


def figure(probs: Array, targets: Array, thresholds: Sequence[float], single_label: bool, key: str) -> float | None:
    """``score(...)[key]`` computed alone, for a search that scores many candidates (``train.decide.weights``)."""
    from sklearn.metrics import f1_score, roc_auc_score

    truth = targets > 0
    if key in ("balanced_accuracy", "log_loss"):
        return single_label_figures(probs, truth, single_label)[key]
    if key == "roc_auc_macro":
        both = [c for c in range(truth.shape[1]) if 0 < truth[:, c].sum() < len(truth)]
        return float(np.mean([roc_auc_score(truth[:, c], probs[:, c]) for c in both])) if both else None
    hits = predicted_hits(probs, thresholds, single_label)
    if key == "exact_match":
        return _exact_match(truth, hits)
    if key == "f1_micro":
        return _f1_micro(truth, hits)
    if key != "f1_macro":
        raise ValueError(f"no figure {key!r}")
    occurring = truth.any(axis=0) | hits.any(axis=0)  # over the classes that occur, as score's
    if not occurring.any():
        return None
    return float(np.mean(f1_score(truth[:, occurring], hits[:, occurring], average=None, zero_division=np.nan)))


def _exact_match(truth: Array, hits: Array) -> float | None:
    return float(np.mean(np.all(truth == hits, axis=1))) if len(truth) else None


def _f1_micro(truth: Array, hits: Array) -> float | None:
    from sklearn.metrics import f1_score

    return float(f1_score(truth, hits, average="micro", zero_division=0)) if len(truth) else None


def single_label_figures(probs: Array, truth: Array, single_label: bool) -> dict[str, float | None]:
    """``balanced_accuracy`` (scikit-learn's: the mean recall of the classes with a true row) and ``log_loss``
    (the mean of -log p of each row's true class, p clipped to [1e-15, 1]) of a single-label run's argmax; None
    for multi-label runs and for no rows."""
    one = truth.sum(axis=1) == 1  # a row's one true class (a row without a label has none to score)
    if not single_label or not one.any():
        return {"balanced_accuracy": None, "log_loss": None}
    from sklearn.metrics import balanced_accuracy_score

    probs, true = probs[one], truth[one].argmax(axis=1)
    with warnings.catch_warnings():  # a class predicted but never true: left out of the mean, as documented
        warnings.simplefilter("ignore")
        balanced = float(balanced_accuracy_score(true, probs.argmax(axis=1)))
    p = np.clip(probs[np.arange(len(true)), true].astype(np.float64), 1e-15, 1.0)
    return {"balanced_accuracy": balanced, "log_loss": float(-np.log(p).mean())}


def _number(x: float) -> float | None:
    return None if math.isnan(x) else float(x)


def is_single_label(scores: Mapping[str, Any]) -> bool:
    """Whether ``scores`` label by argmax (no class has a threshold): a single-label run's."""
    table = scores.get("per_class")
    return isinstance(table, Mapping) and all(
        isinstance(row, Mapping) and row.get("threshold") is None for row in table.values()
    )


def headline(scores: Mapping[str, Any], metric: Metric | None = None, skip: Sequence[str] = ()) -> str:
    """One line of figures, ``metric``'s first (the one that decides; default ``roc_auc``): a single-label run's
    accuracy, balanced accuracy, F1 macro and log-loss of its argmax (the caller says how labels were chosen); a
    multi-label run's exact-match,
    F1 micro / macro (at thresholds the caller names) and micro AUC; the macro AUC of both. ``skip``: the keys
    of figures the caller's line already gives."""
    lead = metric or METRICS[DEFAULT]
    single = is_single_label(scores)
    if single:
        keys = ("roc_auc_macro", "exact_match", "balanced_accuracy", "f1_macro", "log_loss")
        names = {"exact_match": "accuracy"}
    else:
        keys = ("roc_auc_macro", "exact_match", "f1_micro", "f1_macro", "roc_auc_micro")
        names = {"exact_match": "exact-match", "roc_auc_micro": "micro AUC"}
    words = {m.key: m.words for m in METRICS.values()} | names | {lead.key: lead.words}
    shown = [k for k in (lead.key, *(k for k in keys if k != lead.key)) if k not in skip]
    figures = [f"{words[k]} {_f(scores.get(k), 4 if 'auc' in k or k == 'log_loss' else 3)}" for k in shown]
    return ", ".join(figures)


def class_table(scores: Mapping[str, Any], most: int = TABLE_ROWS, title: str | None = None) -> list[str]:
    """The per-class table as text lines: every class when there are at most ``most``, else the ``most`` with
    the lowest AUC (the ones to look at), saying so; ``title`` first says whose scores they are (the model, its
    views and thresholds)."""
    per_class: dict[str, dict[str, Any]] = scores["per_class"]
    names = list(per_class)
    if len(names) > most:
        names = sorted(names, key=lambda n: (per_class[n]["roc_auc"] is None, per_class[n]["roc_auc"] or 0.0))[:most]
    width = max([5, *(len(n) for n in names)])
    last = "recall" if is_single_label(scores) else "threshold"  # argmax: no threshold; recall is what balances
    lines = [f"per class, {title}:"] if title else []
    lines.append(f"  {'class':<{width}}  positives     AUC      F1  {last:>9}")
    for n in names:
        row = per_class[n]
        lines.append(
            f"  {n:<{width}}  {row['positives']:>9}  {_f(row['roc_auc'], 4):>6}  {_f(row['f1'], 3):>6}"
            f"  {_f(row[last], 3):>9}"
        )
    if len(per_class) > most:
        lines.append(f"  (of {len(per_class)} in all, the {most} with the lowest AUC)")
    return lines


def _f(x: float | None, digits: int) -> str:
    return "-" if x is None else f"{x:.{digits}f}"
