"""When a training phase's backup saves, which ``--resume`` continues (``BackupPolicy``: every epoch's end, every
N steps or minutes, the step a stop was asked at), whichever backend saves it (``train.backends.tf.Backup``,
``train.backends.jax.StepBackup``); and what the phase's callbacks share: the phase (``Phase``) and the step group
a callback is in (``StepGroups``). No Keras here."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from tfpipe.runtime.errors import option
from tfpipe.runtime.lifecycle import Deferred


@dataclass(frozen=True)
class Phase:
    """A training phase as its callbacks see it: its ``name`` (its backup's folder), the ``steps`` of an epoch,
    the run's ``epochs`` in all, the ``replicas``, whether a backup is a collective every worker joins
    (``multiworker``: TensorFlow's workers; their preemption notice is asked for too), the deferred stop the
    phase stops at (``stop``), the epochs ``history.csv`` records, the learning rate, and how a stop noted is
    agreed on by the processes of a JAX cluster (``agree``: ``train.accel.workers.Workers.agree``; one process
    keeps its own)."""

    name: str
    steps: int
    epochs: int
    replicas: int
    multiworker: bool
    stop: Deferred
    recorded: int  # the epochs history.csv records (finished, whatever their backup says)
    rate: Any = 0.0  # the learning rate: a constant, or a schedule of the optimizer's step
    agree: Callable[[int | None], int | None] | None = None


class StepGroups:
    """The step group a callback is in, counted once for every callback that counts steps: with
    ``steps_per_execution`` K Keras calls ``on_train_batch_begin`` with a group's first step and
    ``on_train_batch_end`` with its last, and nothing in between (a resumed epoch starts at the step saved)."""

    _group_start = 0  # the first step of the step group running
    step_offset = 0  # the epoch's steps done before this fit began (a resumed epoch on Keras 3: run_phase)

    def on_train_batch_begin(self, batch: int, logs: dict[str, Any] | None = None) -> None:
        self._group_start = int(batch)

    def step(self, batch: int) -> int:
        """The step of the epoch (0-based) that Keras' ``batch`` of this fit is."""
        return int(batch) + self.step_offset

    def group_steps(self, batch: int) -> int:
        """The steps the group ending at ``batch`` ran."""
        return int(batch) + 1 - self._group_start


SAVE_SECONDS = 600.0  # the backup's default interval within an epoch (--save-every not given): ten minutes


class BackupPolicy(StepGroups):
    """When a phase's backup saves, for every backend's backup: at every epoch's end;
    within an epoch every ``every`` steps (None: at the first step group after ``SAVE_SECONDS``; 0: never); and at
    the step a stop was asked at (``phase.stop``: SIGTERM, Ctrl-C), after which the job ends saying where.

    On several machines a save is a collective (reading the batch-norm statistics sums over every worker): saves
    come at the same steps on every worker or not at all. There ``every`` None means epoch ends only, and a stop
    ends the job at its step without saving (the others may not stop at the same step), saying which backup
    ``--resume`` continues from. The step saved is a step group's last (the one ``on_train_batch_end`` is
    given)."""

    model: Any

    def policy(self, phase: Phase, every: int | None, say: bool) -> None:
        self.phase, self.say = phase, say
        self.every = 0 if every is None and phase.multiworker else every
        self._since, self._saved_at = 0, time.monotonic()
        self.last: tuple[int, int] | None = None  # (epoch, step) of the last backup, 0-based; the step: done
        self.epoch = 0  # the epoch running (0-based)

    def save_step(self, epoch: int, step: int) -> None:
        raise NotImplementedError

    def on_epoch_begin(self, epoch: int, logs: dict[str, Any] | None = None) -> None:
        self.epoch = epoch

    def on_train_batch_end(self, batch: int, logs: dict[str, Any] | None = None) -> None:
        step = self.step(batch)  # a resumed epoch's steps are NumPy integers
        self._since += self.group_steps(batch)  # the group's last step is the one saved (the class docstring)
        due = (self.every and self._since >= self.every) or (
            self.every is None and time.monotonic() - self._saved_at >= SAVE_SECONDS
        )
        stopping = self.agreed_stop()
        if due or (stopping and not self.phase.multiworker):
            self.save_step(self.epoch, step)
        if stopping:
            here, at = self.position(self.epoch, step), f"epoch {self.epoch + 1}, step {step + 1}"
            self.phase.stop.stop(f"at {at}; {self.continues(here)}", at)

    def position(self, epoch: int, step: int) -> tuple[int, int]:
        """Where training goes on after ``step`` of ``epoch`` (0-based): (epoch, steps done), 0-based."""
        return (epoch + 1, 0) if step == self.phase.steps - 1 else (epoch, step + 1)

    def continues(self, here: tuple[int, int]) -> str:
        """Where ``--resume`` goes on: ``here`` when it was saved, else at the last backup."""
        resume = option("resume", True)
        if self.last is None:
            return f"nothing of this phase was saved: {resume} starts it again"
        if self.last == here:
            return f"saved: {resume} continues there"
        return f"{resume} continues from the last backup (epoch {self.last[0] + 1}, step {self.last[1]})"

    def on_epoch_end(self, epoch: int, logs: dict[str, Any] | None = None) -> None:
        self.save_step(epoch, self.phase.steps - 1)  # the epoch's last step: a resume starts the next epoch
        if self.agreed_stop():
            self.model.stop_training = True  # the epoch's other callbacks run first (history.csv's row)

    def agreed_stop(self) -> bool:
        """Whether the phase stops here: a stop noted by this process or, in a JAX cluster, by any (each asks at
        the same steps, so each saves at the same step)."""
        stop = self.phase.stop
        if self.phase.agree is not None:
            stop.received = self.phase.agree(stop.received)
        return stop.received is not None

    def said_resuming(self, epoch: int, step: int) -> None:
        if self.say and 0 <= epoch < self.phase.epochs:
            print(f"train.fit: resuming at epoch {epoch + 1}, step {step}", flush=True)
