"""The Keras callbacks of a training phase, in the order they run at an epoch's end (``phase_callbacks``): the
batch-norm statistics synced before validation, what the log says meanwhile (``Progress``), the shards watched,
the epoch backed up, its pace and learning rate added to ``history.csv``, TensorBoard and the best checkpoint."""

from __future__ import annotations

import sys
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, TextIO

from tfpipe.deps import require_keras

if TYPE_CHECKING:
    import tf_keras as keras
else:
    keras = require_keras()  # tf-keras of TensorFlow's release, or MissingDependency saying what to install

from tfpipe import console
from tfpipe.shards import Shards
from train import run as run_files
from train.config import FitConfig
from train.swa import sync_batch_norm


def phase_callbacks(
    cfg: FitConfig,
    name: str,
    steps: int,
    epochs: int,
    replicas: int,
    throughput: Throughput,
    first: Sequence[keras.callbacks.Callback],
) -> tuple[list[keras.callbacks.Callback], list[Progress]]:
    """The callbacks of the phase ``name`` of a run of ``epochs`` epochs in all, and the ``Progress`` among them
    (the caller closes its heartbeat when fit ends). ``first``: callbacks that run before the epoch's backup."""
    progress = [Progress(replicas, cfg.steps_per_execution, steps, epochs, bar=cfg.verbose == 1)] if cfg.verbose else []
    callbacks = [
        SyncBatchNorm(),
        *progress,
        *first,
        keep_backup(run_files.path(cfg.run, f"{run_files.BACKUP}/{name}")),
        throughput,  # after the backup (it counts the epochs saved), before the CSV logger (it adds columns)
        LogLearningRate(),
        keras.callbacks.CSVLogger(run_files.path(cfg.run, run_files.HISTORY), append=True),
        keras.callbacks.TensorBoard(run_files.path(cfg.run, run_files.LOGS), update_freq="epoch", profile_batch=0),
        keras.callbacks.ModelCheckpoint(
            run_files.path(cfg.run, f"{run_files.CHECKPOINTS}/best"),
            monitor="val_auc",
            mode="max",
            save_best_only=True,
            save_weights_only=True,
        ),
        *cfg.callbacks,
    ]
    return callbacks, progress


class Throughput(keras.callbacks.Callback):
    """Training images/s per epoch, timed from epoch start to the start of validation, and the epoch's seconds:
    both added to the epoch's logs, so ``history.csv`` keeps every job's (``run_phase`` places it before the
    CSV logger, after ``BackupAndRestore``); ``epochs_saved``, the epochs of this job that ended with their backup
    saved; ``seconds``, this job's seconds in epochs."""

    def __init__(self, images_per_epoch: int) -> None:
        super().__init__()
        self.images_per_epoch = images_per_epoch
        self.rates: list[float] = []
        self.epochs_saved = 0
        self.seconds = self.last_seconds = 0.0
        self._start: float | None = None
        self._began = 0.0

    def on_epoch_begin(self, epoch: int, logs: dict[str, Any] | None = None) -> None:
        self._start = self._began = time.perf_counter()

    def on_test_begin(self, logs: dict[str, Any] | None = None) -> None:
        if self._start is not None:
            self.rates.append(self.images_per_epoch / (time.perf_counter() - self._start))
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


class Progress(keras.callbacks.Callback):
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
        many = (
            (
                f"; it is traced once per replica, so this takes about {self.replicas}x as long as on one replica "
                "(minutes for an EfficientNet on CPU replicas)"
            )
            if self.replicas > 1
            else ""
        )
        self._say(
            f"compiling the training step for {self.replicas} replica{'s' * (self.replicas > 1)} "
            f"(steps_per_execution {self.spe}); the first steps wait for it{many}"
        )
        self.beat.start("still compiling the training step")

    def on_epoch_begin(self, epoch: int, logs: dict[str, Any] | None = None) -> None:
        self._epoch, self._epoch_began = epoch, time.perf_counter()
        if self._first_step_seen and not self.bar:
            # on several replicas an epoch's first steps can wait many seconds (measured: ~16 s on 8 CPU replicas)
            wait = self._first_wait or 0.0
            waited = f" (the last epoch's first steps came after {wait:.0f} s)" if wait >= SLOW_START_SECONDS else ""
            self.beat.start(f"epoch {epoch + 1}/{self.epochs}: step 0/{self.steps}{waited}")

    def on_train_batch_end(self, batch: int, logs: dict[str, Any] | None = None) -> None:
        self._bar_open = self.bar  # Keras' bar (the first callback) has just drawn this step
        if batch < self.spe:  # the epoch's first execution
            self._first_wait = time.perf_counter() - self._epoch_began
        where = f"epoch {self._epoch + 1}/{self.epochs}: step {batch + 1}/{self.steps}"
        if not self._first_step_seen:
            self._first_step_seen = True
            now = time.perf_counter()
            self._say(f"compiled; the first {batch + 1} step{'s' * (batch > 0)} done after {now - self._start:.0f} s")
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
    """Adds to the logs (so to history.csv) the learning rate the epoch's last step used."""

    def on_epoch_end(self, epoch: int, logs: dict[str, Any] | None = None) -> None:
        if logs is not None:  # Keras always passes the epoch's logs
            logs["lr"] = float(keras.backend.get_value(self.model.optimizer.learning_rate))


def keep_backup(folder: str) -> keras.callbacks.BackupAndRestore:
    """Backs a phase up every epoch, kept after the phase (``delete_checkpoint=False``) until the whole job has
    finished: a job interrupted after its last epoch (saving the model, in the report) resumes from it with
    nothing left to train, never from scratch."""
    return keras.callbacks.BackupAndRestore(folder, save_freq="epoch", delete_checkpoint=False)


class ShardsUnchanged(keras.callbacks.Callback):
    """At every epoch's end: stop if the shard folder was rewritten since training started."""

    def __init__(self, shards: Shards) -> None:
        super().__init__()
        self.shards = shards

    def on_epoch_end(self, epoch: int, logs: dict[str, Any] | None = None) -> None:
        self.shards.check_unchanged()
