"""The cross-validation engine behind ``train.cv`` (TensorFlow and tf-keras): every fold trained in turn in one
process, then the out-of-fold (OOF) predictions, their scores and the thresholds tuned on them.

Steps: check the plan (the shards' folds, the settings) -> check out the CV folder (new, resumed with the plan it
started with, or replaced) -> resolve the strategy once (on a TPU: one connection) -> for each fold, a normal
``train.fit`` run in ``CV_DIR/fold-K`` (a finished one kept, an unfinished one resumed), Keras' state cleared
and a TPU system initialised again between folds, as the Kaggle notebooks do -> the OOF predictions of every
fold's model on its own validation images (``train.decide.tuning.out_of_fold``) -> ``oof.csv``, ``thresholds.json``,
``cv.json``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import time
from collections.abc import Iterator, Sequence
from typing import Any

import tensorflow as tf

from tfpipe.format.shards import Shards
from tfpipe.runtime import fs
from tfpipe.runtime.console import counted
from tfpipe.runtime.errors import TfpipeError, option
from tfpipe.runtime.locks import LOCK, locked_folder
from tfpipe.tf.columns import check_no_image_twice
from train import backends as backend
from train.accel.strategy import tpu_strategy
from train.accel.workers import Workers
from train.decide.evaluation import Scores, headline, score
from train.decide.tta import scored_at_own_thresholds, views_worth
from train.decide.tuning import Predictions, describe, out_of_fold, tune, write_oof
from train.keras.config import FitConfig
from train.keras.fit_run import remove_if_empty, replace_run, settings_of
from train.keras.plan import Devices
from train.keras.planning import check_config, make_plan, resolved
from train.prediction.inference import validation_predictor
from train.runs import run as run_files
from train.runs.cv_folder import (
    CV_FILE,
    OOF_COLUMNS,
    CVResult,
    ModelScores,
    check_fold_run,
    described_folds,
    fold_run,
    fold_scores,
    shared_settings,
    submitted_model,
)
from train.runs.results import WorkerResult
from train.runs.run import RunConfig, read_state
from train.runs.thresholds import save_thresholds

PROG = "train.cv"


def cross_validate(
    cfg: FitConfig, folds: Sequence[int] | None, tta: int, choice: backend.Choice, shards: Shards
) -> CVResult | WorkerResult:
    """Trains ``folds`` (default: every fold of the shards) with the settings of ``cfg`` into the CV folder
    ``cfg.run``, then scores the out-of-fold predictions over ``tta`` views; returns ``cv.json``'s content (a JAX
    cluster's processes other than 0: a ``WorkerResult``, process 0 writes the CV). Called through
    ``train.cv.cross_validate`` (see its example), which readied the process for ``choice`` and opened the
    ``shards``: every fold is planned from these (their dataset id in cv.json)."""
    check_config(cfg)  # once for every fold
    if cfg.strategy == "multiworker" and choice.name != "jax":
        raise TfpipeError(_refused_setting(cfg))
    devices, kind = backend.resolve(choice, cfg.strategy, cfg.replicas)  # once: one TPU connection, one cluster
    if cfg.verbose:
        print(f"{PROG}: {backend.describe(choice, devices, kind)}", flush=True)
    cfg = dataclasses.replace(cfg, backend=choice.name)
    check_no_image_twice(shards)
    plan = plan_cv(cfg, shards, folds, tta, devices.num_replicas_in_sync)
    workers = backend.get(choice.name).workers(devices)
    with workers.answering(cfg.run), cv_folder(cfg, plan, workers) as stands:
        for i, k in enumerate(plan.folds):
            if i:
                devices = between_folds(devices, kind, choice.name)
            train_fold(cfg, plan, (k, i, stands[i]), (devices, kind), shards)
        with workers.answering(cfg.run):  # the OOF predictions: by process 0 alone, on its own devices
            if workers.many:
                workers.trained()
                devices = backend.get(choice.name).this_machine(devices)
            result = score_out_of_fold(cfg, plan, devices, workers)
            workers.finished()
    return result if workers.chief else WorkerResult(workers.name, workers.chief_name, cfg.run)


NEW, STARTED, FINISHED, REFUSED = 0, 1, 2, -1  # where a fold stands (process 0 read it; every process acts on it)


@contextlib.contextmanager
def cv_folder(cfg: FitConfig, plan: CVResult, workers: Workers) -> Iterator[list[int]]:
    """The CV folder locked and checked out by the chief (process 0 of a JAX cluster), the plan saved there;
    yields where each fold stands, as the chief read it (``NEW``, ``STARTED``, ``FINISHED``), on every process:
    each process trains the same folds the same way. A refusal of the chief's is every process's."""
    if not workers.chief:
        where = workers.from_chief([NEW] * len(plan.folds))
        if REFUSED in where:
            raise TfpipeError(
                f"{workers.name}: {workers.chief_name} refused the CV folder {cfg.run} (its own output says why)"
            )
        yield where
        return
    created = not fs.exists(cfg.run)
    try:
        with locked_folder(cfg.run, PROG, setting="run"):
            try:
                check_out_cv(cfg, plan)
                plan.save(cfg.run)
                where = [fold_stands(cfg.run, plan, k) for k in plan.folds]
            except TfpipeError:
                workers.from_chief([REFUSED] * len(plan.folds))
                raise
            yield workers.from_chief(where)
    except BaseException:
        if created:
            remove_if_empty(cfg.run)
        raise


def fold_stands(cv: str, plan: CVResult, fold: int) -> int:
    """Where fold ``fold``'s run in the CV folder ``cv`` stands: ``NEW``, ``STARTED`` (checked against the plan)
    or ``FINISHED``."""
    run = fold_run(cv, fold)
    if not fs.exists(run_files.path(run, run_files.CONFIG)):
        return NEW
    check_fold_run(run, RunConfig.load(run), plan, fold)
    return FINISHED if read_state(run).get("finished") else STARTED


def plan_cv(cfg: FitConfig, shards: Shards, folds: Sequence[int] | None, tta: int, replicas: int) -> CVResult:
    """``cv.json``'s plan, every check made before anything trains: shards with folds, the folds to train among
    theirs, settings a CV can use, class names that fit ``oof.csv``'s columns; every fold on ``replicas``."""
    from train.prediction.inference import check_tta

    check_tta(tta)
    if cfg.fold is not None:  # from Python (the command's --fold is the folds' list)
        raise TfpipeError("cross_validate trains a run for each fold of folds=[...]; leave FitConfig.fold out")
    if cfg.preflight or not cfg.report or (cfg.resume and cfg.overwrite):
        raise TfpipeError(_refused_setting(cfg))
    if not shards.num_folds:
        raise TfpipeError(f"{cfg.records}: written without folds; write the shards with --num-folds to cross-validate")
    chosen = list(range(shards.num_folds)) if folds is None else list(folds)
    wrong = [k for k in chosen if not 0 <= k < shards.num_folds]
    if wrong or not chosen or len(set(chosen)) != len(chosen):
        raise TfpipeError(
            f"{option('fold')} {','.join(map(str, chosen)) or '(none)'}: the folds of {cfg.records} are "
            f"0..{shards.num_folds - 1}; name each at most once"
        )
    decided = resolved(dataclasses.replace(cfg, fold=chosen[0]), shards, cfg.backend)
    twice = sorted(set(OOF_COLUMNS) & set(shards.classes or ()))
    if twice:
        raise TfpipeError(f"a class is named {twice[0]!r}, a column oof.csv has of its own; rename the class")
    assert shards.dataset_id is not None and decided.single_label is not None  # resolved() refuses foreign shards
    return CVResult(
        cfg.records, shards.dataset_id, shards.num_folds, tuple(chosen), tuple(shards.classes or ()),
        decided.single_label, tta, shared_settings(settings_of(decided)), replicas,
    )  # fmt: skip


