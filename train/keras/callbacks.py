"""The Keras callbacks of a training phase, in the order they run at an epoch's end (``phase_callbacks``): the
batch-norm statistics synced before validation, what the log says meanwhile (``Progress``), the shards watched,
the epoch backed up, its pace and learning rate added to ``history.csv``, TensorBoard and the best checkpoint."""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TextIO

import numpy as np

from train.accel.backend import is_keras_3, keras_module, weights_file

if TYPE_CHECKING:
    import tf_keras as keras
else:
    keras = keras_module()  # tf-keras, or Keras 3 on JAX (train.accel.backend)

from tfpipe import console, fs
from tfpipe.data_service import WorkerWatch
from tfpipe.errors import TfpipeError, option
from tfpipe.lifecycle import Deferred
from tfpipe.shards import Shards
from train.keras.config import FitConfig
from train.keras.swa import sync_batch_norm
from train.runs import run as run_files


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


def phase_callbacks(
    cfg: FitConfig, phase: Phase, throughput: Throughput, first: Sequence[keras.callbacks.Callback]
) -> tuple[list[keras.callbacks.Callback], list[Callable[[], None]]]:
    """The callbacks of ``phase``, and what the caller closes when fit ends, also when it fails (a heartbeat, a
    service's watch: no thread of a phase outlives it). ``first``: callbacks that run before the epoch's
    backup."""
    progress = (
        [Progress(phase.replicas, cfg.steps_per_execution, phase.steps, phase.epochs, bar=cfg.verbose == 1)]
        if cfg.verbose
        else []
    )
    watch = [ServiceWatch(cfg.data_service)] if cfg.data_service else []
    backup = STEP_BACKUP(
        run_files.path(cfg.run, f"{run_files.BACKUP}/{phase.name}"), phase, cfg.save_every, cfg.verbose > 0
    )
    callbacks = [
        *([] if is_keras_3(keras) else [SyncBatchNorm()]),  # one SPMD program on JAX: one copy of each statistic
        *progress,
        *first,
        backup,
        throughput,  # after the backup (it counts the epochs saved), before the CSV logger (it adds columns)
        LogLearningRate(phase.rate),
        keras.callbacks.CSVLogger(run_files.path(cfg.run, run_files.HISTORY), append=True),
        keras.callbacks.TensorBoard(run_files.path(cfg.run, run_files.LOGS), update_freq="epoch", profile_batch=0),
        keras.callbacks.ModelCheckpoint(
            weights_file(run_files.path(cfg.run, f"{run_files.CHECKPOINTS}/best")),
            monitor="val_auc",
            mode="max",
            save_best_only=True,
            save_weights_only=True,
        ),
        *watch,
        *cfg.callbacks,
    ]
    return callbacks, [*(p.beat.close for p in progress), *(w.watch.stop for w in watch)]


class ServiceWatch(keras.callbacks.Callback):
    """While ``fit`` trains through a tf.data service: ``tfpipe.data_service.WorkerWatch`` dials its workers,
    and a worker silent for two minutes while no step ends stops the job in one line instead of a wait with no
    end (TensorFlow's client waits for a lost worker forever)."""

    def __init__(self, service: str) -> None:
        super().__init__()
        self.watch = WorkerWatch(service, "train.fit")

    def on_train_begin(self, logs: dict[str, Any] | None = None) -> None:
        self.watch.start()

    def on_train_batch_end(self, batch: int, logs: dict[str, Any] | None = None) -> None:
        self.watch.stepped()

    def on_train_end(self, logs: dict[str, Any] | None = None) -> None:
        self.watch.stop()


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


