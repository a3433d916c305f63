"""The ``jax`` backend: Keras 3 on JAX, one SPMD program over every device (``keras.distribution.DataParallel``):
the TPU's cores, the GPUs, or N XLA host devices on a CPU (``--replicas N``: a dry run of an 8-core TPU that costs
what one device does). One program holds one copy of each batch-norm statistic and traces the step once; Keras 3's
``BackupAndRestore`` resumes at an epoch's start only, so a phase's backup within an epoch is ``StepBackup``.

Imported once ``KERAS_BACKEND`` is jax (``train.backends.choice.ready``): it binds Keras 3 then.
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from collections.abc import Callable, Iterator, Sequence
from types import ModuleType
from typing import Any

import jax
import keras
import numpy as np

from tfpipe.runtime import fs
from tfpipe.runtime.console import stdout_on_stderr
from tfpipe.runtime.errors import NoAccelerator, TfpipeError, option
from train.accel import hosts
from train.accel.tpus import tpu_present
from train.accel.workers import ALONE, Workers
from train.backends.choice import HOST_DEVICES
from train.keras.backup import BackupPolicy, Phase
from train.runs import run as run_files


class JaxDevices:
    """JAX's ``devices`` under Keras 3's ``DataParallel``: the scope a model is built and trained in, and the
    replica count (the devices). Each process's input pipeline makes its share of the global batch (one process:
    all of it); Keras assembles the global batch and shards it over the devices. ``processes``: the processes of
    a JAX program over several hosts (``--strategy multiworker``), None for one process."""

    backend = "jax"  # what train.backends.choice.choose reads of devices a notebook made

    def __init__(self, devices: list[Any], kind: str, processes: hosts.Processes | None = None) -> None:
        self.devices, self.kind, self.processes = devices, kind, processes
        # each process reads its own share of the shards: Keras' own sharding would have every host read them all
        self.distribution = keras.distribution.DataParallel(devices=devices, auto_shard_dataset=False)
        self.num_replicas_in_sync = len(devices)

    @contextlib.contextmanager
    def scope(self) -> Iterator[None]:
        with self.distribution.scope():
            yield

    def describe(self) -> str:
        """``8 TPU v5 lite cores`` / ``8 CPU devices (XLA host devices)`` / ``1 GPU`` / ``process 1 of 2, 8 CPU
        devices in all (4 on this one, XLA host devices)``."""
        n, first = len(self.devices), self.devices[0]
        if self.processes is not None and self.processes.many:
            here = sum(d.process_index == self.processes.index for d in self.devices)
            host = ", XLA host devices" if self.kind == "cpu" and here > 1 else ""
            what = {"tpu": f"{getattr(first, 'device_kind', 'TPU')} cores", "gpu": "GPUs"}.get(self.kind, "CPU devices")
            return f"{self.processes.name} of {self.processes.count}, {n} {what} in all ({here} on this one{host})"
        if self.kind == "tpu":
            return f"{n} {getattr(first, 'device_kind', 'TPU')} core{'s' * (n > 1)}"
        if self.kind == "gpu":
            return f"{n} GPU{'s' * (n > 1)} ({getattr(first, 'device_kind', 'GPU')})"
        return f"{n} CPU device{'s' * (n > 1)}" + (" (XLA host devices)" if n > 1 else "")


def jax_devices(strategy: str, replicas: int | None) -> JaxDevices:
    """The devices a JAX job runs on, by the same strategy names as the TF path: tpu (every core), gpu (every
    GPU), cpu (``replicas`` XLA host devices, default 1), auto (the TPU or GPUs JAX sees, else the CPU). A TPU
    machine never trains on its host CPU unless ``cpu`` asks for it."""
    if strategy == "multiworker":
        return cluster_devices(replicas)
    if replicas is not None and replicas != 1 and strategy in ("tpu", "gpu"):
        raise TfpipeError(
            f"{option('replicas')} sets CPU devices ({option('strategy', 'cpu')}); a {strategy.upper()} job uses "
            "every core or device it finds"
        )
    platform = jax.default_backend()  # "tpu", "gpu" or "cpu": the best JAX found
    if strategy in ("tpu", "gpu") or (strategy == "auto" and platform != "cpu"):
        wanted = platform if strategy == "auto" else strategy
        if platform != wanted:
            raise NoAccelerator(
                f"JAX sees no {wanted.upper()} (its devices: {platform}); "
                + ("install jax[tpu] on a TPU VM" if wanted == "tpu" else "install jax with CUDA (jax[cuda12])")
            )
        return JaxDevices(jax.devices(), wanted)
    if strategy == "auto" and tpu_present():
        raise NoAccelerator(
            "a TPU machine, but JAX sees no TPU (install jax[tpu], whose libtpu drives it); nothing trains on "
            f"the host CPU unless {option('strategy', 'cpu')} asks for it"
        )
    n = replicas or 1
    cpus = jax.devices("cpu")
    if len(cpus) < n:
        raise TfpipeError(
            f"JAX already started with {len(cpus)} CPU device{'s' * (len(cpus) != 1)} in this process, so {n} "
            f"cannot be made: set XLA_FLAGS={HOST_DEVICES}={n} before JAX starts (in a notebook: the first cell, "
            "then restart the kernel), or use 1 replica"
        )
    return JaxDevices(cpus[:n], "cpu")


def cluster_devices(replicas: int | None) -> JaxDevices:
    """``--strategy multiworker``: this process joins the cluster of Keras' variables or the TPU pod slice's
    (``train.accel.hosts``); every process's devices train, each process feeding its own. On CPUs each process
    has ``replicas`` XLA host devices (``train.backends.choice.use_backend`` asked XLA for them)."""
    with stdout_on_stderr():  # gloo's lines as its groups connect: noise (filtered there)
        hosts.join(hosts.cluster_from_environment(os.environ))
        processes = hosts.Processes(jax.process_index(), jax.process_count())
        processes.connect()
    platform, here = jax.default_backend(), jax.local_device_count()
    if platform != "cpu" and replicas not in (None, 1):
        raise TfpipeError(
            f"{option('replicas')} sets each process's CPU devices; on a {platform.upper()} every process uses "
            "every device it finds"
        )
    if platform == "cpu" and replicas is not None and here != replicas:
        raise TfpipeError(
            f"this process has {here} CPU device{'s' * (here != 1)}, not {replicas} ({option('replicas')}): "
            f"JAX started before {HOST_DEVICES} could be set; start the job in a new process"
        )
    return JaxDevices(jax.devices(), platform, processes)


BACKUP_WEIGHTS, BACKUP_POSITION = "latest.weights.h5", "position.json"  # StepBackup's two files


class StepBackup(BackupPolicy, keras.callbacks.Callback):
    """Keras 3's backup of a phase, saved as ``BackupPolicy`` says: the weights with the optimizer's state
    (``latest.weights.h5``, Keras' own weights file) and where training stands (``position.json``: the epoch and
    the steps done), each written through a temporary name. Keras 3's ``BackupAndRestore`` resumes at an epoch's
    start only; ``restore`` reads the backup before fit, and ``run_phase`` fits the rest of a resumed epoch
    first."""

    def __init__(self, folder: str, phase: Phase, every: int | None, say: bool) -> None:
        super().__init__()
        self.folder = folder
        self.policy(phase, every, say)

    def restore(self, model: Any) -> tuple[int, int] | None:
        """Loads the backup into ``model`` (built and compiled) and returns where it continues, (epoch, steps
        done), 0-based; None when nothing of this phase was saved."""
        position = run_files.path(self.folder, BACKUP_POSITION)
        if not fs.exists(position):
            return None
        with fs.open(position, "rb") as f:
            saved = fs.parse_json(f.read(), position, "the backup's position")
        if not (isinstance(saved, dict) and all(type(saved.get(k)) is int for k in ("epoch", "steps"))):
            raise TfpipeError(f"{position}: not a backup position train.fit wrote; the backup is damaged")
        model.optimizer.build(model.trainable_variables)
        model.load_weights(run_files.path(self.folder, BACKUP_WEIGHTS))
        self.last = (saved["epoch"], saved["steps"])
        self.said_resuming(*self.last)
        return self.last

    def save_step(self, epoch: int, step: int) -> None:
        """Backs up the weights and optimizer as they are after ``step`` (0-based) of ``epoch`` (0-based)."""
        fs.makedirs(self.folder)
        weights = run_files.path(self.folder, BACKUP_WEIGHTS)
        tmp = fs.temporary_name(weights[: -len(".weights.h5")]) + ".weights.h5"
        self.model.save_weights(tmp)
        fs.rename(tmp, weights, overwrite=True)
        here = self.position(epoch, step)
        fs.write_atomic(run_files.path(self.folder, BACKUP_POSITION), json.dumps({"epoch": here[0], "steps": here[1]}))
        self._since, self._saved_at = 0, time.monotonic()
        self.last = here


def mean_batch_statistics(model: keras.Model, layers: list[Any], dataset: Any, steps: int, devices: Any) -> None:
    """The SWA pass on Keras 3 (JAX): forward steps in training mode with every momentum 0, so after a
    step a layer's moving statistics are that batch's; their mean over ``steps`` batches is the same cumulative
    mean. One compiled program (``model.stateless_call`` under ``jax.jit``: called eagerly, layer by layer, the
    pass takes about three times an epoch's time), each batch the global batch."""
    saved = [layer.momentum for layer in layers]
    where = {id(v): i for i, v in enumerate(model.non_trainable_variables)}
    wanted = [(where[id(layer.moving_mean)], where[id(layer.moving_variance)]) for layer in layers]
    trainable = [v.value for v in model.trainable_variables]
    state = [v.value for v in model.non_trainable_variables]

    def forward(state: list[Any], images: Any) -> list[Any]:
        _, new = model.stateless_call(trainable, state, images, training=True)
        return [(new[m], new[v]) for m, v in wanted]

    for layer in layers:
        layer.momentum = 0.0  # read when the step is traced, below
    sums = [[np.zeros(layer.moving_mean.shape), np.zeros(layer.moving_variance.shape)] for layer in layers]
    batches = iter(dataset)
    try:
        with devices.scope() if devices is not None else contextlib.nullcontext():
            step = jax.jit(forward)
            for _ in range(steps):
                for total, (mean, variance) in zip(sums, step(state, np.asarray(next(batches)[0]))):
                    total[0] += np.asarray(mean, np.float64)
                    total[1] += np.asarray(variance, np.float64)
    finally:
        for layer, m in zip(layers, saved):
            layer.momentum = m
    for (mean, variance), layer in zip(sums, layers):
        layer.moving_mean.assign((mean / steps).astype(np.float32))
        layer.moving_variance.assign((variance / steps).astype(np.float32))


class JaxBackend:
    """Keras 3 on JAX (see the module's docstring)."""

    name = "jax"
    traces_per_replica = False  # one SPMD program: traced once
    replica_batch_norm = False  # one copy of each statistic

    def keras(self) -> ModuleType:
        return keras

    def devices(self, strategy: Any, replicas: int | None) -> tuple[Any, str]:
        if isinstance(strategy, JaxDevices):  # made already (a notebook's devices cell)
            return strategy, strategy.kind
        found = jax_devices(strategy, replicas)
        return found, found.kind

    def describe_devices(self, devices: Any, kind: str) -> str:
        return str(devices.describe())

    def input_pipelines(self, devices: Any) -> int:
        return devices.processes.count if devices.processes is not None else 1  # a process feeds its devices

    def datasets(self, devices: Any, make: Callable[[Any], Any]) -> Any:
        """This process's share of the global batch from its input pipeline: ``make`` is asked for one replica a
        pipeline, so its batch size is the global batch over the processes."""
        import tensorflow as tf

        n = self.input_pipelines(devices)
        return make(tf.distribute.InputContext(n, devices.processes.index if n > 1 else 0, n))

    def workers(self, devices: Any) -> Workers:
        return devices.processes if devices.processes is not None else ALONE

    def this_machine(self, devices: Any) -> JaxDevices:
        return JaxDevices(jax.local_devices(), devices.kind)

    def weights_file(self, base: str) -> str:
        return f"{base}.weights.h5"  # Keras 3 wants the suffix

    def tensor_ops(self) -> Any:
        return keras.ops

    def backup(self, folder: str, phase: Phase, every: int | None, say: bool) -> Any:
        return StepBackup(folder, phase, every, say)

    def fits(
        self, callbacks: Sequence[Any], model: Any, phase: Phase, initial_epoch: int
    ) -> list[tuple[int, int, int]]:
        """The backup is read here first; a backup within an epoch is continued by a fit of that epoch's
        remaining steps, then one of the epochs after."""
        backup = next((c for c in callbacks if isinstance(c, StepBackup)), None)
        at = backup.restore(model) if backup is not None else None
        if at is None:
            return [(initial_epoch, phase.epochs, 0)]
        epoch, done = at
        if done == 0 or epoch >= phase.epochs:
            return [(epoch, phase.epochs, 0)] if epoch < phase.epochs else []
        return [(epoch, epoch + 1, done)] + ([(epoch + 1, phase.epochs, 0)] if epoch + 1 < phase.epochs else [])

    def sync_batch_norm(self, model: Any, layers: list[Any]) -> None:
        pass  # one copy of each statistic

    def recompute_batch_norm(self, model: Any, layers: list[Any], dataset: Any, steps: int, devices: Any) -> None:
        mean_batch_statistics(model, layers, dataset, steps, devices)

    def build_before_tracing(self, metric: Any, shape: tuple[int | None, ...]) -> None:
        pass  # Keras 3 builds its metrics' variables before tracing

    def efficientnet(self, variant: str, input_shape: tuple[int, int, int], weights: str | None) -> tuple[Any, bool]:
        """Keras' own EfficientNet (``keras.applications``), which normalises its [0, 255] input itself."""
        fn = getattr(keras.applications, f"EfficientNetB{variant}")
        return fn(include_top=False, weights=weights, input_shape=input_shape), True

    def custom_objects(self, classes: dict[str, Any]) -> dict[str, Any]:
        """tfpipe's ``classes``: Keras 3 compiles a loaded model with the optimizer and metrics its file names."""
        return dict(classes)


BACKEND = JaxBackend()