def _refused_setting(cfg: FitConfig) -> str:
    if cfg.preflight:
        return "train.cv trains; check the settings once with train.fit --preflight (one fold is enough)"
    if cfg.strategy == "multiworker":
        return (
            f"train.cv trains on a cluster with {option('backend', 'jax')}; a TensorFlow multi-worker cluster "
            "trains one fold with train.fit"
        )
    if cfg.resume and cfg.overwrite:
        return f"{option('resume', True)} continues the CV in the folder, {option('overwrite', True)} replaces it"
    return f"train.cv scores each fold's validation predictions, which {option('report', False)} turns off"


def check_out_cv(cfg: FitConfig, plan: CVResult) -> None:
    """The CV folder is new or empty, a CV that ``resume`` continues with the plan it started with, or one that
    ``overwrite`` replaces (the files train.cv and train.fit wrote; others stay). Anything else: one line."""
    names = sorted(n for n in fs.listdir(cfg.run) if n != LOCK)
    if not names:
        return
    if CV_FILE in names:  # every fold folder this job trains into or replaces holds train.fit's files only
        folds = set(plan.folds) | (set(CVResult.load(cfg.run, checked=False).folds) if cfg.overwrite else set())
        check_fold_folders(cfg.run, sorted(folds), cfg.overwrite)
    if CV_FILE not in names and run_files.CONFIG in names:
        raise TfpipeError(f"{cfg.run} is a run folder of train.fit; choose a new or empty {option('run')} folder")
    if CV_FILE not in names:
        raise TfpipeError(
            f"{cfg.run}: it holds files train.cv did not write ({', '.join(names[:3])}); choose a new or empty "
            f"{option('run')} folder"
        )
    before = CVResult.load(cfg.run, checked=not cfg.overwrite)  # replaced whole: its record does not matter
    if cfg.overwrite:
        replace_cv(cfg.run, before, names)
    elif not cfg.resume:
        raise TfpipeError(
            f"{cfg.run} already holds a cross-validation; pass {option('resume', True)} to continue it or "
            f"{option('overwrite', True)} to replace it, or choose another {option('run')} folder"
        )
    else:
        check_same_plan(cfg.run, before, plan)
        if before.finished:
            raise TfpipeError(
                f"{cfg.run} holds a finished cross-validation; {option('resume', True)} continues an interrupted "
                f"one -- pass {option('overwrite', True)} to replace it"
            )