class Throughput(StepGroups, keras.callbacks.Callback):
    """Training images/s per epoch, timed from epoch start to the start of validation, and the epoch's seconds:
    both added to the epoch's logs, so ``history.csv`` keeps every job's (``run_phase`` places it before the
    CSV logger, after ``BackupAndRestore``); ``epochs_saved``, the epochs of this job that ended with their backup
    saved; ``seconds``, this job's seconds in epochs."""

    def __init__(self, images_per_step: int) -> None:
        super().__init__()
        self.images_per_step = images_per_step
        self.steps = 0  # this epoch's steps in this job (a resumed epoch's are fewer)
        self.rates: list[float] = []
        self.epochs_saved = 0
        self.seconds = self.last_seconds = 0.0
        self._start: float | None = None
        self._began = 0.0

    def on_epoch_begin(self, epoch: int, logs: dict[str, Any] | None = None) -> None:
        self._start = self._began = time.perf_counter()
        self.steps, self._group_start = 0, 0

    def on_train_batch_end(self, batch: int, logs: dict[str, Any] | None = None) -> None:
        self.steps += self.group_steps(batch)

    def on_test_begin(self, logs: dict[str, Any] | None = None) -> None:
        if self._start is not None:
            self.rates.append(self.steps * self.images_per_step / (time.perf_counter() - self._start))
            self._start = None

    def on_epoch_end(self, epoch: int, logs: dict[str, Any] | None = None) -> None:
        self.on_test_begin()  # an epoch without validation: timed to its end
        seconds = self.last_seconds = time.perf_counter() - self._began
        self.seconds += seconds
        self.epochs_saved += 1
        if logs is not None:
            logs.update({run_files.IMAGES_PER_SEC: self.rates[-1], run_files.EPOCH_SECONDS: seconds})


class SyncBatchNorm(keras.callbacks.Callback):
    """Before each validation, every replica gets the batch-norm statistics a checkpoint saves (their mean):
    otherwise each replica validates with its own copy, and the epoch's scores describe another model than
    the one saved (a 40-image test reported 0.48 for a model.keras that scores 0.55)."""

    def on_test_begin(self, logs: dict[str, Any] | None = None) -> None:
        sync_batch_norm(self.model)


