"""``train.fit --preflight --backend jax``: the TPU preflight for Keras 3 on JAX.

    python -m train.fit --records records/demo/train --model efficientnet-b0 --image-size 224 \
        --batch-size 16 --backend jax --preflight --tpu v5e

The same checks as the TF path (``train.preflight.check``: the input's shapes and dtypes, the batch and the dense
widths, the settings, the report), but the step is the one a TPU runs under ``keras.distribution.DataParallel``:
Keras 3's own ``train_step``, compiled by XLA (``jax.jit``) as one SPMD program over the TPU's device count of XLA
host devices (``--tpu v5e``: 8), each device a per-core batch. The memory of a device is XLA's own analysis of
that program (``compiled.memory_analysis()``: its arguments, outputs and temporaries, less what is aliased), on the
CPU backend: a guide to the TPU's, whose layouts and bfloat16 differ.
"""

from __future__ import annotations

import re
import time
from typing import Any

import numpy as np

from tfpipe.format.shards import Shards
from tfpipe.runtime import console
from tfpipe.runtime.errors import TfpipeError
from train.accel.tpus import Tpu
from train.backends.choice import HOST_DEVICES
from train.backends.jax import JaxDevices
from train.keras.config import FitConfig
from train.keras.data import build_datasets
from train.keras.plan import Devices, Plan
from train.preflight.check import (
    PREFIX,
    compiled_model,
    data_findings,
    finish,
    headline,
    layer_findings,
    layer_paths,
    memory_findings,
    planned,
    say,
    tpu_of,
)
from train.preflight.core_memory import HEADROOM, SUBLANES, Memory, largest_batch
from train.preflight.xla_step import COMPILE_FIX, Finding, StepRefused
from train.runs.results import PreflightReport


def preflight(cfg: FitConfig, shards: Shards) -> PreflightReport:
    """``train.preflight.check.preflight`` on Keras 3 and JAX: ``cfg`` checked as a run on every core of a
    ``cfg.tpu``, compiled over that many XLA host devices (``train.fit.fit`` asked XLA for them); ``shards``:
    opened by ``train.fit.fit``."""
    import jax

    tpu, replicas = tpu_of(cfg)
    cpus = jax.devices("cpu")
    if len(cpus) < replicas:
        raise TfpipeError(
            f"JAX started with {len(cpus)} CPU device{'s' * (len(cpus) != 1)}, and the preflight of a TPU "
            f"{tpu.name} compiles over {replicas}: set XLA_FLAGS={HOST_DEVICES}={replicas} before JAX starts"
        )
    devices = JaxDevices(cpus[:replicas], "cpu")
    with planned(cfg, shards, Devices("jax", devices, "tpu", replicas)) as plan:
        train_ds, val_ds, n_train, _, _ = build_datasets(plan, devices)
        say(plan, headline(plan, tpu).replace("compiled with XLA", "compiled by JAX's XLA"))
        report: dict[str, Any] = {"tpu": tpu.name, "replicas": replicas, "seconds": {}, "memory": None}
        findings = data_findings(plan, tpu, replicas, (train_ds, val_ds), n_train)
        if not any(f.level == "refuse" for f in findings):
            with devices.scope():
                findings += model_checks(plan, tpu, devices, (train_ds, val_ds), report)
        return finish(plan, tpu, findings, report)


def model_checks(plan: Plan, tpu: Tpu, devices: JaxDevices, datasets: Any, report: dict[str, Any]) -> list[Finding]:
    """The run's model (compiled as ``train.fit`` compiles it), Keras' training and evaluation steps compiled
    over the devices on the first real batches, what their programs hold, and the memory of a device."""
    verbose = bool(plan.run.verbose)
    with console.saying(PREFIX, "reading the first batches and building the model", "still building", verbose):
        started = time.perf_counter()
        batches = [tuple(np.asarray(t) for t in next(iter(ds))) for ds in datasets]
        report["seconds"]["first_batches"] = round(time.perf_counter() - started, 2)
        model = compiled_model(plan)
        model._symbolic_build(data_batch=batches[0])  # the compiled metrics' variables, as fit builds them
        record = getattr(model, "_record_training_state_sharding_spec", None)
        if callable(record):  # Keras 3.10-3.1x: the state's shardings, which its train_step reads, as fit records
            record()
    paths = layer_paths(model)
    findings = layer_findings(paths)
    programs = []
    for name, batch in (("training", batches[0]), ("evaluation", batches[1])):
        with console.saying(PREFIX, f"compiling the {name} step with XLA", f"still compiling the {name} step", verbose):
            try:
                compiled, seconds = compile_step(model, batch, devices, training=name == "training")
            except StepRefused as e:
                return findings + e.findings
        report["seconds"][f"compile_{name}"] = round(seconds, 2)
        programs.append(compiled)
    findings += program_findings(paths, [c.as_text() for c in programs])
    with console.saying(PREFIX, "measuring the memory of a device", "still measuring the memory", verbose):
        memory = device_memory(model, batches[0], devices, programs[0], tpu)
    report["memory"] = memory._asdict()
    return findings + memory_findings(memory, tpu)