def check_fold_folders(cv: str, folds: Sequence[int], overwrite: bool) -> None:
    """Before anything is trained or removed: a fold folder holding files train.fit did not write is refused
    (train.fit would refuse it at that fold, after the folds before it; ``overwrite`` would have removed the
    others' runs first)."""
    for k in folds:
        run = fold_run(cv, k)
        if fs.exists(run) and not fs.isdir(run):
            raise TfpipeError(
                f"{run} is a file, where train.cv keeps fold {k}'s run folder; move it out of the CV folder first "
                "(nothing was removed or trained)"
            )
        if not fs.isdir(run):
            continue
        names = [n for n in fs.listdir(run) if n != LOCK]
        started = run_files.CONFIG in names
        foreign = [n for n in names if not run_files.written_by_fit(n)] + run_files.foreign_in_folders(run)
        if foreign and (overwrite or not started):
            doing = f"that {option('overwrite', True)} replaces" if overwrite else "train.cv trains into"
            raise TfpipeError(
                f"{run_files.path(run, foreign[0])} is not a file train.fit writes, in the fold folder {doing}; move "
                "it out of the CV folder first"
            )


def check_same_plan(cv: str, before: CVResult, plan: CVResult) -> None:
    """A resumed CV trains the shards, folds, views and settings it started with."""
    if before.dataset_id != plan.dataset_id:
        raise TfpipeError(
            f"{plan.records} is not the shards {cv} started on (dataset id {before.dataset_id}, now "
            f"{plan.dataset_id}); a CV folder never mixes shards -- choose another {option('run')} folder"
        )
    for what, old, new in (("folds", before.folds, plan.folds), ("tta", before.tta, plan.tta)):
        if old != new:
            raise TfpipeError(f"{cv} was started with {what} {old}, not {new}; {option('resume', True)} continues it")
    if before.replicas != plan.replicas:  # the global batch and the scaled LR follow the replicas
        raise TfpipeError(
            f"{cv} trains its folds on {counted(before.replicas, 'replica')}, and this strategy has "
            f"{plan.replicas}: the folds would differ in global batch and learning rate; resume it where it has "
            f"{before.replicas} ({option('strategy')}, {option('replicas')})"
        )
    changed = [
        k for k in sorted(set(before.settings) | set(plan.settings)) if before.settings.get(k) != plan.settings.get(k)
    ]
    if changed:
        k = changed[0]
        raise TfpipeError(
            f"{cv} was started with {k}={before.settings.get(k)!r}, not {plan.settings.get(k)!r}; a CV folder "
            "never mixes settings"
        )


