"""The Keras callbacks of a training phase, in the order they run at an epoch's end (``phase_callbacks``): the
batch-norm statistics synced before validation, what the log says meanwhile (``Progress``), the shards watched,
the epoch backed up, its pace and learning rate added to ``history.csv``, TensorBoard and the best checkpoint."""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, TextIO

import numpy as np

from tfpipe.format.shards import Shards
from tfpipe.runtime import console
from tfpipe.tf.data_service import WorkerWatch
from train.backends import KerasMixin, complete, current, keras_module
from train.keras.backup import Phase, StepGroups
from train.keras.plan import Plan
from train.keras.swa import sync_batch_norm
from train.runs import run as run_files

if TYPE_CHECKING:
    import tf_keras as keras


def phase_callbacks(
    plan: Plan, phase: Phase, throughput: Throughput, first: Sequence[keras.callbacks.Callback]
) -> tuple[list[keras.callbacks.Callback], list[Callable[[], None]]]:
    """The callbacks of ``phase``, and what the caller closes when fit ends, also when it fails (a heartbeat, a
    service's watch: no thread of a phase outlives it). ``first``: callbacks that run before the epoch's
    backup."""
    run, verbose, service = plan.run.folder, plan.run.verbose, plan.data.data_service
    spe = plan.schedule.steps_per_execution
    progress = [complete(Progress)(phase.replicas, spe, phase.steps, phase.epochs, bar=verbose == 1)] if verbose else []
    watch = [complete(ServiceWatch)(service)] if service else []
    backend, keras = current(), keras_module()
    backup = backend.backup(
        run_files.path(run, f"{run_files.BACKUP}/{phase.name}"), phase, plan.schedule.save_every, verbose > 0
    )
    callbacks = [
        *([complete(Lockstep)()] if backend.workers(plan.devices.handle).many else []),
        *([complete(SyncBatchNorm)()] if backend.replica_batch_norm else []),
        *progress,
        *first,
        backup,
        throughput,  # after the backup (it counts the epochs saved), before the CSV logger (it adds columns)
        complete(LogLearningRate)(phase.rate),
        complete(HistoryLog)(run_files.path(run, run_files.HISTORY), append=True),
        keras.callbacks.TensorBoard(run_files.path(run, run_files.LOGS), update_freq="epoch", profile_batch=0),
        keras.callbacks.ModelCheckpoint(
            backend.weights_file(run_files.path(run, f"{run_files.CHECKPOINTS}/best")),
            monitor="val_auc",
            mode="max",
            save_best_only=True,
            save_weights_only=True,
        ),
        *watch,
        *plan.run.callbacks,
    ]
    return callbacks, [*(p.beat.close for p in progress), *(w.watch.stop for w in watch)]


class Lockstep(KerasMixin):
    """The processes of a cluster run the same computations in the same order: every callback of a batch's end on
    the main thread of every process. Keras 3 dispatches them to a thread pool where no callback needs a batch's
    end, and the processes' callbacks differ (the chief's progress lines): JAX's processes would then launch their
    computations in different orders, and wait for each other forever."""

    KERAS_BASE = "callbacks.Callback"

    def on_train_batch_end(self, batch: int, logs: dict[str, Any] | None = None) -> None:
        pass  # overridden: Keras then calls every batch's end on the main thread

    def on_test_batch_end(self, batch: int, logs: dict[str, Any] | None = None) -> None:
        pass

    def on_predict_batch_end(self, batch: int, logs: dict[str, Any] | None = None) -> None:
        pass


class ServiceWatch(KerasMixin):
    """While ``fit`` trains through a tf.data service: ``tfpipe.tf.data_service.WorkerWatch`` dials its workers,
    and a worker silent for two minutes while no step ends stops the job in one line instead of a wait with no
    end (TensorFlow's client waits for a lost worker forever)."""

    KERAS_BASE = "callbacks.Callback"

    def __init__(self, service: str) -> None:
        super().__init__()
        self.watch = WorkerWatch(service, "train.fit")

    def on_train_begin(self, logs: dict[str, Any] | None = None) -> None:
        self.watch.start()

    def on_train_batch_end(self, batch: int, logs: dict[str, Any] | None = None) -> None:
        self.watch.stepped()

    def on_train_end(self, logs: dict[str, Any] | None = None) -> None:
        self.watch.stop()


