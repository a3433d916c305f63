"""The training engine behind ``train.fit`` (TensorFlow and tf-keras): datasets, model, phases, outputs.

``train.fit`` holds the configuration and the command line (no TensorFlow, so ``--help`` is instant) and calls
``fit`` here. Steps: resolve the strategy -> split train/validation by fold -> build distributed datasets ->
build and compile the model inside ``strategy.scope()`` -> (optionally) train the head with the backbone
frozen -> fine-tune everything -> save ``model.keras``, ``history.csv``, ``metrics.json``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import json
import math
import os
import shutil
import statistics
import sys
import time
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any, TextIO

from tfpipe.deps import check_installed, require_keras

if TYPE_CHECKING:
    import tf_keras as keras
else:
    keras = require_keras()  # tf-keras of TensorFlow's release, or MissingDependency saying what to install
import tensorflow as tf

import tfpipe
from tfpipe import console, fs
from tfpipe.augment import Augment
from tfpipe.errors import (
    TfpipeError,
    check_at_least,
    check_count,
    check_fraction,
    check_path,
    check_positive,
    check_seed,
    option,
)
from tfpipe.read import check_no_image_twice
from tfpipe.shards import Shards, open_shards
from tfpipe.staging import LOCK, WriteLock, locked_folder
from train import run as run_files
from train.config import FitConfig
from train.models import build_model, min_image_size
from train.names import OPTIMIZERS, PRECISIONS, SCHEDULES
from train.report import learning_curves, validation_report
from train.run import Parts, RunConfig, read_state, training_parts, write_state
from train.schedules import make_schedule, scaled_lr
from train.strategy import default_precision, quick_teardown, resolve_strategy
from train.swa import AverageWeights, recompute_batch_norm, sync_batch_norm

BURN_DONE = f"{run_files.CHECKPOINTS}/burn-done"  # weights after the burn-in phase, for --resume
# Keras' default 200 thresholds could not tell apart predictions squeezed into 0.463-0.483 (a run reported 0.52
# for an exact 0.61); 1000 costs nothing measurable (a [1000, C] counter update per batch).
AUC_THRESHOLDS = 1000
# Settings a resumed run must share with the run it continues (others, such as verbose, may change).
RESUME_KEYS = (
    "records",
    "model",
    "image_size",
    "batch_size",
    "epochs",
    "steps_per_execution",
    "lr",
    "schedule",
    "optimizer",
    "fold",
    "val_fraction",
    "burn_epochs",
    "single_label",
    "swa_epochs",
    "classes",
)


# (training dataset, validation dataset, training steps an epoch, validation steps)
PhaseData = tuple[tf.distribute.DistributedDataset, tf.distribute.DistributedDataset, int, int]


def build_datasets(
    cfg: FitConfig, strategy: tf.distribute.Strategy, num_classes: int | None, parts: Parts
) -> tuple[tf.distribute.DistributedDataset, tf.distribute.DistributedDataset, int, int, int]:
    """Distributed training and validation datasets, and their sizes."""
    train_src, train_folds, val_src, val_folds = parts
    n_train, n_val = tfpipe.count_examples(train_src, train_folds), tfpipe.count_examples(val_src, val_folds)
    global_batch = cfg.batch_size * strategy.num_replicas_in_sync
    common: dict[str, Any] = {
        "image_size": cfg.image_size,
        "num_classes": num_classes,
        "label_mode": "one_hot" if cfg.single_label else "multi_hot",
    }

    def train_fn(ctx: tf.distribute.InputContext) -> tf.data.Dataset:
        return tfpipe.make_dataset(
            train_src,
            ctx.get_per_replica_batch_size(global_batch),
            training=True,
            folds=train_folds,
            augment=cfg.augment,
            seed=cfg.seed,
            input_context=ctx,
            **common,
        )

    # padded to static shapes; weight 0 on padding keeps the metrics exact
    def val_fn(ctx: tf.distribute.InputContext) -> tf.data.Dataset:
        return tfpipe.make_dataset(
            val_src,
            ctx.get_per_replica_batch_size(global_batch),
            folds=val_folds,
            pad_batches=True,
            input_context=ctx,
            **common,
        )

    train_ds = strategy.distribute_datasets_from_function(train_fn)
    val_ds = strategy.distribute_datasets_from_function(val_fn)
    return train_ds, val_ds, n_train, n_val, global_batch


@keras.utils.register_keras_serializable(package="tfpipe")
class F1Score(keras.metrics.F1Score):
    """Keras' F1Score as a weighted metric: compile passes it [B, 1] sample weights, which its own update
    expands once more (to [B, 1, 1]) and then fails on; it gets them as [B]."""

    def update_state(self, y_true: tf.Tensor, y_pred: tf.Tensor, sample_weight: tf.Tensor | None = None) -> Any:
        if sample_weight is not None:
            sample_weight = tf.reshape(sample_weight, [-1])
        return super().update_state(y_true, y_pred, sample_weight)


def make_auc(num_classes: int) -> keras.metrics.AUC:
    """Keras' macro AUC, as tracked per epoch: an estimate from predictions binned at ``AUC_THRESHOLDS`` evenly
    spaced thresholds (the exact AUC of the saved model is ``report.roc_auc_macro``, computed after training)."""
    return keras.metrics.AUC(name="auc", multi_label=True, num_labels=num_classes, num_thresholds=AUC_THRESHOLDS)


def make_metrics(num_classes: int, single_label: bool, threshold: float) -> list[keras.metrics.Metric]:
    if single_label:
        return [keras.metrics.CategoricalAccuracy(name="accuracy"), make_auc(num_classes)]
    # float32 whatever the precision policy: under mixed_bfloat16 on several replicas its counts were
    # autocast sync-on-read variables, which its result() cannot add (a NotImplementedError in fit)
    f1 = F1Score(name="f1", average="macro", threshold=threshold, dtype="float32")
    # Its variables now, not in the first traced step: a tf.function whose first trace creates variables is
    # traced a second time, and a trace of the training step on 8 replicas takes about 20 s.
    f1.build((None, num_classes), (None, num_classes))
    return [make_auc(num_classes), f1, keras.metrics.BinaryAccuracy(name="accuracy", threshold=threshold)]


def make_optimizer(
    name: str, lr: float | keras.optimizers.schedules.LearningRateSchedule, weight_decay: float
) -> keras.optimizers.Optimizer:
    if name == "adam":
        return keras.optimizers.Adam(lr)
    if name == "adamw":
        return keras.optimizers.AdamW(lr, weight_decay=weight_decay)
    if name == "sgd":
        return keras.optimizers.SGD(lr, momentum=0.9, nesterov=True)
    raise TfpipeError(f"unknown optimizer {name!r}: use adam, adamw or sgd")


def compile_model(
    model: keras.Model, cfg: FitConfig, lr: float | keras.optimizers.schedules.LearningRateSchedule, num_classes: int
) -> None:
    loss = (
        keras.losses.CategoricalCrossentropy(label_smoothing=cfg.label_smoothing)
        if cfg.single_label
        else keras.losses.BinaryCrossentropy(label_smoothing=cfg.label_smoothing)
    )
    # weighted_metrics, not metrics: Keras' plain metrics ignore sample weights, so the weight-0 rows that pad
    # validation batches to static shapes would count as negatives (a tiny fold on 8 replicas reported an AUC
    # of 0.20 for a model whose AUC on the real rows is 0.40).
    model.compile(
        optimizer=make_optimizer(cfg.optimizer, lr, cfg.weight_decay),
        loss=loss,
        weighted_metrics=make_metrics(num_classes, bool(cfg.single_label), cfg.threshold),
        steps_per_execution=cfg.steps_per_execution,
    )
    model.optimizer.build(model.trainable_variables)  # its slots now, for the same reason as make_metrics' F1


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


def run_phase(
    model: keras.Model,
    cfg: FitConfig,
    name: str,
    lr_schedule: float | keras.optimizers.schedules.LearningRateSchedule,
    epochs: int,
    initial_epoch: int,
    data: PhaseData,
    num_classes: int,
    throughput: Throughput,
    first: Sequence[keras.callbacks.Callback] = (),
) -> None:
    """Compiles and fits one phase, backed up every epoch so ``--resume`` continues it.

    ``first``: callbacks that run before the backup at the end of an epoch.
    """
    train_ds, val_ds, steps, val_steps = data
    compile_model(model, cfg, lr_schedule, num_classes)
    replicas = model.distribute_strategy.num_replicas_in_sync
    progress = (
        [Progress(replicas, cfg.steps_per_execution, steps, initial_epoch + epochs, bar=cfg.verbose == 1)]
        if cfg.verbose
        else []
    )
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
    try:
        model.fit(
            train_ds,
            epochs=initial_epoch + epochs,
            initial_epoch=initial_epoch,
            steps_per_epoch=steps,
            validation_data=val_ds,
            validation_steps=val_steps,
            callbacks=callbacks,
            verbose=cfg.verbose,
        )
    finally:
        for p in progress:  # also when fit fails: a heartbeat must not keep talking
            p.beat.close()


def keep_backup(folder: str) -> keras.callbacks.BackupAndRestore:
    """Backs a phase up every epoch, kept after the phase (``delete_checkpoint=False``) until the whole job has
    finished: a job interrupted after its last epoch (saving the model, in the report) resumes from it with
    nothing left to train, never from scratch."""
    return keras.callbacks.BackupAndRestore(folder, save_freq="epoch", delete_checkpoint=False)


def set_trainable(backbone: keras.Model, trainable: bool) -> None:
    backbone.trainable = trainable  # a frozen backbone also runs its BatchNorm layers in inference mode


def check_out(cfg: FitConfig, shards: Shards) -> bool:
    """A run folder is a new or empty folder, or a run that ``resume`` continues with the settings it started
    with, on the same shards; a finished run is never trained over, and a folder holding anything train.fit did
    not write (no valid ``config.json``) is never trained into. Each is an error naming the way out. Called
    holding the folder's lock; returns True for a new or empty folder (no earlier run in it)."""
    others = sorted(n for n in fs.listdir(cfg.run) if n != LOCK)
    if others and not fs.exists(run_files.path(cfg.run, run_files.CONFIG)):
        listed = ", ".join(others[:3]) + (f" and {len(others) - 3} more" if len(others) > 3 else "")
        files = "files" if len(others) > 1 else "a file"
        raise TfpipeError(
            f"{cfg.run} holds {files} train.fit did not write ({listed}); choose a new or empty {option('run')} folder"
        )
    if not others:
        return True
    config = RunConfig.load(cfg.run)
    if config.recipe:  # its files are not train.fit's to continue or replace
        raise TfpipeError(
            f"{cfg.run} holds a run of the PyTorch recipe {config.recipe}; choose another {option('run')} folder"
        )
    if cfg.overwrite:
        replace_run(cfg.run, others, cfg.verbose > 0)
        return True
    if not cfg.resume:
        raise TfpipeError(
            f"{cfg.run} already holds a run; pass {option('resume', True)} to continue it or "
            f"{option('overwrite', True)} to replace it, or choose another {option('run')} folder"
        )
    check_resume_fits(cfg, shards, config)
    run_files.remove_half_saved(cfg.run)  # of a job killed while saving: this one saves them again
    return False


