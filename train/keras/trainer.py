"""The training engine behind ``train.fit`` (TensorFlow and tf-keras): datasets, model, phases, outputs.

``train.fit`` holds the configuration and the command line (no TensorFlow, so ``--help`` is instant) and calls
``fit`` here. Steps: resolve the strategy -> check the plan (``train.keras.plan``) -> split train/validation by fold ->
check out the run folder (``train.keras.fit_run``) -> build distributed datasets -> build and compile the model inside
``strategy.scope()`` (``train.keras.compiling``) -> (optionally) train the head with the backbone frozen -> fine-tune
everything, each phase with its callbacks (``train.keras.callbacks``) -> save ``model.keras``, ``history.csv``,
``metrics.json`` and the reports.
"""

from __future__ import annotations

import dataclasses
import json
import tempfile
import time
import zlib
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from tfpipe.runtime.deps import check_installed
from train import backends as backend
from train.backends import complete, current, keras_module

if TYPE_CHECKING:
    import tf_keras as keras
import tensorflow as tf

import tfpipe
from tfpipe.format.shards import Shards, open_shards
from tfpipe.runtime import console, fs
from tfpipe.runtime.errors import TfpipeError, check_count, check_path, option, renamed
from tfpipe.runtime.lifecycle import deferred_stops
from tfpipe.runtime.locks import WriteLock, locked_folder
from tfpipe.tf.columns import check_no_image_twice
from train.accel.cluster import (
    check_same_start,
    chief_name,
    copy_for_resume,
    is_chief,
    is_multiworker,
    peers_answering,
    records_here,
    task_name,
)
from train.accel.strategy import default_precision, quick_teardown
from train.keras.backup import Phase, StepGroups
from train.keras.callbacks import ShardsUnchanged, Throughput, phase_callbacks
from train.keras.compiling import compile_model
from train.keras.config import FitConfig
from train.keras.data import PhaseData, training_data
from train.keras.fit_run import (
    Layout,
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
from train.keras.plan import (
    capped_steps_per_execution,
    check_batch_fits,
    check_numbers,
    check_strategy_settings,
    prepare,
)
from train.keras.schedules import make_schedule, scaled_lr
from train.keras.swa import AverageWeights
from train.runs import files
from train.runs import run as run_files
from train.runs.results import FitResult, WorkerResult
from train.runs.run import Parts, read_state, training_parts, write_state


def run_phase(
    model: keras.Model,
    cfg: FitConfig,
    name: str,
    lr_schedule: float | keras.optimizers.schedules.LearningRateSchedule,
    epochs: int,
    initial_epoch: int,
    data: PhaseData,
    num_classes: int,
    throughput: Throughput,
    strategy: Any,
    first: Sequence[keras.callbacks.Callback] = (),
) -> None:
    """Compiles and fits one phase, backed up at every epoch's end and within epochs, so ``--resume`` continues
    it. A stop asked meanwhile (SIGTERM, Ctrl-C) waits for the step, or the epoch's end, to be saved
    (``train.keras.backup.BackupPolicy``); then the job ends saying where.

    ``first``: callbacks that run before the backup at the end of an epoch.
    """
    train_ds, val_ds, steps, val_steps, loss_weights = data
    compile_model(model, cfg, lr_schedule, num_classes, loss_weights)
    with deferred_stops() as stop:
        recorded = len(run_files.read_history(cfg.run) or [])
        phase = Phase(name, steps, initial_epoch + epochs, strategy.num_replicas_in_sync, is_multiworker(strategy),
                      stop, recorded, lr_schedule)  # fmt: skip
        callbacks, closing = phase_callbacks(cfg, phase, throughput, first)
        try:
            history = None
            for start, rest, done in current().fits(callbacks, model, phase, initial_epoch):
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
                    verbose=cfg.verbose,
                    shuffle=False,  # make_dataset shuffles (Keras 3 says it ignores shuffle=True on a dataset)
                )
                if model.stop_training:
                    break
        finally:
            for close in closing:  # also when fit fails: a heartbeat must not keep talking, nor a watch watching
                close()
        if stop.received is not None:  # asked during validation or an epoch's end: the epoch was saved whole
            done = history.epoch[-1] + 1 if history is not None and history.epoch else initial_epoch
            stop.stop(
                f"after epoch {done}; saved: {option('resume', True)} continues there", f"the end of epoch {done}"
            )


