"""The run folder and the submission of the PyTorch recipes (``examples/torch_ddp.py``, ``examples/lightning_swa.py``):
the shape of a ``train.fit`` run as far as it fits a PyTorch model, and the same submission CSV as
``train.predict``. No TensorFlow here.

    python examples/torch_ddp.py --records records/demo/train --run runs/torch \\
        --predict records/demo/test --out runs/torch/submission.csv

A run folder holds ``config.json`` (``train.runs.run.RunConfig``: classes, input size, how the images were made
square, the training shards' dataset id, the validation fold, every setting, and ``recipe``), ``model.pt`` (the
model's ``state_dict`` after the last epoch), ``model-swa.pt`` (the averaged weights, where the recipe averages),
train.fit's validation report of each (``val_predictions.csv``, ``thresholds.json``, ``roc.png``; ``-swa`` for the
SWA model's: ``train.torch.report``) and ``metrics.json`` in train.fit's shape. The recipes write it only as a new
or empty folder, or with ``--overwrite`` over a run folder a recipe wrote; the submission goes through
``train.prediction.submission``'s checks, labelled at the thresholds tuned on the validation predictions of the
model that predicts. ``--predict-only`` predicts with a finished run's weights, training nothing.
"""

from __future__ import annotations

import argparse
import io
import json
import os
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from tfpipe.format import schema
from tfpipe.format.sampling import check_sampling_fits
from tfpipe.format.shards import Shards, open_shards
from tfpipe.format.tfrecord import read_records
from tfpipe.runtime import fs
from tfpipe.runtime.errors import TfpipeError, option
from train.decide.choice import (
    RunScores,
    better_model,
    choice_line,
    run_scores,
    same_thresholds,
    scored_thresholds,
)
from train.decide.metrics import DEFAULT, METRICS
from train.prediction.submission import (
    check_submission_columns,
    check_submission_target,
    submission_table,
    write_submission,
)
from train.prediction.written import wrote_it
from train.runs import files
from train.runs import run as run_files
from train.runs.run import RunConfig
from train.runs.thresholds import load_thresholds

MODEL, MODEL_SWA = run_files.TORCH_MODEL, run_files.TORCH_MODEL_SWA
# every file a recipe writes in a run folder: metrics.json first (the mark of a finished run), the report's files
# (train.decide.validation) of both models
WRITTEN = (
    run_files.METRICS,
    run_files.CONFIG,
    run_files.FILES,
    MODEL,
    MODEL_SWA,
    *(
        name(n)
        for n in (run_files.VAL_PREDICTIONS, run_files.THRESHOLDS, run_files.ROC_PNG)
        for name in (str, run_files.swa_name)
    ),
)
AGAIN = "train the run again"
# a class's threshold when no validation image has it (train.torch.report tunes the others, as train.fit does)
THRESHOLD = 0.5


def add_run_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags of a recipe's run folder and submission, in ``train.fit``'s and ``train.predict``'s words."""
    parser.add_argument("--run", help="run folder to save config.json, the model's weights and metrics.json in")
    parser.add_argument(
        "--overwrite", action="store_true", help="replace the run folder a recipe wrote before, and --out's file"
    )
    parser.add_argument("--predict", metavar="RECORDS", help="shard folder to predict after training (a test set)")
    parser.add_argument("--out", default="submission.csv", help="the submission CSV --predict writes")
    parser.add_argument("--probabilities", action="store_true", help="one probability column per class, no labels")
    parser.add_argument(
        "--predict-only",
        action="store_true",
        help="train nothing: predict --predict with the weights of the finished run at --run",
    )


