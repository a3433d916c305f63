"""The training engine behind ``train.fit``: datasets, model, phases, outputs, on either backend.

``train.fit`` holds the configuration and the command line (no TensorFlow, so ``--help`` is instant), opens the
shards and calls ``plan_run`` here, then ``train`` with the plan. Steps: check the configuration and start the
devices -> the plan (``train.keras.plan``: the fold's training and validation parts, an epoch's steps) -> check out
the run folder (``train.keras.fit_run``) -> build distributed datasets -> build and compile the model inside the
devices' scope (``train.keras.compiling``) -> (optionally) train the head with the backbone frozen -> fine-tune
everything, each phase with its callbacks (``train.keras.callbacks``) -> save ``model.keras``, ``history.csv``,
``metrics.json`` and the reports.
"""

from __future__ import annotations

import contextlib
import json
import tempfile
import time
import zlib
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any, NamedTuple

from train import backends as backend
from train.backends import complete, current, keras_module

if TYPE_CHECKING:
    import tf_keras as keras

    from train.accel.workers import Workers
import tensorflow as tf

import tfpipe
from tfpipe.format.shards import Shards
from tfpipe.runtime import console, fs
from tfpipe.runtime.errors import TfpipeError, option, renamed
from tfpipe.runtime.lifecycle import deferred_stops
from tfpipe.runtime.locks import WriteLock, locked_folder
from tfpipe.tf.columns import check_no_image_twice
from train.accel.cluster import copy_for_resume, records_here
from train.accel.strategy import default_precision, quick_teardown
from train.keras.backup import Phase, StepGroups
from train.keras.callbacks import ShardsUnchanged, Throughput, phase_callbacks
from train.keras.compiling import compile_model
from train.keras.config import FitConfig
from train.keras.data import PhaseData, training_data
from train.keras.fit_run import (
    check_out,
    remove_if_empty,
    removed_unless_an_epoch_is_saved,
    save_model,
    settings_of,
    stopping_cleanly,
    stops_recorded,
    summarise,
    unfinished_on_error,
    write_run_config,
)
from train.keras.models import build_model
from train.keras.outputs import report_arguments, reports
from train.keras.plan import Devices, ModelPlan, Plan
from train.keras.planning import check_config, make_plan, upscaling
from train.keras.schedules import make_schedule, scaled_lr
from train.keras.swa import AverageWeights
from train.runs import files
from train.runs import run as run_files
from train.runs.results import FitResult, WorkerResult
from train.runs.run import read_state, write_state


def plan_run(cfg: FitConfig, choice: backend.Choice, shards: Shards) -> Plan:
    """``cfg`` checked, the devices of ``choice`` started (their line said), and the plan on ``shards`` (opened
    once, by ``train.fit.fit``)."""
    check_config(cfg)  # before a multi-worker strategy connects to its cluster
    devices = start_devices(cfg, choice)
    check_no_image_twice(shards)
    return make_plan(cfg, shards, devices)


def start_devices(cfg: FitConfig, choice: backend.Choice) -> Devices:
    """The devices ``cfg`` asks for on the backend of ``choice``, said in the job's first line."""
    handle, kind = backend.resolve(choice, cfg.strategy, cfg.replicas)  # first: virtual CPUs need a fresh start
    if cfg.verbose:
        print(f"train.fit: {backend.describe(choice, handle, kind)}", flush=True)
    processes = backend.get(choice.name).input_pipelines(handle)  # one input pipeline a process (host)
    return Devices(choice.name, handle, kind, handle.num_replicas_in_sync, processes)


