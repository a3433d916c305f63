"""What a run writes after training: the report's arguments, the validation report and the SWA model (its
weights averaged, its batch-norm statistics re-estimated, scored and saved). ``train.keras.trainer`` calls ``reports``
once the model is saved."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import tensorflow as tf

import tfpipe
from tfpipe.format.shards import Shards
from tfpipe.runtime import console
from train.decide.metrics import metric_of
from train.keras.compiling import compile_model
from train.keras.config import FitConfig
from train.keras.data import PhaseData
from train.keras.fit_run import save_model
from train.keras.report import learning_curves, validation_report
from train.keras.swa import AverageWeights, recompute_batch_norm
from train.runs import run as run_files
from train.runs.run import Parts

if TYPE_CHECKING:
    import tf_keras as keras


def finish_swa(
    model: keras.Model,
    swa: AverageWeights,
    strategy: tf.distribute.Strategy,
    cfg: FitConfig,
    data: PhaseData,
    report_args: dict[str, Any],
) -> dict[str, Any]:
    """Loads the averaged weights, re-estimates batch-norm statistics, scores them and saves ``model-swa.keras``."""
    train_ds, val_ds, steps, val_steps, _ = data
    model.set_weights(swa.average)
    recompute_batch_norm(model, train_ds, steps, strategy)
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
        compile_model(model, cfg, 0.0, len(report_args["classes"]), data.loss_weights)
    save_model(model, run_files.path(cfg.run, run_files.MODEL_SWA))
    return result


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
        "metric": metric_of(plan.metric, bool(plan.single_label)),
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
    ``plan.swa_epochs``; its line estimates its time by ``epoch_seconds``, the last epoch's: the pass takes
    about an epoch's time)."""
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