def prepare(recipe: str, args: argparse.Namespace, parser: argparse.ArgumentParser | None = None) -> RunConfig:
    """Before any process starts: the run folder may be written and the shards of ``--predict`` fit the run.
    Returns the run's config (``--predict-only``: the saved run's; ``parser``: the recipe's, whose defaults tell
    the training flags given from those left out)."""
    if args.predict_only:
        return saved_run(args, recipe, parser)
    if not args.records:
        raise TfpipeError(f"{option('records')} names the shard folder to train on (or pass {option('predict_only')})")
    shards = open_shards(args.records)
    config = run_config(recipe, args, shards)
    check_sampling_fits(args.sampling, config.single_label, args.records)
    check_run_folder(args.run, args.overwrite)
    check_predict(config, args, recipe)
    return config


def saved_run(args: argparse.Namespace, prog: str, parser: argparse.ArgumentParser | None = None) -> RunConfig:
    """``--predict-only``: the finished recipe run at ``--run`` (its config, weights and metrics), whose model
    ``args.model`` becomes; ``--predict``'s shards must fit it."""
    if not (args.run and args.predict):
        raise TfpipeError(f"{option('predict_only')} takes {option('run')} (a finished run) and {option('predict')}")
    if not fs.isdir(args.run):
        raise TfpipeError(f"{args.run} is no folder; {option('predict_only')} takes the folder of a finished run")
    if recipe_of(args.run) is None:
        raise TfpipeError(
            f"{args.run}: not a run of a PyTorch recipe (no config.json naming one); train.fit's runs predict with "
            "python -m train.predict"
        )
    if not fs.exists(run_files.path(args.run, run_files.METRICS)):
        raise TfpipeError(f"{args.run}: the run did not finish (no {run_files.METRICS}); train it again")
    config = RunConfig.load(args.run)
    model = config.settings.get("model")
    if not isinstance(model, str) or not model:
        raise TfpipeError(f"{run_files.path(args.run, run_files.CONFIG)}: names no model; the file was edited")
    ignored = ignored_flags(args, config, parser)
    if ignored and os.environ.get("LOCAL_RANK", "0") == "0":  # once a machine (a launcher's ranks each check)
        print(f"{prog}: {option('predict_only')} predicts with the run's model and settings: {ignored} not used")
    args.model, args.records = model, None  # the run's, whatever the command line says
    check_predict(config, args, prog)
    load_saved(args.run, config)  # every file it needs, checked here once: not in every rank, each saying it
    return config


TRAINING_FLAGS = (
    "records",
    "model",
    "fold",
    "epochs",
    "swa_epochs",
    "lr",
    "seed",
)  # what --predict-only takes from the run


def ignored_flags(args: argparse.Namespace, config: RunConfig, parser: argparse.ArgumentParser | None) -> str:
    """The training flags given to ``--predict-only`` (other than their defaults in ``parser``) that differ from
    the run's settings, which decide: ``--model resnet18 (the run's: small-cnn)``; empty when none do."""
    differ = []
    for key in TRAINING_FLAGS:
        given, used = getattr(args, key, None), config.settings.get(key)
        default = parser.get_default(key) if parser is not None else None
        if given is not None and given != default and given != used:
            differ.append(f"--{key.replace('_', '-')} {given} (the run's: {used})")
    return ", ".join(differ)


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
    """Whether ``run/name`` is a submission tfpipe wrote and nobody changed since, or the record an earlier version
    kept beside one (also of one deleted since)."""
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
        # the recipes train every class as its own yes/no (BCE on logits); single-label shards (one class an
        # image) are labelled and scored by the argmax, as train.fit's single-label runs are
        single_label=bool(shards.single_label),
        fit=manifest.image.effective_fit,
        dataset_id=shards.dataset_id,
        fold=args.fold,
        records=args.records,
        settings=dict(settings, recipe=recipe, threshold=THRESHOLD),
        stored_size=shards.image_size,
        label_column=manifest.label_column,  # the submission names its labels column so
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
    check_submission_target(config, test, args.predict, args.out, args.overwrite, prog)
    if test.num_examples == 0:
        raise TfpipeError(f"{args.predict}: no records to predict")
    columns = (test.id_column, not args.probabilities, args.probabilities)
    check_submission_columns(config, written_ids(test), args.predict, columns)
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
    config: RunConfig,
    args: argparse.Namespace,
    test: Shards,
    rows: tuple[Sequence[str], np.ndarray],
    thresholds: Sequence[float] | None,
) -> str:
    """The submission of ``rows`` (ids, each test image once, in any order; probabilities) at ``--out``, in the
    shards' written order, labelled at ``thresholds`` (tuned on the validation predictions of the model that
    predicted, ``THRESHOLD`` for each class where None); returns what to print."""
    ids, probs = rows
    test.check_unchanged()
    order = written_ids(test)
    row = {name: i for i, name in enumerate(ids)}
    if sorted(row) != sorted(order):
        raise TfpipeError(f"{args.predict}: the predictions cover {len(row)} ids, the shards hold {len(order)}")
    probs = probs[[row[name] for name in order]]
    labels_at = None if args.probabilities else list(thresholds or [THRESHOLD] * len(config.classes))
    df = submission_table(probs.astype(np.float32), order, test.id_column, config, labels_at, args.probabilities)
    write_submission(args.out, df.to_csv(index=False), args.overwrite)
    return f"wrote {args.out}: {len(df)} row{'s' * (len(df) != 1)}"


