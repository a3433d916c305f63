"""Read a run back: what a ``train.fit`` run, a PyTorch recipe's run or a ``train.cv`` folder holds.

    python -m train.inspect runs/demo          # settings, shards, epochs and time, final and SWA scores side by
                                               # side, their per-class tables, thresholds files, the model
                                               # train.predict would use
    python -m train.inspect runs/cv --json     # the same as one JSON object, for scripts

Every score says which model and how many views it belongs to; every file read is validated first (a damaged
one is one line naming it, exit 2). No TensorFlow here: it answers in a second.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import textwrap
from collections.abc import Sequence
from typing import Any

from tfpipe import fs
from tfpipe.console import counted
from tfpipe.errors import ArgumentParser, TfpipeError, check_path, run_cli
from tfpipe.shards import open_shards
from train import evaluation
from train import run as run_files
from train.cv_folder import CVResult, fold_run, is_cv_folder
from train.run import RunConfig

PROG = "train.inspect"
FIGURES: tuple[tuple[str, str], ...] = (("roc_auc_macro", "AUC, macro"), ("roc_auc_micro", "AUC, micro"))
FIGURES += (
    ("exact_match", "exact-match"),
    ("f1_micro", "F1, micro"),
    ("f1_macro", "F1, macro"),
    ("examples", "images"),
)
THRESHOLDS_FILE = re.compile(r"^thresholds(?P<swa>-swa)?(?:-tta(?P<views>[2-8]))?\.json$")
ROW = ("positives", "roc_auc", "f1", "precision", "recall", "threshold")  # a class table row's figures
SHOWN_SETTINGS = 24  # scalar settings shown in the text form (--json: all)


def inspect_folder(folder: str) -> dict[str, Any]:
    """What ``folder`` (a run or a CV folder) holds, as ``--json`` prints it."""
    return inspect_cv(folder) if is_cv_folder(folder) else inspect_run(folder)


def inspect_run(run: str) -> dict[str, Any]:
    """A run folder of train.fit or of a PyTorch recipe: its config, metrics, thresholds files and the model
    train.predict (a recipe: ``--predict-only``) would use."""
    if not fs.exists(run_files.path(run, run_files.CONFIG)):
        raise TfpipeError(f"{run}: no {run_files.CONFIG}; not a run folder (train.fit --run) or a CV folder (train.cv)")
    config = RunConfig.load(run)
    where = run_files.path(run, run_files.METRICS)
    metrics = _checked(read_metrics(run), where)
    models = [m for m in (_model(metrics, False, config, where), _model(metrics, True, config, where)) if m]
    return {
        "folder": run,
        "kind": "run",
        "trained_by": config.recipe or "train.fit",
        "finished": bool(metrics) and _finished(run, config),
        "classes": list(config.classes),
        "image_size": config.image_size,
        "single_label": config.single_label,
        "shards": shards_info(config.records, config.dataset_id, config.fold),
        "settings": config.settings,
        "epochs": metrics.get("epochs"),
        "seconds": metrics.get("seconds"),
        "stops": metrics.get("stops", []),
        "models": models,
        "thresholds_files": thresholds_files(run, config.recipe),
        "predicts_with": predicts_with(run, config) if metrics else None,
    }


def read_metrics(run: str) -> dict[str, Any]:
    """``metrics.json`` of a run (empty when the run did not finish), an object or an error naming it."""
    p = run_files.path(run, run_files.METRICS)
    if not fs.exists(p):
        return {}
    metrics = fs.read_json(p, "run file")
    if not isinstance(metrics, dict):
        raise TfpipeError(f"{p}: expected an object of the run's figures; the file was edited or damaged")
    return metrics


def _finished(run: str, config: RunConfig) -> bool:
    """A recipe's run is finished once it has metrics.json; train.fit's once its state says so."""
    return config.recipe is not None or bool(run_files.read_state(run).get("finished"))


def _model(metrics: dict[str, Any], swa: bool, config: RunConfig, where: str) -> dict[str, Any] | None:
    """One model's entry: its file, views, thresholds file and validation report (None when it has none)."""
    part = metrics.get("swa") if swa else metrics
    report = part.get("report") if isinstance(part, dict) else None
    if report is None:
        return None
    if not _valid_report(report):
        raise TfpipeError(f"{where}: the {'SWA model' if swa else 'final model'}'s report is damaged")
    names = (run_files.TORCH_MODEL_SWA if swa else run_files.TORCH_MODEL) if config.recipe else None
    model, thresholds = run_files.model_files(swa)
    return {
        "model": names or model,
        "views": 1,
        "thresholds": None if config.single_label else thresholds,
        "scores": report,
    }


