"""Cross-validate: train every fold of the shards in turn, score the out-of-fold predictions, tune thresholds on them.

    python -m train.cv --records records/demo/train --run runs/cv --strategy cpu --replicas 8 \
        --model small-cnn --epochs 4 [--fold 0,1,2] [--tta 2]

Takes every flag of ``train.fit``; ``--fold`` names the validation folds to train a run for (default: all).
``CV_DIR/fold-K`` is a normal run folder for each fold (``train.predict --run CV_DIR/fold-K`` works on it);
``CV_DIR/oof.csv`` holds every validation image once, predicted by the model of the fold it validated in;
``CV_DIR/cv.json`` the OOF scores (AUC, exact-match, F1 at thresholds tuned on the OOF predictions,
``thresholds.json``) and each fold's. ``--resume`` continues with the unfinished fold. Then
``python -m train.predict --run CV_DIR ...`` predicts with the fold ensemble. This module is the command line
and imports no TensorFlow; ``cross_validate`` runs the engine in ``train.crossval.engine``.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING

from tfpipe.runtime.console import counted, quiet_call
from tfpipe.runtime.errors import ArgumentParser, TfpipeError, option, run_cli
from train.fit import build_parser as fit_parser
from train.fit import config_from_args, start
from train.keras.config import FitConfig
from train.keras.names import TTA_VIEW_COUNT
from train.runs.cv_folder import oof_name
from train.runs.results import WorkerResult

if TYPE_CHECKING:
    from train.runs.cv_folder import CVResult


@quiet_call
def cross_validate(cfg: FitConfig, folds: Sequence[int] | None = None, tta: int = 1) -> CVResult | WorkerResult:
    """Trains ``folds`` (default: every fold the shards have) with the settings of ``cfg`` (a ``FitConfig``,
    ``cfg.run`` the CV folder, ``cfg.fold`` left out) one after another in this process, then scores the
    out-of-fold predictions over ``tta`` views; returns ``cv.json``'s content, a ``CVResult``
    (``result.scores_of(swa=False).scores["roc_auc_macro"]``: the OOF AUC). On a JAX cluster
    (``strategy="multiworker"``, ``backend="jax"``) every process runs the same call, and the processes other
    than 0 get a ``WorkerResult``: process 0 writes the CV folder.

    Example (a notebook: the Kaggle TPU notebooks' K-fold loop)::

        from train.cv import FitConfig, cross_validate
        result = cross_validate(FitConfig(records="gs://bucket/train", run="gs://bucket/cv", strategy="tpu"))
    """
    shards, choice = start(cfg)  # every fold is planned from these shards (their dataset id in cv.json)
    from train.crossval import engine as cross_validation  # the engine (Keras): imported when training starts

    return cross_validation.cross_validate(cfg, folds, tta, choice, shards)


def build_parser() -> ArgumentParser:
    p = fit_parser("python -m train.cv", (__doc__ or "").split("\n\n")[0])
    fold = next(a for a in p._actions if "--fold" in a.option_strings)  # train.fit's: one validation fold
    fold.type, fold.metavar = _fold_list, "K,K,..."
    fold.help = "the validation folds to train a run for, one after another, e.g. 0,1,2 (default: every fold)"
    group = p.add_argument_group("cross-validation")
    group.add_argument(
        "--tta",
        type=int,
        default=1,
        help=f"TTA views of the out-of-fold predictions scored and tuned on (1..{TTA_VIEW_COUNT})",
    )
    return p


def _fold_list(text: str) -> list[int]:
    """``0,2,3`` -> [0, 2, 3]."""
    try:
        return [int(x) for x in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"fold numbers separated by commas (e.g. 0,1,2), not {text!r}") from None


def run_command(args: argparse.Namespace) -> None:
    if args.records is None:
        raise TfpipeError(f"{option('records')} names the shard folder to cross-validate (written with --num-folds)")
    folds, args.fold = args.fold, None  # the CV's folds; each fold's run gets its own
    cfg = config_from_args(args)
    result = cross_validate(cfg, folds, args.tta)
    if isinstance(result, WorkerResult):  # a JAX cluster's other processes: process 0 prints the scores
        print(f"train.cv: {result.task} done; {result.chief_task}, the chief, writes the CV", flush=True)
        return
    print(
        f"train.cv: {counted(len(result.folds), 'fold')} -> {cfg.run} (cv.json, {oof_name(False, result.tta)}); "
        f"predict with the fold ensemble: python -m train.predict --run {cfg.run} --records ...",
        flush=True,
    )


def main(argv: Sequence[str] | None = None) -> int:
    return run_cli("train.cv", run_command, build_parser().parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
