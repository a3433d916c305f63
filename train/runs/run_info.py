"""What a run folder or a CV folder holds, read back and validated: the JSON form ``python -m train.inspect``
prints (``--json``) and renders as text. No TensorFlow here.

    info = folder_info("runs/demo")      # info["models"][0]["scores"]["roc_auc_macro"], info["predicts_with"], ...

Every file read is input: a damaged one is a ``TfpipeError`` naming it and what is wrong, and what the files
say of each other is checked too (a thresholds file against the scores made at it, a fold's run against its CV).
"""

from __future__ import annotations

import re
from typing import Any

from tfpipe.format.manifest import MANIFEST
from tfpipe.format.shards import open_shards
from tfpipe.runtime import fs
from tfpipe.runtime.console import counted
from tfpipe.runtime.errors import TfpipeError
from tfpipe.runtime.locks import LOCK
from train.decide.choice import run_choice, thresholds_state
from train.decide.evaluation import is_count, is_number, scores_problem
from train.keras.names import STRATEGIES
from train.runs import files
from train.runs import run as run_files
from train.runs.cv_folder import CVResult, checked_fold_run, fold_run, is_cv_folder
from train.runs.run import RunConfig

THRESHOLDS_FILE = re.compile(r"^thresholds(?P<swa>-swa)?(?:-tta(?P<views>[2-8]))?\.json$")


def folder_info(folder: str) -> dict[str, Any]:
    """What ``folder`` (a run or a CV folder) holds, as ``--json`` prints it."""
    if is_cv_folder(folder):
        return cv_info(folder)
    if not fs.exists(run_files.path(folder, run_files.CONFIG)):
        shards = " (it holds shards: read them with python -m tfpipe.inspect)" if _has(folder, MANIFEST) else ""
        raise TfpipeError(
            f"{folder}: no {run_files.CONFIG}; not a run folder (train.fit --run, a recipe's --run) or a CV folder "
            f"(train.cv --run){shards}"
        )
    return run_info(folder)


def run_info(run: str) -> dict[str, Any]:
    """A run folder of train.fit or of a PyTorch recipe: its config, metrics (or, unfinished, its history and
    stops), each model's report checked against its thresholds file, and the model predicting would use."""
    config = RunConfig.load(run)
    where = run_files.path(run, run_files.METRICS)
    metrics = _checked(read_metrics(run), where)
    check_trained_by(run, config, metrics)
    models = [m for m in (_model(run, metrics, swa, config, where) for swa in (False, True)) if m]
    finished = bool(metrics) and _finished(run, config)
    progress = {} if metrics else _progress(run)
    locked = not finished and _has(run, LOCK)  # a job holds the folder: perhaps still training
    info = {
        "folder": run,
        "kind": "run",
        "trained_by": config.recipe or "train.fit",
        "backend": None if config.recipe else config.settings.get("backend", "tf"),  # tf when not recorded
        "finished": finished,
        "classes": list(config.classes),
        "image_size": config.image_size,
        "single_label": config.single_label,
        "shards": shards_info(config.records, config.dataset_id, config.fold),
        "settings": shown_settings(config.settings, metrics),
        "epochs": metrics.get("epochs", progress.get("epochs")),
        "seconds": metrics.get("seconds"),
        "stops": metrics.get("stops", progress.get("stops", [])),
        "models": models,
        "thresholds_files": thresholds_files(run, config.recipe),
        "files": recorded_files(run, finished),
    }
    chosen = predicts_with(run, config, models) if finished else None
    return dict(info, locked=locked, predicts_with=refused_by_record(chosen, info["files"]))


def shown_settings(settings: dict[str, Any], metrics: dict[str, Any]) -> dict[str, Any]:
    """``config.json``'s settings as they are shown: a strategy that an earlier tfpipe recorded by its Python class
    name (``JaxDevices``, ``MirroredStrategy``: a strategy object given, each fold of ``train.cv``) is shown as the
    strategy name ``metrics.json`` records for the devices (tpu, gpu, cpu); any other value as it is."""
    strategy, kind = settings.get("strategy"), metrics.get("strategy")
    a_class = isinstance(strategy, str) and strategy.endswith(("Strategy", "Devices")) and strategy not in STRATEGIES
    return dict(settings, strategy=kind) if a_class and isinstance(kind, str) and kind in STRATEGIES else settings