def _valid_report(report: Any) -> bool:
    """A report as train.validation writes it: numbers (or null) for the figures, a class table of them."""
    if not isinstance(report, dict) or not isinstance(report.get("per_class"), dict):
        return False
    rows = list(report["per_class"].values())
    figures = [report.get(k) for k, _ in FIGURES] + [r.get(k) for r in rows if isinstance(r, dict) for k in ROW]
    return all(isinstance(r, dict) for r in rows) and all(_number_or_none(v) for v in figures)


def _number_or_none(v: Any) -> bool:
    return v is None or (isinstance(v, (int, float)) and not isinstance(v, bool))


def _checked(metrics: dict[str, Any], where: str) -> dict[str, Any]:
    """``metrics.json``'s run figures this command shows: counts and seconds as numbers, stops as a list."""
    for key in ("epochs", "seconds"):
        if not _number_or_none(metrics.get(key)):
            raise TfpipeError(f"{where}: {key!r} is {metrics.get(key)!r}, not a number; the file was edited or damaged")
    if not isinstance(metrics.get("stops", []), list):
        raise TfpipeError(f"{where}: 'stops' is not a list; the file was edited or damaged")
    return metrics


def shards_info(records: str, dataset_id: str | None, fold: int | None) -> dict[str, Any]:
    """Where the run's shards were and whether they still hold the same dataset (``here``: same, changed,
    missing, unknown)."""
    here = "unknown"
    try:
        found = open_shards(records).dataset_id if fs.exists(records) else None
        here = "missing" if found is None else ("same" if found == dataset_id else "changed")
    except TfpipeError:
        here = "missing"
    return {"records": records, "dataset_id": dataset_id, "fold": fold, "here": here}


def thresholds_files(folder: str, recipe: str | None = None) -> list[dict[str, Any]]:
    """Every thresholds file in ``folder``, with the model and the views it was tuned for."""
    found = []
    for name in sorted(fs.listdir(folder)):
        m = THRESHOLDS_FILE.match(name)
        if m:
            swa = bool(m["swa"])
            model = (run_files.TORCH_MODEL_SWA if swa else run_files.TORCH_MODEL) if recipe else None
            found.append({"file": name, "model": model or run_files.model_files(swa)[0], "views": int(m["views"] or 1)})
    return found


def predicts_with(run: str, config: RunConfig) -> dict[str, Any]:
    """The model train.predict (a recipe: ``--predict-only``) uses by default, and why."""
    if config.recipe:
        from train.torch_report import chosen_model

        swa, why = chosen_model(run)
        model = run_files.TORCH_MODEL_SWA if swa else run_files.TORCH_MODEL
        return {"model": model, "why": why, "command": f"python examples/{config.recipe}.py --predict-only"}
    from train.tuning import run_choice

    swa, line = run_choice(run, None)
    model = run_files.model_files(swa)[0]
    return {"model": model, "why": line or f"predicting with {model}", "command": "python -m train.predict"}


def inspect_cv(cv: str) -> dict[str, Any]:
    """A CV folder: its plan, its out-of-fold scores of each model, each fold's run, the thresholds files and
    the models train.predict uses."""
    result = CVResult.load(cv)
    folds = []
    for k in result.folds:
        run = fold_run(cv, k)
        info = inspect_run(run) if fs.exists(run_files.path(run, run_files.CONFIG)) else None
        folds.append({"fold": k, "run": run, "finished": bool(info and info["finished"]), "run_info": info})
    models = [
        {"model": m.model, "views": m.views, "thresholds": m.thresholds, "scores": m.scores, "spread": m.spread()}
        for m in result.models
    ]
    return {
        "folder": cv,
        "kind": "cv",
        "trained_by": "train.cv",
        "finished": result.finished,
        "classes": list(result.classes),
        "single_label": result.single_label,
        "shards": shards_info(result.records, result.dataset_id, None),
        "settings": result.settings,
        "folds": folds,
        "models": models,
        "thresholds_files": thresholds_files(cv),
        "predicts_with": {
            "model": f"the mean of {counted(len(result.folds), 'fold model')} ({result.submits} each)",
            "why": f"predicting with the mean of the {len(result.folds)} fold models, {result.submits} each: the "
            "better out-of-fold AUC (cv.json)",
            "command": "python -m train.predict",
        }
        if result.submits
        else None,
    }


def text_lines(info: dict[str, Any]) -> list[str]:
    """The text form of ``inspect_folder``'s answer."""
    lines = [*head_lines(info), *score_lines(info)]
    if info["kind"] == "cv":
        lines += fold_lines(info)
    tuned = ", ".join(f"{t['file']} ({t['model']}, {_views(t['views'])})" for t in info["thresholds_files"])
    lines.append(f"thresholds files: {tuned or 'none (single-label: the argmax)'}")
    chosen = info["predicts_with"]
    if chosen:
        lines.append(f"{chosen['command']}: {chosen['why']}")
    return lines


