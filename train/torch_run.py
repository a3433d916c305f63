"""The run folder and the submission of the PyTorch recipes (``examples/torch_ddp.py``, ``examples/lightning_swa.py``):
the shape of a ``train.fit`` run as far as it fits a PyTorch model, and the same submission CSV as
``train.predict``. No TensorFlow here.

    python examples/torch_ddp.py --records records/demo/train --run runs/torch \\
        --predict records/demo/test --out runs/torch/submission.csv

A run folder holds ``config.json`` (``train.run.RunConfig``: classes, input size, how the images were made
square, the training shards' dataset id, the validation fold, every setting, and ``recipe``), ``model.pt`` (the
model's ``state_dict`` after the last epoch), ``model-swa.pt`` (the averaged weights, where the recipe averages)
and ``metrics.json`` (the exact validation scores). The recipes write it only as a new or empty folder, or with
``--overwrite`` over a run folder a recipe wrote; the submission goes through ``train.submission``'s checks.
"""

from __future__ import annotations

import argparse
import io
import json
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from tfpipe import fs, schema
from tfpipe.errors import TfpipeError, option
from tfpipe.shards import Shards, open_shards
from tfpipe.tfrecord import read_records
from train import run as run_files
from train.run import RunConfig
from train.submission import (
    check_column_names,
    check_destination,
    check_ids_once,
    check_labels_can_be_joined,
    check_run_fits_records,
    submission_table,
    write_submission,
    wrote_it,
)

MODEL, MODEL_SWA = run_files.TORCH_MODEL, run_files.TORCH_MODEL_SWA
WRITTEN = (run_files.METRICS, run_files.CONFIG, MODEL, MODEL_SWA)  # every file a recipe writes in a run folder
THRESHOLD = 0.5  # a label at this probability or above: the recipes tune no per-class thresholds


def add_run_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags of a recipe's run folder and submission, in ``train.fit``'s and ``train.predict``'s words."""
    parser.add_argument("--run", help="run folder to save config.json, the model's weights and metrics.json in")
    parser.add_argument(
        "--overwrite", action="store_true", help="replace the run folder a recipe wrote before, and --out's file"
    )
    parser.add_argument("--predict", metavar="RECORDS", help="shard folder to predict after training (a test set)")
    parser.add_argument("--out", default="submission.csv", help="the submission CSV --predict writes")
    parser.add_argument("--probabilities", action="store_true", help="one probability column per class, no labels")


def prepare(recipe: str, args: argparse.Namespace) -> RunConfig | None:
    """Before any process starts: the run folder may be written and the shards of ``--predict`` fit the run.
    Returns the run's config (None without ``--run`` and ``--predict``)."""
    if not (args.run or args.predict):
        return None
    config = run_config(recipe, args, open_shards(args.records))
    check_run_folder(args.run, args.overwrite)
    check_predict(config, args, recipe)
    return config


def check_run_folder(run: str | None, overwrite: bool) -> None:
    """Before any training: ``run`` is new or empty, or (with ``overwrite``) a run folder a recipe wrote (beside
    it, only submissions tfpipe wrote and nobody changed since): ``save_run`` replaces its files."""
    if not run:
        return
    if fs.exists(run) and not fs.isdir(run):
        raise TfpipeError(f"{run} is a file; {option('run')} names a folder")
    names = sorted(fs.listdir(run)) if fs.exists(run) else []
    if not names:
        return
    foreign = [n for n in names if not (run_file(run, n) or submission_of(run, n))]
    if foreign or recipe_of(run) is None:
        shown = ", ".join(foreign[:3] or names[:3])
        raise TfpipeError(f"{run} holds what no recipe wrote ({shown}); choose a new or empty {option('run')} folder")
    if not overwrite:
        raise TfpipeError(
            f"{run} already holds a run of {recipe_of(run)}; pass {option('overwrite', True)} to replace it or "
            f"choose another {option('run')} folder"
        )


def run_file(run: str, name: str) -> bool:
    """Whether ``run/name`` is a file a recipe writes: the name, and a file (a folder of that name is not)."""
    return name in WRITTEN and (fs.is_remote(run) or fs.isfile(run_files.path(run, name)))


def submission_of(run: str, name: str) -> bool:
    """Whether ``run/name`` is a submission tfpipe wrote and nobody changed since, or the record of one (also of
    one deleted since)."""
    if name.startswith(".") and name.endswith(".tfpipe"):
        csv = run_files.path(run, name[1 : -len(".tfpipe")])
        return fs.isfile(run_files.path(run, name)) and (not fs.exists(csv) or wrote_it(csv))
    return wrote_it(run_files.path(run, name))


def recipe_of(run: str) -> str | None:
    """The recipe named in ``run/config.json`` (validated as a run's config), None when it names none."""
    if not fs.exists(run_files.path(run, run_files.CONFIG)):
        return None
    return RunConfig.load(run).recipe


