"""The PyTorch recipes' validation report and ``metrics.json``: ``train.fit``'s (``train.decide.validation``: tuned
thresholds, exact scores, ``val_predictions.csv``, ``thresholds.json``, ``roc.png``) from the rows every rank
predicted, and which saved model a run predicts with. No TensorFlow here.

    report = validation_report("runs/torch", shards, config, rows, swa=False)   # rows: gather_rows' (ids, p, t)
"""

from __future__ import annotations

import argparse
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from tfpipe.format import schema
from tfpipe.format.shards import Shards, select_folds
from tfpipe.format.tfrecord import read_records
from tfpipe.runtime.console import counted
from tfpipe.runtime.errors import TfpipeError
from train.decide import evaluation
from train.decide.validation import Validated, validation_files
from train.runs import run as run_files
from train.runs.run import RunConfig
from train.torch.run import MODEL, MODEL_SWA, THRESHOLD


def fold_images(shards: Shards, fold: int) -> tuple[list[str], list[str]]:
    """(image names, image digests) of the validation fold's records, in written order (``val_predictions.csv``'s
    rows, as train.fit's report writes them)."""
    names, digests = [], []
    for f in select_folds(shards, [fold], shards).files:
        for record in read_records(f):
            example = schema.decode_example(record)
            name = example.get(schema.IMAGE_NAME, b"")
            names.append(name.decode("utf-8") if isinstance(name, bytes) else str(name))
            digests.append(schema.image_digest(example[schema.IMAGE]))
    return names, digests


def validation_report(
    run: str | None, shards: Shards, config: RunConfig, rows: Sequence[Any], swa: bool = False
) -> Validated:
    """The report of one model's validation ``rows`` (ids sorted, probabilities, targets: ``gather_rows``'), in
    the fold's written order; its files in ``run`` (None: scores only)."""
    ids, probs, targets = rows
    names, digests = fold_images(shards, config.fold or 0)
    if sorted(names) != list(ids):
        raise TfpipeError(
            f"{config.records}: the ranks predicted {counted(len(ids), 'validation image')}, fold {config.fold} "
            f"holds {len(names)} other or more (the shards changed while the job ran?)"
        )
    at = {name: i for i, name in enumerate(ids)}
    order = [at[n] for n in names]
    return validation_files(
        run, names, digests, np.asarray(probs)[order], np.asarray(targets)[order], config.classes,
        single_label=config.single_label, threshold=THRESHOLD, model=MODEL_SWA if swa else MODEL, swa=swa,
    )  # fmt: skip


def model_reports(
    run: str | None, shards: Shards, config: RunConfig, rows: Mapping[bool, Sequence[Any]], swa_epochs: int = 0
) -> tuple[dict[str, Any], dict[bool, Validated]]:
    """The reports of the final model (``rows[False]``) and, where there is one, the SWA model (``rows[True]``,
    averaged over ``swa_epochs``): metrics.json's part of them, as train.fit writes it, and each report."""
    done = {swa: validation_report(run, shards, config, r, swa) for swa, r in rows.items()}
    part: dict[str, Any] = {
        "validation_auc": done[False].scores["roc_auc_macro"],  # the figure under train.fit's metrics.json key
        "report": {"model": MODEL, **done[False].scores},
    }
    if True in done:
        part["swa_validation_auc"] = done[True].scores["roc_auc_macro"]
        part["swa"] = {"model": MODEL_SWA, "epochs_averaged": swa_epochs, "report": done[True].scores}
    return part, done


def run_metrics(
    recipe: str, args: argparse.Namespace, config: RunConfig, ranks: int, counts: tuple[int, int], seconds: float
) -> dict[str, Any]:
    """``metrics.json``'s settings and counts, in train.fit's words (``train.decide.validation.RUN_FIGURES``); the
    reports are added by the caller. ``counts``: (training images, validation images)."""
    return {
        "recipe": recipe,
        "model": args.model,
        "image_size": config.image_size,
        "fold": config.fold,
        "epochs": args.epochs,
        "replicas": ranks,
        "ranks": ranks,  # the same count under its other key, which readers of metrics.json take
        "per_replica_batch_size": args.batch_size,
        "global_batch_size": args.batch_size * ranks,
        "base_lr": args.lr,
        "scaled_lr": args.lr * ranks,
        "train_examples": counts[0],
        "val_examples": counts[1],
        "seconds": seconds,
    }


def described(report: Mapping[str, Any], model: str) -> list[str]:
    """The lines a recipe prints of one model's report: its scores, then its per-class table, each naming the
    model (and its thresholds file) they belong to."""
    auc = report.get("roc_auc_macro")
    shown = "-" if auc is None else f"{auc:.4f}"
    thresholds = run_files.THRESHOLDS if model == MODEL else run_files.swa_name(run_files.THRESHOLDS)
    how = "labels by argmax" if evaluation.is_single_label(report) else f"at the thresholds of {thresholds}"
    rest = evaluation.headline(report, skip=("roc_auc_macro",))
    return [
        f"{model}, 1 view: validation AUC {shown} (exact, macro), {rest}",
        *evaluation.class_table(report, title=f"{model}, 1 view, {how}"),
    ]