def begin_run(run: str, config: RunConfig) -> None:
    """Starts writing the run folder: an earlier run's files go (``--overwrite``; metrics.json first, the mark of
    a finished run), then ``config.json``, so that a folder with weights always says what they are."""
    fs.makedirs(run)
    for name in WRITTEN:
        if fs.exists(run_files.path(run, name)):
            fs.remove(run_files.path(run, name))
    config.save(run)


def end_run(run: str, weights: Mapping[str, Any], metrics: Mapping[str, Any]) -> None:
    """Ends writing the run folder (after the report's files): ``weights`` maps a file name (``MODEL``,
    ``MODEL_SWA``) to a ``state_dict``, each file whole or absent; ``metrics.json`` last."""
    import torch

    for name, state in weights.items():
        buffer = io.BytesIO()
        torch.save({k: v.detach().cpu() for k, v in state.items()}, buffer)
        fs.write_atomic(run_files.path(run, name), buffer.getvalue())
    files.record(run, list(weights))
    fs.write_atomic(run_files.path(run, run_files.METRICS), json.dumps(dict(metrics), indent=1) + "\n")
    files.record(run, [run_files.METRICS])


def load_weights(run: str, name: str = MODEL) -> dict[str, Any]:
    """A ``state_dict`` a recipe saved (``model.load_state_dict(load_weights(run))``): tensors only; a file that
    is not one is an error naming it."""
    import pickle

    import torch

    p = run_files.path(run, name)
    run_files.check_file(run, name, f"put the run's own {name} back, or {AGAIN}")
    try:
        with fs.open(p, "rb") as f:
            state = torch.load(io.BytesIO(f.read()), weights_only=True)
    except (RuntimeError, pickle.UnpicklingError, EOFError, ValueError, OSError) as e:
        first = (str(e).strip().splitlines() or [type(e).__name__])[0].split(". ")[0][:160]
        raise TfpipeError(
            f"{p}: not weights a recipe saved ({first}); the file is damaged -- train the run again"
        ) from None
    if not isinstance(state, dict):
        raise TfpipeError(
            f"{p}: not a state_dict (a {type(state).__name__}); the file is damaged -- train the run again"
        )
    return dict(state)


# paths (and what only rank 0 writes) and a machine's DataLoader workers (its cores) may differ between machines
PER_MACHINE = ("records", "predict", "run", "out", "overwrite", "workers")