def set_trainable(backbone: keras.Model, trainable: bool) -> None:
    backbone.trainable = trainable  # a frozen backbone also runs its BatchNorm layers in inference mode


def seed_run(plan: FitConfig) -> None:
    """A seed (``prepare`` gives a deterministic run seed 0 when it has none): the initial weights, dropout and
    Python's, NumPy's and TensorFlow's global generators seeded (``keras.utils.set_random_seed``, as a user would);
    ``deterministic`` also turns on TensorFlow's op determinism. The input order and augmentation take the seed
    from the plan too."""
    if plan.seed is not None:
        keras_module().utils.set_random_seed(plan.seed)
    if plan.deterministic:
        tf.config.experimental.enable_op_determinism()


def fit(cfg: FitConfig, choice: backend.Choice | None = None) -> FitResult | WorkerResult:
    """Trains per ``cfg`` (a ``FitConfig``); returns the ``FitResult`` whose serialisation is ``metrics.json``
    (a multi-worker job's other workers: a ``WorkerResult``).

    Called through ``train.fit.fit`` (see its example).
    """
    started = time.perf_counter()
    check_settings(cfg)
    choice = choice or backend.ready(cfg.backend, cfg.strategy, cfg.replicas)  # train.fit.fit's, made first
    strategy, kind = backend.resolve(choice, cfg.strategy, cfg.replicas)  # first: virtual CPUs need a fresh start
    if cfg.verbose:
        print(f"train.fit: {backend.describe(choice, strategy, kind)}", flush=True)
    plan, shards, parts = plan_training(dataclasses.replace(cfg, backend=choice.name), strategy.num_replicas_in_sync)
    return train_planned(plan, shards, parts, strategy, kind, started)


def check_settings(cfg: FitConfig) -> None:
    """What can be refused before any strategy starts: paths, numbers, the strategy's own settings, and the
    package the report's pictures need (they come last: a missing one must not cost a whole run)."""
    check_path(records=cfg.records, run=cfg.run)
    check_count(1, replicas=cfg.replicas)
    check_numbers(cfg)
    check_strategy_settings(cfg)  # before a multi-worker strategy connects to its cluster
    if cfg.report:
        check_installed("matplotlib")


def train_planned(
    plan: FitConfig, shards: Shards, parts: Parts, strategy: tf.distribute.Strategy, kind: str, started: float
) -> FitResult | WorkerResult:
    """A run already checked and planned (``plan_training``'s) on a strategy already made, into ``plan.run``:
    ``train.fit``'s run, and each fold's of ``train.cv`` (which plans every fold from the shards it opened once)."""
    seed_run(plan)  # after prepare's checks (a seed out of range is one line), before the model is built
    with peers_answering(strategy, plan.run):
        if not is_chief(strategy):
            return train_as_worker(plan, shards, parts, strategy, kind, started)
        # Every check that needs no training has passed: only now is the run folder made and written.
        created = not fs.exists(plan.run)
        try:
            # One job per run folder: two fits started together would interleave one history.csv and one model.
            with locked_folder(plan.run, "train.fit", setting="run") as lock, quick_teardown():
                if is_multiworker(strategy):  # before check_out, which may replace the run (--overwrite)
                    check_same_start(strategy, plan.run, start_point(plan.run, plan, shards))
                fresh = check_out(plan, shards, Layout.of(strategy, parts))
                metrics = train_and_report(plan, shards, parts, strategy, kind, lock, started, fresh)
                return FitResult.from_metrics(plan.run, metrics)
        except BaseException:
            if created:
                remove_if_empty(plan.run)  # made by this job, and nothing in it worth keeping
            raise


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


