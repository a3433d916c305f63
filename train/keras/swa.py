"""Stochastic weight averaging: average the weights of the last epochs, then re-estimate batch-norm statistics.

The average is kept as a running mean of the end-of-epoch weights and saved
every epoch (``swa/average.npz``), so ``--resume`` after a crash continues it.
Averaged weights do not match the batch-norm statistics of any epoch, so
``recompute_batch_norm`` runs one pass over training data with each
BatchNormalization layer's momentum set per step to a cumulative average
(what PyTorch's ``torch.optim.swa_utils.update_bn`` does), forward steps only, under the model's strategy (on
Keras 3: with momentum 0, the per-batch statistics averaged).
"""

from __future__ import annotations

import contextlib
import io
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import numpy.typing as npt
import tensorflow as tf

from tfpipe.runtime import fs
from train.accel.backend import is_keras_3, keras_module

if TYPE_CHECKING:
    import tf_keras as keras
else:
    keras = keras_module()  # tf-keras, or Keras 3 on JAX (train.accel.backend)


def average_weights(
    average: list[npt.NDArray[np.float64]] | None, count: int, weights: Sequence[npt.ArrayLike]
) -> list[npt.NDArray[np.float64]]:
    """Running mean: ``average`` of ``count`` snapshots updated with one more (lists of arrays)."""
    if average is None:
        return [np.array(w, np.float64) for w in weights]
    return [a + (np.asarray(w, np.float64) - a) / (count + 1) for a, w in zip(average, weights)]


class AverageWeights(keras.callbacks.Callback):
    """Averages the model's weights at the end of every epoch from ``start_epoch`` (0-based, global) on."""

    def __init__(self, start_epoch: int, path: str) -> None:
        super().__init__()
        self.start_epoch, self.path = start_epoch, path
        self.average: list[npt.NDArray[np.float64]] | None = None
        self.count = 0
        if fs.exists(path):  # resumed: continue the running mean
            with fs.open(path, "rb") as f:
                saved = np.load(io.BytesIO(f.read()))
                self.count = int(saved["count"])
                self.average = [saved[f"w{i}"] for i in range(len(saved.files) - 1)]

    def on_epoch_end(self, epoch: int, logs: dict[str, Any] | None = None) -> None:
        if epoch < self.start_epoch or epoch < self.start_epoch + self.count:  # before the window, or already in
            return
        self.average = average_weights(self.average, self.count, self.model.get_weights())
        self.count += 1
        buf = io.BytesIO()
        # Any: mypy checks **arrays against savez's allow_pickle (a bool) too
        arrays: dict[str, Any] = {f"w{i}": w for i, w in enumerate(self.average)}
        np.savez(buf, count=self.count, **arrays)
        fs.write_atomic(self.path, buf.getvalue())  # a crash keeps the previous average


def batch_norm_layers(model: keras.Model) -> list[keras.layers.BatchNormalization]:
    """Every BatchNormalization layer of ``model``, nested models' too."""
    found, todo = [], list(model.layers)
    while todo:
        layer = todo.pop(0)
        if isinstance(layer, keras.layers.BatchNormalization):
            found.append(layer)
        todo += getattr(layer, "layers", [])
    return found


def sync_batch_norm(model: keras.Model) -> None:
    """Gives every replica the batch-norm statistics the saved model has.

    Keras keeps moving means and variances as sync-on-read variables: under a MirroredStrategy each replica
    updates and evaluates with its own copy, while saving (a cross-replica read) stores their mean. Without
    this, scores and predictions made in memory after training describe a slightly different model than the
    file (seen: a SWA model scored 0.56 in memory, 0.69 as saved, on a tiny validation fold). Keras 3 on JAX has
    one copy of each statistic (one SPMD program): nothing to do.
    """
    if is_keras_3(keras):
        return
    with model.distribute_strategy.scope():
        for layer in batch_norm_layers(model):
            for variable in (layer.moving_mean, layer.moving_variance):
                variable.assign(variable.read_value())  # cross-replica read = the mean, assigned to every copy


def recompute_batch_norm(
    model: keras.Model, dataset: tf.data.Dataset | tf.distribute.DistributedDataset, steps: int, strategy: Any = None
) -> int:
    """Sets every BatchNormalization layer's moving statistics to their mean over ``steps`` training batches.

    One pass of forward steps in training mode, under whatever strategy built the model (a plain dataset is
    distributed over its replicas as ``model.fit`` would), while each layer's momentum is a variable set to
    k/(k+1) before step k, which turns the moving averages into exact cumulative means. Forward only: no
    gradients, no optimizer (through ``model.fit`` with a zero learning rate, the pass traced the whole training
    step once per replica: on 8 virtual CPU replicas it took 3 times as long).
    """
    layers = batch_norm_layers(model)
    if not layers:
        return 0
    if is_keras_3(keras):
        return mean_batch_statistics(model, layers, dataset, steps, strategy)
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
    sync_batch_norm(model)  # each replica averaged its own batches; the exact mean is the mean of those
    return len(layers)


def mean_batch_statistics(
    model: keras.Model, layers: list[Any], dataset: tf.data.Dataset, steps: int, strategy: Any
) -> int:
    """``recompute_batch_norm`` on Keras 3 (JAX): forward steps in training mode with every momentum 0, so after a
    step a layer's moving statistics are that batch's; their mean over ``steps`` batches is the same cumulative
    mean. One compiled program (``model.stateless_call`` under ``jax.jit``: called eagerly, layer by layer, the
    demo's pass took 15 s instead of about an epoch's 5), each batch the global batch."""
    import jax

    saved = [layer.momentum for layer in layers]
    where = {id(v): i for i, v in enumerate(model.non_trainable_variables)}
    wanted = [(where[id(layer.moving_mean)], where[id(layer.moving_variance)]) for layer in layers]
    trainable = [v.value for v in model.trainable_variables]
    state = [v.value for v in model.non_trainable_variables]

    def forward(state: list[Any], images: Any) -> list[Any]:
        _, new = model.stateless_call(trainable, state, images, training=True)
        return [(new[m], new[v]) for m, v in wanted]

    for layer in layers:
        layer.momentum = 0.0  # read when the step is traced, below
    sums = [[np.zeros(layer.moving_mean.shape), np.zeros(layer.moving_variance.shape)] for layer in layers]
    batches = iter(dataset)
    try:
        with strategy.scope() if strategy is not None else contextlib.nullcontext():
            step = jax.jit(forward)
            for _ in range(steps):
                for total, (mean, variance) in zip(sums, step(state, np.asarray(next(batches)[0]))):
                    total[0] += np.asarray(mean, np.float64)
                    total[1] += np.asarray(variance, np.float64)
    finally:
        for layer, m in zip(layers, saved):
            layer.momentum = m
    for (mean, variance), layer in zip(sums, layers):
        layer.moving_mean.assign((mean / steps).astype(np.float32))
        layer.moving_variance.assign((variance / steps).astype(np.float32))
    return len(layers)
