"""A training phase's backup, which ``--resume`` continues: when it saves (``BackupPolicy``: every epoch's end,
every N steps or minutes, the step a stop was asked at) and how, on each backend's Keras -- tf-keras'
``BackupAndRestore`` (``Backup``) or, on Keras 3, tfpipe's own (``StepBackup``: Keras 3's resumes at an epoch's
start only). ``STEP_BACKUP`` is the running backend's. Also what the phase's callbacks share: the phase
(``Phase``) and the step group a callback is in (``StepGroups``)."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from tfpipe.runtime import fs
from tfpipe.runtime.errors import TfpipeError, option
from tfpipe.runtime.lifecycle import Deferred
from train.accel.backend import is_keras_3, keras_module
from train.runs import run as run_files

if TYPE_CHECKING:
    import tf_keras as keras
else:
    keras = keras_module()  # tf-keras, or Keras 3 on JAX (train.accel.backend)


@dataclass(frozen=True)
class Phase:
    """A training phase as its callbacks see it: its ``name`` (its backup's folder), the ``steps`` of an epoch,
    the run's ``epochs`` in all, the ``replicas``, whether it trains on several machines (``multiworker``: a
    backup is then a collective every worker joins, and TensorFlow's preemption notice is asked for), the
    deferred stop the phase stops at (``stop``) and the epochs ``history.csv`` records."""

    name: str
    steps: int
    epochs: int
    replicas: int
    multiworker: bool
    stop: Deferred
    recorded: int  # the epochs history.csv records (finished, whatever their backup says)
    rate: Any = 0.0  # the learning rate: a constant, or a schedule of the optimizer's step


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
    """When a phase's backup saves, for both backends' backups (``Backup``, ``StepBackup``): at every epoch's end;
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
        stopping = self.phase.stop.received is not None
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
        if self.phase.stop.received is not None:
            self.model.stop_training = True  # the epoch's other callbacks run first (history.csv's row)

    def said_resuming(self, epoch: int, step: int) -> None:
        if self.say and 0 <= epoch < self.phase.epochs:
            print(f"train.fit: resuming at epoch {epoch + 1}, step {step}", flush=True)


class Backup(BackupPolicy, keras.callbacks.BackupAndRestore):
    """tf-keras' backup of a phase (weights, optimizer, the epoch and step reached), which ``--resume`` restores,
    saved as ``BackupPolicy`` says. Kept after the phase (``delete_checkpoint=False``) until the whole job has
    finished: a job interrupted after its last epoch (in the report) resumes with nothing left to train.

    Keras records a step when it begins; with ``steps_per_execution`` K that is a group's first step, and a
    resume redid K - 1 steps. Here the step saved is the group's last. ``save_before_preemption`` (TensorFlow's
    preemption notice) is Keras' own, which it uses for multi-worker runs on Google Cloud only."""

    def __init__(self, folder: str, phase: Phase, every: int | None, say: bool) -> None:
        # an int save_freq: Keras then resumes within an epoch (with "epoch" it redoes the whole epoch)
        super().__init__(folder, save_freq=max(1, every or phase.steps), delete_checkpoint=False)
        self.save_before_preemption = phase.multiworker
        self.policy(phase, every, say)

    def on_train_begin(self, logs: dict[str, Any] | None = None) -> None:
        super().on_train_begin(logs)  # restores the backup, if any
        state = self._training_state
        if 0 <= int(state._ckpt_saved_epoch.numpy()) < self.phase.recorded:  # history.csv has that epoch's row:
            state._ckpt_saved_batch.assign(self.phase.steps - 1)  # a backup of tfpipe 1.1 (the last group's start)
        epoch, step = self.model._maybe_load_initial_counters_from_ckpt(self.phase.steps, -1)
        if epoch >= 0:
            self.last = (epoch, step)
        self.said_resuming(epoch, step)

    def on_epoch_begin(self, epoch: int, logs: dict[str, Any] | None = None) -> None:
        BackupPolicy.on_epoch_begin(self, epoch, logs)
        keras.callbacks.BackupAndRestore.on_epoch_begin(self, epoch, logs)

    def on_train_batch_end(self, batch: int, logs: dict[str, Any] | None = None) -> None:
        self._training_state._ckpt_saved_batch.assign(int(batch))  # before any save: Keras' preemption save too
        self._training_state.backup_if_preempted()  # a no-op unless Keras turned the preemption notice on
        BackupPolicy.on_train_batch_end(self, batch, logs)

    def on_epoch_end(self, epoch: int, logs: dict[str, Any] | None = None) -> None:
        BackupPolicy.on_epoch_end(self, epoch, logs)

    def save_step(self, epoch: int, step: int) -> None:
        """Backs up the weights and optimizer as they are after ``step`` (0-based) of ``epoch`` (0-based)."""
        self._training_state._ckpt_saved_epoch.assign(epoch)
        self._training_state._ckpt_saved_batch.assign(step)
        self._backup(epoch=epoch, batch=step)
        self._since, self._saved_at = 0, time.monotonic()
        self.last = self.position(epoch, step)


BACKUP_WEIGHTS, BACKUP_POSITION = "latest.weights.h5", "position.json"  # StepBackup's two files


class StepBackup(BackupPolicy, keras.callbacks.Callback):
    """Keras 3's backup of a phase, saved as ``BackupPolicy`` says: the weights with the optimizer's state
    (``latest.weights.h5``, Keras' own weights file) and where training stands (``position.json``: the epoch and
    the steps done), each written through a temporary name. Keras 3's ``BackupAndRestore`` resumes at an epoch's
    start only; ``restore`` reads the backup before fit, and ``run_phase`` fits the rest of a resumed epoch
    first."""

    def __init__(self, folder: str, phase: Phase, every: int | None, say: bool) -> None:
        super().__init__()
        self.folder = folder
        self.policy(phase, every, say)

    def restore(self, model: Any) -> tuple[int, int] | None:
        """Loads the backup into ``model`` (built and compiled) and returns where it continues, (epoch, steps
        done), 0-based; None when nothing of this phase was saved."""
        position = run_files.path(self.folder, BACKUP_POSITION)
        if not fs.exists(position):
            return None
        with fs.open(position, "rb") as f:
            saved = fs.parse_json(f.read(), position, "the backup's position")
        if not (isinstance(saved, dict) and all(type(saved.get(k)) is int for k in ("epoch", "steps"))):
            raise TfpipeError(f"{position}: not a backup position train.fit wrote; the backup is damaged")
        model.optimizer.build(model.trainable_variables)
        model.load_weights(run_files.path(self.folder, BACKUP_WEIGHTS))
        self.last = (saved["epoch"], saved["steps"])
        self.said_resuming(*self.last)
        return self.last

    def save_step(self, epoch: int, step: int) -> None:
        """Backs up the weights and optimizer as they are after ``step`` (0-based) of ``epoch`` (0-based)."""
        fs.makedirs(self.folder)
        weights = run_files.path(self.folder, BACKUP_WEIGHTS)
        tmp = fs.temporary_name(weights[: -len(".weights.h5")]) + ".weights.h5"
        self.model.save_weights(tmp)
        fs.rename(tmp, weights, overwrite=True)
        here = self.position(epoch, step)
        fs.write_atomic(run_files.path(self.folder, BACKUP_POSITION), json.dumps({"epoch": here[0], "steps": here[1]}))
        self._since, self._saved_at = 0, time.monotonic()
        self.last = here


STEP_BACKUP = StepBackup if is_keras_3(keras) else Backup  # the backend's backup of a phase