def check_resume_fits(cfg: FitConfig, shards: Shards, config: RunConfig) -> None:
    """``resume`` continues an unfinished run on its own shards with the settings it started with."""
    if read_state(cfg.run).get("finished"):
        raise TfpipeError(
            f"{cfg.run} holds a finished run (model.keras); {option('resume', True)} continues an interrupted "
            f"one -- pass {option('overwrite', True)} to replace it, or choose another {option('run')} folder"
        )
    if config.dataset_id and config.dataset_id != shards.dataset_id:
        raise TfpipeError(
            f"{cfg.records} was rewritten since {cfg.run} started (dataset id {config.dataset_id}, "
            f"now {shards.dataset_id}); {option('resume', True)} continues a run on its own shards "
            f"-- choose another {option('run')} folder to train on the new ones"
        )
    before = config.settings
    now = dict(settings_of(cfg), classes=shards.classes)
    changed = [k for k in RESUME_KEYS if k in before and json.loads(json.dumps(now[k], default=str)) != before[k]]
    if changed:
        k = changed[0]
        raise TfpipeError(
            f"{cfg.run} was started with {k}={before[k]!r}, not {now[k]!r}; {option('resume', True)} "
            "continues a run with its own settings"
        )
    check_resumable(cfg.run, config)


def replace_run(run: str, names: Sequence[str], progress: bool) -> None:
    """``overwrite``: removes the files of the run in ``run`` that train.fit wrote (``config.json`` last, so a job
    killed meanwhile leaves a folder that is still a run's); files of other names stay, and are said. A file of
    another name inside its folders (``logs/``, ...) is refused: those folders go whole."""
    stray = run_files.foreign_in_folders(run)
    if stray:
        raise TfpipeError(
            f"{run_files.path(run, stray[0])} is not a file train.fit writes, in a folder {option('overwrite', True)} "
            "removes whole; move it out of the run folder first"
        )
    own = sorted((n for n in names if run_files.written_by_fit(n)), key=lambda n: n == run_files.CONFIG)
    for name in own:
        p = run_files.path(run, name)
        fs.rmtree(p) if fs.isdir(p) and not os.path.islink(p) else fs.remove(p)
    kept = [n for n in names if n not in own]
    if progress:
        what = f"; kept what train.fit did not write: {', '.join(kept[:3])}" + (" ..." if len(kept) > 3 else "")
        print(f"train.fit: replaced the run in {run} ({option('overwrite', True)}){what if kept else ''}", flush=True)