def start_settings(args: argparse.Namespace) -> dict[str, object]:
    """What every rank of a recipe must start with alike (``train.torch.ranks.check_same_start``): its flags as
    written (``--lr``), but for paths, which may differ between machines, in place of which the dataset ids of
    the shards they name count."""
    settings: dict[str, object] = {
        f"--{k.replace('_', '-')}": v for k, v in sorted(vars(args).items()) if k not in PER_MACHINE
    }
    for flag in ("records", "predict"):
        path = getattr(args, flag, None)
        settings[f"the dataset id of --{flag}"] = open_shards(path).dataset_id if path else None
    return settings


def chosen_model(run: str, scores: RunScores | None = None) -> tuple[bool, str]:
    """(swa, the line saying why) for predicting with a saved recipe run: ``model-swa.pt`` when the run has an
    SWA model and its validation AUC beats ``model.pt``'s (metrics.json, or its ``scores`` already read), as
    ``train.predict`` chooses for train.fit's runs. A model metrics.json scores but the folder lacks is an error,
    never the other model."""
    scores = scores or run_scores(run, required=True)
    for name, scored in ((MODEL, True), (MODEL_SWA, scores.has_swa)):
        if scored and not fs.exists(run_files.path(run, name)):
            raise TfpipeError(f"{run}: no {name}, which its metrics.json scores; the run folder lost it (train again)")
    if not scores.has_swa:
        return False, f"predicting with {MODEL} (the run has no SWA model)"
    chosen = better_model(scores.final_report, scores.swa_report, scores.metric)
    return chosen, recipe_choice_line(chosen, scores)


def swa_beats(final_auc: float, swa_auc: float) -> bool:
    """Whether the SWA model's validation AUC beats the final model's (a tie keeps the final one): the recipes
    decide by AUC, train.fit's default ``--metric``."""
    auc = METRICS[DEFAULT]
    return better_model({auc.key: final_auc}, {auc.key: swa_auc}, auc)


def recipe_choice_line(swa: bool, scores: RunScores) -> str:
    """``train.decide.choice.choice_line`` for a recipe's weights (the recipes have no ``--swa`` flag)."""
    final, averaged = scores.final_value, scores.swa_value
    return choice_line(swa, final, averaged, "validation", scores.metric, names=(MODEL, MODEL_SWA), flags=False)


def load_saved(run: str, config: RunConfig) -> tuple[Any, list[float] | None, str]:
    """(the model, its tuned thresholds, the line saying which) of a finished recipe run, for ``--predict-only``:
    the model of ``chosen_model``, its weights loaded (``torch.nn.Module`` on the CPU, in eval mode). A multi-label
    run without the thresholds tuned for that model is an error, never a label at 0.5."""
    from train.torch.models import build_model

    scores = run_scores(run, required=True)  # read once: the choice and the thresholds it was scored at
    swa, line = chosen_model(run, scores)
    remedy = "train the run again (its thresholds are tuned on its own validation predictions)"
    thresholds = load_thresholds(run, config.classes, swa, remedy=remedy)
    if thresholds is None and not config.single_label:
        missing = run_files.path(run, run_files.model_files(swa)[1])
        raise TfpipeError(f"{missing}: missing; the run labels at the thresholds tuned for its model -- {remedy}")
    net = build_model(str(config.settings["model"]), len(config.classes))
    name = MODEL_SWA if swa else MODEL
    try:
        net.load_state_dict(load_weights(run, name))
    except (RuntimeError, KeyError) as e:  # another model's tensors (names or shapes)
        first = str(e).strip().splitlines()[0][:160]
        raise TfpipeError(
            f"{run_files.path(run, name)}: not the weights of the run's {config.settings['model']} ({first})"
        ) from None
    scored = scored_thresholds(scores.report(swa), config.classes)
    if thresholds is not None and not same_thresholds(scored, thresholds):
        file = run_files.model_files(swa)[1]
        line += f"; {file} holds other thresholds than its validation report was scored at (edited?): labelling at them"
    return net.eval(), thresholds, line
