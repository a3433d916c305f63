"""Learning-rate schedules, all per optimizer step.

A ``LearningRateSchedule`` is evaluated on ``optimizer.iterations`` inside the
compiled training loop, so it stays exact with ``steps_per_execution > 1``
(a per-batch callback would only run every K steps). Warmup + cosine is Keras'
own ``CosineDecay``; Keras has no one-cycle or Kaggle ramp schedule, so those
two are small classes here.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

from tfpipe.runtime.errors import TfpipeError
from train.backends import KerasMixin, complete, current, keras_module
from train.keras.names import SCHEDULES

if TYPE_CHECKING:
    import tf_keras as keras


# The Keras class that completes each schedule (train.backends.complete). Not registered with Keras: a model file
# names them by their class names, "OneCycle" and "KaggleRamp", which train.keras.models.custom_objects holds.
SCHEDULE = "optimizers.schedules.LearningRateSchedule"


def scaled_lr(base_lr: float, replicas: int) -> float:
    """The TPU notebooks' rule: the base LR is for one replica and grows with the replica count."""
    return base_lr * replicas


class OneCycle(KerasMixin):
    """One-cycle (Smith 2018): cosine rise from peak/div to peak over ``pct_start``, then cosine down to
    peak/(div*final_div)."""

    KERAS_BASE = SCHEDULE

    def __init__(
        self, peak: float, total_steps: int, pct_start: float = 0.3, div: float = 25.0, final_div: float = 1e4
    ) -> None:
        self.peak, self.total_steps, self.pct_start, self.div, self.final_div = (
            peak,
            total_steps,
            pct_start,
            div,
            final_div,
        )

    def __call__(self, step: Any) -> Any:
        ops = current().tensor_ops()
        step = ops.cast(step, "float32")
        up = max(1.0, self.pct_start * self.total_steps)
        down = max(1.0, self.total_steps - up)
        start, end = self.peak / self.div, self.peak / (self.div * self.final_div)

        def anneal(a: float, b: float, t: Any) -> Any:
            return b + (a - b) * (1 + ops.cos(math.pi * ops.clip(t, 0.0, 1.0))) / 2

        return ops.where(step < up, anneal(start, self.peak, step / up), anneal(self.peak, end, (step - up) / down))

    def get_config(self) -> dict[str, float]:
        return {
            "peak": self.peak,
            "total_steps": self.total_steps,
            "pct_start": self.pct_start,
            "div": self.div,
            "final_div": self.final_div,
        }


class KaggleRamp(KerasMixin):
    """The Kaggle TPU notebooks' ``lrfn``: linear ramp-up, sustain, then exponential decay per epoch,
    evaluated per step at fractional epochs."""

    KERAS_BASE = SCHEDULE

    def __init__(
        self,
        peak: float,
        steps_per_epoch: int,
        start: float = 1e-5,
        minimum: float = 1e-6,
        rampup_epochs: float = 5,
        sustain_epochs: float = 0,
        decay: float = 0.8,
    ) -> None:
        self.peak, self.steps_per_epoch, self.start, self.minimum = peak, steps_per_epoch, start, minimum
        self.rampup_epochs, self.sustain_epochs, self.decay = rampup_epochs, sustain_epochs, decay

    def __call__(self, step: Any) -> Any:
        ops = current().tensor_ops()
        epoch = ops.cast(step, "float32") / self.steps_per_epoch
        ramp = self.start + (self.peak - self.start) * epoch / max(self.rampup_epochs, 1e-9)
        decayed = (self.peak - self.minimum) * self.decay ** (
            epoch - self.rampup_epochs - self.sustain_epochs
        ) + self.minimum
        return ops.where(
            epoch < self.rampup_epochs,
            ramp,
            ops.where(epoch < self.rampup_epochs + self.sustain_epochs, self.peak, decayed),
        )

    def get_config(self) -> dict[str, float]:
        return {
            "peak": self.peak,
            "steps_per_epoch": self.steps_per_epoch,
            "start": self.start,
            "minimum": self.minimum,
            "rampup_epochs": self.rampup_epochs,
            "sustain_epochs": self.sustain_epochs,
            "decay": self.decay,
        }


def make_schedule(
    name: str, peak: float, steps_per_epoch: int, epochs: int, warmup_epochs: float = 1.0
) -> keras.optimizers.schedules.LearningRateSchedule | float:
    """A schedule over ``epochs * steps_per_epoch`` optimizer steps peaking at ``peak``."""
    total = max(1, epochs * steps_per_epoch)
    warmup = min(round(warmup_epochs * steps_per_epoch), total - 1)
    if name == "cosine":
        return keras_module().optimizers.schedules.CosineDecay(
            0.0 if warmup else peak,
            decay_steps=max(1, total - warmup),
            warmup_target=peak if warmup else None,
            warmup_steps=warmup,
        )
    if name == "onecycle":
        return complete(OneCycle)(peak, total)
    if name == "kaggle":
        return complete(KaggleRamp)(
            peak, steps_per_epoch, start=peak / 50, minimum=peak / 500, rampup_epochs=warmup_epochs
        )
    if name == "constant":
        return peak
    raise TfpipeError(f"unknown schedule {name!r}: use one of {', '.join(SCHEDULES)}")