def replace_cv(cv: str, before: CVResult, names: Sequence[str]) -> None:
    """``overwrite``: the fold runs ``before`` planned replaced as ``train.fit --overwrite`` does, then train.cv's
    own files (``cv.json`` last); files of other names stay."""
    for k in before.folds:
        run = fold_run(cv, k)
        if fs.isdir(run):
            replace_run(run, fs.listdir(run), progress=False)
            remove_if_empty(run)
    own = [n for n in names if run_files.written_by_fit(n) or (n.startswith("oof") and n.endswith(".csv"))]
    for name in sorted(own, key=lambda n: n == CV_FILE) + [CV_FILE]:
        if fs.exists(run_files.path(cv, name)) and not fs.isdir(run_files.path(cv, name)):
            fs.remove(run_files.path(cv, name))
    print(f"{PROG}: replaced the cross-validation in {cv} ({option('overwrite', True)})", flush=True)


def train_fold(cfg: FitConfig, plan: CVResult, fold: tuple[int, int, int], on: tuple[Any, str], shards: Shards) -> None:
    """A fold's run (``fold``: the fold, its place in the plan, where it stands): kept when finished, continued
    when started, else trained: planned from the CV's ``shards`` and handed to the engine on the CV's devices
    (``on``: the strategy or JAX devices, and their kind)."""
    from train.keras.trainer import train  # binds the backend's Keras: after ready

    k, index, stands = fold
    run = fold_run(cfg.run, k)
    where = f"{PROG}: fold {k} ({index + 1} of {len(plan.folds)})"
    if stands == FINISHED:
        print(f"{where}: trained earlier -> {run}", flush=True)
        return
    print(f"{where}: {'continuing' if stands == STARTED else 'training'} -> {run}", flush=True)
    begun = time.perf_counter()
    devices, kind = on
    fold_cfg = dataclasses.replace(cfg, run=run, fold=k, resume=stands == STARTED, overwrite=False, strategy=devices)
    processes = backend.get(cfg.backend).input_pipelines(devices)
    m = train(
        make_plan(fold_cfg, shards, Devices(cfg.backend, devices, kind, devices.num_replicas_in_sync, processes)), begun
    )
    if isinstance(m, WorkerResult):
        return  # process 0 says the fold's validation
    assert m.report is not None  # a CV always trains with the report
    report = m.report
    print(
        f"{where}: validation of {describe(False, 1)} on {counted(report['examples'], 'image')}: "
        f"{headline(report, plan.metric)}{' (labels by argmax)' * bool(plan.single_label)}, "
        f"{time.perf_counter() - begun:.0f} s",
        flush=True,
    )


def between_folds(devices: Any, kind: str, name: str) -> Any:
    """Keras' global state cleared and its memory freed; on a TPU under TensorFlow (backend ``name``) its system
    initialised again (the memory a fold's model held is freed there only then) and a new strategy over the same
    connection. JAX frees a fold's arrays once nothing holds them: its devices serve every fold."""
    backend.keras_module().backend.clear_session()
    gc.collect()
    if kind != "tpu" or name != "tf":
        return devices
    return tpu_strategy(devices.cluster_resolver)


def score_out_of_fold(cfg: FitConfig, plan: CVResult, strategy: Any, workers: Workers) -> CVResult:
    """The OOF predictions of the final models (and of the SWA models, when trained) over the plan's views,
    scored at thresholds tuned on them; the model with the better OOF AUC is the one train.predict submits with.
    Written to ``cv.json`` by the chief (the others return the plan)."""
    if not workers.chief:
        return plan
    models = [oof_scores(cfg, plan, strategy, swa=False)]
    if cfg.swa_epochs:
        models.append(oof_scores(cfg, plan, strategy, swa=True))
    result = dataclasses.replace(plan, models=tuple(models), submits=submitted_model(models, plan.metric))
    result.save(cfg.run)
    return result


