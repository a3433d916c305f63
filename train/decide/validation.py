"""What a run writes about its validation predictions, with no TensorFlow: one code for ``train.fit``'s report
(``train.keras.report``) and the PyTorch recipes (``train.torch.run``), so that their run folders hold the same files
and their ``metrics.json`` the same figures.

    runs/NAME/val_predictions.csv   id, image digest, true labels, predicted labels, one probability per class
    runs/NAME/thresholds.json       per-class thresholds maximising validation F1 (multi-label)
    runs/NAME/roc.png               per-class validation ROC curves

The SWA model's files carry ``-swa`` (``thresholds-swa.json``): a threshold set belongs to the model whose
predictions it was tuned on.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

import numpy as np
import numpy.typing as npt
import pandas as pd

from tfpipe.runtime import fs
from train.decide import evaluation
from train.decide.metrics import Metric
from train.decide.tuning import Tuned, tune
from train.keras import plots
from train.prediction.submission import label_strings, labels_at
from train.runs import files
from train.runs import run as run_files
from train.runs.thresholds import save_thresholds

# The figures every run's metrics.json holds, train.fit's and the PyTorch recipes' alike (a test compares them):
# "model" the architecture, "report" the exact validation scores of the saved model (with "model" its file).
RUN_FIGURES = (
    "model",
    "image_size",
    "fold",
    "epochs",
    "replicas",
    "per_replica_batch_size",
    "global_batch_size",
    "train_examples",
    "val_examples",
    "seconds",
    "report",
)


class Validated(NamedTuple):
    thresholds: list[float]
    truth: list[str]  # the true labels of each row, space-separated
    predicted: list[str]  # the predicted labels at ``thresholds``
    scores: evaluation.Report  # metrics.json's "report"
    notes: list[str]  # the decisions against tuning a threshold (``train.decide.tuning.Tuned.notes``)


def validation_files(
    run_dir: str | None,
    ids: Sequence[str],
    digests: Sequence[str],
    probs: npt.NDArray[Any],
    targets: npt.NDArray[Any],
    classes: Sequence[str],
    *,
    single_label: bool,
    threshold: float,
    model: str,
    swa: bool = False,
    metric: Metric | None = None,
) -> Validated:
    """Tunes the thresholds on ``probs`` [N, C] (multi-label; ``threshold`` for a class with no positive, and the
    single-label argmax needs none), writes the files above in ``run_dir`` (``swa``: the SWA model's; None: no
    files; each recorded in ``files.json`` as of the file ``model``, one view; thresholds tuned for ``metric``)
    and returns the scores of ``train.decide.evaluation.score`` at those thresholds, in metrics.json's words."""
    from sklearn.metrics import f1_score

    tuned = Tuned([threshold] * len(classes)) if single_label else tune(probs, targets, threshold, metric)
    thresholds = tuned.thresholds
    predicted = labels_at(probs, classes, thresholds, single_label)
    truth = label_strings(targets > 0, classes)
    if run_dir is not None:
        table = pd.DataFrame({"image_name": ids, "image_digest": digests, "true": truth, "predicted": predicted})
        table = pd.concat([table, pd.DataFrame(probs, columns=list(classes))], axis=1)
        named = run_files.swa_name if swa else str  # the SWA model's report files: roc-swa.png, ...
        fs.write_atomic(run_files.path(run_dir, named(run_files.VAL_PREDICTIONS)), table.to_csv(index=False))
        files.record(run_dir, [named(run_files.VAL_PREDICTIONS)], model, 1)
        if not single_label:
            save_thresholds(run_dir, classes, thresholds, model, run_files.SWA_SUFFIX if swa else "")
        plots.roc_curves(targets, probs, classes, run_files.path(run_dir, named(run_files.ROC_PNG)))
    scores = evaluation.score(probs, targets, classes, thresholds, single_label)
    hits = targets > 0
    report = evaluation.Report(
        **scores,
        # metrics.json's own names of two figures, which its readers take: "accuracy" is the exact-match accuracy,
        # "f1_macro_tuned" sklearn's macro F1 over every class (0 for a class nobody has)
        accuracy=scores["exact_match"],
        f1_macro_tuned=None
        if single_label
        else float(f1_score(hits, probs >= np.asarray(thresholds), average="macro", zero_division=0)),
    )
    return Validated(thresholds, truth, predicted, report, tuned.notes(classes, threshold, "validation"))
