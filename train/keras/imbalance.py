"""Imbalanced classes (``--class-weight balanced``): each class's loss weighed by the rarity of its training
images, as scikit-learn's ``compute_class_weight("balanced")`` weighs them, for either backend's Keras.

- single-label: a row weighs ``n / (classes x n_c)`` for its true class c (classes with images only);
- multi-label: each class is its own yes/no question, weighed as scikit-learn weighs a binary one: its positives
  ``n / (2 n_pos)``, its negatives ``n / (2 n_neg)``.

    counts = training_counts(parts, num_classes)          # [C] training images per class, and the total
    loss = make_loss(keras, cfg, weights_of(counts, n, single_label=True))
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence
from typing import Any

import numpy as np

import tfpipe
from tfpipe.runtime.errors import option
from train.backends import current
from train.runs.run import Parts

SHOWN = 8  # classes named in a run's line of weights
EPS = 1e-7  # probabilities clipped away from 0 and 1 before the log, as Keras' own cross-entropies do


@dataclasses.dataclass(frozen=True)
class LossWeights:
    """Per-class loss weights: ``positive`` of a class's true rows, ``negative`` of its others (multi-label;
    single-label rows weigh their true class's ``positive``)."""

    positive: tuple[float, ...]
    negative: tuple[float, ...]
    absent: tuple[int, ...] = ()  # the classes without a training image (they weigh 1: their rows never come)

    def line(self, classes: Sequence[str], single_label: bool) -> str:
        """``--class-weight balanced: each image of its class weighs common 0.40, rare 4.00; no training image
        of zebra (weighs 1)``: what a run says once, before it trains."""
        rows = "each image of its class weighs" if single_label else "each class's positive images weigh"
        shown = ", ".join(f"{c} {w:.2f}" for c, w in list(zip(classes, self.positive))[:SHOWN])
        more = f", ... {len(classes)} classes in all" if len(classes) > SHOWN else ""
        names = [classes[i] for i in self.absent]
        absent = f"; no training image of {', '.join(names[:SHOWN])}{' ...' * (len(names) > SHOWN)} (weighs 1)"
        return f"{option('class_weight', 'balanced')}: {rows} {shown}{more}{absent if names else ''}"


def training_counts(parts: Parts, num_classes: int) -> tuple[np.ndarray, int]:
    """The training images of each class [C] and in all, read from the labels column (no image decoded)."""
    targets = tfpipe.read_targets(parts.train, num_classes, parts.train_folds)
    return targets.sum(axis=0).astype(np.int64), len(targets)


def weights_of(class_counts: Sequence[int] | np.ndarray, n: int, single_label: bool) -> LossWeights:
    """Balanced weights from the training counts (scikit-learn's rule); a class with no training image weighs
    1 (its true rows never occur)."""
    from sklearn.utils.class_weight import compute_class_weight

    counts = np.asarray(class_counts, np.int64)
    absent = tuple(int(i) for i in np.flatnonzero(counts == 0))
    if single_label:
        present = np.flatnonzero(counts)
        y = np.repeat(present, counts[present])
        w = np.ones(len(counts))
        w[present] = compute_class_weight("balanced", classes=present, y=y)
        return LossWeights(tuple(map(float, w)), tuple(map(float, w)), absent)
    pos = np.where(counts > 0, n / (2 * np.maximum(counts, 1)), 1.0)
    neg = np.where(counts < n, n / (2 * np.maximum(n - counts, 1)), 1.0)
    return LossWeights(tuple(map(float, pos)), tuple(map(float, neg)), absent)


def make_loss(keras: Any, single_label: bool, label_smoothing: float, weights: LossWeights | None) -> Any:
    """The run's loss: Keras' own cross-entropy, or with ``weights`` the weighted one (``WeightedCrossEntropy``)."""
    if weights is None:
        if single_label:
            return keras.losses.CategoricalCrossentropy(label_smoothing=label_smoothing)
        return keras.losses.BinaryCrossentropy(label_smoothing=label_smoothing)
    return weighted_loss_class(keras)(single_label, label_smoothing, weights.positive, weights.negative)


@functools.cache  # one class a Keras module: registered once
def weighted_loss_class(keras: Any) -> type:
    """``WeightedCrossEntropy`` for the running Keras (tf-keras or Keras 3), registered so a saved model loads."""

    @keras.utils.register_keras_serializable(package="tfpipe")
    class WeightedCrossEntropy(keras.losses.Loss):
        """Cross-entropy of probabilities with per-class weights (``LossWeights``), label smoothing as Keras'."""

        def __init__(
            self,
            single_label: bool,
            label_smoothing: float,
            positive: Sequence[float],
            negative: Sequence[float],
            name: str = "weighted_cross_entropy",
            **kwargs: Any,
        ) -> None:
            super().__init__(name=name, **kwargs)
            self.single_label, self.label_smoothing = bool(single_label), float(label_smoothing)
            self.positive, self.negative = [float(w) for w in positive], [float(w) for w in negative]

        def call(self, y_true: Any, y_pred: Any) -> Any:
            ops = current().tensor_ops()
            y = ops.cast(y_true, "float32")
            p = ops.cast(y_pred, "float32")
            pos = ops.cast(self.positive, "float32")
            s = self.label_smoothing
            if self.single_label:
                smooth = y * (1 - s) + s / len(self.positive)
                return -ops.sum(smooth * ops.log(ops.clip(p, EPS, 1.0)), -1) * ops.sum(y * pos, -1)
            smooth = y * (1 - s) + 0.5 * s
            p = ops.clip(p, EPS, 1 - EPS)
            bce = -(smooth * ops.log(p) + (1 - smooth) * ops.log(1 - p))
            return ops.mean(bce * (y * pos + (1 - y) * ops.cast(self.negative, "float32")), -1)

        def get_config(self) -> dict[str, Any]:
            return dict(
                super().get_config(),
                single_label=self.single_label,
                label_smoothing=self.label_smoothing,
                positive=self.positive,
                negative=self.negative,
            )

    return WeightedCrossEntropy
