"""The run folder as ``train.fit`` writes it (``train.runs.run`` names its files and reads them back): checked out
before training (new, resumed with the settings it started with, or replaced), ``config.json`` written, models
saved through temporary names, and what a failed job wrote taken back so the folder never looks finished."""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import json
import os
import posixpath
import shutil
import signal
import statistics
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any, NamedTuple

from tfpipe.runtime import fs
from tfpipe.runtime.errors import TfpipeError, option
from tfpipe.runtime.lifecycle import with_detail
from tfpipe.runtime.locks import LOCK
from train.keras.config import PREFLIGHT_ONLY, FitConfig
from train.keras.plan import Plan
from train.keras.schedules import scaled_lr
from train.runs import files
from train.runs import run as run_files
from train.runs.cv_folder import CV_FILE
from train.runs.run import RunConfig, read_state, same_setting

if TYPE_CHECKING:
    import tf_keras as keras

    from train.keras.callbacks import Throughput
import tensorflow as tf  # its errors: what stops training from outside (stopping_cleanly)

# Settings a resumed run must share with the run it continues (others, such as verbose, may change).
RESUME_KEYS = (
    "backend",  # a backup is the backend's own (a TensorFlow checkpoint, or Keras 3's weights file)
    "model",
    "image_size",
    "batch_size",
    "epochs",
    "steps_per_execution",
    "lr",
    "schedule",
    "optimizer",
    "fold",
    "val_fraction",
    "burn_epochs",
    "single_label",
    "swa_epochs",
    "class_weight",  # the loss and the batches it trained on (a config.json recording neither: resumed unchecked)
    "sampling",
    "metric",  # the figure its report and a CV's choices decide by
    "classes",
    # how the run was laid out on its replicas (a config.json without it: resumed unchecked): the global batch, and
    # with it the steps of an epoch, the learning-rate schedule and the position a backup saved, follow them
    "replicas_in_sync",
    "global_batch_size",
    "train_examples",
    "processes",  # each reads its share of the shards, and a cluster's other processes resume from their own folders
)


class Layout(NamedTuple):
    """How a run is laid out: the replicas in sync, the training images, the global batch (an epoch's steps
    follow) and the processes (hosts) training together."""

    replicas: int
    train_examples: int

    global_batch: int
    processes: int = 1

    @classmethod
    def of(cls, plan: Plan) -> Layout:
        return cls(plan.devices.replicas, plan.data.train_examples, plan.global_batch, plan.devices.processes)

    def settings(self) -> dict[str, int]:
        """config.json's record of it (``RESUME_KEYS``' last four)."""
        return {
            "replicas_in_sync": self.replicas,
            "global_batch_size": self.global_batch,
            "train_examples": self.train_examples,
            "processes": self.processes,
        }


def check_out(plan: Plan) -> bool:
    """A run folder is a new or empty folder, or a run that ``resume`` continues with the settings it started
    with, on the same shards; a finished run is never trained over, and a folder holding anything train.fit did
    not write (no valid ``config.json``) is never trained into. Each is an error naming the way out. Called
    holding the folder's lock; returns True for a new or empty folder (no earlier run in it)."""
    run = plan.run.folder
    others = sorted(n for n in fs.listdir(run) if n != LOCK)
    if CV_FILE in others:
        raise TfpipeError(
            f"{run} is a CV folder of train.cv (its {CV_FILE}); continue it with train.cv "
            f"{option('resume', True)}, or choose another {option('run')} folder"
        )
    if others and not fs.exists(run_files.path(run, run_files.CONFIG)):
        listed = ", ".join(others[:3]) + (f" and {len(others) - 3} more" if len(others) > 3 else "")
        files = "files" if len(others) > 1 else "a file"
        raise TfpipeError(
            f"{run} holds {files} train.fit did not write ({listed}); choose a new or empty {option('run')} folder"
        )
    if not others:
        return True
    config = RunConfig.load(run)
    if config.recipe:  # its files are not train.fit's to continue or replace
        raise TfpipeError(
            f"{run} holds a run of the PyTorch recipe {config.recipe}; choose another {option('run')} folder"
        )
    if plan.run.overwrite:
        replace_run(run, others, plan.run.verbose > 0)
        return True
    if not plan.run.resume:
        raise TfpipeError(
            f"{run} already holds a run; pass {option('resume', True)} to continue it or "
            f"{option('overwrite', True)} to replace it, or choose another {option('run')} folder"
        )
    check_resume_fits(plan, config)
    run_files.remove_half_saved(run)  # of a job killed while saving: this one saves them again
    return False