def check_resumable(run: str, config: RunConfig) -> None:
    """What an interrupted job left must be continued, never started over: ``history.csv`` recording epochs with
    no backup to continue them from (a job of tfpipe 1.0 interrupted after its last epoch, when Keras had already
    deleted its backup) would train from scratch and append to the history, counting epochs twice."""
    rows = run_files.read_history(run)
    if rows is None:
        return
    epochs = len(rows)
    burn = int(config.settings.get("burn_epochs") or 0)
    burn_done = bool(read_state(run).get("burn_done"))  # the burn-in's epochs are kept as its weights
    phase, in_phase = ("fine-tune", epochs - burn) if burn_done or not burn else ("burn", epochs)
    if in_phase > 0 and not tf.io.gfile.glob(run_files.path(run, f"{run_files.BACKUP}/{phase}/*")):
        raise TfpipeError(
            f"{run}: {run_files.HISTORY} lists {epochs} epoch{'s' * (epochs != 1)} but no backup is left to continue "
            f"from ({run_files.BACKUP}/ is empty: the job was interrupted after its last epoch by an older tfpipe); "
            f"{option('resume', True)} would train again from scratch -- choose another {option('run')} folder"
        )


def summarise(
    cfg: FitConfig,
    kind: str,
    strategy: tf.distribute.Strategy,
    global_batch: int,
    steps: int,
    n_train: int,
    n_val: int,
    precision: str,
    model: keras.Model,
    seconds: float,
    throughput: Throughput,
) -> dict[str, Any]:
    """metrics.json: the run's configuration, speed and validation scores (from history.csv)."""
    import pandas as pd

    with fs.open(run_files.path(cfg.run, run_files.HISTORY)) as f:
        history = pd.read_csv(f)
    val_cols = [c for c in history.columns if c.startswith("val_")]
    best = history.loc[history["val_auc"].idxmax()] if "val_auc" in history else history.iloc[-1]
    rates = throughput.rates
    if {run_files.IMAGES_PER_SEC, run_files.EPOCH_SECONDS} <= set(history.columns):
        # Every job's epochs, an interrupted run's too (runs before tfpipe 1.1 have only this job's): the epochs'
        # seconds, plus this job's outside its epochs (start, saving, report; earlier jobs' are not recorded).
        rates = list(history[run_files.IMAGES_PER_SEC].dropna())
        seconds = float(history[run_files.EPOCH_SECONDS].sum()) + seconds - throughput.seconds
    rates = rates[1:] or rates  # the first epoch includes tracing and compilation (a resumed job's first epoch
    # does too: the median outvotes it)
    return {
        "strategy": kind,
        "strategy_class": type(strategy).__name__,
        "replicas": strategy.num_replicas_in_sync,
        "steps_per_execution": cfg.steps_per_execution,
        "per_replica_batch_size": cfg.batch_size,
        "global_batch_size": global_batch,
        "base_lr": cfg.lr,
        "scaled_lr": scaled_lr(cfg.lr, strategy.num_replicas_in_sync),
        "schedule": cfg.schedule,
        "model": cfg.model,
        "image_size": cfg.image_size,
        "precision": precision,
        "epochs": len(history),
        "burn_epochs": cfg.burn_epochs,
        "steps_per_epoch": steps,
        "optimizer_steps": int(model.optimizer.iterations.numpy()),
        "train_examples": n_train,
        "val_examples": n_val,
        "fold": cfg.fold,
        "images_per_sec": round(statistics.median(rates), 1) if rates else None,
        "seconds": round(seconds, 1),
        "final": {c: float(history[c].iloc[-1]) for c in val_cols},
        "best": dict({c: float(best[c]) for c in val_cols}, epoch=int(best["epoch"]) + 1),
    }


