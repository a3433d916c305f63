"""What ``model.compile`` gets in a training run: the loss, the optimizer by name, and the metrics Keras tracks
per epoch (weighted, so the padding of validation batches never counts)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from tfpipe.runtime.errors import TfpipeError
from train.backends import KerasMixin, complete, current, keras_module
from train.keras.imbalance import LossWeights, make_loss
from train.keras.plan import ModelPlan, OptimizerPlan

if TYPE_CHECKING:
    import tf_keras as keras

# Keras' default 200 thresholds cannot tell apart predictions squeezed into a band a few hundredths wide (the
# estimate then misses the exact AUC by a tenth or more); 1000 costs nothing measurable (a [1000, C] counter update
# per batch).
AUC_THRESHOLDS = 1000


class F1Score(KerasMixin):
    """Keras' F1Score as a weighted metric: compile passes it [B, 1] sample weights, which its own update
    expands once more (to [B, 1, 1]) and then fails on; it gets them as [B]. Saved in model files as
    ``tfpipe>F1Score``."""

    KERAS_BASE = "metrics.F1Score"
    KERAS_PACKAGE = "tfpipe"

    def update_state(self, y_true: Any, y_pred: Any, sample_weight: Any = None) -> Any:
        if sample_weight is not None:
            sample_weight = current().tensor_ops().reshape(sample_weight, [-1])
        keras_f1: Any = super()  # Keras' F1Score, which completes this class
        return keras_f1.update_state(y_true, y_pred, sample_weight)


def make_auc(num_classes: int) -> keras.metrics.AUC:
    """Keras' macro AUC, as tracked per epoch: an estimate from predictions binned at ``AUC_THRESHOLDS`` evenly
    spaced thresholds (the exact AUC of the saved model is ``report.roc_auc_macro``, computed after training)."""
    keras = keras_module()
    return keras.metrics.AUC(name="auc", multi_label=True, num_labels=num_classes, num_thresholds=AUC_THRESHOLDS)


def make_metrics(num_classes: int, single_label: bool, threshold: float) -> list[keras.metrics.Metric]:
    keras = keras_module()
    if single_label:
        return [keras.metrics.CategoricalAccuracy(name="accuracy"), make_auc(num_classes)]
    # float32 whatever the precision policy: under mixed_bfloat16 on several replicas its counts would be
    # autocast sync-on-read variables, which its result() cannot add (a NotImplementedError in fit)
    f1 = complete(F1Score)(name="f1", average="macro", threshold=threshold, dtype="float32")
    current().build_before_tracing(f1, (None, num_classes))
    return [make_auc(num_classes), f1, keras.metrics.BinaryAccuracy(name="accuracy", threshold=threshold)]


def make_optimizer(
    name: str, lr: float | keras.optimizers.schedules.LearningRateSchedule, weight_decay: float
) -> keras.optimizers.Optimizer:
    keras = keras_module()
    if name == "adam":
        return keras.optimizers.Adam(lr)
    if name == "adamw":
        return keras.optimizers.AdamW(lr, weight_decay=weight_decay)
    if name == "sgd":
        return keras.optimizers.SGD(lr, momentum=0.9, nesterov=True)
    raise TfpipeError(f"unknown optimizer {name!r}: use adam, adamw or sgd")


def compile_model(
    model: keras.Model,
    head: ModelPlan,
    optimizer: OptimizerPlan,
    lr: float | keras.optimizers.schedules.LearningRateSchedule,
    steps_per_execution: int,
    loss_weights: LossWeights | None = None,
) -> None:
    """The run's loss for the model's ``head`` (weighted by ``loss_weights``: ``--class-weight``), the
    ``optimizer`` at ``lr``, and the per-epoch metrics; Keras runs ``steps_per_execution`` steps a call."""
    loss = make_loss(keras_module(), head.single_label, head.label_smoothing, loss_weights)
    # weighted_metrics, not metrics: Keras' plain metrics ignore sample weights, so the weight-0 rows that pad
    # validation batches to static shapes would count as negatives (on a tiny fold over 8 replicas, enough to
    # halve the AUC).
    model.compile(
        optimizer=make_optimizer(optimizer.name, lr, optimizer.weight_decay),
        loss=loss,
        weighted_metrics=make_metrics(head.num_classes, head.single_label, head.threshold),
        steps_per_execution=steps_per_execution,
    )
    model.optimizer.build(model.trainable_variables)  # its slots now, for the same reason as make_metrics' F1