def run_config(recipe: str, args: argparse.Namespace, shards: Shards) -> RunConfig:
    """``config.json`` of a recipe's run on ``shards`` (a folder written at one ``--image-size``, with folds)."""
    manifest = shards.manifest
    if manifest is None or not shards.classes:
        raise TfpipeError(f"{args.records}: no manifest.json with classes; a run folder records them")
    if shards.image_size is None:
        raise TfpipeError(
            f"{args.records}: written without {option('image_size')}: the recipes batch images of one size; "
            f"write the shards again with {option('image_size', 224)}"
        )
    settings = {k: v for k, v in vars(args).items() if k not in ("overwrite",)}
    return RunConfig(
        classes=tuple(shards.classes),
        image_size=shards.image_size,
        single_label=False,  # the recipes train every class as its own yes/no (BCE on logits)
        fit=manifest.image.effective_fit,
        dataset_id=shards.dataset_id,
        fold=args.fold,
        records=args.records,
        settings=dict(settings, recipe=recipe, threshold=THRESHOLD),
        stored_size=shards.image_size,
    )


def check_predict(config: RunConfig, args: argparse.Namespace, prog: str) -> Shards | None:
    """Before any training: the shards of ``--predict`` fit the run (classes, size, fit) and hold each id once,
    and ``--out`` may be written. Returns them opened (None without ``--predict``)."""
    if not args.predict:
        return None
    if not args.out:
        raise TfpipeError(f"{option('out')} is empty; it names the submission CSV {option('predict')} writes")
    test = open_shards(args.predict)
    if test.manifest is None:  # files without one claim no classes or size to check against the run
        raise TfpipeError(
            f"{args.predict}: no manifest.json; {option('predict')} takes a shard folder written by tfpipe.write"
        )
    check_run_fits_records(config, test, args.predict, prog)
    if test.num_examples == 0:
        raise TfpipeError(f"{args.predict}: no records to predict")
    check_destination(args.out, args.overwrite)
    labels = not args.probabilities
    if labels:
        check_labels_can_be_joined(config.classes, config.single_label)
    check_column_names(test.id_column, config.classes, labels, args.probabilities)
    check_ids_once(written_ids(test), args.predict)
    return test


def written_ids(shards: Shards) -> list[str]:
    """Every record's ``image_name`` in written order (the rows' order in ``train.predict``'s submission)."""
    ids = []
    for f in shards.files:
        for record in read_records(f):
            name = schema.decode_example(record).get(schema.IMAGE_NAME, b"")
            ids.append(name.decode("utf-8") if isinstance(name, bytes) else str(name))
    return ids


def write_predictions(
    config: RunConfig, args: argparse.Namespace, test: Shards, ids: Sequence[str], probs: np.ndarray
) -> str:
    """The submission of ``probs`` (rows of ``ids``, each test image once, in any order) at ``--out``, its rows in
    the shards' written order; returns what to print."""
    test.check_unchanged()
    order = written_ids(test)
    row = {name: i for i, name in enumerate(ids)}
    if sorted(row) != sorted(order):
        raise TfpipeError(f"{args.predict}: the predictions cover {len(row)} ids, the shards hold {len(order)}")
    probs = probs[[row[name] for name in order]]
    thresholds = None if args.probabilities else [THRESHOLD] * len(config.classes)
    df = submission_table(probs.astype(np.float32), order, test.id_column, config, thresholds, args.probabilities)
    write_submission(args.out, df.to_csv(index=False), args.overwrite)
    return f"wrote {args.out}: {len(df)} row{'s' * (len(df) != 1)}"


def save_run(run: str, config: RunConfig, weights: Mapping[str, Any], metrics: Mapping[str, Any]) -> None:
    """Writes the run folder: ``weights`` maps a file name (``MODEL``, ``MODEL_SWA``) to a ``state_dict``, each
    file whole or absent; ``config.json`` first, so that a folder with weights always says what they are."""
    import torch

    fs.makedirs(run)
    for name in WRITTEN:  # an earlier run's (--overwrite): metrics.json first, the mark of a finished run
        if fs.exists(run_files.path(run, name)):
            fs.remove(run_files.path(run, name))
    config.save(run)
    for name, state in weights.items():
        buffer = io.BytesIO()
        torch.save({k: v.detach().cpu() for k, v in state.items()}, buffer)
        fs.write_atomic(run_files.path(run, name), buffer.getvalue())
    fs.write_atomic(run_files.path(run, run_files.METRICS), json.dumps(dict(metrics), indent=1) + "\n")


def load_weights(run: str, name: str = MODEL) -> dict[str, Any]:
    """A ``state_dict`` a recipe saved (``model.load_state_dict(load_weights(run))``): tensors only."""
    import torch

    with fs.open(run_files.path(run, name), "rb") as f:
        return dict(torch.load(io.BytesIO(f.read()), weights_only=True))


# paths (and what only rank 0 writes) and a machine's DataLoader workers (its cores) may differ between machines
PER_MACHINE = ("records", "predict", "run", "out", "overwrite", "workers")


def start_settings(args: argparse.Namespace) -> dict[str, object]:
    """What every rank of a recipe must start with alike (``tfpipe.ranks.check_same_start``): its flags as
    written (``--lr``), but for paths, which may differ between machines, in place of which the dataset ids of
    the shards they name count."""
    settings: dict[str, object] = {
        f"--{k.replace('_', '-')}": v for k, v in sorted(vars(args).items()) if k not in PER_MACHINE
    }
    for flag in ("records", "predict"):
        path = getattr(args, flag, None)
        settings[f"the dataset id of --{flag}"] = open_shards(path).dataset_id if path else None
    return settings