def save_model(model: keras.Model, path: str) -> None:
    """Saves through a temporary name: a crash while saving never leaves a half-written model file."""
    tmp = fs.temporary_name(path[: -len(".keras")]) + ".keras"  # a name no user file has
    model.save(tmp)
    fs.rename(tmp, path, overwrite=True)


def write_run_config(plan: FitConfig, shards: Shards) -> None:
    """config.json: what predicting with this run depends on (classes, input size, how the images were fitted,
    single- or multi-label, the shards' dataset id, the validation fold), plus every setting used."""
    manifest = shards.manifest
    # prepare() refuses shards without a manifest, and decides the input size and single- or multi-label
    assert manifest is not None and plan.image_size is not None and plan.single_label is not None
    RunConfig(
        classes=tuple(manifest.classes),
        image_size=plan.image_size,
        single_label=plan.single_label,
        fit=manifest.image.effective_fit,
        dataset_id=shards.dataset_id,
        fold=plan.fold,
        records=plan.records,
        settings=settings_of(plan),
        stored_size=shards.image_size or run_files.OWN_SIZES,
    ).save(plan.run)


def settings_of(cfg: FitConfig) -> dict[str, Any]:
    """Every setting of ``cfg`` as JSON values, as ``config.json`` records them: a strategy object by its class
    name, the callbacks left out (``dataclasses.asdict`` would deep-copy both, and the default strategy refuses
    to be copied)."""
    strategy = cfg.strategy if isinstance(cfg.strategy, str) else type(cfg.strategy).__name__
    fields = dataclasses.asdict(dataclasses.replace(cfg, strategy=strategy, callbacks=()))
    return dict(json.loads(json.dumps({k: v for k, v in fields.items() if k != "callbacks"}, default=str)))


def finish_swa(
    model: keras.Model,
    swa: AverageWeights,
    strategy: tf.distribute.Strategy,
    cfg: FitConfig,
    data: PhaseData,
    report_args: dict[str, Any],
) -> dict[str, Any]:
    """Loads the averaged weights, re-estimates batch-norm statistics, scores them and saves ``model-swa.keras``."""
    train_ds, val_ds, steps, val_steps = data
    model.set_weights(swa.average)
    recompute_batch_norm(model, train_ds, steps)
    # Scored with the validation and prediction steps training traced (compiling first would trace both again:
    # on 8 replicas, seconds each).
    scores = model.evaluate(val_ds, steps=val_steps, return_dict=True, verbose=0)
    result: dict[str, Any] = {
        "model": run_files.MODEL_SWA,  # which model these scores are of: train.predict --swa predicts with it
        "epochs_averaged": swa.count,
        **{f"val_{k}": float(v) for k, v in scores.items()},
    }
    if cfg.report:
        result["report"] = validation_report(model, strategy, cfg.run, suffix=run_files.SWA_SUFFIX, **report_args)
    with strategy.scope():  # saved with a fresh optimizer: the training one's slots belong to other weights
        compile_model(model, cfg, 0.0, len(report_args["classes"]))
    save_model(model, run_files.path(cfg.run, run_files.MODEL_SWA))
    return result


