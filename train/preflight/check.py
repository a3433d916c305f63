"""``train.fit --preflight``: find on a CPU, in minutes, what a TPU would refuse -- before spending TPU time.

    python -m train.fit --records records/demo/train --model efficientnet-b0 --image-size 224 \
        --batch-size 16 --strategy tpu --preflight --tpu v3

With exactly the configuration of the TPU run (model, input size, per-core batch, precision -- bfloat16 unless
``--precision`` says otherwise --, augmentation, optimizer and schedule, the input pipeline over the real
shards), it builds the model on one CPU device, compiles one training step and one evaluation step with XLA
(``train.preflight.xla_step``) and reports, one line each naming the culprit and the fix: ops XLA cannot compile,
shapes not static, float64 (refused) and 64-bit integers (warned), a per-core batch that is not a multiple of 8 and
dense layers not multiples of 128 (warned), and the memory the training step needs on one core -- measured from
XLA's buffer assignment -- against a core of ``--tpu`` (``train.accel.tpus``), with the largest per-core batch that
fits. Nothing is written and nothing trained that is kept; the run folder is not touched.
"""

from __future__ import annotations

import contextlib
import math
import os
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from train.backends import keras_module

if TYPE_CHECKING:
    import tf_keras as keras
import tensorflow as tf

from tfpipe.format.shards import Shards
from tfpipe.runtime import console
from tfpipe.runtime.errors import TfpipeError, check_path, in_command, option
from tfpipe.tf.columns import check_no_image_twice
from train.accel.tpus import TPUS, Tpu
from train.keras.compiling import compile_model
from train.keras.config import FitConfig
from train.keras.data import build_datasets
from train.keras.models import build_model
from train.keras.plan import Devices, Plan
from train.keras.planning import check_config, make_plan, upscaling
from train.keras.schedules import make_schedule, scaled_lr
from train.preflight.core_memory import HEADROOM, SUBLANES, Memory, core_memory, gibibytes, gigabytes
from train.preflight.xla_step import (
    Compiled,
    Finding,
    StepRefused,
    buffer_bytes,
    compile_step,
    dtype_and_shape_findings,
)
from train.runs.results import PreflightReport

PREFIX = "preflight"
TPU_PRECISION = "mixed_bfloat16"  # what a TPU run uses unless --precision says otherwise
LANES = 128  # a TPU's matrix units multiply 128x128 tiles: a feature dimension is padded to a multiple of this
F64_FIX = "compute in float32 (a mixed policy computes in bfloat16 and keeps float32 weights)"


def preflight(cfg: FitConfig, shards: Shards) -> PreflightReport:
    """Checks ``cfg`` as a TPU run of ``cfg.tpu`` would compile it; returns the ``PreflightReport`` (``ok``:
    nothing a TPU would refuse; ``refuse`` and ``warn``: the lines; ``memory`` and ``seconds``: the figures). Through
    ``train.fit``: ``fit(FitConfig(..., preflight=True))``, or the command's ``--preflight`` (exit 2 on a refusal).
    ``shards``: opened by ``train.fit.fit``. The process's Keras precision policy is left as it was."""
    tpu, replicas = tpu_of(cfg)
    if tf.distribute.has_strategy():  # its model would be the strategy's (mirrored variables), not one device's
        raise TfpipeError("the preflight builds its own one-device model: call it outside strategy.scope()")
    here = tf.distribute.get_strategy()  # the default strategy: one device, where the steps are compiled
    with planned(cfg, shards, Devices("tf", here, "tpu", replicas)) as plan, tf.device("/CPU:0"):
        return check_steps(plan, tpu, build_datasets(plan, here))


def tpu_of(cfg: FitConfig) -> tuple[Tpu, int]:
    """The TPU a preflight checks for and the devices of its run (``cfg.replicas``, else the TPU's)."""
    check_path(records=cfg.records)
    if cfg.tpu not in TPUS:
        raise TfpipeError(f"unknown {option('tpu')} {cfg.tpu!r}: use one of {', '.join(TPUS)}")
    tpu = TPUS[cfg.tpu]
    return tpu, cfg.replicas or tpu.devices