def resume_hint(key: str) -> str:
    """What to change for a resume refused because ``key`` differs from the run's (a layout's key), else ""."""
    if key in ("replicas_in_sync", "global_batch_size"):
        return (
            f" ({option('strategy')}, {option('replicas')}: the global batch, an epoch's steps and the learning "
            "rate's schedule follow the replicas)"
        )
    if key == "processes":
        return " (on as many processes, or hosts, as it started with: each reads its share of the shards)"
    return ""


def check_resume_fits(plan: Plan, config: RunConfig) -> None:
    """``resume`` continues an unfinished run on its own shards (their dataset id: wherever they are now) with
    the settings it started with, laid out alike (its replicas, global batch and epoch)."""
    run, records, shards = plan.run.folder, plan.data.records, plan.data.shards
    if read_state(run).get("finished"):
        raise TfpipeError(
            f"{run} holds a finished run (model.keras); {option('resume', True)} continues an interrupted "
            f"one -- pass {option('overwrite', True)} to replace it, or choose another {option('run')} folder"
        )
    if config.dataset_id and config.dataset_id != shards.dataset_id:
        same = isinstance(config.records, str) and fs.same_path(config.records, records)
        what = (
            f"{records} was rewritten since {run} started"
            if same
            else f"{records} holds other shards than {run} trained on ({config.records})"
        )
        raise TfpipeError(
            f"{what} (dataset id {config.dataset_id}, {'now' if same else 'here'} {shards.dataset_id}); "
            f"{option('resume', True)} continues a run on its own shards -- choose another {option('run')} folder "
            "to train on these"
        )
    before = config.settings
    now = dict(settings_of(plan.settings), classes=shards.classes, **Layout.of(plan).settings())
    changed = [
        k
        for k in RESUME_KEYS
        if k in before and not same_setting(k, before[k], json.loads(json.dumps(now[k], default=str)))
    ]
    if changed:
        k = changed[0]
        raise TfpipeError(
            f"{run} was started with {k}={before[k]!r}, not {now[k]!r}; {option('resume', True)} "
            f"continues a run with its own settings{resume_hint(k)}"
        )
    check_resumable(run, config)


def replace_run(run: str, names: Sequence[str], progress: bool) -> None:
    """``overwrite``: removes the files of the run in ``run`` that train.fit wrote (``config.json`` last, so a job
    killed meanwhile leaves a folder that is still a run's); files of other names stay, and are said. A file of
    another name inside its folders (``logs/``, ...) is refused: those folders go whole."""
    stray = run_files.foreign_in_folders(run)
    if stray:
        raise TfpipeError(
            f"{run_files.path(run, stray[0])} is not a file train.fit writes, in a folder {option('overwrite', True)} "
            "removes whole; move it out of the run folder first"
        )
    own = sorted((n for n in names if run_files.written_by_fit(n)), key=lambda n: n == run_files.CONFIG)
    folders = (run_files.BACKUP, run_files.CHECKPOINTS, run_files.LOGS)
    odd = next((n for n in own if fs.isdir(run_files.path(run, n)) != (n in folders)), None)
    if odd is not None and not os.path.islink(run_files.path(run, odd)):  # a link is removed as a link
        kind = "a folder" if odd not in folders else "a file"
        raise TfpipeError(
            f"{run_files.path(run, odd)} is {kind}, which train.fit never writes there; move it out of the run "
            f"folder first (nothing was removed)"
        )
    for name in own:
        p = run_files.path(run, name)
        fs.rmtree(p) if fs.isdir(p) and not os.path.islink(p) else fs.remove(p)
    kept = [n for n in names if n not in own]
    if progress:
        what = f"; kept what train.fit did not write: {', '.join(kept[:3])}" + (" ..." if len(kept) > 3 else "")
        print(f"train.fit: replaced the run in {run} ({option('overwrite', True)}){what if kept else ''}", flush=True)


def check_resumable(run: str, config: RunConfig) -> None:
    """What an interrupted job left must be continued, never started over: ``history.csv`` recording epochs with
    no backup to continue them from (a job interrupted after its last epoch, its backup already deleted) would
    train from scratch and append to the history, counting epochs twice."""
    rows = run_files.read_history(run)
    if rows is None:
        return
    epochs = len(rows)
    burn = int(config.settings.get("burn_epochs") or 0)
    burn_done = bool(read_state(run).get("burn_done"))  # the burn-in's epochs are kept as its weights
    phase, in_phase = ("fine-tune", epochs - burn) if burn_done or not burn else ("burn", epochs)
    if in_phase > 0 and not fs.glob(run_files.path(run, f"{run_files.BACKUP}/{phase}/*")):
        raise TfpipeError(
            f"{run}: {run_files.HISTORY} lists {epochs} epoch{'s' * (epochs != 1)} but no backup is left to continue "
            f"from ({run_files.BACKUP}/ is empty: the job was interrupted after its last epoch by an older tfpipe); "
            f"{option('resume', True)} would train again from scratch -- choose another {option('run')} folder"
        )


