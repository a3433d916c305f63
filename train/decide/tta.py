"""Whether test-time augmentation helps, measured before a submission uses it: the held-out predictions of the same
model (a run's validation images, a CV's out-of-fold rows) scored by the run's metric over one view and over N,
each at thresholds tuned on its own predictions (multi-label) or by argmax. ``train.cv --tta N`` records both in
``cv.json``; ``train.predict --tta N`` says in one line what N views did there, and warns when they scored worse.

    worth = views_worth(one_view_scores, n_view_scores, views=4, metric=metric)
    worth.line("train.predict", "the OOF rows of the fold models (model.keras each)")
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, NamedTuple

import numpy.typing as npt

from train.decide.evaluation import Scores, score
from train.decide.metrics import Metric, better, value


class Worth(NamedTuple):
    """The metric's figure of one model's held-out predictions over 1 view (``one``) and ``views`` views
    (``many``); None where a figure is not defined."""

    views: int
    one: float | None
    many: float | None
    metric: Metric

    @property
    def hurts(self) -> bool:
        """Whether one view scored strictly better than ``views`` views."""
        return better({self.metric.key: self.one}, {self.metric.key: self.many}, self.metric)

    def line(self, prog: str, rows: str) -> str:
        """``train.predict: warning: on the OOF rows ..., 4 TTA views score balanced accuracy 0.7012 against
        0.7200 for 1 view: --tta 1 predicts better there`` (no warning when the views help or tie)."""
        if self.one is None or self.many is None:
            return f"{prog}: on {rows}, {self.metric.words} is not defined at 1 or {self.views} views: TTA unmeasured"
        said = (
            f"on {rows}, {self.views} TTA views score {self.metric.words} {self.many:.4f} against {self.one:.4f} "
            "for 1 view"
        )
        if self.hurts:
            return f"{prog}: warning: {said}: {'--tta 1' if _command() else 'tta=1'} predicts better there"
        return f"{prog}: {said}"


def views_worth(one: Mapping[str, Any] | None, many: Mapping[str, Any] | None, views: int, metric: Metric) -> Worth:
    """``Worth`` of two scores of the same rows (``train.decide.evaluation.score``'s form, or None)."""
    return Worth(views, value(one, metric), value(many, metric), metric)


def scored_at_own_thresholds(
    probs: npt.NDArray[Any],
    targets: npt.NDArray[Any],
    classes: list[str],
    single_label: bool,
    metric: Metric,
    default: float = 0.5,
) -> Scores:
    """The scores of predictions at thresholds tuned on them for ``metric`` (single-label: the argmax), as a CV
    scores its OOF rows and as a submission over those views would be labelled."""
    from train.decide.tuning import tune_thresholds

    thresholds = [0.5] * len(classes) if single_label else tune_thresholds(probs, targets, default, metric)
    return score(probs, targets, classes, thresholds, single_label)


def _command() -> bool:
    from tfpipe.runtime.errors import in_command

    return in_command()
