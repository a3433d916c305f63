"""Planning a training run: ``FitConfig`` (the flags, or a notebook's config) checked once (``check_config``), then
decided from the shards and the devices into a ``train.keras.plan.Plan`` (``make_plan``), before the run folder is
touched. No TensorFlow here."""

from __future__ import annotations

import dataclasses
import sys

import tfpipe
from tfpipe.format.sampling import SAMPLINGS, check_sampling_fits
from tfpipe.format.shards import Shards
from tfpipe.runtime import fs
from tfpipe.runtime.deps import check_installed
from tfpipe.runtime.errors import (
    TfpipeError,
    check_at_least,
    check_count,
    check_fraction,
    check_path,
    check_positive,
    check_seed,
    option,
)
from tfpipe.runtime.locks import check_not_a_file
from tfpipe.tf.augment import Augment
from tfpipe.tf.data_service import check_service
from train.accel.tpus import TPUS
from train.decide.metrics import METRICS, metric_of
from train.keras.config import FitConfig
from train.keras.models import min_image_size
from train.keras.names import CLASS_WEIGHTS, OPTIMIZERS, PRECISIONS, SCHEDULES
from train.keras.plan import DataPlan, Devices, ModelPlan, OptimizerPlan, Plan, RunPlan, Schedule
from train.runs.run import Parts, training_parts


