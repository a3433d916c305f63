"""The metric that decides (``--metric``): the figure of a competition that heads every report line, chooses the
final or the SWA model, tunes multi-label thresholds, says whether TTA helps and weighs a blend. One table, named
as scikit-learn spells the scorers; no TensorFlow, no scikit-learn import here.

    from train.decide.metrics import metric_of, value
    m = metric_of("balanced_accuracy", single_label=True)     # one line naming the flag when it does not apply
    value(scores, m)                                          # 0.812 (a train.decide.evaluation.Scores' figure)
    better(candidate_scores, incumbent_scores, m)             # strictly better by it (log-loss: lower)
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any

from tfpipe.runtime.errors import TfpipeError, option

SINGLE, MULTI = "single", "multi"  # the kinds of run a metric applies to


@dataclasses.dataclass(frozen=True)
class Metric:
    """A metric: its name (``--metric``), the ``Scores`` key holding its figure, the words a line says it in,
    whether higher is better, and the kinds of run it applies to."""

    name: str
    key: str
    words: str
    kinds: frozenset[str]
    higher: bool = True

    def __eq__(self, other: object) -> bool:
        """A metric is equal to its name as ``metrics.json`` and ``--metric`` spell it (``result.metric ==
        "roc_auc"``, as ``result.metrics["metric"] == "roc_auc"`` is), and to a metric of every field alike."""
        if isinstance(other, str):
            return self.name == other
        if isinstance(other, Metric):
            return dataclasses.astuple(self) == dataclasses.astuple(other)
        return NotImplemented

    def __hash__(self) -> int:
        return hash(self.name)  # equal to its name, so hashed as it is: a dict or set finds either

    def figure(self, scores: Mapping[str, Any] | None) -> str:
        """``balanced accuracy 0.8120``; ``-`` for a figure not defined (e.g. no AUC without both kinds of row)."""
        v = value(scores, self)
        return f"{self.words} {'-' if v is None else f'{v:.4f}'}"


BOTH = frozenset({SINGLE, MULTI})
METRICS = {
    m.name: m
    for m in (
        Metric("roc_auc", "roc_auc_macro", "AUC (exact, macro)", BOTH),
        Metric("accuracy", "exact_match", "accuracy", frozenset({SINGLE})),
        Metric("balanced_accuracy", "balanced_accuracy", "balanced accuracy", frozenset({SINGLE})),
        Metric("f1_macro", "f1_macro", "F1 macro", BOTH),
        Metric("log_loss", "log_loss", "log-loss", frozenset({SINGLE}), higher=False),
        Metric("exact_match", "exact_match", "exact-match", frozenset({MULTI})),
        Metric("f1_micro", "f1_micro", "F1 micro", frozenset({MULTI})),
    )
}
DEFAULT = "roc_auc"  # threshold-free, defined for both kinds: also the metric of runs that record none


def metric_of(name: str | None, single_label: bool) -> Metric:
    """The metric ``name`` (None: ``DEFAULT``) for a single- or multi-label run; one line when it is not one or
    does not apply to the run's kind."""
    name = DEFAULT if name is None else name
    kind = SINGLE if single_label else MULTI
    found = METRICS.get(name)
    if found is None or kind not in found.kinds:
        fits = ", ".join(m.name for m in METRICS.values() if kind in m.kinds)
        what = "is not a metric" if found is None else f"does not apply to a {kind}-label run"
        raise TfpipeError(f"{option('metric', name)} {what}; a {kind}-label run is scored by one of {fits}")
    return found


def run_metric(settings: Mapping[str, Any], single_label: bool) -> Metric:
    """The metric a run (its ``config.json`` settings) or a CV (its shared settings) recorded; settings that
    record none decide by ``DEFAULT``."""
    name = settings.get("metric")
    return metric_of(name if isinstance(name, str) else None, single_label)


def value(scores: Mapping[str, Any] | None, metric: Metric) -> float | None:
    """The metric's figure in ``scores`` (a report, OOF or fold scores), None when it holds no number."""
    v = scores.get(metric.key) if isinstance(scores, Mapping) else None
    if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v):
        return float(v)
    return None


def better(candidate: Mapping[str, Any] | None, incumbent: Mapping[str, Any] | None, metric: Metric) -> bool:
    """Whether ``candidate`` scores strictly better than ``incumbent`` by ``metric``; an unknown figure never
    wins, and a tie keeps the incumbent."""
    a, b = value(candidate, metric), value(incumbent, metric)
    if a is None or b is None:
        return False
    return a > b if metric.higher else a < b