def start_point(folder: str, plan: FitConfig, shards: Shards) -> tuple[int, int, int]:
    """Where a worker's training starts, to compare across workers: the epochs its run ``folder`` records (none
    when ``overwrite`` replaces them), whether the burn-in is done, and a digest of every setting but
    ``MAY_DIFFER`` and of the shards' dataset id."""
    settings = settings_of(plan)
    kept = sorted((k, v) for k, v in settings.items() if k not in MAY_DIFFER) + [("shards", shards.dataset_id)]
    digest = zlib.crc32(json.dumps(kept, default=str).encode()) % 2**20  # small: exact in float64 sums
    if plan.overwrite:
        return 0, 0, digest
    rows = run_files.read_history(folder) or []
    return len(rows), int(bool(read_state(folder).get("burn_done"))), digest


def train_as_worker(
    plan: FitConfig, shards: Shards, parts: Parts, strategy: tf.distribute.Strategy, kind: str, started: float
) -> WorkerResult:
    """A worker other than the chief: the same training, step for step, in a private temporary folder removed
    when it ends (on ``resume`` a copy of what the chief's run folder holds to continue from); the chief writes
    the run. Returns which task this was."""
    with tempfile.TemporaryDirectory(prefix="tfpipe-worker-") as own:
        try:
            if plan.resume:
                copy_for_resume(plan.run, own, RESUMED)
                records_here(own, plan.records)
            mine = dataclasses.replace(plan, run=own, verbose=0, overwrite=False)
            still = f"{task_name(strategy)}: still training ({chief_name(strategy)}, the chief, prints the epochs)"
            with (
                locked_folder(own, "train.fit", setting="run") as lock,
                quick_teardown(),
                console.saying("train.fit", None, still, plan.verbose > 0),
            ):  # a heartbeat: a worker's log is not silent for its whole run
                check_same_start(strategy, plan.run, start_point(own, mine, shards))
                fresh = check_out(mine, shards, Layout.of(strategy, parts))
                train_and_report(mine, shards, parts, strategy, kind, lock, started, fresh)
        except TfpipeError as e:  # said of the private folder: the user knows the run folder
            raise renamed(e, own, plan.run) from None  # the same kind, said of the run folder
    return WorkerResult(task_name(strategy), chief_name(strategy), plan.run)


def plan_training(cfg: FitConfig, replicas: int, shards: Shards | None = None) -> tuple[FitConfig, Shards, Parts]:
    """The shards opened and checked (``shards``: opened and checked already, by a CV for all its folds), the
    plan (``prepare``) and the training and validation parts, for a run on ``replicas`` replicas: every check
    that needs no model. Shared by training, ``train.cv`` and ``train.preflight.check``."""
    if shards is None:
        shards = open_shards(cfg.records)
        check_no_image_twice(shards)
    plan = prepare(cfg, shards)
    parts = training_parts(shards, plan.fold, plan.val_fraction)  # the fold exists
    check_batch_fits(plan, replicas, tfpipe.count_examples(parts.train, parts.train_folds))
    return plan, shards, parts