def state_of(model: Any, training: bool) -> tuple[list[Any], ...]:
    """The values Keras 3's stateless ``train_step`` (or ``test_step``) takes, in its order."""
    parts = [model.trainable_variables, model.non_trainable_variables]
    parts += [model.optimizer.variables] if training else []
    return tuple([v.value for v in part] for part in [*parts, model.metrics_variables])


def compile_step(model: Any, batch: Any, devices: JaxDevices, training: bool) -> tuple[Any, float]:
    """Keras' step compiled by XLA over ``devices``, the batch sharded as ``DataParallel`` shards it (its first
    axis over the devices); a step XLA refuses is one line naming XLA's reason."""
    import jax

    started = time.perf_counter()
    step = model.train_step if training else model.test_step
    data = tuple(jax.device_put(t, devices.distribution.get_data_layout(t.shape).backend_layout) for t in batch)
    try:
        compiled = jax.jit(step).lower(state_of(model, training), data).compile()
    except Exception as e:  # XLA's and JAX's tracing errors have no common class; the message says what failed
        first = str(e).strip().splitlines()[0][:300] if str(e).strip() else type(e).__name__
        raise StepRefused([Finding("refuse", "the step", f"XLA cannot compile it: {first}", COMPILE_FIX)]) from None
    return compiled, time.perf_counter() - started


# An HLO instruction's result type and the op's name in its metadata: "%x = f64[8,10]{1,0} ... op_name="..."".
INSTRUCTION = re.compile(r"= (f64|s64|u64)\[([\d,]*)\][^\n]*?op_name=\"([^\"]+)\"")


# JAX's own random bits (dropout's): its threefry counter is 64-bit on every backend, a TPU's too
JAX_RANDOM = ("iota_2x32_shape", "threefry", "random_bits")


def program_findings(paths: dict[str, Any], programs: list[str]) -> list[Finding]:
    """float64 anywhere in the compiled programs (a TPU has none: refused) and 64-bit integer arrays (emulated on
    a TPU: warned; not JAX's own random bits), one finding a layer and kind, each named by its op's layer."""
    found: dict[tuple[str, str], Finding] = {}
    for text in programs:
        for kind, dims, op_name in INSTRUCTION.findall(text):
            if kind != "f64" and any(word in op_name for word in JAX_RANDOM):
                continue
            layer = op_layer(paths, op_name)
            if kind == "f64":
                why = f"float64 tensor [{dims}] (a TPU has no float64)"
                found.setdefault((layer, kind), Finding("refuse", layer, why, "compute in float32"))
            elif dims:
                why = f"{'int64' if kind == 's64' else 'uint64'} tensor [{dims}] (a TPU emulates 64-bit integers)"
                found.setdefault((layer, "64"), Finding("warn", layer, why, "use int32"))
    return list(found.values())


def op_layer(paths: dict[str, Any], op_name: str) -> str:
    """The deepest layer named in a JAX op's name (``jit(train_step)/jvp(conv0_0)/conv_general_dilated``: each
    part a scope, some inside a transformation's parentheses); else the op's name."""
    scopes = {re.sub(r"^\w+\((.*)\)$", r"\1", part) for part in op_name.split("/")}
    for path in paths:  # deepest first
        if path.split("/")[-1] in scopes:
            return f"layer {path}"
    return op_name


def device_bytes(compiled: Any) -> int:
    """The bytes one device holds for a compiled program, by XLA's own analysis: arguments, outputs and
    temporaries, an output aliasing its argument counted once."""
    m = compiled.memory_analysis()
    return int(m.argument_size_in_bytes + m.output_size_in_bytes - m.alias_size_in_bytes + m.temp_size_in_bytes)


def device_memory(model: Any, batch: Any, devices: JaxDevices, compiled: Any, tpu: Tpu) -> Memory:
    """The memory of a device for the training step, and the largest per-core batch that fits a ``tpu`` core:
    estimated from a second compile at ``SUBLANES`` more images a device (``core_memory.largest_batch``)."""
    n = devices.num_replicas_in_sync
    size = int(batch[0].shape[0]) // n
    measured = device_bytes(compiled)
    bigger = tuple(np.zeros((t.shape[0] + SUBLANES * n, *t.shape[1:]), t.dtype) for t in batch)
    other = device_bytes(compile_step(model, bigger, devices, training=True)[0])
    usable = int(tpu.memory * HEADROOM)
    return Memory(
        measured,
        sum(int(np.prod(v.shape)) * np.dtype(v.dtype).itemsize for v in model.weights),
        sum(int(np.prod(v.shape)) * np.dtype(v.dtype).itemsize for v in model.optimizer.variables),
        sum(t.nbytes for t in batch) // n,
        tpu.memory,
        usable,
        largest_batch(measured, size, other, size + SUBLANES, usable),
        "estimated",
    )