def save_model(model: keras.Model, path: str) -> None:
    """Saves through a temporary name: a crash while saving never leaves a half-written model file; the file is
    recorded in the run's ``files.json``."""
    tmp = fs.temporary_name(path[: -len(".keras")]) + ".keras"  # a name no user file has
    model.save(tmp)
    fs.rename(tmp, path, overwrite=True)
    files.record(posixpath.dirname(path), [posixpath.basename(path)])


def write_run_config(plan: Plan) -> None:
    """config.json: what predicting with this run depends on (classes, input size, how the images were fitted,
    single- or multi-label, the shards' dataset id, the validation fold), plus every setting used and the
    run's layout (what a resume must keep)."""
    shards = plan.data.shards
    manifest = shards.manifest
    assert manifest is not None  # make_plan refuses shards without one
    RunConfig(
        classes=tuple(manifest.classes),
        image_size=plan.model.image_size,
        single_label=plan.model.single_label,
        fit=manifest.image.effective_fit,
        dataset_id=shards.dataset_id,
        fold=plan.data.fold,
        records=plan.data.records,
        settings=dict(settings_of(plan.settings), **Layout.of(plan).settings()),
        stored_size=shards.image_size or run_files.OWN_SIZES,
        label_column=manifest.label_column,  # the submission names its labels column so
    ).save(plan.run.folder)


def settings_of(cfg: FitConfig) -> dict[str, Any]:
    """Every setting of ``cfg`` as JSON values, as ``config.json`` records them: the strategy by its name (a
    plan's is one: ``train.keras.planning.strategy_name``; a config not planned, by its object's class name), the
    callbacks and the preflight's settings left out (``dataclasses.asdict`` would deep-copy a strategy and the
    callbacks, and the default strategy refuses to be copied)."""
    strategy = cfg.strategy if isinstance(cfg.strategy, str) else type(cfg.strategy).__name__
    fields = dataclasses.asdict(dataclasses.replace(cfg, strategy=strategy, callbacks=()))
    kept = {k: v for k, v in fields.items() if k not in ("callbacks", *PREFLIGHT_ONLY)}  # a run is never a preflight
    return dict(json.loads(json.dumps(kept, default=str)))


def stops_of(run_dir: str) -> dict[str, Any]:
    """metrics.json's count of the jobs a signal stopped before this one finished the run, and where each
    stopped (``state.json``'s record)."""
    stops = read_state(run_dir).get("stops", [])
    return {"interrupted": len(stops), "stops": stops}


@contextlib.contextmanager
def stops_recorded(run_dir: str, where: str = "") -> Iterator[None]:
    """A job stopped by a signal (SIGTERM, Ctrl-C) in a run that can be resumed is added to ``state.json``'s
    stops, which ``metrics.json`` counts: where (the step it stopped at, else ``where``) and by what."""
    try:
        yield
    except KeyboardInterrupt as e:
        if fs.exists(run_files.path(run_dir, run_files.CONFIG)):  # else nothing is left to resume
            signum = getattr(e, "signum", signal.SIGINT)
            with contextlib.suppress(TfpipeError, OSError):  # the stop's own line matters more
                run_files.record_stop(run_dir, signal.Signals(signum).name, getattr(e, "at", "") or where)
        raise


def backup_saved(run_dir: str) -> bool:
    """Whether a phase's backup (an epoch's or a step's) is in ``run_dir``: something ``--resume`` continues."""
    return bool(
        tf.io.gfile.glob(run_files.path(run_dir, f"{run_files.BACKUP}/*/chief/checkpoint"))
        or tf.io.gfile.glob(run_files.path(run_dir, f"{run_files.BACKUP}/*/position.json"))  # Keras 3's
    )


@contextlib.contextmanager
def removed_unless_an_epoch_is_saved(run_dir: str, fresh: bool, throughput: Throughput) -> Iterator[None]:
    """A job that fails before its first epoch or step is saved (the model cannot be built: ImageNet weights
    offline) in a ``fresh`` folder (new or empty when it started) removes the run files it wrote there: nothing could be
    resumed, and they would make the corrected command refuse the folder. Nothing else is touched: not a file of
    another name, never a folder that held a run before this job."""
    try:
        yield
    except BaseException:
        if fresh and not throughput.epochs_saved and not backup_saved(run_dir):
            for name in run_files.WRITTEN:
                p = run_files.path(run_dir, name)
                if fs.isdir(p):
                    fs.rmtree(p)
                elif fs.exists(p):
                    fs.remove(p)
        raise


def remove_if_empty(folder: str) -> None:
    """Removes ``folder`` when it is empty (a run folder this job made and left nothing in); a local folder only
    (an empty "folder" on gs:// is no object)."""
    if not fs.is_remote(folder):
        with contextlib.suppress(OSError):
            os.rmdir(folder)


