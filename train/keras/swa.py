"""Stochastic weight averaging: average the weights of the last epochs, then re-estimate batch-norm statistics.

The average is kept as a running mean of the end-of-epoch weights and saved
every epoch (``swa/average.npz``), so ``--resume`` after a crash continues it.
Averaged weights do not match the batch-norm statistics of any epoch, so
``recompute_batch_norm`` runs one pass over training data with each
BatchNormalization layer's momentum set per step to a cumulative average
(what PyTorch's ``torch.optim.swa_utils.update_bn`` does), forward steps only, by the backend
(``Backend.recompute_batch_norm``).
"""

from __future__ import annotations

import io
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import numpy.typing as npt

from tfpipe.runtime import fs
from train.backends import KerasMixin, current, keras_module

if TYPE_CHECKING:
    import tf_keras as keras


def average_weights(
    average: list[npt.NDArray[np.float64]] | None, count: int, weights: Sequence[npt.ArrayLike]
) -> list[npt.NDArray[np.float64]]:
    """Running mean: ``average`` of ``count`` snapshots updated with one more (lists of arrays)."""
    if average is None:
        return [np.array(w, np.float64) for w in weights]
    return [a + (np.asarray(w, np.float64) - a) / (count + 1) for a, w in zip(average, weights)]


class AverageWeights(KerasMixin):
    """Averages the model's weights at the end of every epoch from ``start_epoch`` (0-based, global) on."""

    KERAS_BASE = "callbacks.Callback"
    model: Any  # the model being trained, which Keras' Callback holds

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
    keras = keras_module()
    found, todo = [], list(model.layers)
    while todo:
        layer = todo.pop(0)
        if isinstance(layer, keras.layers.BatchNormalization):
            found.append(layer)
        todo += getattr(layer, "layers", [])
    return found


def sync_batch_norm(model: keras.Model) -> None:
    """Gives every replica the batch-norm statistics the saved model has (a backend whose replicas keep their own,
    ``Backend.replica_batch_norm``; one SPMD program has one copy of each)."""
    current().sync_batch_norm(model, batch_norm_layers(model))


def recompute_batch_norm(model: keras.Model, dataset: Any, steps: int, strategy: Any = None) -> int:
    """Sets every BatchNormalization layer's moving statistics to their mean over ``steps`` training batches, under
    whatever strategy or devices built the model: the backend's forward pass in training mode (tf-keras: momentum
    k/(k+1) at step k, cumulative means; JAX: each batch's statistics, averaged). Returns the layers set."""
    layers = batch_norm_layers(model)
    if layers:
        current().recompute_batch_norm(model, layers, dataset, steps, strategy)
    return len(layers)