def train(plan: Plan, started: float) -> FitResult | WorkerResult:
    """Trains per ``plan`` into its run folder; returns the ``FitResult`` whose serialisation is
    ``metrics.json`` (a multi-worker job's other workers: a ``WorkerResult``). ``train.fit``'s run, and each
    fold's of ``train.cv`` (which plans every fold from the shards it opened once). ``started``: when the job
    began (perf_counter), for metrics.json's seconds."""
    # after the plan's checks (a seed out of range is one line), before the model is built
    seed_run(plan.data.seed, plan.data.deterministic)
    workers, folder = current().workers(plan.devices.handle), plan.run.folder
    with workers.answering(folder):
        with run_folder(plan) as (mine, lock, fresh):
            metrics = train_and_report(mine, lock, started, fresh)
        workers.finished()
    if not workers.chief:
        return WorkerResult(workers.name, workers.chief_name, folder)
    return FitResult.from_metrics(folder, metrics)


def seed_run(seed: int | None, deterministic: bool) -> None:
    """A ``seed`` (a deterministic run has seed 0 when it has none): the initial weights, dropout and Python's,
    NumPy's and TensorFlow's global generators seeded (``keras.utils.set_random_seed``, as a user would);
    ``deterministic`` also turns on TensorFlow's op determinism. The input order and augmentation take the seed
    from the plan too."""
    if seed is not None:
        keras_module().utils.set_random_seed(seed)
    if deterministic:
        tf.config.experimental.enable_op_determinism()


@contextlib.contextmanager
def run_folder(plan: Plan) -> Iterator[tuple[Plan, WriteLock, bool]]:
    """The folder this process trains into, locked and checked out: the run folder (the chief), or a private
    one (``worker_folder``). Yields the plan writing there, its lock, and whether it was new or empty. Every
    check that needs no training has passed: only now is the run folder made and written."""
    workers = current().workers(plan.devices.handle)
    if not workers.chief:
        with worker_folder(plan, workers) as found:
            yield found
        return
    folder = plan.run.folder
    created = not fs.exists(folder)
    try:
        # One job per run folder: two fits started together would interleave one history.csv and one model.
        with locked_folder(folder, "train.fit", setting="run") as lock, quick_teardown():
            if workers.many:  # before check_out, which may replace the run (--overwrite)
                workers.same_start(folder, start_point(folder, plan))
            yield plan, lock, check_out(plan)
    except BaseException:
        if created:
            remove_if_empty(folder)  # made by this job, and nothing in it worth keeping
        raise


@contextlib.contextmanager
def worker_folder(plan: Plan, workers: Workers) -> Iterator[tuple[Plan, WriteLock, bool]]:
    """A worker other than the chief: the same training, step for step, in a private temporary folder removed
    when it ends (on ``resume`` a copy of what the chief's run folder holds to continue from); the chief writes
    the run."""
    folder = plan.run.folder
    with tempfile.TemporaryDirectory(prefix="tfpipe-worker-") as own:
        try:
            if plan.run.resume:
                copy_for_resume(folder, own, RESUMED)
                records_here(own, plan.data.records)
            mine = plan.in_folder(own, verbose=0, overwrite=False)
            still = f"{workers.name}: still training ({workers.chief_name}, the chief, prints the epochs)"
            with (
                locked_folder(own, "train.fit", setting="run") as lock,
                quick_teardown(),
                console.saying("train.fit", None, still, plan.run.verbose > 0),
            ):  # a heartbeat: a worker's log is not silent for its whole run
                workers.same_start(folder, start_point(own, mine))
                yield mine, lock, check_out(mine)
        except TfpipeError as e:  # said of the private folder: the user knows the run folder
            raise renamed(e, own, folder) from None  # the same kind, said of the run folder


# What a resumed worker other than the chief reads of the chief's run folder (``train.accel.cluster.copy_for_resume``).
RESUMED = (
    run_files.CONFIG,
    run_files.STATE,
    run_files.HISTORY,
    run_files.SWA_AVERAGE,
    run_files.BACKUP,
    f"{run_files.BURN_DONE}*",
)


# Settings the workers of one cluster may give differently: where things are and what each prints or is asked
# to do with the run folder (the chief alone acts on it).
MAY_DIFFER = ("run", "records", "verbose", "overwrite", "resume", "report")  # save_every may not: a save is a
# collective every worker joins at the same steps