def make_plan(cfg: FitConfig, shards: Shards, devices: Devices) -> Plan:
    """The plan of ``cfg`` (checked by ``check_config``) on ``shards`` (opened and checked once, by the caller)
    and ``devices``: what ``cfg`` leaves open decided from the shards (single- or multi-label, input size, the
    seed of a deterministic run, the validation fold), an epoch's steps from the training images. The caller's
    config is never changed, so it can be reused (``train.cv``'s folds)."""
    settings = resolved(cfg, shards, devices.backend)
    parts = training_parts(shards, settings.fold, settings.val_fraction)  # the fold exists
    n_train = tfpipe.count_examples(parts.train, parts.train_folds)
    check_batch_fits(settings, devices.replicas, n_train)
    steps = max(1, n_train // (settings.batch_size * devices.replicas))
    spe = capped_steps_per_execution(settings, steps)
    steps = whole_step_groups(settings, steps, spe)
    s = dataclasses.replace(settings, steps_per_execution=spe, strategy=strategy_name(cfg.strategy, devices))
    warn_if_all_warmup(s, steps)
    assert s.image_size is not None and shards.num_classes is not None  # resolved() checked them
    return Plan(
        data=data_plan(s, shards, parts, n_train),
        model=ModelPlan(
            name=s.model,
            num_classes=shards.num_classes,
            image_size=s.image_size,
            single_label=bool(s.single_label),
            weights=s.weights,
            precision=s.precision,
            label_smoothing=s.label_smoothing,
            threshold=s.threshold,
        ),
        optimizer=OptimizerPlan(s.optimizer, s.lr, s.weight_decay, s.schedule, s.warmup_epochs, s.burn_lr),
        devices=devices,
        schedule=Schedule(s.epochs, s.burn_epochs, s.swa_epochs, steps, s.steps_per_execution, s.save_every),
        run=RunPlan(s.run, s.metric, s.resume, s.overwrite, s.report, s.verbose, s.callbacks),
        settings=s,
    )


def data_plan(settings: FitConfig, shards: Shards, parts: Parts, n_train: int) -> DataPlan:
    s = settings
    assert s.augment is not None  # resolved() gives the default augmentation
    return DataPlan(
        records=s.records,
        shards=shards,
        parts=parts,
        fold=s.fold,
        batch_size=s.batch_size,
        train_examples=n_train,
        augment=s.augment,
        sampling=s.sampling,
        class_weight=s.class_weight,
        seed=s.seed,
        deterministic=s.deterministic,
        data_service=s.data_service,
    )


def resolved(cfg: FitConfig, shards: Shards, backend: str) -> FitConfig:
    """``cfg`` on ``backend`` with what it leaves open decided from the shards, checked against them."""
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
    image_size = checked_image_size(cfg, shards)
    if cfg.fold is not None and not shards.num_folds:
        raise TfpipeError(
            f"{cfg.records}: written without folds, so {option('fold', cfg.fold)} has nothing to pick; "
            f"drop it (the last shards are held out, {option('val_fraction')}) or write with --num-folds"
        )
    single_label = kind_of(cfg, shards)
    seed = (0 if cfg.seed is None else cfg.seed) if cfg.deterministic else cfg.seed  # seeded input order
    weights = None if cfg.weights in (None, "none") else cfg.weights  # "none": the command line's word for None
    fold = 0 if cfg.fold is None and shards.num_folds else cfg.fold
    return dataclasses.replace(
        cfg,
        backend=backend,
        image_size=image_size,
        single_label=single_label,
        seed=seed,
        weights=weights,
        fold=fold,
        augment=cfg.augment or Augment(),
    )


def kind_of(cfg: FitConfig, shards: Shards) -> bool:
    """Whether the run is single-label (``cfg.single_label``, else the shards' kind), checked with what depends on
    it: the metric applies to the kind, balanced sampling is of single labels."""
    if cfg.single_label and shards.multi_label:
        raise TfpipeError(
            f"{cfg.records}: {shards.describe_labels()}; {option('single_label', True)} (softmax, one "
            "class an image) would keep one label per image and drop the rest -- leave it out"
        )
    single_label = bool(shards.single_label if cfg.single_label is None else cfg.single_label)
    metric_of(cfg.metric, single_label)
    check_sampling_fits(cfg.sampling, single_label, cfg.records)
    return single_label


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


def upscaling(stored: int | None, size: int) -> str | None:
    """What reading images ``stored`` at a smaller side than the run's input ``size`` does, in the words
    ``train.fit``'s build line and the preflight's finding share; None when nothing is upscaled (the same side, a
    smaller input, images stored at their own sizes)."""
    if not stored or stored >= size:
        return None
    more = size**2 / stored**2
    return f"images stored at {stored} px, each upscaled to {size} px as read: no detail gained, {more:.3g}x the pixels"


def check_config(cfg: FitConfig) -> None:
    """What can be refused before the shards are read and any device starts: paths, numbers, names, the
    strategy's own settings (a multi-worker strategy connects to its cluster, and would wait there for a worker
    that refused), and the package the report's pictures need (they come last: a missing one must not cost a
    whole run). Run once a job (``train.cv``: once for all its folds)."""
    check_path(records=cfg.records, run=cfg.run)
    check_numbers(cfg)
    check_strategy_settings(cfg)
    check_names(cfg)
    if not 0 <= cfg.swa_epochs <= cfg.epochs:
        raise TfpipeError(f"{option('swa_epochs')} must be in 0..{cfg.epochs} (the epochs); got {cfg.swa_epochs}")
    if cfg.report and not cfg.preflight:  # the report's pictures; a preflight writes none
        check_installed("matplotlib")


def check_names(cfg: FitConfig) -> None:
    """Every named setting is one the engine knows (the command line offers only those; Python may pass any),
    and a weights file exists: checked before the run folder is touched. The model's name is checked with its
    smallest input (``checked_image_size``). ``resume`` and ``overwrite`` are not both asked."""
    for name, value, known in (
        ("optimizer", cfg.optimizer, OPTIMIZERS),
        ("schedule", cfg.schedule, SCHEDULES),
        ("precision", cfg.precision, (None, *PRECISIONS)),
        ("tpu", cfg.tpu, tuple(TPUS)),
        ("metric", cfg.metric, tuple(METRICS)),
        ("class_weight", cfg.class_weight, (None, *CLASS_WEIGHTS)),
        ("sampling", cfg.sampling, (None, *SAMPLINGS)),
    ):
        if value not in known:
            raise TfpipeError(f"unknown {name} {value!r}: use one of {', '.join(k for k in known if k)}")
    if cfg.weights not in (None, "none", "imagenet") and not fs.exists(cfg.weights):
        raise TfpipeError(f"cannot load weights {cfg.weights!r} for {cfg.model}: no such file")
    if cfg.data_service is not None:
        check_data_service(cfg)
    if cfg.resume and cfg.overwrite:
        raise TfpipeError(
            f"{option('resume', True)} continues the run in {cfg.run}, {option('overwrite', True)} replaces it; "
            "choose one"
        )


def check_data_service(cfg: FitConfig) -> None:
    """A dispatcher answers at ``cfg.data_service``, and nothing asked of the input that a service cannot give."""
    if cfg.deterministic:
        raise TfpipeError(
            f"{option('deterministic', True)} fixes the input order, and the workers of {option('data_service')} "
            "race each other for it; choose one"
        )

    check_service(cfg.data_service or "", python="data_service")


def check_strategy_settings(cfg: FitConfig) -> None:
    """Settings a strategy cannot have, checked before the strategy starts (a multi-worker one connects to its
    cluster, and would wait there for a worker that refused)."""
    check_not_a_file(cfg.run, "run")
    if cfg.strategy == "multiworker" and cfg.data_service is not None:
        raise TfpipeError(
            f"{option('data_service')} with {option('strategy', 'multiworker')}: each worker would run its own "
            "job on the service, and records would reach several workers; one trainer consumes a service"
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
    check_count(0, burn_epochs=cfg.burn_epochs, swa_epochs=cfg.swa_epochs, fold=cfg.fold, save_every=cfg.save_every)
    check_at_least(
        0, warmup_epochs=cfg.warmup_epochs, weight_decay=cfg.weight_decay, label_smoothing=cfg.label_smoothing
    )
    check_positive(lr=cfg.lr, burn_lr=cfg.burn_lr)
    check_seed(seed=cfg.seed)
    check_fraction(val_fraction=cfg.val_fraction, threshold=cfg.threshold)
    if not cfg.label_smoothing < 1:
        raise TfpipeError(f"{option('label_smoothing')} must be below 1 (got {cfg.label_smoothing})")


def capped_steps_per_execution(plan: FitConfig, steps: int) -> int:
    """Keras runs at most an epoch's steps per compiled call: a larger ``steps_per_execution`` is cut to
    ``steps``, said in a line, and recorded as the value used (config.json, metrics.json, the result line)."""
    if plan.steps_per_execution <= steps:
        return plan.steps_per_execution
    if plan.verbose:
        print(
            f"train.fit: {option('steps_per_execution', plan.steps_per_execution)} is more than the {steps} "
            f"step{'s' * (steps != 1)} of an epoch; using {steps} (Keras never runs past an epoch in one call)",
            flush=True,
        )
    return steps


def whole_step_groups(plan: FitConfig, steps: int, spe: int) -> int:
    """An epoch's steps on ``plan.backend``: Keras 3 (``jax``) runs an epoch in whole groups of ``spe`` steps --
    its last group is not cut at the epoch's end (18 steps at 4 a call ran 20, and the heartbeat said
    ``step 20/18``) -- so there an epoch is cut to a multiple of ``spe``, said in a line; the training stream
    repeats, so the steps left out are the next epoch's first. tf-keras cuts the last group itself."""
    if plan.backend != "jax" or steps % spe == 0:
        return steps
    whole = steps - steps % spe
    if plan.verbose:
        print(
            f"train.fit: an epoch of {steps} steps at {option('steps_per_execution', spe)}: Keras 3 runs whole "
            f"groups of {spe} steps, so an epoch is {whole} steps (the images left over start the next one)",
            flush=True,
        )
    return whole


def strategy_name(strategy: object, devices: Devices) -> str:
    """The strategy as a run records it (``config.json``): the name given (``STRATEGIES``), or, for a strategy
    or JAX devices already made (a notebook's, each fold of ``train.cv``), the name that makes it: ``multiworker``
    across processes, else the devices' kind (tpu, gpu, cpu) -- never a Python class name."""
    if isinstance(strategy, str):
        return strategy
    return "multiworker" if devices.processes > 1 else devices.kind


WARMED = ("cosine", "kaggle")  # the schedules --warmup-epochs shapes (train.keras.schedules.make_schedule)


def warn_if_all_warmup(plan: FitConfig, steps: int) -> None:
    """``--warmup-epochs`` as long as the run (``train.fit --epochs 1`` with the default one): the learning rate
    climbs through every step but the last and never trains at ``--lr`` -- one warning line, not a refusal (a
    one-epoch smoke run is common, and a short warm-up run is not wrong, only rarely meant); quiet (``verbose``
    0) says nothing, as ``capped_steps_per_execution`` does not."""
    if not plan.verbose or plan.schedule not in WARMED or plan.warmup_epochs < plan.epochs or plan.epochs * steps < 2:
        return
    climbs = (
        "climbs from 0 through every step but the last, the only one at its full rate"
        if plan.schedule == "cosine"
        else "climbs through every step and never reaches its full rate"
    )
    print(
        f"train.fit: warning: {option('warmup_epochs', plan.warmup_epochs)} covers the whole run "
        f"({option('epochs', plan.epochs)}): the {plan.schedule} schedule's learning rate {climbs}; pass "
        f"{option('warmup_epochs', 0)}, or more {option('epochs')} than warm-up epochs",
        file=sys.stderr,
        flush=True,
    )


def check_batch_fits(plan: FitConfig, replicas: int, n_train: int) -> None:
    """A global batch (``plan.batch_size`` on each of ``replicas``) larger than the training set would train on
    padding-sized nothing (and a huge batch costs gigabytes before failing): refused, naming the numbers."""
    if plan.batch_size * replicas > n_train:
        raise TfpipeError(
            f"{option('batch_size', plan.batch_size)} x {replicas} replica{'s' * (replicas > 1)} = "
            f"{plan.batch_size * replicas} image{'s' * (plan.batch_size * replicas != 1)} a step, more than the "
            f"{n_train} training image{'s' * (n_train != 1)}; "
            f"use {option('batch_size')} {max(1, n_train // replicas)} or less"
        )
