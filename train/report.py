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

import numpy as np
import pandas as pd

import tfpipe
from tfpipe import fs
from tfpipe.shards import Records
from train import evaluation, plots
from train import run as run_files
from train.inference import predict_probabilities
from train.submission import check_ids_once, label_strings, labels_at
from train.tuning import tune_thresholds

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
    suffix: str = "",
) -> dict[str, Any]:
    """Predicts the validation records, writes the files above, returns the validation scores of
    ``train.evaluation.score`` (exact, sklearn) at the thresholds used."""
    from sklearn.metrics import f1_score

    ids = tfpipe.image_names(records, folds)
    check_ids_once(ids, records, CHANGED)  # a record copied over another keeps the count, not the ids
    probs = predict_probabilities(
        model, records, strategy, batch_size=batch_size, image_size=image_size, num_classes=len(classes), folds=folds,
        ids=ids,
    )  # fmt: skip
    targets = tfpipe.read_targets(records, len(classes), folds)
    thresholds = [threshold] * len(classes) if single_label else tune_thresholds(probs, targets, threshold)
    predicted = labels_at(probs, classes, thresholds, single_label)
    truth = label_strings(targets > 0, classes)
    digests = tfpipe.image_digests(records, folds)  # what train.predict knows these images by, whatever their names
    table = pd.DataFrame({"image_name": ids, "image_digest": digests, "true": truth, "predicted": predicted})
    table = pd.concat([table, pd.DataFrame(probs, columns=classes)], axis=1)
    named = run_files.swa_name if suffix else str  # the SWA model's report files: roc-swa.png, ...
    fs.write_atomic(run_files.path(run_dir, named(run_files.VAL_PREDICTIONS)), table.to_csv(index=False))
    if not single_label:
        run_files.save_thresholds(run_dir, classes, thresholds, suffix)
    plots.roc_curves(targets, probs, classes, run_files.path(run_dir, named(run_files.ROC_PNG)))
    images = next(
        iter(tfpipe.make_dataset(records, GRID_IMAGES, image_size=image_size, folds=folds, num_classes=len(classes)))
    )[0].numpy()
    grid = run_files.path(run_dir, named(run_files.PREDICTIONS_PNG))
    plots.prediction_grid(images, truth[:GRID_IMAGES], predicted[:GRID_IMAGES], grid)
    scores = evaluation.score(probs, targets, classes, thresholds, single_label)
    hits = targets > 0
    return {
        **scores,
        # the names of tfpipe 1.0's metrics.json, kept: "accuracy" is the exact-match accuracy (null before for
        # multi-label runs), "f1_macro_tuned" sklearn's macro F1 over every class (0 for a class nobody has)
        "accuracy": scores["exact_match"],
        "f1_macro_tuned": None
        if single_label
        else float(f1_score(hits, probs >= np.asarray(thresholds), average="macro", zero_division=0)),
    }


def learning_curves(run_dir: str) -> None:
    with fs.open(run_files.path(run_dir, run_files.HISTORY)) as f:
        history = pd.read_csv(f)
    timings = [run_files.IMAGES_PER_SEC, run_files.EPOCH_SECONDS]  # each epoch's speed, not a score to plot
    plots.learning_curves(history.drop(columns=timings, errors="ignore"), run_files.path(run_dir, run_files.CURVES_PNG))