def start_point(folder: str, plan: Plan) -> tuple[int, int, int]:
    """Where a worker's training starts, to compare across workers: the epochs its run ``folder`` records (none
    when ``overwrite`` replaces them), whether the burn-in is done, and a digest of every setting but
    ``MAY_DIFFER`` and of the shards' dataset id."""
    settings = settings_of(plan.settings)
    kept = sorted((k, v) for k, v in settings.items() if k not in MAY_DIFFER)
    kept.append(("shards", plan.data.shards.dataset_id))
    digest = zlib.crc32(json.dumps(kept, default=str).encode()) % 2**20  # small: exact in float64 sums
    if plan.run.overwrite:
        return 0, 0, digest
    rows = run_files.read_history(folder) or []
    return len(rows), int(bool(read_state(folder).get("burn_done"))), digest


def train_and_report(plan: Plan, lock: WriteLock, started: float, fresh: bool) -> dict[str, Any]:
    """The run itself, in ``plan.run.folder`` (locked by ``lock``): config, training, model.keras, reports,
    metrics.json. The shards are checked against their dataset id at every epoch's end and before each output:
    a folder rewritten meanwhile stops the run, and no finished run claims classes or records the shards no
    longer hold. In a ``fresh`` (new or empty) folder, a failure before the first epoch is saved removes what the
    job wrote."""
    handle, folder, shards = plan.devices.handle, plan.run.folder, plan.data.shards
    precision = plan.model.precision or default_precision(plan.devices.kind)
    data, n_val = training_data(plan, handle, say=bool(plan.run.verbose))
    throughput = complete(Throughput)(plan.global_batch)
    with stops_recorded(folder), removed_unless_an_epoch_is_saved(folder, fresh, throughput):
        write_run_config(plan)
        keras_module().mixed_precision.set_global_policy(precision)
        if plan.run.verbose:
            announce_build(plan, n_val)
        with handle.scope(), tfpipe.naming_corrupt_shards(shards), stopping_cleanly(plan):
            model, backbone = built_model(plan)
            schedule = plan.schedule
            averaged_from = schedule.burn_epochs + schedule.epochs - schedule.swa_epochs
            swa = complete(AverageWeights)(averaged_from, run_files.path(folder, run_files.SWA_AVERAGE))
            for phase in phases(plan, model, backbone, swa):
                run_phase(model, plan, phase, data, throughput)
    optimizer_steps = int(model.optimizer.iterations.numpy())
    workers = current().workers(handle)
    if workers.many:
        weights = model.get_weights()  # on every worker: a batch-norm statistic is the mean over all replicas
        workers.trained()
        if not workers.chief:
            return {}  # the chief saves, scores and reports
        model, handle, data = on_this_machine(plan, weights)
    lock.check()  # on gs:// the lock is advisory: a job that lost it saves nothing
    shards.check_unchanged()
    return report_run(plan, (model, swa), handle, data, (n_val, optimizer_steps), precision, started, throughput)


def report_run(
    plan: Plan,
    trained: tuple[keras.Model, AverageWeights],
    handle: Any,
    data: PhaseData,
    sizes: tuple[int, int],
    precision: str,
    started: float,
    throughput: Throughput,
) -> dict[str, Any]:
    """The ``trained`` model (and its SWA average) saved, scored and reported on ``handle``'s devices, then
    metrics.json written (``summarise``'s figures, ``sizes`` among them, and the reports) and the run marked
    finished."""
    (model, swa), folder, shards = trained, plan.run.folder, plan.data.shards
    with stops_recorded(folder, "the report"), unfinished_on_error(folder), tfpipe.naming_corrupt_shards(shards):
        with console.saying("train.fit", f"saving {run_files.MODEL}", "still saving the model", bool(plan.run.verbose)):
            save_model(model, run_files.path(folder, run_files.MODEL))
        summary = summarise(plan, sizes, precision, time.perf_counter() - started, throughput)
        # the kind and the metric its choices decide by (train.decide.metrics), said with its scores
        kind = {"backend": plan.devices.backend, "single_label": plan.model.single_label, "metric": plan.run.metric}
        metrics = {**kind, **summary}
        metrics.update(reports(model, swa, handle, plan, data, report_arguments(plan)))
        shards.check_unchanged(sizes=True)  # the report was of the shards trained on, none replaced in place
        fs.write_atomic(run_files.path(folder, run_files.METRICS), json.dumps(metrics, indent=1) + "\n")
        files.record(folder, [run_files.METRICS])  # its scores choose the model train.predict uses
    write_state(folder, dict(read_state(folder), burn_done=bool(plan.schedule.burn_epochs), finished=True))
    if fs.exists(run_files.path(folder, run_files.BACKUP)):
        fs.rmtree(run_files.path(folder, run_files.BACKUP))  # finished: nothing left to resume
    return metrics


