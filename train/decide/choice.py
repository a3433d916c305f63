"""Which model a finished run predicts with, and whether its thresholds files are those it was scored at: decided
here once for every caller (``train.predict``, ``train.cv``, ``train.inspect``, the PyTorch recipes' ``--predict``
and ``--predict-only``).

A run with an SWA model predicts with it only when its validation figure of the run's ``--metric`` (default: AUC,
exact, macro; a CV's: out-of-fold) beats the final model's; a tie or an unknown score keeps the final model. No
TensorFlow.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

from tfpipe.runtime import fs
from tfpipe.runtime.errors import in_command
from train.decide.metrics import DEFAULT, METRICS, Metric, better, run_metric, value
from train.runs import run as run_files
from train.runs.files import NotAsRecorded
from train.runs.run import RunConfig
from train.runs.thresholds import load_thresholds

SAME = 1e-6  # a thresholds file's value and the report's are the same threshold (JSON round trips)


class RunScores(NamedTuple):
    """What a run's ``metrics.json`` says of its models: the final model's and the SWA model's validation report
    (None: not recorded), whether it reports an SWA model at all, and the metric its choices decide by (its
    ``config.json``'s ``--metric``)."""

    final_report: Any
    swa_report: Any
    has_swa: bool
    metric: Metric = METRICS[DEFAULT]

    @property
    def final_value(self) -> float | None:
        return value(self.final_report, self.metric)

    @property
    def swa_value(self) -> float | None:
        return value(self.swa_report, self.metric)

    def report(self, swa: bool) -> Any:
        return self.swa_report if swa else self.final_report


def better_model(final: Any, averaged: Any, metric: Metric) -> bool:
    """Whether the SWA model's scores (``averaged``: a report, OOF scores) beat the final model's by ``metric``;
    a tie or an unknown figure keeps the final model."""
    return better(averaged, final, metric)


def run_scores(run: str, required: bool = False) -> RunScores:
    """The run's ``metrics.json`` read for the choice; a run without one has recorded nothing, unless
    ``required`` (a finished recipe run always has one: its absence is an error)."""
    p = run_files.path(run, run_files.METRICS)
    if fs.exists(p):  # its scores choose the model: the file the run wrote (train.runs.files)
        run_files.check_file(run, run_files.METRICS, "the run's scores choose its model; train the run again")
    metrics = fs.read_json(p, "run file") if required or fs.exists(p) else {}
    metrics = metrics if isinstance(metrics, dict) else {}
    part = metrics.get("swa")
    swa = part.get("report") if isinstance(part, dict) else None
    return RunScores(metrics.get("report"), swa, part is not None, recorded_metric(run))


def recorded_metric(run: str) -> Metric:
    """The metric a run decides by: its ``config.json``'s (``DEFAULT`` when it records none, and for a folder
    without one)."""
    if not fs.exists(run_files.path(run, run_files.CONFIG)):
        return METRICS[DEFAULT]
    config = RunConfig.load(run)
    return run_metric(config.settings, config.single_label)


def choice_line(
    chosen: bool,
    final: float | None,
    averaged: float | None,
    what: str,
    metric: Metric,
    names: tuple[str, str] = (run_files.MODEL, run_files.MODEL_SWA),
    whose: str = "",
    flags: bool = True,
) -> str:
    """``predicting with model-swa.keras: its validation AUC (exact, macro) 0.9812 beats model.keras's 0.9790
    (--no-swa ...)``: ``final``/``averaged`` the two models' ``metric`` figures, ``names`` the (final, SWA) model
    files, ``whose`` ("the fold models' ") before the model's name, ``flags`` whether the caller has
    ``--swa``/``--no-swa`` (``swa=`` in Python) to choose the other."""
    shown = {True: averaged, False: final}
    name, other = names[chosen], names[not chosen]
    if final is None or averaged is None:
        why = f"{what} {metric.words} of both not recorded"
        if not flags:
            return f"predicting with {whose}{name} ({why})"
    else:
        why = (
            f"{'their' if whose else 'its'} {what} {metric.words} {_f(shown[chosen])} "
            f"{'beats' if chosen else 'is at least as good as'} {other}'s {_f(shown[not chosen])}"
        )
        if not flags:
            return f"predicting with {whose}{name}: {why}"
    flag = ("--no-swa" if chosen else "--swa") if in_command() else f"swa={not chosen}"
    return f"predicting with {whose}{name}: {why} ({flag} for {other})"


def run_choice(run: str, swa: bool | None) -> tuple[bool, str | None]:
    """(swa, the line saying why) for a ``train.fit`` run: ``swa`` as given, else the model with the better
    validation figure of its metric in ``metrics.json``. No line when there is no choice."""
    if swa is not None or not fs.exists(run_files.path(run, run_files.MODEL_SWA)):
        return bool(swa), None
    scores = run_scores(run)
    chosen = better_model(scores.final_report, scores.swa_report, scores.metric)
    return chosen, choice_line(chosen, scores.final_value, scores.swa_value, "validation", scores.metric)


def scored_thresholds(report: Any, classes: Sequence[str]) -> list[Any]:
    """The per-class thresholds a report (``metrics.json``'s or ``cv.json``'s) was scored at, in ``classes``
    order; [] when it holds no per-class table."""
    table = report.get("per_class") if isinstance(report, dict) else None
    return [(table.get(c) or {}).get("threshold") for c in classes] if isinstance(table, dict) else []


def same_thresholds(scored: Sequence[Any], found: Sequence[float]) -> bool:
    """Whether a thresholds file's values (``found``) are those a report was scored at (``scored``)."""
    return len(scored) == len(found) and all(
        isinstance(s, (int, float)) and not isinstance(s, bool) and abs(s - f) <= SAME for s, f in zip(scored, found)
    )


def thresholds_state(folder: str, classes: Sequence[str], swa: bool, views: int, report: Any) -> str:
    """Whether the model's thresholds file (for ``views``) in ``folder`` holds the thresholds its report was scored
    at, and is the file its job recorded: ``same``, ``differs`` or ``missing``."""
    remedy = "the report was scored at the thresholds metrics.json (cv.json) holds"
    try:
        found = load_thresholds(folder, classes, swa, views, remedy=remedy)
    except NotAsRecorded:  # not the file its job wrote (train.runs.files): train.predict refuses it
        return "differs"
    if found is None:
        return "missing"
    return "same" if same_thresholds(scored_thresholds(report, classes), found) else "differs"


def _f(x: float | None) -> str:
    return "-" if x is None else f"{x:.4f}"