def prepare(cfg: FitConfig, shards: Shards) -> FitConfig:
    """The plan: ``cfg`` with what it leaves open decided from the shards (single- or multi-label, input size,
    the seed of a deterministic run). A copy: the caller's config is never changed, so it can be reused."""
    if shards.manifest is None:
        raise TfpipeError(
            f"{cfg.records}: train.fit needs a folder written by tfpipe.write (its manifest gives "
            "the classes and folds)"
        )
    if not shards.labeled:
        raise TfpipeError(
            f"{cfg.records}: written unlabeled (manifest: labeled false, written with "
            f"{option('unlabeled', True, python='Source(..., labeled=False)')}); "
            "training needs labeled shards"
        )
    check_numbers(cfg)
    check_names(cfg)
    image_size = checked_image_size(cfg, shards)
    if cfg.fold is not None and not shards.num_folds:
        raise TfpipeError(
            f"{cfg.records}: written without folds, so {option('fold', cfg.fold)} has nothing to pick; "
            f"drop it (the last shards are held out, {option('val_fraction')}) or write with --num-folds"
        )
    if not 0 <= cfg.swa_epochs <= cfg.epochs:
        raise TfpipeError(f"{option('swa_epochs')} must be in 0..{cfg.epochs} (the epochs); got {cfg.swa_epochs}")
    if cfg.single_label and shards.multi_label:
        raise TfpipeError(
            f"{cfg.records}: {shards.describe_labels()}; {option('single_label', True)} (softmax, one "
            "class an image) would keep one label per image and drop the rest -- leave it out"
        )
    single_label = shards.single_label if cfg.single_label is None else cfg.single_label
    seed = (0 if cfg.seed is None else cfg.seed) if cfg.deterministic else cfg.seed  # seeded input order
    weights = None if cfg.weights in (None, "none") else cfg.weights  # "none": the command line's word for None
    fold = 0 if cfg.fold is None and shards.num_folds else cfg.fold
    return dataclasses.replace(
        cfg,
        image_size=image_size,
        single_label=single_label,
        seed=seed,
        weights=weights,
        fold=fold,
        augment=cfg.augment or Augment(),
    )


def checked_image_size(cfg: FitConfig, shards: Shards) -> int:
    """The input side: ``cfg.image_size``, else the stored size; refused when there is none, or when it is below
    the model's smallest input."""
    image_size = cfg.image_size or shards.image_size
    if not image_size:
        raise TfpipeError(
            f"{cfg.records}: images were stored at their own sizes (written without {option('image_size')}); pass "
            f"{option('image_size', 224)} -- the model's input side, each image resized to it as read"
        )
    if image_size < min_image_size(cfg.model):
        raise TfpipeError(
            f"{option('image_size')} {image_size} is below {cfg.model}'s smallest input "
            f"({min_image_size(cfg.model)} px)"
        )
    return image_size


def check_names(cfg: FitConfig) -> None:
    """Every named setting is one the engine knows (the command line offers only those; Python may pass any),
    and a weights file exists: checked before the run folder is touched. The model's name is checked with its
    smallest input (``checked_image_size``). ``resume`` and ``overwrite`` are not both asked."""
    for name, value, known in (
        ("optimizer", cfg.optimizer, OPTIMIZERS),
        ("schedule", cfg.schedule, SCHEDULES),
        ("precision", cfg.precision, (None, *PRECISIONS)),
    ):
        if value not in known:
            raise TfpipeError(f"unknown {name} {value!r}: use one of {', '.join(k for k in known if k)}")
    if cfg.weights not in (None, "none", "imagenet") and not fs.exists(cfg.weights):
        raise TfpipeError(f"cannot load weights {cfg.weights!r} for {cfg.model}: no such file")
    if cfg.resume and cfg.overwrite:
        raise TfpipeError(
            f"{option('resume', True)} continues the run in {cfg.run}, {option('overwrite', True)} replaces it; "
            "choose one"
        )


def check_numbers(cfg: FitConfig) -> None:
    """Every numeric setting in its range (the command line and Python refuse the same values)."""
    check_count(
        1,
        epochs=cfg.epochs,
        batch_size=cfg.batch_size,
        steps_per_execution=cfg.steps_per_execution,
        replicas=cfg.replicas,
    )
    check_count(0, burn_epochs=cfg.burn_epochs, swa_epochs=cfg.swa_epochs, fold=cfg.fold)
    check_at_least(
        0, warmup_epochs=cfg.warmup_epochs, weight_decay=cfg.weight_decay, label_smoothing=cfg.label_smoothing
    )
    check_positive(lr=cfg.lr, burn_lr=cfg.burn_lr)
    check_seed(seed=cfg.seed)
    check_fraction(val_fraction=cfg.val_fraction, threshold=cfg.threshold)
    if not cfg.label_smoothing < 1:
        raise TfpipeError(f"{option('label_smoothing')} must be below 1 (got {cfg.label_smoothing})")