def on_this_machine(plan: Plan, weights: list[Any]) -> tuple[keras.Model, Any, PhaseData]:
    """The chief of a multi-worker job once training ends: the trained ``weights`` in a model of its own on this
    machine's devices alone (no step waits for workers that have ended), with datasets for this machine alone,
    to save, score and report (and SWA's batch-norm pass). Saved with a fresh optimizer, as the SWA model is."""
    alone, m = current().this_machine(plan.devices.handle), plan.model
    with (
        console.saying("train.fit", None, f"still building {m.name} on the chief", bool(plan.run.verbose)),
        alone.scope(),
    ):
        model, _ = build_model(m.name, m.num_classes, m.image_size, weights=None, multi_label=not m.single_label)
        data, _ = training_data(plan, alone)
        compile_model(model, m, plan.optimizer, 0.0, plan.schedule.steps_per_execution, data.loss_weights)
        model.set_weights(weights)
    return model, alone, data


def announce_build(plan: Plan, n_val: int) -> None:
    """The line saying what is built on what, before the minutes of building and compiling."""
    line = build_line(plan.model, plan.devices, (plan.data.train_examples, n_val), plan.data.shards.image_size)
    print(f"train.fit: {line}", flush=True)


def build_line(m: ModelPlan, devices: Devices, images: tuple[int, int], stored: int | None) -> str:
    """``building MODEL at SIZE px on N KIND replicas; T training images, V validation images`` (``images``:
    T, V); images ``stored`` at another size are said to be resized (train.predict then wants shards stored as
    these are)."""
    (n_train, n_val), replicas = images, devices.replicas
    resized = f" (images stored at {stored} px, resized as read)" if stored and stored != m.image_size else ""
    up = upscaling(stored, m.image_size)
    resized = f" ({up})" if up else resized
    return (
        f"building {m.name} at {m.image_size} px{resized} on {replicas} "
        f"{devices.kind} replica{'s' * (replicas > 1)}; {n_train} training image{'s' * (n_train != 1)}, "
        f"{n_val} validation image{'s' * (n_val != 1)}"
    )


def built_model(plan: Plan) -> tuple[keras.Model, keras.Model]:
    """The model and its backbone, built inside the devices' scope (the caller's)."""
    m = plan.model
    # announce_build said "building MODEL at SIZE px on N replicas" (unless quiet): a heartbeat is enough here
    with console.saying("train.fit", None, f"still building {m.name}", bool(plan.run.verbose)):
        return build_model(m.name, m.num_classes, m.image_size, weights=m.weights, multi_label=not m.single_label)


class PhasePlan(NamedTuple):
    """One phase of training: its name (a backup's folder), learning rate, epochs, the epoch it starts at, and the
    callbacks that run before the backup at the end of an epoch."""

    name: str
    rate: float | keras.optimizers.schedules.LearningRateSchedule
    epochs: int
    initial_epoch: int
    first: Sequence[keras.callbacks.Callback]


