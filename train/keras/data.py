"""What a run trains and validates on: the shards' training and validation parts as distributed datasets
(``make_dataset`` once for each input pipeline of the strategy), and their steps."""

from __future__ import annotations

from typing import Any, NamedTuple

import tensorflow as tf

import tfpipe
from tfpipe.format.shards import Shards, open_shards
from tfpipe.tf.batches import evaluation_steps
from train.backends import current
from train.keras.config import FitConfig
from train.keras.imbalance import LossWeights, training_counts, weights_of
from train.runs.run import Parts


class PhaseData(NamedTuple):
    """What a phase trains and validates on: the datasets, their steps, and the loss weights of
    ``--class-weight`` (None: every image weighs 1)."""

    train: tf.distribute.DistributedDataset
    validation: tf.distribute.DistributedDataset
    steps: int
    validation_steps: int
    loss_weights: LossWeights | None = None


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
            seed=cfg.seed if cfg.data_service is None else None,  # the workers' input is never seeded (guide)
            input_context=ctx,
            service=cfg.data_service,
            sampling=cfg.sampling,
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
    train_ds, val_ds = backend.datasets(strategy, train_fn), backend.datasets(strategy, val_fn)
    return train_ds, val_ds, n_train, n_val, global_batch


def training_data(
    plan: FitConfig, strategy: tf.distribute.Strategy, shards: Shards, parts: Parts, say: bool = False
) -> tuple[PhaseData, int, int, int]:
    """The distributed datasets and their steps, and (training images, validation images, global batch). A
    validation pass has the steps the largest input pipeline's share needs (``evaluation_steps``). ``say``: a
    line of the loss weights (``--class-weight``), where there are."""
    train_ds, val_ds, n_train, n_val, global_batch = build_datasets(plan, strategy, shards.num_classes, parts)
    context = tf.distribute.InputContext(current().input_pipelines(strategy), 0, strategy.num_replicas_in_sync)
    val_steps = evaluation_steps(open_shards(parts.validation, parts.validation_folds), plan.batch_size, context)
    weights = None
    if plan.class_weight == "balanced":
        assert shards.num_classes is not None  # labeled shards: prepare() checked them
        weights = weights_of(*training_counts(parts, shards.num_classes), bool(plan.single_label))
        if say:
            print(f"train.fit: {weights.line(shards.classes or (), bool(plan.single_label))}", flush=True)
    data = PhaseData(train_ds, val_ds, max(1, n_train // global_batch), val_steps, weights)
    return data, n_train, n_val, global_batch