@contextlib.contextmanager
def stopping_cleanly(plan: Plan) -> Iterator[None]:
    """Turns what stops training from outside into one line: the shards rewritten under it (their files gone
    mid-epoch), or a full disk while Keras backs up the epoch (its half-written ``*_temp`` folders removed)."""
    try:
        yield
    except (tf.errors.OpError, OSError) as e:
        plan.data.shards.check_unchanged()
        if "No space left" not in str(e) and getattr(e, "errno", None) != errno.ENOSPC:
            raise
        removed = remove_temporaries(run_files.path(plan.run.folder, run_files.BACKUP))
        raise TfpipeError(
            f"{plan.run.folder}: no space left on the device while saving the epoch's backup "
            f"({removed} half-written file{'s' * (removed != 1)} removed); free space and continue "
            f"with {option('resume', True)}"
        ) from None


def remove_temporaries(folder: str) -> int:
    """Deletes the ``*_temp*`` files and folders TensorFlow's checkpoint writer left under ``folder``."""
    removed = 0
    for root, dirs, names in os.walk(folder) if not fs.is_remote(folder) else ():
        for name in [d for d in dirs if "_temp" in d]:
            shutil.rmtree(os.path.join(root, name), ignore_errors=True)
            dirs.remove(name)
            removed += 1
        for name in [f for f in names if "_temp" in f]:
            os.remove(os.path.join(root, name))
            removed += 1
    return removed


@contextlib.contextmanager
def unfinished_on_error(run_dir: str) -> Iterator[None]:
    """After model.keras is saved, a failure (the shards rewritten, a crash in the report) removes the models
    this job saved, so the folder never holds a model that looks finished but is not. A stop (SIGTERM, Ctrl-C)
    says that the training is kept and ``--resume`` finishes the run."""
    try:
        yield
    except BaseException as e:
        for name in (run_files.MODEL, run_files.MODEL_SWA):
            if fs.exists(run_files.path(run_dir, name)):
                fs.remove(run_files.path(run_dir, name))
        if isinstance(e, KeyboardInterrupt):
            raise with_detail(
                e, f"every epoch is saved; {option('resume', True)} writes the model and report"
            ) from None
        raise


def summarise(
    plan: Plan, sizes: tuple[int, int], precision: str, seconds: float, throughput: Throughput
) -> dict[str, Any]:
    """metrics.json: the run's configuration, speed and validation scores (from history.csv). ``sizes``:
    (validation images, optimizer steps taken)."""
    import pandas as pd

    with fs.open(run_files.path(plan.run.folder, run_files.HISTORY)) as f:
        history = pd.read_csv(f)
    val_cols = [c for c in history.columns if c.startswith("val_")]
    best = history.loc[history["val_auc"].idxmax()] if "val_auc" in history else history.iloc[-1]
    n_val, optimizer_steps = sizes
    rates = throughput.rates
    if {run_files.IMAGES_PER_SEC, run_files.EPOCH_SECONDS} <= set(history.columns):
        # Every job's epochs, an interrupted run's too (rows without these figures left out): the epochs'
        # seconds, plus this job's outside its epochs (start, saving, report; earlier jobs' are not recorded).
        rates = list(history[run_files.IMAGES_PER_SEC].dropna())
        seconds = float(history[run_files.EPOCH_SECONDS].sum()) + seconds - throughput.seconds
    rates = rates[1:] or rates  # the first epoch compiles (a resumed job's first too: the median outvotes it)
    return {
        "strategy": plan.devices.kind,
        "strategy_class": type(plan.devices.handle).__name__,
        "replicas": plan.devices.replicas,
        "steps_per_execution": plan.schedule.steps_per_execution,
        "per_replica_batch_size": plan.data.batch_size,
        "global_batch_size": plan.global_batch,
        "base_lr": plan.optimizer.lr,
        "scaled_lr": scaled_lr(plan.optimizer.lr, plan.devices.replicas),
        "schedule": plan.optimizer.schedule,
        "model": plan.model.name,
        "image_size": plan.model.image_size,
        "precision": precision,
        "epochs": len(history),
        "burn_epochs": plan.schedule.burn_epochs,
        "steps_per_epoch": plan.schedule.steps,
        "optimizer_steps": optimizer_steps,
        "train_examples": plan.data.train_examples,
        "val_examples": n_val,
        "fold": plan.data.fold,
        "images_per_sec": round(statistics.median(rates), 1) if rates else None,
        "seconds": round(seconds, 1),
        **stops_of(plan.run.folder),
        "final": {c: float(history[c].iloc[-1]) for c in val_cols},
        "best": dict({c: float(best[c]) for c in val_cols}, epoch=int(best["epoch"]) + 1),
    }