def recorded_files(folder: str, finished: bool) -> dict[str, Any]:
    """``files.json`` checked against the folder (``train.runs.files``): ``recorded`` (false: a folder with no
    files.json, its files unchecked) and ``problems``, a line for each file not as recorded (gone, once finished)."""
    if files.read(folder) is None:
        return {
            "recorded": False,
            "problems": [f"{files.FILES}: missing"] * (finished and run_files.keeps_record(folder)),
        }
    return {"recorded": True, "problems": files.problems(folder, missing=finished)}


def refused_by_record(chosen: dict[str, Any] | None, record: dict[str, Any]) -> dict[str, Any] | None:
    """What predicting would do, once a file not as recorded is known: refused, naming the first."""
    if chosen is None or not record["problems"]:
        return chosen
    return dict(chosen, why=f"{chosen['why']}; but it refuses the folder: {record['problems'][0]}")


def read_metrics(run: str) -> dict[str, Any]:
    """``metrics.json`` of a run (empty when the run did not finish), an object or an error naming it."""
    p = run_files.path(run, run_files.METRICS)
    if not fs.exists(p):
        return {}
    metrics = fs.read_json(p, "run file")
    if not isinstance(metrics, dict):
        raise TfpipeError(f"{p}: expected an object of the run's figures; the file was edited or damaged")
    return metrics


def check_trained_by(run: str, config: RunConfig, metrics: dict[str, Any]) -> None:
    """config.json's recipe (none: train.fit) agrees with the weights in the folder and with metrics.json."""
    said = metrics.get("recipe")
    if "recipe" in metrics and said != config.recipe:
        raise TfpipeError(
            f"{run}: config.json names {config.recipe or 'no recipe (train.fit)'}, metrics.json {said!r}; one of "
            "them was edited"
        )
    torch_only = _has(run, run_files.TORCH_MODEL) and not _has(run, run_files.MODEL)
    if config.recipe is None and torch_only:
        raise TfpipeError(
            f"{run}: config.json names no recipe (a train.fit run), but the folder holds {run_files.TORCH_MODEL} "
            "and no model.keras; config.json was edited"
        )


def _has(folder: str, name: str) -> bool:
    return fs.exists(run_files.path(folder, name))


def _finished(run: str, config: RunConfig) -> bool:
    """A recipe's run is finished once it has metrics.json; train.fit's once its state says so."""
    return config.recipe is not None or bool(run_files.read_state(run).get("finished"))


def _progress(run: str) -> dict[str, Any]:
    """An unfinished train.fit run's epochs done (history.csv) and the jobs a signal stopped (state.json)."""
    history = run_files.read_history(run) if _has(run, run_files.HISTORY) else None
    return {"epochs": len(history or []), "stops": run_files.read_state(run).get("stops", [])}


def _model(run: str, metrics: dict[str, Any], swa: bool, config: RunConfig, where: str) -> dict[str, Any] | None:
    """One model's entry: its file, views, report and thresholds file (None when it has no report), the file
    compared with the thresholds the report was scored at (``thresholds_file``: same, differs or missing)."""
    part = metrics.get("swa") if swa else metrics
    report = part.get("report") if isinstance(part, dict) else None
    if report is None:
        return None
    problem = scores_problem(report, config.classes)
    if problem:
        raise TfpipeError(f"{where}: the {'SWA model' if swa else 'final model'}'s report is damaged ({problem})")
    model, thresholds = run_files.model_files(swa)
    if config.recipe:
        model = run_files.TORCH_MODEL_SWA if swa else run_files.TORCH_MODEL
    state = None if config.single_label else thresholds_state(run, config.classes, swa, 1, report)
    return {"model": model, "views": 1, "thresholds": None if config.single_label else thresholds,
            "thresholds_file": state, "scores": report}  # fmt: skip


def _checked(metrics: dict[str, Any], where: str) -> dict[str, Any]:
    """``metrics.json``'s run figures shown: epochs a count, seconds a number >= 0, stops a list."""
    seconds = metrics.get("seconds")
    ok = {
        "epochs": is_count(metrics.get("epochs")),
        "seconds": seconds is None or (is_number(seconds) and seconds >= 0),
        "stops": isinstance(metrics.get("stops", []), list),
    }
    for key, fine in ok.items():
        if not fine:
            raise TfpipeError(f"{where}: {key!r} is {metrics.get(key)!r}; the file was edited or damaged")
    return metrics


