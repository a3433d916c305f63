"""What a run writes after training: the report's arguments, the validation report and the SWA model (its
weights averaged, its batch-norm statistics re-estimated, scored and saved). ``train.keras.trainer`` calls ``reports``
once the model is saved."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import tensorflow as tf

import tfpipe
from tfpipe.runtime import console
from train.keras.compiling import compile_model
from train.keras.data import PhaseData
from train.keras.fit_run import save_model
from train.keras.plan import Plan
from train.keras.report import learning_curves, validation_report
from train.keras.swa import AverageWeights, recompute_batch_norm
from train.runs import run as run_files

if TYPE_CHECKING:
    import tf_keras as keras


def finish_swa(
    model: keras.Model,
    swa: AverageWeights,
    strategy: tf.distribute.Strategy,
    plan: Plan,
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
    if plan.run.report:
        found = validation_report(model, strategy, plan.run.folder, suffix=run_files.SWA_SUFFIX, **report_args)
        result["report"] = found
    with strategy.scope():  # saved with a fresh optimizer: the training one's slots belong to other weights
        compile_model(model, plan.model, plan.optimizer, 0.0, plan.schedule.steps_per_execution, data.loss_weights)
    save_model(model, run_files.path(plan.run.folder, run_files.MODEL_SWA))
    return result


def swa_line(epochs: int, batches: int, report: bool) -> str:
    """What finishing SWA does, step by step, and no estimate of its time: its batch-norm pass traces a program of
    its own (on every replica) and starts its own input pipeline before its first batch, which an epoch's time
    does not foretell (a user's took 54-95 s after epochs of 13 s); the heartbeat says how long it has run."""
    reported = ", its report written" if report else ""
    return (
        f"SWA: the weights averaged over {epochs} epoch{'s' * (epochs != 1)}; their batch-norm statistics "
        f"re-estimated over {batches} training batch{'es' * (batches != 1)} (a forward pass, compiled first), "
        f"then the validation images scored{reported} and {run_files.MODEL_SWA} saved"
    )


def report_arguments(plan: Plan) -> dict[str, Any]:
    """What ``validation_report`` needs besides the model: the classes, the validation records and how to read
    and score them."""
    parts = plan.data.parts
    return {
        "classes": plan.data.shards.classes,
        "single_label": plan.model.single_label,
        "records": parts.validation,
        "folds": parts.validation_folds,
        "image_size": plan.model.image_size,
        "batch_size": plan.data.batch_size,
        "threshold": plan.model.threshold,
        "metric": plan.metric,
    }


def reports(
    model: keras.Model,
    swa: AverageWeights,
    strategy: tf.distribute.Strategy,
    plan: Plan,
    data: PhaseData,
    report_args: dict[str, Any],
) -> dict[str, Any]:
    """metrics.json's ``report`` (validation predictions, thresholds and pictures, with ``plan.run.report``; and the
    digests of the images trained on) and ``swa`` (the averaged model saved and scored, with
    ``plan.schedule.swa_epochs``; its line says what it does, ``swa_line``)."""
    found: dict[str, Any] = {}
    parts, folder, say = plan.data.parts, plan.run.folder, bool(plan.run.verbose)
    if plan.run.report:
        with console.saying(
            "train.fit",
            "the report: scoring the validation images with model.keras (val_predictions.csv, thresholds, pictures; "
            "train_digests.txt)",
            "still writing the report",
            say,
        ):
            found["report"] = {"model": run_files.MODEL, **validation_report(model, strategy, folder, **report_args)}
            learning_curves(folder)
            # what train.predict knows the images trained on by, whatever their names
            run_files.save_digests(folder, tfpipe.image_digests(parts.train, parts.train_folds))
    if plan.schedule.swa_epochs:
        with console.saying(
            "train.fit",
            swa_line(swa.count, data.steps, plan.run.report),
            "still averaging (SWA)",
            say,
        ):
            found["swa"] = finish_swa(model, swa, strategy, plan, data, report_args)
    return found
