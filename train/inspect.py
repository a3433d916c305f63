"""Read a run back: what a ``train.fit`` run, a PyTorch recipe's run or a ``train.cv`` folder holds.

    python -m train.inspect runs/demo          # settings, shards, epochs and time, final and SWA scores side by
                                               # side, their per-class tables, thresholds files, the model
                                               # train.predict would use
    python -m train.inspect runs/cv --json     # the same as one JSON object, for scripts

Every score says which model and how many views it belongs to; every file read is validated first (a damaged
one is one line naming it, exit 2: ``train.runs.run_info``). No TensorFlow here: it answers in a second.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import textwrap
from collections.abc import Sequence
from typing import Any

from tfpipe.runtime import fs
from tfpipe.runtime.console import counted
from tfpipe.runtime.errors import ArgumentParser, TfpipeError, run_cli
from train.backends.choice import NAMES as BACKEND_NAMES
from train.decide import evaluation
from train.decide.metrics import run_metric
from train.runs.run_info import folder_info as folder_info  # the --json object, from Python

PROG = "train.inspect"
FIGURES = (  # a multi-label run's
    ("roc_auc_macro", "AUC, macro"),
    ("roc_auc_micro", "AUC, micro"),
    ("exact_match", "exact-match"),
    ("f1_micro", "F1, micro"),
    ("f1_macro", "F1, macro"),
    ("examples", "images"),
)
SINGLE_FIGURES = (  # a single-label run's (its argmax)
    ("roc_auc_macro", "AUC, macro"),
    ("exact_match", "accuracy"),
    ("balanced_accuracy", "balanced acc."),
    ("f1_macro", "F1, macro"),
    ("log_loss", "log-loss"),
    ("examples", "images"),
)
MULTI_ONLY = ("threshold",)  # settings a single-label run has but never uses (its labels are the argmax)
SHOWN_SETTINGS = 24  # scalar settings shown in the text form (--json: all)
HERE = {
    "same": "the folder still holds it",
    "changed": "the folder now holds another dataset",
    "missing": "the folder is gone",
    "unreadable": "the folder holds no readable shards now",
    "not-here": "not found from this folder: the path is relative to where the run was trained",
}
THRESHOLDS_NOW = {
    "same": "at the thresholds of {}",
    "differs": "at the thresholds it was scored at ({} now holds others: edited or copied?)",
    "missing": "at the thresholds it was scored at ({} is missing)",
}


def text_lines(info: dict[str, Any]) -> list[str]:
    """The text form of ``folder_info``'s answer."""
    lines = [*head_lines(info), *score_lines(info)]
    if info["kind"] == "cv":
        lines += fold_lines(info)
    tuned = ", ".join(f"{t['file']} ({t['model']}, {_views(t['views'])})" for t in info["thresholds_files"])
    lines.append(f"thresholds files: {tuned or 'none'}{' (single-label: the argmax)' * info['single_label']}")
    lines += file_lines(info["files"])
    chosen = info["predicts_with"]
    if chosen:
        lines.append(f"{chosen['command']}: {chosen['why']}")
    return lines


def file_lines(record: dict[str, Any]) -> list[str]:
    """``files.json`` against the folder: each file a decision reads as its job wrote it, or what is not."""
    if record["problems"]:
        return ["files not as their job wrote them (predicting refuses them):", *(f"  {p}" for p in record["problems"])]
    if not record["recorded"]:
        return ["files: no record of their digests (a folder of an earlier tfpipe): not checked"]
    return ["files: each as its job wrote it (files.json)"]


def head_lines(info: dict[str, Any]) -> list[str]:
    kind = "a cross-validation" if info["kind"] == "cv" else "a run"
    shards = info["shards"]
    fold = f", fold {shards['fold']} validated" if shards["fold"] is not None else ""
    classes = info["classes"]
    names = ", ".join(classes[:8]) + (", ..." if len(classes) > 8 else "")
    size = f", {info['image_size']} px" if info.get("image_size") else ""
    labels = "single" if info["single_label"] else "multi"
    on = f" ({BACKEND_NAMES.get(info['backend'], info['backend'])})" if info.get("backend") else ""
    lines = [
        f"{info['folder']}: {kind} of {info['trained_by']}{on}, {'finished' if info['finished'] else 'not finished'}",
        f"  {len(classes)} class{'es' * (len(classes) != 1)} ({names}), {labels}-label{size}",
        f"  trained on {shards['records']} (dataset id {shards['dataset_id']}{fold}; {HERE[shards['here']]})",
        *run_lines(info),
    ]
    hidden = ("records", *MULTI_ONLY * info["single_label"])
    scalars = [(k, v) for k, v in info["settings"].items() if not isinstance(v, (dict, list)) and k not in hidden]
    shown = ", ".join(f"{k} {v}" for k, v in scalars[:SHOWN_SETTINGS])
    more = f" (+{len(scalars) - SHOWN_SETTINGS} more: --json)" if len(scalars) > SHOWN_SETTINGS else ""
    return lines + textwrap.wrap(f"settings: {shown}{more}", 116, initial_indent="  ", subsequent_indent="    ")