def shards_info(records: str, dataset_id: str | None, fold: int | None) -> dict[str, Any]:
    """Where the run's shards were and whether they still hold the same dataset (``here``: same, changed,
    missing, or unreadable with ``problem`` saying why)."""
    info: dict[str, Any] = {"records": records, "dataset_id": dataset_id, "fold": fold}
    if not records or not fs.exists(records):
        relative = bool(records) and not fs.is_remote(records) and not records.startswith("/")
        return dict(info, here="not-here" if relative else "missing")
    try:
        found = open_shards(records).dataset_id
    except TfpipeError as e:
        return dict(info, here="unreadable", problem=str(e))
    return dict(info, here="same" if found == dataset_id else "changed")


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


def predicts_with(run: str, config: RunConfig, models: list[dict[str, Any]]) -> dict[str, Any]:
    """The model train.predict (a recipe: ``--predict-only``) uses by default, why, and what stands in its way
    (its thresholds file missing or not the one it was scored at)."""
    if config.recipe:
        from train.torch.run import chosen_model

        try:
            swa, why = chosen_model(run)
        except TfpipeError as e:  # a model file lost: the run is still shown, what stands in the way said
            return {
                "model": None,
                "why": f"--predict-only refuses: {e}",
                "command": f"python examples/{config.recipe}.py",
            }
        model = run_files.TORCH_MODEL_SWA if swa else run_files.TORCH_MODEL
        command = f"python examples/{config.recipe}.py --predict-only"
    else:
        swa, line = run_choice(run, None)
        model = run_files.model_files(swa)[0]
        why, command = line or f"predicting with {model}", "python -m train.predict"
    entry = next((m for m in models if m["model"] == model), None)
    if entry and entry["thresholds_file"] in ("missing", "differs"):
        said = {"missing": "is missing", "differs": "holds other thresholds than its report was scored at (edited?)"}
        why += f"; but its {entry['thresholds']} {said[entry['thresholds_file']]}"
    return {"model": model, "why": why, "command": command}


def cv_info(cv: str) -> dict[str, Any]:
    """A CV folder: its plan, its out-of-fold scores of each model, each fold's run (checked to be the CV's),
    the thresholds files and the models train.predict uses."""
    result = CVResult.load(cv, checked=False)  # the record's problems are shown: recorded_files
    folds = [fold_info(cv, result, k) for k in result.folds]
    models = [
        {"model": m.model, "views": m.views, "thresholds": m.thresholds, "scores": m.scores, "spread": m.spread(),
         "thresholds_file": m.thresholds and thresholds_state(cv, result.classes, m.model == run_files.MODEL_SWA,
                                                              m.views, m.scores)}
        for m in result.models
    ]  # fmt: skip
    info = {
        "folder": cv,
        "kind": "cv",
        "trained_by": "train.cv",
        "backend": result.settings.get("backend", "tf"),
        "finished": result.finished,
        "classes": list(result.classes),
        "single_label": result.single_label,
        "shards": shards_info(result.records, result.dataset_id, None),
        "settings": result.settings,
        "folds": folds,
        "models": models,
        "thresholds_files": thresholds_files(cv),
        "files": recorded_files(cv, result.finished),
        "predicts_with": cv_predicts_with(result, folds) if result.submits else None,
    }
    return dict(info, predicts_with=refused_by_record(info["predicts_with"], info["files"]))


def fold_info(cv: str, result: CVResult, k: int) -> dict[str, Any]:
    """Fold ``k``'s run, read back (``run_info``), or what is wrong with it (``problem``): missing, not a run of
    this CV (another run copied in, settings or shards edited), unfinished, or without the model submitted."""
    info: dict[str, Any] = {"fold": k, "run": fold_run(cv, k), "finished": False, "run_info": None, "problem": None}
    try:
        run, _ = checked_fold_run(cv, result, k)
        info["run_info"] = run_info(run)
        info["finished"] = info["run_info"]["finished"]
        if result.submits and not _has(run, result.submits):
            raise TfpipeError(f"{run}: no {result.submits}, the model the CV submits with")
    except TfpipeError as e:
        info["problem"] = str(e)
    return info


def cv_predicts_with(result: CVResult, folds: list[dict[str, Any]]) -> dict[str, Any]:
    n = len(result.folds)
    model = f"the mean of {counted(n, 'fold model')} ({result.submits}, 1 view each)"
    problem = next((f["problem"] for f in folds if f["problem"]), None)
    if problem:
        return {
            "model": model,
            "why": f"train.predict refuses this CV: {problem}",
            "command": "python -m train.predict",
        }
    choice = "the better out-of-fold AUC (cv.json)" if len(result.models) > 1 else "the only model trained"
    why = f"predicting with the mean of the {n} fold models, {result.submits} each: {choice}"
    return {"model": model, "why": why, "command": "python -m train.predict"}