@contextlib.contextmanager
def planned(cfg: FitConfig, shards: Shards, devices: Devices) -> Iterator[Plan]:
    """The run planned for the TPU's ``devices`` (``devices.handle``: where the preflight compiles; the
    configuration checked, the plan's checks, a batch this machine can hold), under the TPU run's precision policy
    (bfloat16 unless ``--precision`` says otherwise), restored after."""
    check_config(cfg)
    check_no_image_twice(shards)
    plan = make_plan(cfg, shards, devices)
    check_batch_fits_here(plan)
    precision = keras_module().mixed_precision
    previous = precision.global_policy()
    precision.set_global_policy(plan.model.precision or TPU_PRECISION)
    try:
        yield plan
    finally:
        precision.set_global_policy(previous)


def check_batch_fits_here(plan: Plan) -> None:
    """The preflight holds a batch of the run in this machine's memory (and pads validation batches before
    reading): a batch over a quarter of the free memory is refused in one line rather than exhausting it."""
    assert plan.model.image_size is not None
    needs = plan.data.batch_size * plan.model.image_size**2 * 3
    free = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    if needs > free / 4:
        raise TfpipeError(
            f"{option('batch_size', plan.data.batch_size)} at {option('image_size', plan.model.image_size)}: "
            f"{gigabytes(needs)} a batch, over a quarter of this machine's free memory ({gigabytes(free)}): "
            "too big to check here; check a smaller batch (its memory line gives the largest batch that fits a core)"
        )


def check_steps(plan: Plan, tpu: Tpu, data: tuple[Any, Any, int, int, int]) -> PreflightReport:
    """The checks, in the order a TPU run meets them: the input's shapes, the model, the compiled training and
    evaluation steps, the memory of a core; then the report."""
    train_ds, val_ds, n_train, _, _ = data
    replicas = plan.devices.replicas
    say(plan, headline(plan, tpu))
    report: dict[str, Any] = {"tpu": tpu.name, "replicas": replicas, "seconds": {}, "memory": None}
    findings = data_findings(plan, tpu, replicas, (train_ds, val_ds), n_train)
    if not any(f.level == "refuse" for f in findings):  # shapes XLA can compile: on to the model
        findings += model_checks(plan, tpu, (train_ds, val_ds), report)
    return finish(plan, tpu, findings, report)