def phases(plan: Plan, model: keras.Model, backbone: keras.Model, swa: AverageWeights) -> Iterator[PhasePlan]:
    """The phases to run, in order: the burn-in (the head trained with the backbone frozen, its weights kept for
    ``--resume``; a resumed run whose state says it finished loads those weights instead), then everything."""
    schedule, optimizer, replicas = plan.schedule, plan.optimizer, plan.devices.replicas
    watch = complete(ShardsUnchanged)(plan.data.shards)
    burnt = run_files.path(plan.run.folder, run_files.BURN_DONE)
    state = read_state(plan.run.folder) if plan.run.resume else {}
    if schedule.burn_epochs and not state.get("burn_done"):
        set_trainable(backbone, False)
        burn_lr = scaled_lr(optimizer.burn_lr or optimizer.lr, replicas)
        yield PhasePlan("burn", burn_lr, schedule.burn_epochs, 0, [watch])
        model.save_weights(current().weights_file(burnt))
        write_state(plan.run.folder, dict(state, burn_done=True))
    elif schedule.burn_epochs and not tf.io.gfile.glob(burnt + "*"):
        raise TfpipeError(
            f"{plan.run.folder}: {run_files.STATE} says the burn-in finished, but its weights "
            f"({run_files.BURN_DONE}) are gone; start a new run in another {option('run')} folder"
        )
    elif schedule.burn_epochs:
        model.load_weights(current().weights_file(burnt))
    set_trainable(backbone, True)
    rate = make_schedule(
        optimizer.schedule, scaled_lr(optimizer.lr, replicas), schedule.steps, schedule.epochs, optimizer.warmup_epochs
    )
    first = [watch, swa] if schedule.swa_epochs else [watch]
    yield PhasePlan("fine-tune", rate, schedule.epochs, schedule.burn_epochs, first)


def set_trainable(backbone: keras.Model, trainable: bool) -> None:
    backbone.trainable = trainable  # a frozen backbone also runs its BatchNorm layers in inference mode


def run_phase(model: keras.Model, plan: Plan, spec: PhasePlan, data: PhaseData, throughput: Throughput) -> None:
    """Compiles and fits one phase, backed up at every epoch's end and within epochs, so ``--resume`` continues
    it. A stop asked meanwhile (SIGTERM, Ctrl-C) waits for the step, or the epoch's end, to be saved
    (``train.keras.backup.BackupPolicy``); then the job ends saying where."""
    train_ds, val_ds, _, val_steps, loss_weights = data
    steps = plan.schedule.steps  # the plan's epoch (on Keras 3 whole step groups: planning.whole_step_groups)
    compile_model(model, plan.model, plan.optimizer, spec.rate, plan.schedule.steps_per_execution, loss_weights)
    with deferred_stops() as stop:
        recorded = len(run_files.read_history(plan.run.folder) or [])
        workers = current().workers(plan.devices.handle)
        phase = Phase(spec.name, steps, spec.initial_epoch + spec.epochs, plan.devices.replicas,
                      workers.collective_saves, stop, recorded, spec.rate, workers.agree)  # fmt: skip
        callbacks, closing = phase_callbacks(plan, phase, throughput, spec.first)
        try:
            history = None
            for start, rest, done in current().fits(callbacks, model, phase, spec.initial_epoch):
                for c in callbacks:
                    if isinstance(c, StepGroups):
                        c.step_offset = done
                history = model.fit(
                    train_ds,
                    epochs=rest,
                    initial_epoch=start,
                    steps_per_epoch=steps - done,
                    validation_data=val_ds,
                    validation_steps=val_steps,
                    callbacks=callbacks,
                    verbose=plan.run.verbose,
                    shuffle=False,  # make_dataset shuffles (Keras 3 says it ignores shuffle=True on a dataset)
                )
                if model.stop_training:
                    break
        finally:
            for close in closing:  # also when fit fails: a heartbeat must not keep talking, nor a watch watching
                close()
        if stop.received is not None:  # asked during validation or an epoch's end: the epoch was saved whole
            done = history.epoch[-1] + 1 if history is not None and history.epoch else spec.initial_epoch
            stop.stop(
                f"after epoch {done}; saved: {option('resume', True)} continues there", f"the end of epoch {done}"
            )