class Throughput(StepGroups, KerasMixin):
    """Training images/s per epoch, timed from epoch start to the start of validation, and the epoch's seconds:
    both added to the epoch's logs, so ``history.csv`` keeps every job's (``run_phase`` places it before the
    CSV logger, after ``BackupAndRestore``); ``epochs_saved``, the epochs of this job that ended with their backup
    saved; ``seconds``, this job's seconds in epochs."""

    KERAS_BASE = "callbacks.Callback"

    def __init__(self, images_per_step: int) -> None:
        super().__init__()
        self.images_per_step = images_per_step
        self.steps = 0  # this epoch's steps in this job (a resumed epoch's are fewer)
        self.rates: list[float] = []
        self.epochs_saved = 0
        self.seconds = 0.0
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
        seconds = time.perf_counter() - self._began
        self.seconds += seconds
        self.epochs_saved += 1
        if logs is not None:
            logs.update({run_files.IMAGES_PER_SEC: self.rates[-1], run_files.EPOCH_SECONDS: seconds})


class SyncBatchNorm(KerasMixin):
    """Before each validation, every replica gets the batch-norm statistics a checkpoint saves (their mean):
    otherwise each replica validates with its own copy, and the epoch's scores describe another model than
    the one saved (on a small validation set, by several hundredths of AUC)."""

    KERAS_BASE = "callbacks.Callback"
    model: Any  # the model being trained, which Keras' Callback holds

    def on_test_begin(self, logs: dict[str, Any] | None = None) -> None:
        sync_batch_norm(self.model)


class Progress(StepGroups, KerasMixin):
    """Says what happens while Keras' one line per epoch (``verbose=2``) is minutes away, so a log never goes
    quiet for long: compiling the first training and validation steps (minutes for a large graph on CPU
    replicas), and, every ``every`` seconds, the step an epoch is at or how long validation has run. With
    ``steps_per_execution`` K the step count moves K at a time (the host sees nothing in between)."""

    KERAS_BASE = "callbacks.Callback"
    model: Any  # the model being trained, which Keras' Callback holds

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
        workers each trace only their own (a chief with one device: once); one SPMD program (JAX): once."""
        if not current().traces_per_replica:
            return 1
        try:
            return len(self.model.distribute_strategy.extended.worker_devices)
        except (AttributeError, TypeError, RuntimeError):  # no model (a test's), the default strategy (one device)
            return self.replicas

    def on_epoch_begin(self, epoch: int, logs: dict[str, Any] | None = None) -> None:
        self._epoch, self._epoch_began = epoch, time.perf_counter()
        if self._first_step_seen and not self.bar:
            # on several replicas an epoch's first steps can wait many seconds (a quarter of a minute on 8 CPU replicas)
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


class LogLearningRate(KerasMixin):
    """Adds to the logs (so to history.csv) the learning rate the epoch's last step used: the phase's ``rate`` (a
    schedule, or a constant) at the optimizer's last step. (The optimizer's own ``learning_rate`` is the next
    step's on Keras 3, the last one's on tf-keras.)"""

    KERAS_BASE = "callbacks.Callback"
    model: Any  # the model being trained, which Keras' Callback holds

    def __init__(self, rate: Any) -> None:
        super().__init__()
        self.rate = rate

    def on_epoch_end(self, epoch: int, logs: dict[str, Any] | None = None) -> None:
        if logs is not None:  # Keras always passes the epoch's logs
            last = int(self.model.optimizer.iterations.numpy()) - 1  # tf-keras': a variable mirrored over replicas
            logs["lr"] = float(np.asarray(self.rate(last))) if callable(self.rate) else float(self.rate)


class HistoryLog(KerasMixin):
    """Keras' CSV logger of ``history.csv``, its file opened at the first epoch's end: Keras 3's opens (makes) it
    when training begins, so a first epoch interrupted would leave an empty ``history.csv`` -- no run's history
    (``train.runs.run.read_history`` refuses it)."""

    KERAS_BASE = "callbacks.CSVLogger"
    opened = False

    def on_train_begin(self, logs: dict[str, Any] | None = None) -> None:
        self.opened = False

    def on_epoch_end(self, epoch: int, logs: dict[str, Any] | None = None) -> None:
        csv_logger: Any = super()  # Keras' CSVLogger, which completes this class
        if not self.opened:
            csv_logger.on_train_begin()
            self.opened = True
        csv_logger.on_epoch_end(epoch, logs)

    def on_train_end(self, logs: dict[str, Any] | None = None) -> None:
        csv_logger: Any = super()
        if self.opened:
            csv_logger.on_train_end(logs)


class ShardsUnchanged(KerasMixin):
    """At every epoch's end: stop if the shard folder was rewritten since training started."""

    KERAS_BASE = "callbacks.Callback"

    def __init__(self, shards: Shards) -> None:
        super().__init__()
        self.shards = shards

    def on_epoch_end(self, epoch: int, logs: dict[str, Any] | None = None) -> None:
        self.shards.check_unchanged()