def seed_run(plan: FitConfig) -> None:
    """A seed (``prepare`` gives a deterministic run seed 0 when it has none): the initial weights, dropout and
    Python's, NumPy's and TensorFlow's global generators seeded (``keras.utils.set_random_seed``, as a user would);
    ``deterministic`` also turns on TensorFlow's op determinism. The input order and augmentation take the seed
    from the plan too."""
    if plan.seed is not None:
        keras.utils.set_random_seed(plan.seed)
    if plan.deterministic:
        tf.config.experimental.enable_op_determinism()


def fit(cfg: FitConfig) -> dict[str, Any]:
    """Trains per ``cfg`` (a ``FitConfig``); returns the metrics dict also written to ``metrics.json``.

    Called through ``train.fit.fit`` (see its example).
    """
    started = time.perf_counter()
    check_path(records=cfg.records, run=cfg.run)
    check_count(1, replicas=cfg.replicas)
    if cfg.report:
        check_installed("matplotlib")  # the pictures come last: a missing package must not cost a whole run
    strategy, kind = resolve_strategy(cfg.strategy, cfg.replicas)  # first: virtual CPUs need a fresh TensorFlow
    shards = open_shards(cfg.records)
    check_no_image_twice(shards)
    plan = prepare(cfg, shards)
    seed_run(plan)  # after prepare's checks (a seed out of range is one line), before the model is built
    parts = training_parts(shards, plan.fold, plan.val_fraction)  # the fold exists
    check_batch_fits(plan, strategy, tfpipe.count_examples(parts.train, parts.train_folds))
    # Every check that needs no training has passed: only now is the run folder made and written.
    created = not fs.exists(plan.run)
    try:
        # One job per run folder: two fits started together would interleave one history.csv and one model.keras.
        with locked_folder(plan.run, "train.fit", setting="run") as lock, quick_teardown():
            fresh = check_out(plan, shards)
            return train_and_report(plan, shards, parts, strategy, kind, lock, started, fresh)
    except BaseException:
        if created:
            remove_if_empty(plan.run)  # made by this job, and nothing in it worth keeping
        raise


