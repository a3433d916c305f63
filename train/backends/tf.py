"""The ``tf`` backend: tf-keras (Keras 2 of TensorFlow's release, ``tfpipe.runtime.deps.require_keras``) under a
``tf.distribute`` strategy (``train.accel.strategy``: ``TPUStrategy``, ``MirroredStrategy`` over GPUs or virtual
CPU replicas, multi-worker). Keras 3 on TensorFlow's strategies breaks with ``steps_per_execution > 1``
(keras-team/keras#19246): this path keeps tf-keras.

Each replica of a ``MirroredStrategy`` keeps its own batch-norm statistics and traces the step itself; tf-keras'
``BackupAndRestore`` resumes within an epoch.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from types import ModuleType, SimpleNamespace
from typing import TYPE_CHECKING, Any

from tfpipe.runtime.deps import require, require_keras
from train.accel.cluster import is_multiworker
from train.accel.strategy import input_pipelines, resolve_strategy
from train.accel.workers import ALONE, TfWorkers, Workers
from train.keras.backup import BackupPolicy, Phase

if TYPE_CHECKING:
    import tensorflow as tf
    import tf_keras as keras
else:
    tf = require("tensorflow")
    keras = require_keras()  # this backend's Keras: bound when the backend is first used, never before


# What the efficientnet package builds its models and layers with: tf-keras' modules, not Keras 3's.
EFFICIENTNET_MODULES = {"backend": keras.backend, "layers": keras.layers, "models": keras.models, "utils": keras.utils}


class Backup(BackupPolicy, keras.callbacks.BackupAndRestore):
    """tf-keras' backup of a phase (weights, optimizer, the epoch and step reached), which ``--resume`` restores,
    saved as ``BackupPolicy`` says. Kept after the phase (``delete_checkpoint=False``) until the whole job has
    finished: a job interrupted after its last epoch (in the report) resumes with nothing left to train.

    Keras records a step when it begins; with ``steps_per_execution`` K that is a group's first step, and a
    resume would redo K - 1 steps. Here the step saved is the group's last. ``save_before_preemption``
    (TensorFlow's preemption notice) is Keras' own, which it uses for multi-worker runs on Google Cloud only."""

    def __init__(self, folder: str, phase: Phase, every: int | None, say: bool) -> None:
        # an int save_freq: Keras then resumes within an epoch (with "epoch" it redoes the whole epoch)
        super().__init__(folder, save_freq=max(1, every or phase.steps), delete_checkpoint=False)
        self.save_before_preemption = phase.multiworker
        self.policy(phase, every, say)

    def on_train_begin(self, logs: dict[str, Any] | None = None) -> None:
        super().on_train_begin(logs)  # restores the backup, if any
        state = self._training_state
        if 0 <= int(state._ckpt_saved_epoch.numpy()) < self.phase.recorded:  # history.csv has that epoch's row:
            state._ckpt_saved_batch.assign(self.phase.steps - 1)  # a backup saved at the last group's start
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


def sync_batch_norm(model: keras.Model, layers: list[Any]) -> None:
    """Gives every replica the batch-norm statistics the saved model has.

    Keras keeps moving means and variances as sync-on-read variables: under a MirroredStrategy each replica
    updates and evaluates with its own copy, while saving (a cross-replica read) stores their mean. Without
    this, scores and predictions made in memory after training describe a slightly different model than the
    file (on a tiny validation fold, by a tenth of AUC or more)."""
    with model.distribute_strategy.scope():
        for layer in layers:
            for variable in (layer.moving_mean, layer.moving_variance):
                variable.assign(variable.read_value())  # cross-replica read = the mean, given to every copy


def recompute_batch_norm(model: keras.Model, layers: list[Any], dataset: Any, steps: int, strategy: Any = None) -> None:
    """One pass of forward steps in training mode under the strategy that built the model (a plain dataset is
    distributed over its replicas as ``model.fit`` would), while each layer's momentum is a variable set to
    k/(k+1) before step k, which turns the moving averages into exact cumulative means. Forward only: through
    ``model.fit`` with a zero learning rate the pass would trace the whole training step once per replica."""
    strategy = model.distribute_strategy if strategy is None else strategy
    with strategy.scope():
        momentum = tf.Variable(0.0, trainable=False, dtype=tf.float32)
    saved = [layer.momentum for layer in layers]
    for layer in layers:
        layer.moving_mean.assign(tf.zeros_like(layer.moving_mean))
        layer.moving_variance.assign(tf.ones_like(layer.moving_variance))
        layer.momentum = momentum  # read at every step of the traced function
    if isinstance(dataset, tf.data.Dataset):
        dataset = strategy.experimental_distribute_dataset(dataset)
    batches = iter(dataset)

    @tf.function
    def step(k: tf.Tensor) -> None:
        momentum.assign(k / (k + 1.0))
        strategy.run(lambda batch: model(batch[0], training=True), args=(next(batches),))

    try:
        for k in range(steps):
            step(tf.constant(k, tf.float32))
    finally:
        for layer, m in zip(layers, saved):
            layer.momentum = m
    sync_batch_norm(model, layers)  # each replica averaged its own batches; the exact mean is their mean


class TfBackend:
    """tf-keras under a ``tf.distribute`` strategy (see the module's docstring)."""

    name = "tf"
    traces_per_replica = True  # MirroredStrategy traces the step for each replica of this machine
    replica_batch_norm = True  # each replica keeps its own batch-norm statistics (sync-on-read variables)

    def keras(self) -> ModuleType:
        return keras

    def devices(self, strategy: Any, replicas: int | None) -> tuple[Any, str]:
        return resolve_strategy(strategy, replicas)

    def describe_devices(self, devices: Any, kind: str) -> str:
        n = devices.num_replicas_in_sync
        virtual = " virtual" if kind == "cpu" and n > 1 else ""
        return f"{n}{virtual} {kind.upper()} replica{'s' * (n > 1)}"

    def input_pipelines(self, devices: Any) -> int:
        return input_pipelines(devices)

    def datasets(self, devices: Any, make: Callable[[Any], Any]) -> Any:
        return devices.distribute_datasets_from_function(make)

    def workers(self, devices: Any) -> Workers:
        return TfWorkers(devices) if is_multiworker(devices) else ALONE

    def this_machine(self, devices: Any) -> Any:
        return tf.distribute.get_strategy()  # outside every scope: the default strategy, this machine

    def weights_file(self, base: str) -> str:
        return base  # a TensorFlow checkpoint: base.index, base.data-*

    def tensor_ops(self) -> Any:
        return SimpleNamespace(
            cast=tf.cast, cos=tf.cos, clip=tf.clip_by_value, where=tf.where, reshape=tf.reshape, log=tf.math.log,
            sum=tf.reduce_sum, mean=tf.reduce_mean,
        )  # fmt: skip

    def backup(self, folder: str, phase: Phase, every: int | None, say: bool) -> Any:
        return Backup(folder, phase, every, say)

    def fits(
        self, callbacks: Sequence[Any], model: Any, phase: Phase, initial_epoch: int
    ) -> list[tuple[int, int, int]]:
        return [(initial_epoch, phase.epochs, 0)]  # BackupAndRestore resumes within an epoch itself: one fit

    def sync_batch_norm(self, model: Any, layers: list[Any]) -> None:
        sync_batch_norm(model, layers)

    def recompute_batch_norm(self, model: Any, layers: list[Any], dataset: Any, steps: int, devices: Any) -> None:
        recompute_batch_norm(model, layers, dataset, steps, devices)

    def build_before_tracing(self, metric: Any, shape: tuple[int | None, ...]) -> None:
        # a tf.function whose first trace creates variables is traced a second time (seconds on 8 replicas)
        metric.build(shape, shape)

    def efficientnet(self, variant: str, input_shape: tuple[int, int, int], weights: str | None) -> tuple[Any, bool]:
        """The ``efficientnet`` package's EfficientNet, built with tf-keras' modules; its input is normalised by
        the model's preprocessing."""
        efn = require("efficientnet.model")
        fn = getattr(efn, f"EfficientNetB{variant}")
        return fn(include_top=False, weights=weights, input_shape=input_shape, **EFFICIENTNET_MODULES), False

    def custom_objects(self, classes: dict[str, Any]) -> dict[str, Any]:
        """tfpipe's ``classes``, which tf-keras reads where it compiles a loaded model (its own ``load_model``), and
        the efficientnet package's layers (its swish and FixedDropout)."""
        efn = require("efficientnet.model")
        layers = {
            "swish": efn.get_swish(**EFFICIENTNET_MODULES),
            "FixedDropout": efn.get_dropout(**EFFICIENTNET_MODULES),
        }
        return {**classes, **layers}


BACKEND = TfBackend()