def run_lines(info: dict[str, Any]) -> list[str]:
    """A run's epochs and time, or how far an unfinished one got and the jobs a signal stopped."""
    if info["kind"] != "run":
        return []
    epochs, stops = info.get("epochs"), info.get("stops") or []
    stopped = "; stopped by " + ", ".join(_stop(s) for s in stops) if stops else ""
    if info["finished"]:
        return [f"  {counted(int(epochs or 0), 'epoch')} in {info.get('seconds')} s{stopped}"]
    planned = info["settings"].get("epochs")
    of = f" of {planned}" if isinstance(planned, int) else ""
    resume = "; train.fit --resume continues it" if info["trained_by"] == "train.fit" else ""
    if info.get("locked"):  # its lock is there: a job may be training it now (or died without removing it)
        resume = "; a job holds the folder (its lock): it may still be training"
    return [f"  {counted(int(epochs or 0), 'epoch')}{of} recorded{stopped}{resume}"]


def _stop(stop: Any) -> str:
    return f"{stop.get('signal')} at {stop.get('at') or 'the end'}" if isinstance(stop, dict) else str(stop)


def score_lines(info: dict[str, Any]) -> list[str]:
    """The models' scores side by side, then each model's per-class table, each naming its model and views."""
    models = info["models"]
    if not models:
        why = "not finished, or trained with --no-report" if info["trained_by"] == "train.fit" else "not finished"
        return [f"no validation report ({why})"]
    where = "out-of-fold, every validation image once" if info["kind"] == "cv" else "the validation fold"
    heads = [f"{m['model']}, {_views(m['views'])}" for m in models]
    width = max(len(h) for h in heads) + 2
    metric = run_metric(info["settings"], info["single_label"])
    lines = [
        f"scores on {where} (exact; decided by {metric.words}, --metric {metric.name}):",
        "  " + " " * 13 + "".join(f"{h:>{width}}" for h in heads),
    ]
    for key, label in SINGLE_FIGURES if info["single_label"] else FIGURES:
        values = [m["scores"].get(key) for m in models]
        lines.append(f"  {label:<13}" + "".join(f"{_figure(v):>{width}}" for v in values))
    for m in models:
        at = THRESHOLDS_NOW[m["thresholds_file"]].format(m["thresholds"]) if m["thresholds"] else ""
        lines += evaluation.class_table(m["scores"], title=f"{m['model']}, {_views(m['views'])}{', ' * bool(at)}{at}")
    return lines


def fold_lines(info: dict[str, Any]) -> list[str]:
    lines = ["folds (each run's own validation fold):"]
    for f in info["folds"]:
        if f["problem"]:
            lines.append(f"  fold {f['fold']}: {f['problem']}")
            continue
        run = f["run_info"]
        report = next(iter(run["models"]), None)
        metric = run_metric(run["settings"], run["single_label"])
        scored = f"{metric.figure(report['scores'])} ({report['model']}, 1 view)" if report else f"{metric.words} -"
        epochs = counted(int(run["epochs"]), "epoch") if run.get("epochs") is not None else "no epochs recorded"
        done = "finished" if f["finished"] else "not finished"
        lines.append(f"  fold {f['fold']}: {f['run']}, {done}, {epochs}, validation {scored}")
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
    if not args.folder.strip():
        raise TfpipeError("the folder is empty (an unset variable?); give a run folder or a CV folder")
    if not fs.exists(args.folder):
        raise TfpipeError(f"{args.folder} does not exist; pass a run folder or a CV folder")
    if not fs.isdir(args.folder):
        raise TfpipeError(f"{args.folder} is a file; pass a run folder or a CV folder")
    info = folder_info(args.folder)
    print(
        json.dumps(finite(info), indent=1, default=str, allow_nan=False) if args.json else "\n".join(text_lines(info))
    )


def finite(value: Any) -> Any:
    """``value`` with every non-finite float (a diverged loss, an edited setting) as None: strict JSON's null."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: finite(v) for k, v in value.items()}
    return [finite(v) for v in value] if isinstance(value, (list, tuple)) else value


def main(argv: Sequence[str] | None = None) -> int:
    return run_cli(PROG, run_command, build_parser().parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
