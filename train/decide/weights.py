"""A blend's weights searched on the OOF rows by the metric (``train.blend --search-weights``), as Kaggle blends
search them: scipy's Nelder-Mead over the simplex (weights = softmax of the searched numbers, so every weight is
positive and they sum to 1), from equal weights, each candidate scored like the blend it would be (multi-label
thresholds tuned on the candidate's own OOF predictions; single-label the argmax). No TensorFlow.

    found = search_weights([probs_a, probs_b], truth, single_label=False, metric=metric)
    found.weights, found.score, found.equal_score
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

import numpy as np
import numpy.typing as npt

from train.decide.evaluation import figure
from train.decide.metrics import Metric

SIMPLEX_STEP = 1.0  # the first candidates: one model's weight e (2.7) times another's (softmax of unit steps)
SEARCH_EVALUATIONS = 200  # candidate blends scored at most (Nelder-Mead stops sooner when it has converged)


class Searched(NamedTuple):
    """The weights found, their OOF score by the metric, and the equal weights' (where the search started)."""

    weights: tuple[float, ...]
    score: float | None
    equal_score: float | None


def search_weights(
    probs: Sequence[npt.NDArray[Any]],
    truth: npt.NDArray[Any],
    single_label: bool,
    metric: Metric,
) -> Searched:
    """Weights for the models' OOF predictions ``probs`` (each [N, C], rows aligned with ``truth``) that score
    best by ``metric``; equal weights when nothing scores better (a tie keeps them)."""
    from scipy.optimize import minimize

    stacked = np.stack([np.asarray(p, np.float64) for p in probs])
    n = len(stacked)

    def scored(z: npt.NDArray[Any]) -> float | None:
        return blend_figure(stacked, softmax(z), truth, single_label, metric)

    def loss(z: npt.NDArray[Any]) -> float:
        v = scored(z)
        return np.inf if v is None else (-v if metric.higher else v)

    start = np.zeros(n)
    equal = scored(start)
    simplex = np.vstack([start, np.eye(n) * SIMPLEX_STEP])  # steps that change the labels: flat metrics move
    options = {"maxfev": SEARCH_EVALUATIONS, "xatol": 1e-3, "fatol": 1e-6, "initial_simplex": simplex}
    found = minimize(loss, start, method="Nelder-Mead", options=options)
    best = scored(found.x)
    if best is None or (equal is not None and not (best > equal if metric.higher else best < equal)):
        return Searched(tuple(softmax(start)), equal, equal)
    return Searched(tuple(float(w) for w in softmax(found.x)), best, equal)


def blend_figure(
    stacked: npt.NDArray[Any], weights: npt.NDArray[Any], truth: npt.NDArray[Any], single_label: bool, metric: Metric
) -> float | None:
    """The ``metric`` figure of the blend ``weights`` @ ``stacked`` [models, N, C] at thresholds tuned on it for
    ``metric`` (single-label: the argmax), as the blend's own line would score it."""
    from train.decide.tuning import tune_thresholds

    mixed = np.tensordot(weights, stacked, axes=1)
    c = mixed.shape[1]
    thresholds = [0.5] * c if single_label else tune_thresholds(mixed, truth, 0.5, metric)
    return figure(mixed, truth, thresholds, single_label, metric.key)


def softmax(z: npt.NDArray[Any]) -> npt.NDArray[np.float64]:
    e = np.exp(np.asarray(z, np.float64) - np.max(z))
    return np.asarray(e / e.sum(), np.float64)