def train_and_report(
    plan: FitConfig,
    shards: Shards,
    parts: Parts,
    strategy: tf.distribute.Strategy,
    kind: str,
    lock: WriteLock,
    started: float,
    fresh: bool,
) -> dict[str, Any]:
    """The run itself, in ``plan.run`` (locked by ``lock``): config, training, model.keras, reports, metrics.json.
    The shards are checked against their dataset id at every epoch's end and before each output: a folder
    rewritten meanwhile stops the run, and no finished run claims classes or records the shards no longer hold.
    In a ``fresh`` (new or empty) folder, a failure before the first epoch is saved removes what the job wrote."""
    precision = plan.precision or default_precision(kind)
    train_ds, val_ds, n_train, n_val, global_batch = build_datasets(plan, strategy, shards.num_classes, parts)
    steps = max(1, n_train // global_batch)
    plan = capped_steps_per_execution(plan, steps)
    data = (train_ds, val_ds, steps, math.ceil(n_val / global_batch))
    throughput = Throughput(steps * global_batch)
    with removed_unless_an_epoch_is_saved(plan.run, fresh, throughput):
        write_run_config(plan, shards)
        keras.mixed_precision.set_global_policy(precision)
        if plan.verbose:
            announce_build(plan, strategy, kind, n_train, n_val, shards.image_size)
        with strategy.scope(), tfpipe.naming_corrupt_shards(shards), stopping_cleanly(plan, shards):
            model, swa = train_phases(plan, strategy, shards, data, throughput)
    lock.check()  # on gs:// the lock is advisory: a job that lost it saves nothing
    shards.check_unchanged()
    report_args = report_arguments(plan, shards, parts)
    with unfinished_on_error(plan.run):
        with console.saying("train.fit", f"saving {run_files.MODEL}", "still saving the model", bool(plan.verbose)):
            save_model(model, run_files.path(plan.run, run_files.MODEL))
        metrics = summarise(
            plan,
            kind,
            strategy,
            global_batch,
            steps,
            n_train,
            n_val,
            precision,
            model,
            time.perf_counter() - started,
            throughput,
        )
        metrics.update(reports(model, swa, strategy, plan, data, report_args, parts, throughput.last_seconds))
        shards.check_unchanged()
        fs.write_atomic(run_files.path(plan.run, run_files.METRICS), json.dumps(metrics, indent=1) + "\n")
    write_state(plan.run, dict(read_state(plan.run), burn_done=bool(plan.burn_epochs), finished=True))
    if fs.exists(run_files.path(plan.run, run_files.BACKUP)):
        fs.rmtree(run_files.path(plan.run, run_files.BACKUP))  # finished: nothing left to resume
    return metrics


@contextlib.contextmanager
def removed_unless_an_epoch_is_saved(run_dir: str, fresh: bool, throughput: Throughput) -> Iterator[None]:
    """A job that fails before its first epoch is saved (the model cannot be built: ImageNet weights offline) in a
    ``fresh`` folder (new or empty when it started) removes the run files it wrote there: nothing could be
    resumed, and they would make the corrected command refuse the folder. Nothing else is touched: not a file of
    another name, never a folder that held a run before this job."""
    try:
        yield
    except BaseException:
        if fresh and not throughput.epochs_saved:
            for name in run_files.WRITTEN:
                p = run_files.path(run_dir, name)
                if fs.isdir(p):
                    fs.rmtree(p)
                elif fs.exists(p):
                    fs.remove(p)
        raise


def remove_if_empty(folder: str) -> None:
    """Removes ``folder`` when it is empty (a run folder this job made and left nothing in); a local folder only
    (an empty "folder" on gs:// is no object)."""
    if not fs.is_remote(folder):
        with contextlib.suppress(OSError):
            os.rmdir(folder)


def capped_steps_per_execution(plan: FitConfig, steps: int) -> FitConfig:
    """Keras runs at most an epoch's steps per compiled call: a larger ``steps_per_execution`` is cut to
    ``steps``, said in a line, and recorded as the value used (metrics.json, the result line)."""
    if plan.steps_per_execution <= steps:
        return plan
    if plan.verbose:
        print(
            f"train.fit: {option('steps_per_execution', plan.steps_per_execution)} is more than the {steps} "
            f"step{'s' * (steps != 1)} of an epoch; using {steps} (Keras never runs past an epoch in one call)",
            flush=True,
        )
    return dataclasses.replace(plan, steps_per_execution=steps)


def announce_build(
    plan: FitConfig, strategy: tf.distribute.Strategy, kind: str, n_train: int, n_val: int, stored: int | None
) -> None:
    """The line saying what is built on what, before the minutes of building and compiling; images stored at
    another size are said to be resized (train.predict then wants shards stored as these are)."""
    resized = f" (images stored at {stored} px, resized as read)" if stored and stored != plan.image_size else ""
    print(
        f"train.fit: building {plan.model} at {plan.image_size} px{resized} on {strategy.num_replicas_in_sync} "
        f"{kind} replica{'s' * (strategy.num_replicas_in_sync > 1)}; {n_train} training image{'s' * (n_train != 1)}, "
        f"{n_val} validation image{'s' * (n_val != 1)}",
        flush=True,
    )


def report_arguments(plan: FitConfig, shards: Shards, parts: Parts) -> dict[str, Any]:
    """What ``validation_report`` needs besides the model: the classes, the validation records and how to read
    and score them."""
    return {
        "classes": shards.classes,
        "single_label": plan.single_label,
        "records": parts.validation,
        "folds": parts.validation_folds,
        "image_size": plan.image_size,
        "batch_size": plan.batch_size,
        "threshold": plan.threshold,
    }


def reports(
    model: keras.Model,
    swa: AverageWeights,
    strategy: tf.distribute.Strategy,
    plan: FitConfig,
    data: PhaseData,
    report_args: dict[str, Any],
    parts: Parts,
    epoch_seconds: float,
) -> dict[str, Any]:
    """metrics.json's ``report`` (validation predictions, thresholds and pictures, with ``plan.report``; and the
    digests of the images trained on, ``parts.train``) and ``swa`` (the averaged model saved and scored, with
    ``plan.swa_epochs``; its line estimates its time by ``epoch_seconds``, the last epoch's: measured 7 s for a
    6 s epoch of the demo on 8 replicas)."""
    found: dict[str, Any] = {}
    if plan.report:
        with console.saying(
            "train.fit",
            "the report: scoring the validation images with model.keras (val_predictions.csv, thresholds, pictures; "
            "train_digests.txt)",
            "still writing the report",
            bool(plan.verbose),
        ):
            found["report"] = {"model": run_files.MODEL, **validation_report(model, strategy, plan.run, **report_args)}
            learning_curves(plan.run)
            # what train.predict knows the images trained on by, whatever their names
            run_files.save_digests(plan.run, tfpipe.image_digests(parts.train, parts.train_folds))
    if plan.swa_epochs:
        with console.saying(
            "train.fit",
            f"SWA: the weights averaged over {swa.count} epoch{'s' * (swa.count != 1)}, their batch-norm statistics "
            f"and scores -- about an epoch's time (the last took {epoch_seconds:.0f} s)",
            "still averaging (SWA)",
            bool(plan.verbose),
        ):
            found["swa"] = finish_swa(model, swa, strategy, plan, data, report_args)
    return found


def check_batch_fits(plan: FitConfig, strategy: tf.distribute.Strategy, n_train: int) -> None:
    """A global batch larger than the training set would train on padding-sized nothing (and a huge batch
    costs gigabytes before failing): refused, naming the numbers."""
    replicas = strategy.num_replicas_in_sync
    if plan.batch_size * replicas > n_train:
        raise TfpipeError(
            f"{option('batch_size', plan.batch_size)} x {replicas} replica{'s' * (replicas > 1)} = "
            f"{plan.batch_size * replicas} image{'s' * (plan.batch_size * replicas != 1)} a step, more than the "
            f"{n_train} training image{'s' * (n_train != 1)}; "
            f"use {option('batch_size')} {max(1, n_train // replicas)} or less"
        )


class ShardsUnchanged(keras.callbacks.Callback):
    """At every epoch's end: stop if the shard folder was rewritten since training started."""

    def __init__(self, shards: Shards) -> None:
        super().__init__()
        self.shards = shards

    def on_epoch_end(self, epoch: int, logs: dict[str, Any] | None = None) -> None:
        self.shards.check_unchanged()


@contextlib.contextmanager
def stopping_cleanly(plan: FitConfig, shards: Shards) -> Iterator[None]:
    """Turns what stops training from outside into one line: the shards rewritten under it (their files gone
    mid-epoch), or a full disk while Keras backs up the epoch (its half-written ``*_temp`` folders removed)."""
    try:
        yield
    except (tf.errors.OpError, OSError) as e:
        shards.check_unchanged()
        if "No space left" not in str(e) and getattr(e, "errno", None) != errno.ENOSPC:
            raise
        removed = remove_temporaries(run_files.path(plan.run, run_files.BACKUP))
        raise TfpipeError(
            f"{plan.run}: no space left on the device while saving the epoch's backup "
            f"({removed} half-written file{'s' * (removed != 1)} removed); free space and continue "
            f"with {option('resume', True)}"
        ) from None


def remove_temporaries(folder: str) -> int:
    """Deletes the ``*_temp*`` files and folders TensorFlow's checkpoint writer left under ``folder``."""
    removed = 0
    for root, dirs, files in os.walk(folder) if not fs.is_remote(folder) else ():
        for name in [d for d in dirs if "_temp" in d]:
            shutil.rmtree(os.path.join(root, name), ignore_errors=True)
            dirs.remove(name)
            removed += 1
        for name in [f for f in files if "_temp" in f]:
            os.remove(os.path.join(root, name))
            removed += 1
    return removed


@contextlib.contextmanager
def unfinished_on_error(run_dir: str) -> Iterator[None]:
    """After model.keras is saved, a failure (the shards rewritten, a crash in the report) removes the models
    this job saved, so the folder never holds a model that looks finished but is not."""
    try:
        yield
    except BaseException:
        for name in (run_files.MODEL, run_files.MODEL_SWA):
            if fs.exists(run_files.path(run_dir, name)):
                fs.remove(run_files.path(run_dir, name))
        raise


def train_phases(
    plan: FitConfig, strategy: tf.distribute.Strategy, shards: Shards, data: PhaseData, throughput: Throughput
) -> tuple[keras.Model, AverageWeights]:
    """Builds the model (inside ``strategy.scope()``), trains the head with the backbone frozen when asked, then
    everything. Returns (model, the SWA average)."""
    replicas, steps, num_classes = strategy.num_replicas_in_sync, data[2], shards.num_classes
    # prepare() refuses shards without a manifest (which gives the classes) and decides the input size
    assert num_classes is not None and plan.image_size is not None
    watch = ShardsUnchanged(shards)
    # announce_build said "building MODEL at SIZE px on N replicas" (unless quiet): a heartbeat is enough here
    with console.saying("train.fit", None, f"still building {plan.model}", bool(plan.verbose)):
        model, backbone = build_model(
            plan.model, num_classes, plan.image_size, weights=plan.weights, multi_label=not plan.single_label
        )
    state = read_state(plan.run) if plan.resume else {}
    if plan.burn_epochs:
        burn_in(model, backbone, plan, state, replicas, data, num_classes, throughput, watch)
    set_trainable(backbone, True)
    schedule = make_schedule(plan.schedule, scaled_lr(plan.lr, replicas), steps, plan.epochs, plan.warmup_epochs)
    swa = AverageWeights(
        plan.burn_epochs + plan.epochs - plan.swa_epochs, run_files.path(plan.run, run_files.SWA_AVERAGE)
    )
    run_phase(
        model,
        plan,
        "fine-tune",
        schedule,
        plan.epochs,
        plan.burn_epochs,
        data,
        num_classes,
        throughput,
        first=[watch, swa] if plan.swa_epochs else [watch],
    )
    return model, swa


def burn_in(
    model: keras.Model,
    backbone: keras.Model,
    plan: FitConfig,
    state: dict[str, bool],
    replicas: int,
    data: PhaseData,
    num_classes: int,
    throughput: Throughput,
    watch: ShardsUnchanged,
) -> None:
    """Trains the head with the backbone frozen for ``plan.burn_epochs`` and keeps its weights for ``--resume``;
    a resumed run whose state says the burn-in finished loads those weights instead."""
    if not state.get("burn_done"):
        set_trainable(backbone, False)
        run_phase(
            model,
            plan,
            "burn",
            scaled_lr(plan.burn_lr or plan.lr, replicas),
            plan.burn_epochs,
            0,
            data,
            num_classes,
            throughput,
            first=[watch],
        )
        model.save_weights(run_files.path(plan.run, BURN_DONE))
        write_state(plan.run, dict(state, burn_done=True))
    elif not tf.io.gfile.glob(run_files.path(plan.run, BURN_DONE) + "*"):
        raise TfpipeError(
            f"{plan.run}: {run_files.STATE} says the burn-in finished, but its weights "
            f"({BURN_DONE}) are gone; start a new run in another {option('run')} folder"
        )
    else:
        model.load_weights(run_files.path(plan.run, BURN_DONE))