def train_and_report(
    plan: FitConfig,
    shards: Shards,
    parts: Parts,
    strategy: tf.distribute.Strategy,
    kind: str,
    lock: WriteLock,
    started: float,
    fresh: bool,
) -> dict[str, Any]:
    """The run itself, in ``plan.run`` (locked by ``lock``): config, training, model.keras, reports, metrics.json.
    The shards are checked against their dataset id at every epoch's end and before each output: a folder
    rewritten meanwhile stops the run, and no finished run claims classes or records the shards no longer hold.
    In a ``fresh`` (new or empty) folder, a failure before the first epoch is saved removes what the job wrote."""
    precision = plan.precision or default_precision(kind)
    data, n_train, n_val, global_batch = training_data(plan, strategy, shards, parts, say=bool(plan.verbose))
    plan = capped_steps_per_execution(plan, data[2])
    throughput = complete(Throughput)(global_batch)
    with stops_recorded(plan.run), removed_unless_an_epoch_is_saved(plan.run, fresh, throughput):
        write_run_config(plan, shards, Layout(strategy.num_replicas_in_sync, n_train))
        keras_module().mixed_precision.set_global_policy(precision)
        if plan.verbose:
            announce_build(plan, strategy, kind, n_train, n_val, shards.image_size)
        with strategy.scope(), tfpipe.naming_corrupt_shards(shards), stopping_cleanly(plan, shards):
            model, swa = train_phases(plan, strategy, shards, data, throughput)
    trained_on, steps, optimizer_steps = strategy, data[2], int(model.optimizer.iterations.numpy())
    if is_multiworker(strategy):
        weights = model.get_weights()  # on every worker: a batch-norm statistic is the mean over all replicas
        if not is_chief(strategy):
            return {}  # the chief saves, scores and reports
        model, strategy, data = on_this_machine(plan, shards, parts, weights)
    lock.check()  # on gs:// the lock is advisory: a job that lost it saves nothing
    shards.check_unchanged()
    report_args = report_arguments(plan, shards, parts)
    with stops_recorded(plan.run, "the report"), unfinished_on_error(plan.run), tfpipe.naming_corrupt_shards(shards):
        with console.saying("train.fit", f"saving {run_files.MODEL}", "still saving the model", bool(plan.verbose)):
            save_model(model, run_files.path(plan.run, run_files.MODEL))
        sizes = (global_batch, steps, n_train, n_val, optimizer_steps)
        metrics = summarise(plan, kind, trained_on, sizes, precision, time.perf_counter() - started, throughput)
        # the kind and the metric its choices decide by (train.decide.metrics), said with its scores
        metrics = {"backend": plan.backend, "single_label": bool(plan.single_label), "metric": plan.metric, **metrics}
        metrics.update(reports(model, swa, strategy, plan, data, report_args, parts, throughput.last_seconds))
        shards.check_unchanged(sizes=True)  # the report was of the shards trained on, none replaced in place
        fs.write_atomic(run_files.path(plan.run, run_files.METRICS), json.dumps(metrics, indent=1) + "\n")
        files.record(plan.run, [run_files.METRICS])  # its scores choose the model train.predict uses
    write_state(plan.run, dict(read_state(plan.run), burn_done=bool(plan.burn_epochs), finished=True))
    if fs.exists(run_files.path(plan.run, run_files.BACKUP)):
        fs.rmtree(run_files.path(plan.run, run_files.BACKUP))  # finished: nothing left to resume
    return metrics


def on_this_machine(
    plan: FitConfig, shards: Shards, parts: Parts, weights: list[Any]
) -> tuple[keras.Model, tf.distribute.Strategy, PhaseData]:
    """The chief of a multi-worker job once training ends: the trained ``weights`` in a model of its own under
    the default strategy (no step waits for workers that have ended), with datasets for this machine alone, to
    save, score and report (and SWA's batch-norm pass). Saved with a fresh optimizer, as the SWA model is."""
    strategy = tf.distribute.get_strategy()  # outside every scope: the default strategy, this machine
    assert shards.num_classes is not None and plan.image_size is not None  # prepare() decided them
    with console.saying("train.fit", None, f"still building {plan.model} on the chief", bool(plan.verbose)):
        model, _ = build_model(
            plan.model, shards.num_classes, plan.image_size, weights=None, multi_label=not plan.single_label
        )
        data, *_ = training_data(plan, strategy, shards, parts)
        compile_model(model, plan, 0.0, shards.num_classes, data.loss_weights)
        model.set_weights(weights)
    return model, strategy, data


