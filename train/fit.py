"""Train an image classifier on tfpipe shards, on TPU, GPUs, CPU or N virtual CPU replicas.

    python -m train.fit --records records/demo/train --strategy cpu --replicas 8 \
        --steps-per-execution 8 --run runs/demo

On a Kaggle TPU v3-8: ``--strategy tpu`` (the same command otherwise). This module is the command line over
``train.keras.config.FitConfig`` (also ``train.fit.FitConfig``), and imports no TensorFlow (``--help`` answers at once);
``fit`` runs the engine in ``train.keras.trainer``.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from tfpipe.format.sampling import SAMPLINGS
from tfpipe.runtime import console
from tfpipe.runtime.errors import ArgumentParser, TfpipeError, check_path, run_cli
from tfpipe.runtime.lifecycle import BAD_INPUT
from train.accel.tpus import TPUS
from train.decide.metrics import METRICS, Metric
from train.keras.config import FitConfig as FitConfig  # the notebook's spelling: from train.fit import FitConfig, fit
from train.keras.models import model_names
from train.keras.names import (
    BACKENDS,
    CLASS_WEIGHT_HELP,
    CLASS_WEIGHTS,
    OPTIMIZERS,
    PRECISIONS,
    SAMPLING_HELP,
    SCHEDULES,
    STRATEGIES,
)
from train.runs.results import Best, FitResult, PreflightReport, WorkerResult

if TYPE_CHECKING:
    from tfpipe.format.shards import Shards
    from tfpipe.tf.augment import Augment
    from train.backends.choice import Choice


def fit(cfg: FitConfig) -> FitResult | PreflightReport | WorkerResult:
    """Trains per ``cfg`` (a ``FitConfig``); returns a ``FitResult``, whose serialisation is the run's
    ``metrics.json`` (``FitResult.load(run)`` reads it back). With ``cfg.preflight``: trains nothing, writes
    nothing, returns the ``PreflightReport`` (``report.ok``). On a worker of a multi-worker cluster other than the
    chief: a ``WorkerResult`` naming the chief, which writes the run and returns its ``FitResult``.

    TensorFlow's C++ log lines are held back while it runs (``tfpipe.runtime.console.quiet_tensorflow``).

    Example (a notebook on a TPU, or anywhere with ``strategy="cpu", replicas=8``)::

        from train.fit import FitConfig, fit
        metrics = fit(FitConfig(records="gs://bucket/train", run="gs://bucket/runs/b0", strategy="tpu"))
    """
    started = time.perf_counter()
    shards, choice = start(cfg)
    with console.quiet_tensorflow(environment=False):
        if cfg.preflight:  # a report of what a TPU would refuse, instead of training
            return preflight(cfg, choice, shards)
        from train.keras import trainer  # the engine (Keras): imported when training starts, not with the command

        return trainer.train(trainer.plan_run(cfg, choice, shards), started)


def start(cfg: FitConfig) -> tuple[Shards, Choice]:
    """What a training job (``fit``, ``train.cv``) does before its engine starts: the shards opened, once and before
    TensorFlow starts (a mistyped folder is answered at once), and the process readied for its backend (``auto``
    continuing a run with the run's own), before Keras starts."""
    from tfpipe.format.shards import open_shards  # here, not at the top: --help stays instant
    from train.backends import choice as backend

    check_path(records=cfg.records)
    shards = open_shards(cfg.records)
    resume = cfg.run if cfg.resume else None
    return shards, backend.ready(cfg.backend, cfg.strategy, cfg.replicas, resume)


def preflight(cfg: FitConfig, choice: Choice, shards: Shards) -> PreflightReport:
    """The backend's preflight of ``cfg`` on ``shards``: what a TPU would refuse, compiled as it would be."""
    from train.backends import choice as backend

    if choice.name == "jax":  # the TPU's device count of XLA host devices, before JAX starts
        backend.ask_host_devices(cfg.replicas or TPUS[cfg.tpu].devices if cfg.tpu in TPUS else 1)
        from train.preflight import jax_check

        return jax_check.preflight(cfg, shards)
    from train.preflight import check

    return check.preflight(cfg, shards)


def build_parser(prog: str = "python -m train.fit", description: str | None = None) -> ArgumentParser:
    """The command's parser: one flag a field of ``FitConfig`` (``train.cv`` builds on it, with its own ``prog``)."""
    d = FitConfig()
    p = ArgumentParser(prog=prog, description=description or (__doc__ or "").split("\n\n")[0])
    _data_args(p, d)
    _model_args(p, d)
    _optimizer_args(p, d)
    _training_args(p, d)
    _augment_args(p)
    _run_args(p, d)
    _resume_args(p)
    _preflight_args(p, d)
    return p


def _preflight_args(p: ArgumentParser, d: FitConfig) -> None:
    """The TPU preflight: the same command, checked on a CPU instead of trained."""
    group = p.add_argument_group("preflight", "before spending TPU time (docs: the training guide, The preflight)")
    group.add_argument(
        "--preflight",
        action="store_true",
        help="train nothing: compile a training and an evaluation step with XLA as a TPU would, report what a TPU "
        "would refuse and the memory of a core; exit 2 on a refusal",
    )
    group.add_argument("--tpu", choices=tuple(TPUS), default=d.tpu, help="the TPU a --preflight checks for")


def _data_args(p: ArgumentParser, d: FitConfig) -> None:
    """What to train on, where to write, on which devices."""
    p.add_argument("--records", help=f"shard folder from tfpipe.write (default: {d.records}, where make demo writes)")
    p.add_argument("--run", default=d.run, help="the run folder to write (model, thresholds, history, metrics)")
    p.add_argument(
        "--strategy",
        choices=STRATEGIES,
        default=d.strategy,
        help="auto: TPU, then GPUs, then CPU; multiworker: several machines, the cluster in TF_CONFIG",
    )
    p.add_argument("--replicas", type=int, help="with --strategy cpu: N virtual CPU replicas (dry-run a TPU: 8)")
    p.add_argument(
        "--backend",
        choices=BACKENDS,
        default=d.backend,
        help="tf: tf-keras on TensorFlow's strategies; jax: Keras 3 on JAX (Kaggle's TPU v5e); auto: jax where "
        "TensorFlow cannot use the TPU or tf-keras is missing, else tf",
    )
    p.add_argument(
        "--data-service",
        metavar="grpc://HOST:PORT",
        help="a tf.data service dispatcher (python -m tfpipe.service): its workers read, decode and augment the "
        "training images",
    )


def _model_args(p: ArgumentParser, d: FitConfig) -> None:
    """The model, its input, and the size of the training steps."""
    p.add_argument(
        "--model", choices=model_names(), default=d.model, metavar="MODEL", help=f"one of {', '.join(model_names())}"
    )
    p.add_argument("--weights", default="none", help="none, imagenet (downloads) or a weights file")
    p.add_argument("--image-size", type=int, help="input side (default: the stored size)")
    p.add_argument("--batch-size", type=int, default=d.batch_size, help="per replica")
    p.add_argument("--epochs", type=int, default=d.epochs, help="fine-tuning epochs (after --burn-epochs)")
    p.add_argument(
        "--steps-per-execution",
        type=int,
        default=d.steps_per_execution,
        help="training steps per compiled call (fewer host round trips)",
    )


def _optimizer_args(p: ArgumentParser, d: FitConfig) -> None:
    """Learning rate, schedule, optimizer and loss."""
    p.add_argument("--lr", type=float, default=d.lr, help="base LR for ONE replica; scaled by the replica count")
    p.add_argument("--schedule", choices=SCHEDULES, default=d.schedule, help="learning-rate schedule")
    p.add_argument("--warmup-epochs", type=float, default=d.warmup_epochs, help="linear warm-up of the schedule")
    p.add_argument("--optimizer", choices=OPTIMIZERS, default=d.optimizer, help="optimizer")
    p.add_argument("--weight-decay", type=float, default=d.weight_decay, help="weight decay of adamw")
    p.add_argument("--label-smoothing", type=float, default=d.label_smoothing, help="label smoothing of the loss")


def _training_args(p: ArgumentParser, d: FitConfig) -> None:
    """The validation split, the burn-in phase, precision and the outputs' labels."""
    p.add_argument("--fold", type=int, help="validation fold of shards written with --num-folds (default: 0)")
    p.add_argument("--val-fraction", type=float, default=d.val_fraction, help="held-out shards without folds")
    p.add_argument("--burn-epochs", type=int, default=0, help="epochs training the head with the backbone frozen")
    p.add_argument("--burn-lr", type=float, help="base LR of the burn-in (default: --lr)")
    p.add_argument("--precision", choices=PRECISIONS, help="default: bfloat16 on TPU, float16 on GPU, float32 on CPU")
    p.add_argument("--single-label", action="store_true", default=None, help="softmax (default: from the manifest)")
    p.add_argument("--threshold", type=float, default=d.threshold, help="for F1 and accuracy of multi-label outputs")
    p.add_argument(
        "--metric",
        choices=tuple(METRICS),
        default=d.metric,
        help="the competition's figure: it heads the report and chooses final vs SWA, thresholds and TTA "
        "(single-label: accuracy, balanced_accuracy, f1_macro, roc_auc, log_loss; multi-label: exact_match, "
        "f1_micro, f1_macro, roc_auc)",
    )
    p.add_argument("--class-weight", choices=CLASS_WEIGHTS, help=CLASS_WEIGHT_HELP)
    p.add_argument("--sampling", choices=SAMPLINGS, help=SAMPLING_HELP)


AUGMENT_CROPS = ("pad", "resized", "none")  # Augment.crop's values on the command line ("none": None)


def _augment_args(p: ArgumentParser) -> None:
    """Training augmentation: one flag for every field of ``tfpipe.Augment``, made from its fields (so a field
    added there is a flag here), each left out meaning Augment's default; ``config_from_args`` makes the
    ``Augment`` of them. Importing ``tfpipe.tf.augment`` starts no TensorFlow."""
    from tfpipe.tf.augment import Augment

    group = p.add_argument_group("augmentation", "the fields of tfpipe.Augment, one flag each (docs: Augment)")
    group.add_argument("--no-augment", action="store_true", help="no training augmentation at all")
    described = documented_attributes(Augment)
    for field in dataclasses.fields(Augment):
        flag, default = "--" + field.name.replace("_", "-"), field.default
        shown = ",".join(f"{x:g}" for x in default) if isinstance(default, tuple) else default
        text = f"{described.get(field.name, 'Augment.' + field.name)} (default: {shown})"
        if field.name == "crop":
            group.add_argument(flag, choices=AUGMENT_CROPS, help=text)
        elif isinstance(default, bool):
            on = f"{described.get(field.name, 'Augment.' + field.name)} ({'on' if default else 'off'} by default)"
            group.add_argument(flag, action=argparse.BooleanOptionalAction, help=on)
        elif isinstance(default, tuple):
            group.add_argument(flag, type=_float_pair, metavar="LOW,HIGH", help=text)
        else:
            group.add_argument(flag, type=int if field.type.startswith("int") else float, help=text)


def documented_attributes(cls: type) -> dict[str, str]:
    """The ``Attributes:`` section of a class's docstring (Google style) as {name: text}; an entry may name
    several (``brightness, contrast, saturation: ...``). The flags' help is the class's own words."""
    import inspect

    found: dict[str, str] = {}
    names: list[str] = []
    lines = (inspect.getdoc(cls) or "").split("Attributes:", 1)[-1].splitlines()
    for line in lines[1:]:
        entry = line[2:] if line.startswith("  ") and not line.startswith("    ") else None
        if entry is not None and ":" in entry:
            head, text = entry.split(":", 1)
            names = [n.strip() for n in head.split(",")]
            found.update(dict.fromkeys(names, text.strip().replace("``", "")))
        elif line.startswith("    ") and names:
            found.update({n: f"{found[n]} {line.strip().replace('``', '')}" for n in names})
        elif line.strip():
            break
    return found


def _float_pair(text: str) -> tuple[float, float]:
    """``0.5,1.0`` -> (0.5, 1.0): a range flag's two numbers."""
    parts = text.split(",")
    try:
        low, high = (float(x) for x in parts)
    except ValueError:
        raise argparse.ArgumentTypeError(f"two numbers, LOW,HIGH (e.g. 0.5,1.0), not {text!r}") from None
    return low, high


def _run_args(p: ArgumentParser, d: FitConfig) -> None:
    """Seeding, weight averaging, the report, resuming and Keras' output."""
    p.add_argument(
        "--seed", type=int, help="seed of the initial weights, shuffling and augmentation (fixes the input order)"
    )
    p.add_argument(
        "--deterministic",
        action="store_true",
        help="same batches and weights on every run (seed 0 unless --seed; slower)",
    )
    p.add_argument(
        "--swa-epochs",
        type=int,
        default=0,
        help="stochastic weight averaging over the last N epochs -> model-swa.keras",
    )
    p.add_argument(
        "--no-report",
        dest="report",
        action="store_false",
        help="skip the validation report (by default written after training: predictions, thresholds, pictures)",
    )
    p.add_argument(
        "--overwrite",
        action="store_true",
        help="replace the run in --run: the files train.fit wrote there (others stay)",
    )
    p.add_argument(
        "--verbose",
        type=int,
        choices=(0, 1, 2),
        help="0 silent, 1 a progress bar, 2 lines (one per epoch, and where an epoch is every 15 s) "
        "(default: 1 on a terminal, else 2)",
    )


def _resume_args(p: ArgumentParser) -> None:
    """Resuming, and the backups it resumes from."""
    p.add_argument(
        "--resume", action="store_true", help="continue the run in --run where it stopped (its epoch and step)"
    )
    p.add_argument(
        "--save-every",
        type=int,
        metavar="STEPS",
        help="back the run up within an epoch every STEPS steps, for --resume after a kill; 0: at epoch ends only "
        "(default: every 10 minutes; with --strategy multiworker, epoch ends only). SIGTERM and Ctrl-C always "
        "save the step they stop at (on one machine)",
    )


def config_from_args(args: argparse.Namespace) -> FitConfig:
    augment = augment_from_args(args)
    fields = {f.name for f in dataclasses.fields(FitConfig)} - {"augment", "callbacks"}
    given = {k: v for k, v in vars(args).items() if k in fields and v is not None}  # None: the default
    if args.verbose is None:  # a bar where someone watches, lines in a log (a bar there is one endless line)
        given["verbose"] = 1 if console.on_terminal() else 2
    return FitConfig(augment=augment, **given)


def augment_from_args(args: argparse.Namespace) -> Augment:
    """The ``Augment`` the flags give (Augment's defaults for those left out); ``--no-augment`` with a flag that
    asks for some augmentation is refused rather than one of them ignored."""
    from tfpipe.tf.augment import NO_AUGMENT, Augment

    given = {f.name: getattr(args, f.name) for f in dataclasses.fields(Augment) if getattr(args, f.name) is not None}
    if given.get("crop") == "none":
        given["crop"] = None
    if args.no_augment:
        asking = [name for name, value in given.items() if name != "jit" and value != getattr(NO_AUGMENT, name)]
        if asking:
            flags = ", ".join(_flag(name, given[name]) for name in asking)
            raise TfpipeError(f"--no-augment turns training augmentation off, and {flags} asks for some; give one")
        return dataclasses.replace(NO_AUGMENT, **given)
    return Augment(**given)


def _flag(name: str, value: object) -> str:
    """How a flag of ``name`` was typed for ``value`` (``--no-flip`` for flip False)."""
    flag = name.replace("_", "-")
    return f"--no-{flag}" if value is False else f"--{flag}"


def run_command(args: argparse.Namespace) -> int:
    if args.records is None:  # the demo's folder: say so when it is not there, rather than "no shard files"
        args.records = FitConfig.records
        from tfpipe.runtime import fs

        if not fs.exists(args.records):
            raise TfpipeError(
                f"{args.records} does not exist; it is the default of --records (the folder make demo writes): "
                "pass --records with the shard folder to train on"
            )
    m = fit(config_from_args(args))  # a worker stopped (a job scheduler's SIGTERM) says so, and its peers name it
    if isinstance(m, WorkerResult):  # a multi-worker job's other workers: the chief prints the results
        print(f"train.fit: {m.task} done; {m.chief_task}, the chief, writes the run", flush=True)
        return 0
    if isinstance(m, PreflightReport):  # the report is printed: exit 2 when a TPU would refuse the run
        return 0 if m.ok else BAD_INPUT
    print("\n".join(summary_lines(m)))
    return 0


def summary_lines(m: FitResult) -> list[str]:
    """What the command prints of a finished run: its headline (the exact AUC, Keras' estimate labelled), the
    SWA model's, and model.keras's class table (model-swa.keras's: metrics.json, "swa", or train.inspect)."""
    headline = (
        f"validation {_lead(m.report, m.metric)}AUC {_headline_auc(m.report, m.keras_auc, m.best)}"
        f"{_scores(m.report, m.metric)}, "
        f"{m.epochs} epoch{'s' * (m.epochs != 1)}, {m.optimizer_steps} step{'s' * (m.optimizer_steps != 1)}, "
        f"{m.replicas} replica{'s' * (m.replicas > 1)} x {m.per_replica_batch_size} = {m.global_batch_size} per "
        f"step, steps_per_execution {m.steps_per_execution}, {m.images_per_sec} images/s -> {m.run}"
    )
    lines = [headline]
    if m.swa:
        lines.append(
            f"SWA of the last {m.swa.epochs_averaged} epoch{'s' * (m.swa.epochs_averaged != 1)}: "
            f"validation {_lead(m.swa.report, m.metric)}AUC {_headline_auc(m.swa.report, m.swa.val_auc, None)}"
            f"{_scores(m.swa.report, m.metric)}"
            f" -> {m.run}/model-swa.keras"
        )
    if m.report:
        from train.decide.evaluation import class_table

        title = "model.keras, 1 view, " + (
            "labels by argmax" if m.single_label else "at the thresholds of thresholds.json"
        )
        lines += [*class_table(m.report, title=title), f'  (every class: {m.run}/metrics.json, "report")']
    return lines


def _lead(report: Mapping[str, Any] | None, metric: Metric) -> str:
    """``balanced accuracy 0.8120, `` first where the run's metric is not the AUC that follows."""
    return f"{metric.figure(report)}, " if report and metric.key != "roc_auc_macro" else ""


def _scores(report: Mapping[str, Any] | None, metric: Metric) -> str:
    """ ", exact-match ..., F1 ..." of the report (the figures the line has not given yet), when it ran."""
    from train.decide.evaluation import headline, is_single_label

    if not report:
        return ""
    how = " (labels by argmax)" if is_single_label(report) else ""
    return f", {headline(report, metric, skip=(metric.key, 'roc_auc_macro'))}{how}"


def _headline_auc(report: Mapping[str, Any] | None, keras: float | None, best: Best | None) -> str:
    """The exact AUC of the saved model (sklearn, as in roc.png) when the report ran, with Keras' per-epoch
    binned estimate (``keras``; ``best``: the best epoch's) labelled as such; without the report only the estimate
    exists, and says so."""
    keras_auc = float("nan") if keras is None else keras
    best_auc = float("nan") if best is None or best.val_auc is None else best.val_auc
    best_at = f", best {best_auc:.4f} at epoch {best.epoch}" if best else ""
    exact = (report or {}).get("roc_auc_macro")
    if report and exact is None:  # no class has both positive and negative validation images
        return (
            "undefined (no class has both positive and negative validation images; Keras' binned estimate "
            f"{keras_auc:.4f} means nothing here)"
        )
    if exact is None:
        return f"{keras_auc:.4f} (Keras' binned estimate{best_at})"
    return f"{exact:.4f} (exact; Keras' binned estimate {keras_auc:.4f}{best_at})"


def main(argv: Sequence[str] | None = None) -> int:
    return run_cli("train.fit", run_command, build_parser().parse_args(argv))


if __name__ == "__main__":
    code = main()
    from tfpipe.runtime.lifecycle import exit_now
    from train.accel.cluster import in_a_cluster

    if in_a_cluster():  # TensorFlow's teardown would report the workers that ended first, after our last line
        exit_now(code)
    sys.exit(code)
