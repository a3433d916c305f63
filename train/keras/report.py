"""What a finished run writes about its validation set: predictions, tuned thresholds and pictures.

    runs/NAME/val_predictions.csv   id, image digest, true labels, predicted labels, one probability per class
    runs/NAME/thresholds.json       per-class thresholds maximising validation F1 (multi-label)
    runs/NAME/learning_curves.png   loss, scores and learning rate per epoch
    runs/NAME/roc.png               per-class validation ROC curves
    runs/NAME/predictions.png       validation images titled true / predicted (blue right, red wrong)

A SWA model writes the same files with a ``-swa`` suffix (no learning curves).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import pandas as pd

import tfpipe
from tfpipe.format.shards import Records
from tfpipe.runtime import fs
from train.decide.evaluation import Report
from train.decide.metrics import Metric
from train.decide.validation import validation_files
from train.keras import plots
from train.prediction.inference import predict_probabilities
from train.prediction.submission import check_ids_once
from train.runs import run as run_files

if TYPE_CHECKING:
    import tensorflow as tf

GRID_IMAGES = 24
# tfpipe.write never writes an id twice: one read twice means a record was copied over another while the job ran
CHANGED = (
    "validation records (a shard changed while this job read it?); nothing of the report counts -- run it again "
    "once the shards are whole"
)


def validation_report(
    model: Any,
    strategy: tf.distribute.Strategy,
    run_dir: str,
    *,
    classes: Sequence[str],
    single_label: bool,
    records: Records,
    folds: Sequence[int] | None,
    image_size: int,
    batch_size: int,
    threshold: float,
    metric: Metric | None = None,
    suffix: str = "",
) -> Report:
    """Predicts the validation records, writes the files above, returns the validation scores of
    ``train.decide.evaluation.score`` (exact, sklearn) at the thresholds used (``train.decide.validation``)."""
    ids = tfpipe.image_names(records, folds)
    check_ids_once(ids, records, CHANGED)  # a record copied over another keeps the count, not the ids
    probs = predict_probabilities(
        model, records, strategy, batch_size=batch_size, image_size=image_size, num_classes=len(classes), folds=folds,
        ids=ids,
    )  # fmt: skip
    targets = tfpipe.read_targets(records, len(classes), folds)
    digests = tfpipe.image_digests(records, folds)  # what train.predict knows these images by, whatever their names
    done = validation_files(
        run_dir, ids, digests, probs, targets, classes, single_label=single_label, threshold=threshold,
        model=run_files.model_files(bool(suffix))[0], swa=bool(suffix), metric=metric,
    )  # fmt: skip
    for note in done.notes:
        print(f"train.fit: thresholds of {run_files.model_files(bool(suffix))[0]}: {note}", flush=True)
    images = next(
        iter(tfpipe.make_dataset(records, GRID_IMAGES, image_size=image_size, folds=folds, num_classes=len(classes)))
    )[0].numpy()
    grid = run_files.path(run_dir, (run_files.swa_name if suffix else str)(run_files.PREDICTIONS_PNG))
    plots.prediction_grid(images, done.truth[:GRID_IMAGES], done.predicted[:GRID_IMAGES], grid)
    return done.scores


def learning_curves(run_dir: str) -> None:
    with fs.open(run_files.path(run_dir, run_files.HISTORY)) as f:
        history = pd.read_csv(f)
    timings = [run_files.IMAGES_PER_SEC, run_files.EPOCH_SECONDS]  # each epoch's speed, not a score to plot
    plots.learning_curves(history.drop(columns=timings, errors="ignore"), run_files.path(run_dir, run_files.CURVES_PNG))