def head_lines(info: dict[str, Any]) -> list[str]:
    kind = "a cross-validation" if info["kind"] == "cv" else "a run"
    state = "finished" if info["finished"] else "not finished"
    shards = info["shards"]
    still = {"same": "the folder still holds it", "changed": "the folder now holds another dataset"}
    where = still.get(shards["here"], "the folder is gone")
    fold = f", fold {shards['fold']} validated" if shards["fold"] is not None else ""
    classes = info["classes"]
    names = ", ".join(classes[:8]) + (", ..." if len(classes) > 8 else "")
    size = f", {info['image_size']} px" if info.get("image_size") else ""
    labels = "single" if info["single_label"] else "multi"
    lines = [
        f"{info['folder']}: {kind} of {info['trained_by']}, {state}",
        f"  {len(classes)} class{'es' * (len(classes) != 1)} ({names}), {labels}-label{size}",
        f"  trained on {shards['records']} (dataset id {shards['dataset_id']}{fold}; {where})",
    ]
    if info.get("epochs") is not None:
        stops = info.get("stops") or []
        stopped = f"; {counted(len(stops), 'job')} stopped by a signal and resumed" if stops else ""
        lines.append(f"  {counted(int(info['epochs']), 'epoch')} in {info.get('seconds')} s{stopped}")
    scalars = [(k, v) for k, v in info["settings"].items() if not isinstance(v, (dict, list)) and k != "records"]
    shown = ", ".join(f"{k} {v}" for k, v in scalars[:SHOWN_SETTINGS])
    more = f" (+{len(scalars) - SHOWN_SETTINGS} more: --json)" if len(scalars) > SHOWN_SETTINGS else ""
    lines += textwrap.wrap(f"settings: {shown}{more}", 116, initial_indent="  ", subsequent_indent="    ")
    return lines


def score_lines(info: dict[str, Any]) -> list[str]:
    """The models' scores side by side, then each model's per-class table, each naming its model and views."""
    models = info["models"]
    if not models:
        return ["no validation report (trained with --no-report, not finished, or by tfpipe 1.0)"]
    where = "out-of-fold, every validation image once" if info["kind"] == "cv" else "the validation fold"
    heads = [f"{m['model']}, {_views(m['views'])}" for m in models]
    width = max(len(h) for h in heads) + 2
    lines = [f"scores on {where} (exact):", "  " + " " * 12 + "".join(f"{h:>{width}}" for h in heads)]
    for key, label in FIGURES:
        values = [m["scores"].get(key) for m in models]
        lines.append(f"  {label:<12}" + "".join(f"{_figure(v):>{width}}" for v in values))
    for m in models:
        at = f", at the thresholds of {m['thresholds']}" if m["thresholds"] else ""
        title = f"{m['model']}, {_views(m['views'])}{at}"
        lines += evaluation.class_table(m["scores"], title=title)
    return lines


def fold_lines(info: dict[str, Any]) -> list[str]:
    lines = ["folds:"]
    for f in info["folds"]:
        run = f["run_info"] or {}
        report = next(iter(run.get("models") or []), None)
        auc = _figure(report["scores"].get("roc_auc_macro")) if report else "-"
        epochs = counted(int(run["epochs"]), "epoch") if run.get("epochs") is not None else "no epochs recorded"
        done = "finished" if f["finished"] else "not finished"
        lines.append(f"  fold {f['fold']}: {f['run']}, {done}, {epochs}, validation AUC {auc}")
    return lines


def _views(n: int) -> str:
    return f"{n} {'TTA views' if n > 1 else 'view'}"


def _figure(v: Any) -> str:
    if isinstance(v, bool) or v is None:
        return "-"
    return str(v) if isinstance(v, int) else (f"{v:.4f}" if isinstance(v, float) else "?")


def build_parser() -> ArgumentParser:
    p = ArgumentParser(prog=PROG, description="Show what a run folder or a CV folder holds.")
    p.add_argument("folder", help="a run folder (train.fit --run, a recipe's --run) or a CV folder (train.cv --run)")
    p.add_argument("--json", action="store_true", help="one JSON object, for scripts")
    return p


def run_command(args: argparse.Namespace) -> None:
    check_path(folder=args.folder)
    if not fs.isdir(args.folder):
        raise TfpipeError(f"{args.folder} is no folder; pass a run folder or a CV folder")
    info = inspect_folder(args.folder)
    print(json.dumps(info, indent=1, default=str) if args.json else "\n".join(text_lines(info)))


def main(argv: Sequence[str] | None = None) -> int:
    return run_cli(PROG, run_command, build_parser().parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