def oof_scores(cfg: FitConfig, plan: CVResult, strategy: tf.distribute.Strategy, swa: bool) -> ModelScores:
    """One model's OOF file, thresholds (tuned on it, always anew) and scores, over all rows and fold by fold."""
    predict = validation_predictor(strategy, cfg.batch_size, swa=swa, views=plan.tta, progress=bool(cfg.verbose))
    found, fold_of = out_of_fold(plan, cfg.run, swa=swa, views=plan.tta, predict=predict)
    oof = write_oof(plan, cfg.run, found, fold_of, swa=swa, views=plan.tta)
    thresholds, named = oof_thresholds_now(cfg, plan, found, swa)
    scores = score(found.probs, found.targets, plan.classes, thresholds, plan.single_label)
    per_fold = tuple(fold_scores(k, _rows_scored(found, fold_of == k, plan, thresholds)) for k in plan.folds)
    one = one_view_scores(cfg, plan, strategy, swa) if plan.tta > 1 else None
    result = ModelScores(run_files.model_files(swa)[0], plan.tta, oof, named, scores, per_fold, one)
    print(oof_line(plan, result, len(found.names)), flush=True)
    return result


def one_view_scores(cfg: FitConfig, plan: CVResult, strategy: tf.distribute.Strategy, swa: bool) -> Scores:
    """The same OOF rows over 1 view (each fold run's report predicted them so: read back), scored alike: what
    the plan's TTA views are measured against (``train.decide.tta``)."""
    predict = validation_predictor(strategy, cfg.batch_size, swa=swa, views=1, progress=bool(cfg.verbose))
    found, _ = out_of_fold(plan, cfg.run, swa=swa, views=1, predict=predict)
    return scored_at_own_thresholds(
        found.probs, found.targets, list(plan.classes), plan.single_label, plan.metric, cfg.threshold
    )


def oof_thresholds_now(cfg: FitConfig, plan: CVResult, found: Predictions, swa: bool) -> tuple[list[float], str | None]:
    """Thresholds tuned on the OOF predictions ``found`` and recorded in the CV folder (none for single-label
    runs, labelled by argmax), and their file's name."""
    if plan.single_label:
        return [cfg.threshold] * len(plan.classes), None
    tuned = tune(found.probs, found.targets, cfg.threshold, plan.metric)
    thresholds, model = tuned.thresholds, run_files.model_files(swa)[0]
    for note in tuned.notes(plan.classes, cfg.threshold, "OOF"):
        print(f"{PROG}: thresholds of {describe(swa, plan.tta)}: {note}", flush=True)
    save_thresholds(cfg.run, plan.classes, thresholds, model, run_files.SWA_SUFFIX if swa else "", plan.tta)
    return thresholds, run_files.model_files(swa, plan.tta)[1]


def _rows_scored(found: Predictions, rows: Any, plan: CVResult, thresholds: list[float]) -> Scores:
    return score(found.probs[rows], found.targets[rows], plan.classes, thresholds, plan.single_label)


def oof_line(plan: CVResult, m: ModelScores, n: int) -> str:
    """``train.cv: OOF of model.keras, 1 view (2000 images, folds 0..4): AUC (exact, macro) 0.9712, ... at
    thresholds tuned on them; fold AUC ... best fold 3 ...``: the CV's metric first, the folds' spread of it and
    the best single fold's figure."""
    metric = plan.metric
    spread = m.spread().get(metric.key)
    best = m.best_fold(metric)
    folds = (
        f"; fold {metric.words} {spread['mean']:.4f} +- {spread['sd']:.4f} ({spread['min']:.4f}..{spread['max']:.4f})"
        if spread
        else ""
    )
    folds += f", best fold {best.fold} alone {metric.figure(dataclasses.asdict(best))}" if best else ""
    if m.one_view is not None:
        worth = views_worth(m.one_view, m.scores, m.views, metric)
        folds += f"; over 1 view {metric.figure(m.one_view)}" + (f" (the {m.views} views lose)" * worth.hurts)
    how = " (labels by argmax)" if plan.single_label else " at thresholds tuned on them"
    return (
        f"{PROG}: OOF of {describe(m.model == run_files.MODEL_SWA, m.views)} ({counted(n, 'image')}, "
        f"{described_folds(plan.folds)}): {headline(m.scores, metric)}{how}{folds}"
    )
