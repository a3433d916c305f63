"""What ``train.fit``'s ``fit()`` returns, as types: a finished run (``FitResult``, whose serialisation is the run's
``metrics.json``: ``FitResult.load(run)`` reads it back), a preflight's report (``PreflightReport``), and what a
multi-worker job's other workers return (``WorkerResult``: the chief writes the run). No TensorFlow.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from tfpipe.runtime import fs
from tfpipe.runtime.errors import RunMismatch
from train.decide.evaluation import Report, is_single_label, scores_problem
from train.decide.metrics import Metric, run_metric
from train.runs import run as run_files


@dataclasses.dataclass(frozen=True)
class WorkerResult:
    """A multi-worker job's worker other than the chief: it trained its share; ``chief_task`` writes ``run``."""

    task: str
    chief_task: str
    run: str

    def as_dict(self) -> dict[str, Any]:
        return {"chief": False, **dataclasses.asdict(self)}


@dataclasses.dataclass(frozen=True)
class PreflightReport:
    """``--preflight``'s findings for ``tpu`` over ``replicas`` devices: ``ok`` when nothing would be refused;
    ``refuse`` and ``warn``, the lines; ``memory`` (a core's, ``train.preflight.core_memory.Memory``'s fields, None
    when no step compiled) and ``seconds`` (each compile and pass)."""

    tpu: str
    replicas: int
    refuse: tuple[str, ...]
    warn: tuple[str, ...]
    memory: dict[str, Any] | None
    seconds: dict[str, float]

    @property
    def ok(self) -> bool:
        return not self.refuse

    def as_dict(self) -> dict[str, Any]:
        found = dataclasses.asdict(self)
        return dict(found, refuse=list(self.refuse), warn=list(self.warn), ok=self.ok)


@dataclasses.dataclass(frozen=True)
class Best:
    """The epoch with the best validation AUC (Keras' binned estimate, per epoch)."""

    epoch: int
    val_auc: float | None


@dataclasses.dataclass(frozen=True)
class SwaResult:
    """The SWA model's part of a run: the epochs averaged and its scores (``report``: as the final model's)."""

    epochs_averaged: int
    val_auc: float | None
    report: Report | None


@dataclasses.dataclass(frozen=True)
class FitResult:
    """A finished ``train.fit`` run in ``run``. ``metrics`` is ``metrics.json`` as written; the figures a caller
    reads are typed here: the shape of the training, its speed, and the scores of model.keras (``report``: the
    exact scores on the validation images, None with ``--no-report``; ``keras_auc``: Keras' binned estimate at
    the last epoch) and of model-swa.keras (``swa``)."""

    run: str
    epochs: int
    optimizer_steps: int
    replicas: int
    per_replica_batch_size: int
    global_batch_size: int
    steps_per_execution: int
    images_per_sec: float | None  # the median epoch's, the first left out (None: no epoch timed)
    keras_auc: float | None
    best: Best | None
    report: Report | None
    swa: SwaResult | None
    metrics: Mapping[str, Any] = dataclasses.field(repr=False)
    backend: str = "tf"  # tf (tf-keras) or jax (Keras 3 on JAX); tf when metrics.json does not record it

    @classmethod
    def from_metrics(cls, run: str, metrics: Mapping[str, Any]) -> FitResult:
        """The result whose serialisation ``metrics`` (a ``metrics.json`` object) is; one that lacks a figure
        is not a finished ``train.fit`` run's (``RunMismatch`` naming it)."""
        where = run_files.path(run, run_files.METRICS)
        swa_part = metrics.get("swa")
        swa_report = swa_part.get("report") if isinstance(swa_part, dict) else None
        for part, report in (("report", metrics.get("report")), ("swa.report", swa_report)):
            problem = report is not None and scores_problem(report)
            if problem:
                raise RunMismatch(f"{where}: its {part} is damaged ({problem})")
        try:
            best, swa = metrics.get("best"), metrics.get("swa")
            final = metrics.get("final") or metrics
            return cls(
                run,
                int(metrics["epochs"]),
                int(metrics["optimizer_steps"]),
                int(metrics["replicas"]),
                int(metrics["per_replica_batch_size"]),
                int(metrics["global_batch_size"]),
                int(metrics["steps_per_execution"]),
                _number(metrics["images_per_sec"]),
                _number(final.get("val_auc")),
                Best(int(best["epoch"]), _number(best.get("val_auc"))) if best else None,
                metrics.get("report"),
                SwaResult(int(swa["epochs_averaged"]), _number(swa.get("val_auc")), swa.get("report")) if swa else None,
                metrics,
                str(metrics.get("backend", "tf")),
            )
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            why = f"{type(e).__name__}: {e}"
            raise RunMismatch(f"{where}: not the metrics of a finished train.fit run ({why})") from None

    @classmethod
    def load(cls, run: str) -> FitResult:
        """The run's ``metrics.json`` read back (written when the run finished)."""
        p = run_files.path(run, run_files.METRICS)
        metrics = fs.read_json(p, "run file")
        run_files.check_file(run, run_files.METRICS, "train the run again")
        if not isinstance(metrics, dict):
            raise RunMismatch(f"{p}: not the metrics of a finished train.fit run (not a JSON object)")
        return cls.from_metrics(run, metrics)

    def as_dict(self) -> dict[str, Any]:
        return dict(self.metrics)

    @property
    def single_label(self) -> bool:
        """Whether the run labels by argmax (metrics.json's record; without one: its report says)."""
        recorded = self.metrics.get("single_label")
        return recorded if isinstance(recorded, bool) else bool(self.report) and is_single_label(self.report or {})

    @property
    def metric(self) -> Metric:
        """The metric the run decides by (``--metric``; ``roc_auc`` when none is recorded)."""
        return run_metric(self.metrics, self.single_label)


def _number(value: Any) -> float | None:
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None
