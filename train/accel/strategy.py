"""Resolve a strategy name to a ``tf.distribute.Strategy``: auto, tpu, gpu or cpu (with N virtual replicas)."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

from tfpipe.runtime.console import quiet_call
from tfpipe.runtime.deps import require
from tfpipe.runtime.errors import BadSetting, NoAccelerator, TfpipeError, option
from train.accel.tpus import TPU_HINTS as TPU_HINTS  # where they are listed
from train.accel.tpus import tpu_present
from train.keras.names import STRATEGIES

if TYPE_CHECKING:
    import tensorflow as tf
else:
    tf = require("tensorflow")


def connect_tpu() -> tf.distribute.TPUStrategy:
    """Finds, connects to and initialises the TPU; returns a ``TPUStrategy``.

    Tries the address from the environment (Kaggle, Colab, ``TPU_NAME``) and
    then ``tpu="local"`` (a TPU VM).
    """
    errors: list[str] = []
    for kwargs in ({}, {"tpu": "local"}):
        try:
            resolver = tf.distribute.cluster_resolver.TPUClusterResolver(**kwargs)
            tf.config.experimental_connect_to_cluster(resolver)
            return tpu_strategy(resolver)
        except (ValueError, tf.errors.OpError, RuntimeError) as e:
            errors.append(str(e).splitlines()[0][:120])
    raise NoAccelerator(f"no TPU found (tried TPU_NAME/Colab/Kaggle address, then a local TPU VM: {errors[-1]})")


def tpu_strategy(resolver: tf.distribute.cluster_resolver.TPUClusterResolver) -> tf.distribute.TPUStrategy:
    """The TPU's system initialised (again: the memory the last model held is freed on the TPU only then) and a
    ``TPUStrategy`` over the connection ``resolver`` made."""
    tf.tpu.experimental.initialize_tpu_system(resolver)
    return tf.distribute.TPUStrategy(resolver)


def ensure_virtual_cpus(n: int) -> list[str]:
    """Makes ``n`` logical CPU devices exist (must run before TensorFlow initialises its devices)."""
    cpus = tf.config.list_physical_devices("CPU")
    try:
        tf.config.set_logical_device_configuration(cpus[0], [tf.config.LogicalDeviceConfiguration()] * n)
    except RuntimeError:  # already initialised: fine if it already has enough devices
        have = len(tf.config.list_logical_devices("CPU"))
        if have < n:
            raise TfpipeError(
                f"TensorFlow already started its devices in this process ({have} CPU device(s)), so "
                f"{n} virtual CPU replicas can no longer be made: create the strategy before anything "
                "else uses TensorFlow (in a notebook: restart the kernel and run the strategy cell "
                "first), or use 1 replica"
            ) from None
    return [d.name for d in tf.config.list_logical_devices("CPU")[:n]]


@quiet_call
def resolve_strategy(
    name: str | tf.distribute.Strategy = "auto", replicas: int | None = None
) -> tuple[tf.distribute.Strategy, str]:
    """Returns (strategy, kind) for a strategy name.

    One device (a CPU or a single GPU) gets the default strategy, which Keras
    callbacks such as BackupAndRestore support (OneDeviceStrategy they do not).
    TensorFlow's log lines while it finds the devices (``cuInit``, ``Using MirroredStrategy``) are held back, in
    a notebook as under a command (``TFPIPE_VERBOSE=1`` shows them).

    Example (a notebook's strategy cell: the TPU, else the GPUs, else 8 virtual CPU replicas as a dry run)::

        strategy, kind = resolve_strategy("auto", replicas=8)

    Args:
      name: "tpu", "gpu" (MirroredStrategy over all GPUs, or one GPU), "cpu", "auto" (TPU, then GPUs, then
        CPU), or "multiworker" (MultiWorkerMirroredStrategy over the cluster in ``TF_CONFIG``: every GPU, else
        the CPU, of every worker); or a strategy object, returned as it is.
      replicas: with "cpu" (or "auto" where it finds neither a TPU nor a GPU), the number of virtual CPU
        replicas (a dry run of an 8-core TPU: ``replicas=8``); None or 1 is a single CPU device.
    """
    if isinstance(name, tf.distribute.Strategy):  # already built (a notebook passes the one it made)
        return name, strategy_kind(name)
    if name not in STRATEGIES:
        raise BadSetting(f"unknown strategy {name!r}: use one of {', '.join(STRATEGIES)}")
    if replicas is not None and replicas != 1 and name in ("tpu", "gpu", "multiworker"):
        raise TfpipeError(
            f"{option('replicas')} sets virtual CPU replicas (--strategy cpu); a {name.upper()} "
            "strategy uses every core or device it finds"
        )
    if name == "multiworker":
        from train.accel.cluster import connect

        strategy = connect()
        return strategy, strategy_kind(strategy)
    if name == "tpu" or (name == "auto" and tpu_present()):
        return connect_tpu(), "tpu"
    gpus = tf.config.list_physical_devices("GPU") if name != "cpu" else []  # lists, starts no device
    if name == "gpu" and not gpus:
        raise NoAccelerator("no GPU found (tf.config.list_physical_devices('GPU') is empty)")
    if gpus:  # "gpu", or "auto" with GPUs: before virtual CPU replicas (a GPU notebook trains on its GPU)
        if len(gpus) > 1:
            return tf.distribute.MirroredStrategy(), "gpu"
        return tf.distribute.get_strategy(), "gpu"  # the default strategy places work on the one GPU
    if replicas and replicas > 1:
        # Reduce on one device rather than with collective ops: the replicas share one memory anyway, and
        # collectives' instance keys collide once a process has built several models (tensorflow#62790).
        return tf.distribute.MirroredStrategy(
            ensure_virtual_cpus(replicas), cross_device_ops=tf.distribute.ReductionToOneDevice()
        ), "cpu"
    return tf.distribute.get_strategy(), "cpu"


def strategy_kind(strategy: tf.distribute.Strategy) -> str:
    """ "tpu", "gpu" or "cpu": where a strategy's replicas run."""
    if "TPU" in type(strategy).__name__:
        return "tpu"
    try:
        devices = tuple(strategy.extended.worker_devices)
    except (AttributeError, RuntimeError):  # the default strategy has no worker devices (it raises RuntimeError)
        devices = ()
    gpu = any("GPU" in d.upper() for d in devices) or (not devices and tf.config.list_physical_devices("GPU"))
    return "gpu" if gpu else "cpu"


def input_pipelines(strategy: tf.distribute.Strategy) -> int:
    """How many input pipelines ``distribute_datasets_from_function`` makes: one a worker of a multi-worker
    cluster, one a host of a TPU pod, else one."""
    from train.accel.cluster import is_multiworker

    if is_multiworker(strategy):  # tf.distribute.MultiWorkerMirroredStrategy's class: CollectiveAllReduceStrategy
        spec = strategy.cluster_resolver.cluster_spec()
        return sum(spec.num_tasks(job) for job in ("chief", "worker") if job in spec.jobs)
    return int(getattr(strategy.extended, "num_hosts", 1) or 1)


def default_precision(kind: str) -> str:
    """bfloat16 on TPU, float16 on GPU, float32 on CPU (the Keras mixed-precision policy names)."""
    return {"tpu": "mixed_bfloat16", "gpu": "mixed_float16"}.get(kind, "float32")


@contextlib.contextmanager
def quick_teardown() -> Iterator[None]:
    """Distributed datasets iterated inside this block end at once instead of holding the process for minutes.

    A distributed dataset gives every replica a one-element prefetch of its own, each with tf.data's autotuning
    thread. When the iterator is destroyed (at the end of every ``fit``, ``evaluate`` and ``predict``), that
    thread is told to stop, but it can miss the signal (it checks a flag that TensorFlow sets only after the
    signal: a race) and then sleeps out its period, which grows to 60 s, holding Python's lock meanwhile: 8
    replicas at the end of a long fit can wait minutes. A one-element prefetch has nothing to tune,
    so these per-replica pipelines are built untuned; the input pipeline itself (``make_dataset``) keeps its
    autotuning. Builds nothing itself; a TensorFlow without the private function it wraps is left as it is.
    """
    from tensorflow.python.data.ops import multi_device_iterator_ops as ops  # the one place that builds them

    make: Callable[..., Any] | None = getattr(ops, "_create_device_dataset", None)
    if make is None or getattr(make, "untuned", False):  # another TensorFlow, or already inside this block
        yield
        return
    untuned_options = tf.data.Options()
    untuned_options.autotune.enabled = False

    def untuned(*args: Any, **kwargs: Any) -> tf.data.Dataset:
        return make(*args, **kwargs).with_options(untuned_options)

    untuned.untuned = True  # type: ignore[attr-defined]
    ops._create_device_dataset = untuned
    try:
        yield
    finally:
        ops._create_device_dataset = make