class Progress(StepGroups, keras.callbacks.Callback):
    """Says what happens while Keras' one line per epoch (``verbose=2``) is minutes away, so a log never goes
    quiet for long: compiling the first training and validation steps (minutes for a large graph on CPU
    replicas), and, every ``every`` seconds, the step an epoch is at or how long validation has run. With
    ``steps_per_execution`` K the step count moves K at a time (the host sees nothing in between)."""

    def __init__(
        self,
        replicas: int,
        steps_per_execution: int,
        steps: int,
        epochs: int,
        every: float = console.HEARTBEAT_SECONDS,
        out: TextIO | None = None,
        bar: bool = False,
    ) -> None:
        super().__init__()
        self.replicas, self.spe, self.steps, self.epochs, self.out = replicas, steps_per_execution, steps, epochs, out
        self.bar = bar  # Keras draws a progress bar (verbose=1): no step lines of ours within an epoch
        self.beat = console.Heartbeat("train.fit", every, out)
        self._start = self._epoch_began = 0.0
        self._epoch = 0
        self._first_wait: float | None = None  # seconds from an epoch's start to its first steps (the last epoch's)
        self._first_step_seen = self._validation_seen = False
        self._bar_open = False  # Keras' bar has drawn this epoch's line and not ended it yet

    def _say(self, text: str) -> None:
        self._end_bar_line()
        print(f"train.fit: {text}", file=self.out or sys.stdout, flush=True)
        self.beat.touch()

    def _end_bar_line(self) -> None:
        """Our lines start on a line of their own, not glued to the end of Keras' bar (which ends its line only at
        the epoch's end)."""
        if self._bar_open:
            print(file=self.out or sys.stdout, flush=True)
            self._bar_open = False

    def on_train_begin(self, logs: dict[str, Any] | None = None) -> None:
        self._start = time.perf_counter()
        here = self._replicas_here()
        many = (
            (
                f"; it is traced once per replica of this machine, so this takes about {here}x as long as on one "
                "replica (minutes for an EfficientNet on CPU replicas)"
            )
            if here > 1
            else ""
        )
        self._say(
            f"compiling the training step for {self.replicas} replica{'s' * (self.replicas > 1)} "
            f"(steps_per_execution {self.spe}); the first steps wait for it{many}"
        )
        self.beat.start("still compiling the training step")

    def _replicas_here(self) -> int:
        """The replicas this process traces the step for: all of them on one machine; a multi-worker job's
        workers each trace only their own (a chief with one device: once); Keras 3 on JAX: once, one program."""
        if is_keras_3(keras):
            return 1
        try:
            return len(self.model.distribute_strategy.extended.worker_devices)
        except (AttributeError, TypeError, RuntimeError):  # no model (a test's), the default strategy (one device)
            return self.replicas

    def on_epoch_begin(self, epoch: int, logs: dict[str, Any] | None = None) -> None:
        self._epoch, self._epoch_began = epoch, time.perf_counter()
        if self._first_step_seen and not self.bar:
            # on several replicas an epoch's first steps can wait many seconds (measured: ~16 s on 8 CPU replicas)
            wait = self._first_wait or 0.0
            waited = f" (the last epoch's first steps came after {wait:.0f} s)" if wait >= SLOW_START_SECONDS else ""
            self.beat.start(f"epoch {epoch + 1}/{self.epochs}: step 0/{self.steps}{waited}")

    def on_train_batch_end(self, batch: int, logs: dict[str, Any] | None = None) -> None:
        batch = self.step(batch)  # a resumed epoch's steps are NumPy integers
        self._bar_open = self.bar  # Keras' bar (the first callback) has just drawn this step
        if batch < self.spe:  # the epoch's first execution
            self._first_wait = time.perf_counter() - self._epoch_began
        where = f"epoch {self._epoch + 1}/{self.epochs}: step {batch + 1}/{self.steps}"
        if not self._first_step_seen:
            self._first_step_seen = True
            now, done = time.perf_counter(), self.group_steps(batch)
            self._say(f"compiled; the first {done} step{'s' * (done > 1)} done after {now - self._start:.0f} s")
            self.beat.stop() if self.bar else self.beat.start(where)
        elif not self.bar:
            self.beat.update(where)

    def on_test_begin(self, logs: dict[str, Any] | None = None) -> None:
        if not self._validation_seen:
            self._validation_seen = True
            self._say("compiling the validation step")
            self.beat.start("still compiling the validation step")
        else:
            self._end_bar_line()  # the heartbeat's lines come next
            self.beat.start(f"epoch {self._epoch + 1}/{self.epochs}: validating")

    def on_test_end(self, logs: dict[str, Any] | None = None) -> None:
        self.beat.stop()  # Keras' epoch line comes next

    def on_epoch_end(self, epoch: int, logs: dict[str, Any] | None = None) -> None:
        self._bar_open = False  # Keras' bar (the first callback) has just ended its line
        # the callbacks after this one save the SWA average, the backup and the best weights
        self.beat.start(f"epoch {epoch + 1}/{self.epochs}: still saving the backup and checkpoints")

    def on_train_end(self, logs: dict[str, Any] | None = None) -> None:
        # until fit returns: TensorFlow destroys the input pipeline holding the GIL, at times for a minute
        self.beat.start_outside("still closing the input pipeline (TensorFlow)")


SLOW_START_SECONDS = 5.0  # an epoch start that waits longer is said, with the wait, at the next epoch's start


class LogLearningRate(keras.callbacks.Callback):
    """Adds to the logs (so to history.csv) the learning rate the epoch's last step used: the phase's ``rate`` (a
    schedule, or a constant) at the optimizer's last step. (The optimizer's own ``learning_rate`` is the next
    step's on Keras 3, the last one's on tf-keras.)"""

    def __init__(self, rate: Any) -> None:
        super().__init__()
        self.rate = rate

    def on_epoch_end(self, epoch: int, logs: dict[str, Any] | None = None) -> None:
        if logs is not None:  # Keras always passes the epoch's logs
            last = int(self.model.optimizer.iterations.numpy()) - 1  # tf-keras': a variable mirrored over replicas
            logs["lr"] = float(np.asarray(self.rate(last))) if callable(self.rate) else float(self.rate)


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


class ShardsUnchanged(keras.callbacks.Callback):
    """At every epoch's end: stop if the shard folder was rewritten since training started."""

    def __init__(self, shards: Shards) -> None:
        super().__init__()
        self.shards = shards

    def on_epoch_end(self, epoch: int, logs: dict[str, Any] | None = None) -> None:
        self.shards.check_unchanged()