def announce_build(
    plan: FitConfig, strategy: tf.distribute.Strategy, kind: str, n_train: int, n_val: int, stored: int | None
) -> None:
    """The line saying what is built on what, before the minutes of building and compiling; images stored at
    another size are said to be resized (train.predict then wants shards stored as these are)."""
    resized = f" (images stored at {stored} px, resized as read)" if stored and stored != plan.image_size else ""
    print(
        f"train.fit: building {plan.model} at {plan.image_size} px{resized} on {strategy.num_replicas_in_sync} "
        f"{kind} replica{'s' * (strategy.num_replicas_in_sync > 1)}; {n_train} training image{'s' * (n_train != 1)}, "
        f"{n_val} validation image{'s' * (n_val != 1)}",
        flush=True,
    )


def train_phases(
    plan: FitConfig, strategy: tf.distribute.Strategy, shards: Shards, data: PhaseData, throughput: Throughput
) -> tuple[keras.Model, AverageWeights]:
    """Builds the model (inside ``strategy.scope()``), trains the head with the backbone frozen when asked, then
    everything. Returns (model, the SWA average)."""
    replicas, steps, num_classes = strategy.num_replicas_in_sync, data[2], shards.num_classes
    # prepare() refuses shards without a manifest (which gives the classes) and decides the input size
    assert num_classes is not None and plan.image_size is not None
    watch = complete(ShardsUnchanged)(shards)
    # announce_build said "building MODEL at SIZE px on N replicas" (unless quiet): a heartbeat is enough here
    with console.saying("train.fit", None, f"still building {plan.model}", bool(plan.verbose)):
        model, backbone = build_model(
            plan.model, num_classes, plan.image_size, weights=plan.weights, multi_label=not plan.single_label
        )
    state = read_state(plan.run) if plan.resume else {}
    if plan.burn_epochs:
        burn_in(model, backbone, plan, state, strategy, data, num_classes, throughput, watch)
    set_trainable(backbone, True)
    schedule = make_schedule(plan.schedule, scaled_lr(plan.lr, replicas), steps, plan.epochs, plan.warmup_epochs)
    swa = complete(AverageWeights)(
        plan.burn_epochs + plan.epochs - plan.swa_epochs, run_files.path(plan.run, run_files.SWA_AVERAGE)
    )
    run_phase(
        model,
        plan,
        "fine-tune",
        schedule,
        plan.epochs,
        plan.burn_epochs,
        data,
        num_classes,
        throughput,
        strategy,
        first=[watch, swa] if plan.swa_epochs else [watch],
    )
    return model, swa


def burn_in(
    model: keras.Model,
    backbone: keras.Model,
    plan: FitConfig,
    state: dict[str, bool],
    strategy: Any,
    data: PhaseData,
    num_classes: int,
    throughput: Throughput,
    watch: ShardsUnchanged,
) -> None:
    """Trains the head with the backbone frozen for ``plan.burn_epochs`` and keeps its weights for ``--resume``;
    a resumed run whose state says the burn-in finished loads those weights instead."""
    if not state.get("burn_done"):
        set_trainable(backbone, False)
        run_phase(
            model,
            plan,
            "burn",
            scaled_lr(plan.burn_lr or plan.lr, strategy.num_replicas_in_sync),
            plan.burn_epochs,
            0,
            data,
            num_classes,
            throughput,
            strategy,
            first=[watch],
        )
        model.save_weights(current().weights_file(run_files.path(plan.run, run_files.BURN_DONE)))
        write_state(plan.run, dict(state, burn_done=True))
    elif not tf.io.gfile.glob(run_files.path(plan.run, run_files.BURN_DONE) + "*"):
        raise TfpipeError(
            f"{plan.run}: {run_files.STATE} says the burn-in finished, but its weights "
            f"({run_files.BURN_DONE}) are gone; start a new run in another {option('run')} folder"
        )
    else:
        model.load_weights(current().weights_file(run_files.path(plan.run, run_files.BURN_DONE)))