def data_findings(plan: Plan, tpu: Tpu, replicas: int, datasets: tuple[Any, Any], n_train: int) -> list[Finding]:
    """What needs no model: the shapes and dtypes of the training and validation batches, the batch, the settings."""
    findings = input_findings(datasets[0].element_spec, "training batches")
    findings += input_findings(datasets[1].element_spec, "validation batches")
    return findings + batch_findings(plan, n_train // replicas) + setting_findings(plan, tpu) + size_findings(plan)


def headline(plan: Plan, tpu: Tpu) -> str:
    replicas, batch, m = plan.devices.replicas, plan.data.batch_size, plan.model
    return (
        f"{m.name} at {m.image_size} px, {batch} image{'s' * (batch != 1)} a core "
        f"({plan.global_batch} a step on {replicas} core{'s' * (replicas != 1)}), "
        f"{m.precision or TPU_PRECISION}, steps_per_execution {plan.schedule.steps_per_execution}; checked for a TPU "
        f"{tpu.name} core ({gibibytes(tpu.memory)}), compiled with XLA on this CPU"
    )


def say(plan: Plan, line: str, report: bool = False) -> None:
    """A progress line (unless quiet); a ``report`` line also when quiet under the command, whose output the
    report is (from Python, quiet is quiet: the returned report holds it all)."""
    if plan.run.verbose or (report and in_command()):
        print(f"{PREFIX}: {line}", flush=True)


def input_findings(spec: Any, name: str) -> list[Finding]:
    """A TPU compiles a step for one shape of its input: every dimension of every part of a batch must be known
    (no partial last batch, no images of their own sizes), and float64 cannot be fed to it. One finding a
    kind, naming the first part it is in."""
    found: dict[str, Finding] = {}
    for path, part in zip(("images", "targets", "weights"), tf.nest.flatten(spec)):
        shape = part.shape.as_list() if part.shape.rank is not None else None
        culprit = f"{name}, {path} {part.dtype.name}{shape}"
        if shape is None or None in shape:
            unknown = "the batch dimension" if shape and shape[0] is None else "a dimension"
            fix = (
                "batch with drop_remainder=True for training and pad_batches=True for evaluation "
                "(tfpipe.make_dataset), and give an image_size"
            )
            why = f"{unknown} is not static (a TPU compiles one shape)"
            found.setdefault("shape", Finding("refuse", culprit, why, fix))
        if part.dtype in (tf.float64, tf.int64, tf.uint64):
            level = "refuse" if part.dtype == tf.float64 else "warn"
            found.setdefault(level, Finding(level, culprit, "64-bit input", "cast it to 32 bits in the pipeline"))
    return list(found.values())


def batch_findings(plan: Plan, most: int) -> list[Finding]:
    """A core's batch is laid out in groups of ``SUBLANES``: 12 images a core cost what 16 do. The batch
    suggested is one the training set holds (``most`` images a core)."""
    if plan.data.batch_size % SUBLANES == 0:
        return []
    up, down = math.ceil(plan.data.batch_size / SUBLANES) * SUBLANES, plan.data.batch_size // SUBLANES * SUBLANES
    sizes = [option("batch_size", n) for n in (up, down) if SUBLANES <= n <= most]
    return [
        Finding(
            "warn",
            option("batch_size", plan.data.batch_size),
            f"not a multiple of {SUBLANES}: a TPU core computes it as {up} (the rest is padding)",
            f"use {' or '.join(sizes)}" if sizes else f"more images (a batch of {SUBLANES}s a core)",
        )
    ]


def setting_findings(plan: Plan, tpu: Tpu) -> list[Finding]:
    """Settings that are not a TPU run's: the preflight checks the run for a TPU whatever ``strategy`` says, and
    a TPU computes in bfloat16, not float16."""
    found = []
    if plan.settings.strategy in ("gpu", "cpu", "multiworker"):
        found.append(
            Finding(
                "warn",
                option("strategy", plan.settings.strategy),
                f"the preflight checks the run for a TPU {tpu.name}, not for this strategy",
                f"use {option('strategy', 'tpu')} (or auto) for the TPU run it checks",
            )
        )
    if plan.data.deterministic:
        found.append(
            Finding(
                "warn",
                option("deterministic", True),
                "not applied by the preflight (TensorFlow's op determinism is a switch for the whole process, "
                "never switched off): XLA has no deterministic gradient for some ops (MaxPool's, on every "
                "backend), so a TPU run may refuse what passes here",
                "leave it out of a TPU run, or check in a fresh process after "
                "tf.config.experimental.enable_op_determinism()",
            )
        )
    if plan.model.precision == "mixed_float16":
        found.append(
            Finding(
                "warn",
                option("precision", plan.model.precision),
                "float16 is the GPUs' mixed precision; Keras' guide says mixed_bfloat16 on a TPU",
                f"leave {option('precision')} out (bfloat16 on a TPU)",
            )
        )
    return found


def size_findings(plan: Plan) -> list[Finding]:
    """Shards stored smaller than the run's input: a TPU computes the upscaled pixels, as ``train.fit``'s build
    line says (``upscaling``)."""
    size, stored = plan.model.image_size, plan.data.shards.image_size
    up = upscaling(stored, size)
    if up is None:
        return []
    fix = (
        f"write the shards at {size} px (tfpipe.write --image-size {size}), or train at {option('image_size', stored)}"
    )
    return [Finding("warn", option("image_size", size), up, fix)]


def model_checks(plan: Plan, tpu: Tpu, datasets: tuple[Any, Any], report: dict[str, Any]) -> list[Finding]:
    """The model built and compiled as ``train.fit`` compiles it (optimizer, schedule over the plan's replicas
    and steps, loss, metrics), its steps compiled by XLA on the first real batches, timed, and measured."""
    verbose = bool(plan.run.verbose)
    with console.saying(PREFIX, "reading the first batches and building the model", "still building", verbose):
        started = time.perf_counter()
        batches = next(iter(datasets[0])), next(iter(datasets[1]))
        report["seconds"]["first_batches"] = round(time.perf_counter() - started, 2)
        model = compiled_model(plan)
    paths = layer_paths(model)
    findings = layer_findings(paths)
    try:
        train = compiled(plan, "training", model.train_step, batches[0], report)
        evaluation = compiled(plan, "evaluation", model.test_step, batches[1], report)
    except StepRefused as e:
        return findings + named(paths, e.findings)
    findings += program_findings(paths, [train, evaluation], findings)
    with console.saying(PREFIX, "measuring the memory of a core", "still measuring the memory", verbose):
        memory = core_memory(model, batches[0], buffer_bytes(train.proto)[0], tpu)
    report["memory"] = memory._asdict()
    findings += memory_findings(memory, tpu)
    if not any(f.level == "refuse" for f in findings):
        report["seconds"]["training_step"] = timed_step(plan, model, batches[0], memory.measured)
    return findings


def compiled_model(plan: Plan) -> keras.Model:
    """The model of the run, compiled with the run's optimizer and schedule (its optimizer slots built)."""
    m, optimizer, schedule = plan.model, plan.optimizer, plan.schedule
    model, _ = build_model(m.name, m.num_classes, m.image_size, weights=m.weights, multi_label=not m.single_label)
    lr = scaled_lr(optimizer.lr, plan.devices.replicas)
    rate = make_schedule(optimizer.schedule, lr, schedule.steps, schedule.epochs, optimizer.warmup_epochs)
    compile_model(model, m, optimizer, rate, schedule.steps_per_execution)
    return model


def compiled(plan: Plan, name: str, step: Any, batch: Any, report: dict[str, Any]) -> Compiled:
    with console.saying(
        PREFIX, f"compiling the {name} step with XLA", f"still compiling the {name} step", bool(plan.run.verbose)
    ):
        result = compile_step(step, batch)
    report["seconds"][f"compile_{name}"] = round(result.seconds, 2)
    return result


def layer_paths(model: keras.Model) -> dict[str, Any]:
    """Every layer by its path in the model, as TensorFlow names its ops (``my-net/backbone/block1/dense``),
    nested models walked; the deepest first, so that an op's path finds its own layer before the model's."""
    found: dict[str, Any] = {}
    keras = keras_module()

    def walk(layer: Any, prefix: str) -> None:
        path = f"{prefix}/{layer.name}" if prefix else layer.name
        found[path] = layer
        for inner in getattr(layer, "layers", ()) if isinstance(layer, keras.Model) else ():
            walk(inner, path)

    walk(model, "")
    return dict(sorted(found.items(), key=lambda item: -item[0].count("/")))


def layer_of(paths: dict[str, Any], culprit: str) -> str:
    """The layer an op's path (``model/block/layer/op/...``) is in: ``layer model/block/layer``; a path outside
    the model (the optimizer, the loss) stays as it is."""
    for path in paths:
        if culprit == path or culprit.startswith(path + "/"):
            return f"layer {path}" if "/" in path else culprit
    return culprit


def named(paths: dict[str, Any], findings: list[Finding]) -> list[Finding]:
    """``findings`` with each culprit its layer's path (``layer_of``), one finding a layer, kind and level."""
    found: dict[tuple[str, str, str], Finding] = {}
    for f in findings:
        culprit = layer_of(paths, f.culprit)
        kind = " ".join(f.why.split(" ")[:2])  # "float64 tensor", "op EagerPyFunc": the shapes differ
        found.setdefault((culprit, f.level, kind), f._replace(culprit=culprit))
    return list(found.values())


def layer_findings(paths: dict[str, Any]) -> list[Finding]:
    """Layers with float64 weights (a TPU has no float64: refused before compiling, so they are named even when
    another op stops the compiler first), and dense layers whose widths are not multiples of ``LANES`` (the
    classifier's outputs are the classes: not counted): a TPU's matrix units pad them, paying for work not done."""
    found: list[Finding] = []
    keras = keras_module()
    for path, layer in reversed(paths.items()):  # the model's order: outer layers first
        if not isinstance(layer, keras.Model) and any(w.dtype == tf.float64 for w in layer.weights):
            found.append(Finding("refuse", f"layer {path}", "float64 weights (a TPU has no float64)", F64_FIX))
        if not isinstance(layer, keras.layers.Dense):
            continue
        inputs, units = int(layer.kernel.shape[0]), int(layer.units)
        odd = [f"{n} {what}" for n, what in ((inputs, "inputs"), (units, "units")) if n % LANES]
        if layer.name == "classifier":
            odd = odd[:1] if inputs % LANES else []
        if odd:
            found.append(
                Finding(
                    "warn",
                    f"layer {path}",
                    f"{' and '.join(odd)}, not multiples of {LANES}: a TPU pads them to {LANES}s",
                    f"widths of {LANES}s use the TPU's matrix units fully",
                )
            )
    return found


def program_findings(paths: dict[str, Any], steps: list[Compiled], before: list[Finding]) -> list[Finding]:
    """What the compiled steps show (``dtype_and_shape_findings``), named by layer, once for both steps.
    float64 found ``before`` in a layer's weights is said once: the compiled programs' float64 ops (the layer's
    own, its gradient, its optimizer slots) follow from it."""
    weights_in_f64 = any(f.why.startswith("float64 weights") for f in before)
    found = [f for step in steps for f in dtype_and_shape_findings(step.lowered)]
    return named(paths, [f for f in found if not (weights_in_f64 and f.why.startswith("float64"))])


def memory_findings(memory: Memory, tpu: Tpu) -> list[Finding]:
    """A training step over the usable memory of a core: refused, with the batch that fits."""
    if memory.measured <= memory.usable:
        return []
    fits = memory.largest_batch
    fix = (
        f"use {option('batch_size', fits)} or less ({memory.largest_batch_is})"
        if fits
        else f"use a smaller {option('image_size')} or model (one image a core does not fit)"
    )
    why = (
        f"the training step needs {gigabytes(memory.measured)} (measured on XLA's CPU backend), more than "
        f"{HEADROOM:.0%} of a TPU {tpu.name} core's {gibibytes(tpu.memory)}"
    )
    return [Finding("refuse", "memory of a core", why, fix)]


def timed_step(plan: Plan, model: keras.Model, batch: Any, needs: int) -> float | None:
    """Seconds of one training step run here (compiled by XLA, its second call): a figure for comparing
    configurations on this machine, not a TPU's time. Not run when the step ``needs`` more than half the
    machine's free memory (the preflight of a large TPU batch must not exhaust the machine it runs on)."""
    free = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    if needs > free / 2:
        say(plan, f"a training step is not run here: it needs {gigabytes(needs)}, over half the free memory")
        return None
    step = tf.function(model.train_step, jit_compile=True)
    with console.saying(PREFIX, "timing a training step on this CPU", "still timing", bool(plan.run.verbose)):
        step(batch)  # compiles it (again: the compiled program above is not the one a call runs)
        started = time.perf_counter()
        step(batch)
    return round(time.perf_counter() - started, 3)


def finish(plan: Plan, tpu: Tpu, findings: list[Finding], report: dict[str, Any]) -> PreflightReport:
    """The report: the findings by level, the memory and time lines, and the verdict; printed unless quiet."""
    report["refuse"] = [f.line() for f in findings if f.level == "refuse"]
    report["warn"] = [f.line() for f in findings if f.level == "warn"]
    report["ok"] = not report["refuse"]
    for level in ("refuse", "warn"):
        for line in report[level]:
            say(plan, f"{'REFUSED' if level == 'refuse' else 'warning'}: {line}", report=True)
    for line in figures(tpu, report):
        say(plan, line, report=True)
    verdict = (
        f"all clear for a TPU {tpu.name}"
        if report["ok"]
        else f"a TPU {tpu.name} would refuse this run: {len(report['refuse'])} REFUSED line"
        f"{'s' * (len(report['refuse']) != 1)} above"
    )
    say(plan, f'{verdict} (what a preflight cannot see: docs/guides/training.md, "The preflight")', report=True)
    found = (tuple(report["refuse"]), tuple(report["warn"]), report["memory"], report["seconds"])
    return PreflightReport(report["tpu"], report["replicas"], *found)


def figures(tpu: Tpu, report: dict[str, Any]) -> list[str]:
    """The memory and time lines, each figure labelled measured or estimated."""
    lines = []
    memory, seconds = report["memory"], report["seconds"]
    if memory:
        rest = memory["measured"] - memory["weights"] - memory["optimizer"] - memory["batch"]
        lines.append(
            f"memory of a core: {gigabytes(memory['measured'])} for the training step (measured: XLA's buffers, on "
            f"its CPU backend) = weights {gigabytes(memory['weights'])}, optimizer {gigabytes(memory['optimizer'])}, "
            f"batch {gigabytes(memory['batch'])}, gradients, activations and scratch {gigabytes(rest)}; a TPU "
            f"{tpu.name} core has {gibibytes(tpu.memory)}: the largest per-core batch that fits {HEADROOM:.0%} of it "
            + (
                f"is {memory['largest_batch']} (measured)"
                if memory["largest_batch_is"] == "measured"
                else f"is about {memory['largest_batch']} (estimated from the step measured at two batch sizes)"
            )
        )
    if "compile_training" in seconds:
        step = seconds.get("training_step")
        lines.append(
            f"on this CPU: compiled the training step in {seconds['compile_training']:.1f} s and the evaluation "
            f"step in {seconds.get('compile_evaluation', 0):.1f} s"
            + (f"; a training step took {step:.2f} s" if step else "")
            + " (for comparing configurations here; not a TPU's times)"
        )
    return lines
