"""What a run trains and validates on: the shards' training and validation parts as distributed datasets
(``make_dataset`` once for each input pipeline of the strategy), and their steps."""

from __future__ import annotations

from typing import Any, NamedTuple

import tensorflow as tf

import tfpipe
from tfpipe.format.shards import open_shards
from tfpipe.tf.batches import evaluation_steps
from train.backends import current
from train.keras.imbalance import LossWeights, training_counts, weights_of
from train.keras.plan import Plan


class PhaseData(NamedTuple):
    """What a phase trains and validates on: the datasets, their steps, and the loss weights of
    ``--class-weight`` (None: every image weighs 1)."""

    train: tf.distribute.DistributedDataset
    validation: tf.distribute.DistributedDataset
    steps: int
    validation_steps: int
    loss_weights: LossWeights | None = None


def build_datasets(
    plan: Plan, devices: Any
) -> tuple[tf.distribute.DistributedDataset, tf.distribute.DistributedDataset, int, int, int]:
    """Distributed training and validation datasets on ``devices`` (the plan's, or one machine's for a
    multi-worker job's report), and their sizes: training images, validation images, global batch."""
    data = plan.data
    train_src, train_folds, val_src, val_folds = data.parts
    n_val = tfpipe.count_examples(val_src, val_folds)
    global_batch = data.batch_size * devices.num_replicas_in_sync
    common: dict[str, Any] = {
        "image_size": plan.model.image_size,
        "num_classes": plan.model.num_classes,
        "label_mode": "one_hot" if plan.model.single_label else "multi_hot",
    }

    def train_fn(ctx: tf.distribute.InputContext) -> tf.data.Dataset:
        return tfpipe.make_dataset(
            train_src,
            ctx.get_per_replica_batch_size(global_batch),
            training=True,
            folds=train_folds,
            augment=data.augment,
            seed=data.seed if data.data_service is None else None,  # the workers' input is never seeded (guide)
            input_context=ctx,
            service=data.data_service,
            sampling=data.sampling,
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

    backend = current()
    train_ds, val_ds = backend.datasets(devices, train_fn), backend.datasets(devices, val_fn)
    return train_ds, val_ds, data.train_examples, n_val, global_batch


def training_data(plan: Plan, devices: Any, say: bool = False) -> tuple[PhaseData, int]:
    """The distributed datasets on ``devices`` and their steps, and the validation images. A validation pass has
    the steps the largest input pipeline's share needs (``evaluation_steps``). ``say``: a line of the loss
    weights (``--class-weight``), where there are."""
    train_ds, val_ds, n_train, n_val, global_batch = build_datasets(plan, devices)
    parts, model = plan.data.parts, plan.model
    context = tf.distribute.InputContext(current().input_pipelines(devices), 0, devices.num_replicas_in_sync)
    val_steps = evaluation_steps(open_shards(parts.validation, parts.validation_folds), plan.data.batch_size, context)
    weights = None
    if plan.data.class_weight == "balanced":
        weights = weights_of(*training_counts(parts, model.num_classes), model.single_label)
        if say:
            print(f"train.fit: {weights.line(plan.data.shards.classes or (), model.single_label)}", flush=True)
    return PhaseData(train_ds, val_ds, max(1, n_train // global_batch), val_steps, weights), n_val
