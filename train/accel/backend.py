"""Which Keras trains, and how it spreads a step over the devices: the one place that decides.

Two backends run the one trainer (``train.keras``), which is written against the Keras API:

- ``tf``: tf-keras (Keras 2 of TensorFlow's release) under a ``tf.distribute`` strategy -- ``TPUStrategy``,
  ``MirroredStrategy`` over GPUs or virtual CPU replicas, multi-worker (``train.accel.strategy``).
- ``jax``: Keras 3 on JAX, one SPMD program over every device (``keras.distribution.DataParallel``): the TPU's
  cores, the GPUs, or N XLA host devices on a CPU (``--replicas N``: a dry run of an 8-core TPU that costs what
  one device does). ``JaxDevices`` here is that distribution, with the part of a strategy's interface the trainer
  uses (``scope``, ``num_replicas_in_sync``, ``distribute_datasets_from_function``).

The process's Keras is the one ``KERAS_BACKEND`` names, as Keras itself decides: ``jax`` -> Keras 3 on JAX,
anything else -> tf-keras (``keras_module``). ``use_backend`` sets it, and XLA's host device count, before Keras or
JAX start, or says in one line that it is too late; importing tfpipe sets nothing.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.metadata
import importlib.util
import os
import re
import sys
from collections.abc import Iterator
from types import ModuleType, SimpleNamespace
from typing import Any

from tfpipe.runtime.deps import MissingDependency, require
from tfpipe.runtime.errors import BadSetting, NoAccelerator, TfpipeError, option
from train.accel.tpus import tpu_present
from train.keras.names import BACKENDS

HOST_DEVICES = "--xla_force_host_platform_device_count"  # XLA's flag: N devices on the host CPU
NAMES = {"tf": "tf-keras on TensorFlow", "jax": "Keras 3 on JAX"}


@dataclasses.dataclass(frozen=True)
class Choice:
    """The backend a job trains or predicts with (``tf`` or ``jax``) and, when ``auto`` chose it, why."""

    name: str
    why: str = ""

    @property
    def words(self) -> str:
        """``Keras 3 on JAX`` / ``tf-keras on TensorFlow``."""
        return NAMES[self.name]


def installed(module: str) -> bool:
    return importlib.util.find_spec(module) is not None


def keras_3_installed() -> bool:
    try:
        return int(importlib.metadata.version("keras").split(".")[0]) >= 3
    except importlib.metadata.PackageNotFoundError:
        return False


def tensorflow_build() -> str:
    """The distribution TensorFlow came from (``tensorflow``, ``tensorflow-cpu``, ``tensorflow-tpu``) and its
    version, or "" when TensorFlow is not installed."""
    for dist in ("tensorflow-tpu", "tensorflow", "tensorflow-cpu", "tf-nightly-tpu", "tf-nightly"):
        with contextlib.suppress(importlib.metadata.PackageNotFoundError):
            return f"{dist} {importlib.metadata.version(dist)}"
    return ""


def tensorflow_has_tpu_support() -> bool:
    """Whether this TensorFlow can drive a TPU: only the ``tensorflow-tpu`` builds (with the ``libtpu`` of their
    release) can; ``tensorflow`` and ``tensorflow-cpu`` wheels cannot, whatever ``libtpu`` JAX brought (Kaggle's
    TPU v5e image ships ``tensorflow-cpu`` for its ``tf.data``)."""
    return tensorflow_build().split(" ")[0] in ("tensorflow-tpu", "tf-nightly-tpu")


def keras_backend_set() -> str:
    """The Keras 3 backend of this process: the one Keras started with, else ``KERAS_BACKEND`` ("" if unset)."""
    keras = sys.modules.get("keras")
    if keras is not None and hasattr(keras, "backend") and hasattr(keras.backend, "backend"):
        return str(keras.backend.backend())
    return os.environ.get("KERAS_BACKEND", "")


def choose(asked: str, strategy: Any = "auto") -> Choice:
    """The backend for ``asked`` (``auto``, ``tf``, ``jax``). ``auto``: jax where Keras is already set to JAX,
    where the machine has a TPU this TensorFlow cannot use but JAX can, or where tf-keras is missing but Keras 3
    and JAX are there; else tf (today's default). A strategy object (a notebook's own) is TensorFlow's."""
    if asked not in BACKENDS:
        raise BadSetting(f"unknown backend {asked!r}: use one of {', '.join(BACKENDS)}")
    if asked != "auto":
        return Choice(asked)
    if isinstance(strategy, JaxDevices):
        return Choice("jax", "JAX devices were given")
    if not isinstance(strategy, str):
        return Choice("tf", "a tf.distribute strategy was given")
    jax_ready = installed("jax") and keras_3_installed()
    if keras_backend_set() == "jax" and jax_ready:
        return Choice("jax", "KERAS_BACKEND is jax")
    if strategy in ("auto", "tpu") and tpu_present() and not tensorflow_has_tpu_support() and jax_ready:
        return Choice("jax", f"a TPU machine whose TensorFlow ({tensorflow_build() or 'none'}) has no TPU support")
    if not installed("tf_keras") and jax_ready:
        return Choice("jax", "tf-keras is not installed; Keras 3 and JAX are")
    return Choice("tf")


def ready(asked: str, strategy: Any = "auto", replicas: int | None = None) -> Choice:
    """``choose`` and ``use_backend``: what a command (train.fit, train.cv) calls before it imports its engine."""
    choice = choose(asked, strategy)
    use_backend(choice, strategy, replicas)
    return choice


def for_run(asked: str, trained_with: str, run: str) -> Choice:
    """The backend that predicts (or continues) ``run``, trained with ``trained_with`` (a run of tfpipe before 1.2:
    tf): ``auto`` takes the run's own; another backend is refused in one line (a model file is its Keras')."""
    if asked not in BACKENDS:
        raise BadSetting(f"unknown backend {asked!r}: use one of {', '.join(BACKENDS)}")
    if asked in ("auto", trained_with):
        return Choice(trained_with, "the run's own backend" if asked == "auto" else "")
    raise BadSetting(
        f"{run} was trained with {option('backend', trained_with)} ({NAMES[trained_with]}), whose model file "
        f"{NAMES[asked]} does not load: predict it with {option('backend', trained_with)} (or auto)"
    )


def trained_backend(folder: str) -> str:
    """The backend a run folder, or a CV folder's folds, trained with (``config.json``'s setting; tf before it was
    recorded)."""
    from train.runs.cv_folder import CVResult, is_cv_folder
    from train.runs.run import RunConfig

    settings = CVResult.load(folder).settings if is_cv_folder(folder) else RunConfig.load(folder).settings
    found = settings.get("backend", "tf")
    if found not in ("tf", "jax"):
        raise TfpipeError(f"{folder}: its settings name backend {found!r}, not tf or jax; the folder is damaged")
    return str(found)


def use_backend(choice: Choice, strategy: Any = "auto", replicas: int | None = None) -> None:
    """Readies the process for ``choice`` before Keras and JAX start: ``KERAS_BACKEND=jax`` and, for N replicas
    on the CPU, XLA's N host devices (``HOST_DEVICES``). What can no longer be set is one line saying what to set
    first. The TF path also refuses a TPU its TensorFlow cannot drive, in one line naming what works."""
    if choice.name == "tf":
        if strategy in ("tpu", "auto") and tpu_present() and not tensorflow_has_tpu_support():
            raise NoAccelerator(
                f"this TensorFlow build ({tensorflow_build() or 'none'}) has no TPU support, so the TPU here cannot "
                f"train with {option('backend', 'tf')}: use {option('backend', 'jax')} (Keras 3 on JAX), or "
                f"install the matching tensorflow-tpu and libtpu pair (or {option('strategy', 'cpu')} for the host "
                "CPU)"
            )
        if os.environ.get("KERAS_BACKEND") == "jax":
            raise BadSetting(
                f"KERAS_BACKEND is jax in this process, so tfpipe's trainer would be Keras 3 on JAX: unset it for "
                f"{option('backend', 'tf')}, or use {option('backend', 'jax')}"
            )
        check_engine(choice)
        return
    if not installed("jax") or not keras_3_installed():
        raise MissingDependency(
            f"{option('backend', 'jax')} needs Keras 3 and JAX: pip install 'tfpipe[jax]' (on a TPU: 'jax[tpu]')"
        )
    if keras_backend_set() not in ("", "jax") and "keras" in sys.modules:
        raise BadSetting(
            f"Keras was already imported with the {keras_backend_set()} backend in this process; "
            f"{option('backend', 'jax')} needs KERAS_BACKEND=jax set before keras is imported (in a notebook: "
            "the first cell, then restart the kernel)"
        )
    check_engine(choice)
    os.environ["KERAS_BACKEND"] = "jax"
    if strategy in ("cpu", "auto") and replicas and replicas > 1:
        ask_host_devices(replicas)


def check_engine(choice: Choice) -> None:
    """One Keras a process: the trainer's modules bind theirs when first imported, so a process that trained with
    one backend cannot train with the other."""
    loaded = sys.modules.get("train.keras.compiling")
    if loaded is not None and is_keras_3(loaded.keras) != (choice.name == "jax"):
        other = "jax" if choice.name == "tf" else "tf"
        raise BadSetting(
            f"tfpipe's trainer is already loaded with {NAMES[other]} in this process (one backend a process): run "
            f"{option('backend', choice.name)} in a new process (in a notebook: restart the kernel)"
        )


def ask_host_devices(n: int) -> None:
    """``XLA_FLAGS`` asks XLA for (at least) ``n`` host CPU devices, unless JAX has already made its devices (then
    ``jax_devices`` says so when it finds fewer)."""
    if jax_started():
        return
    flags = os.environ.get("XLA_FLAGS", "")
    found = re.search(rf"{HOST_DEVICES}=(\d+)", flags)
    if found and int(found[1]) >= n:
        return
    flags = re.sub(rf"\s*{HOST_DEVICES}=\d+", "", flags)
    os.environ["XLA_FLAGS"] = f"{flags} {HOST_DEVICES}={n}".strip()


def jax_started() -> bool:
    """Whether JAX has made its devices in this process (XLA's flags are read then, once)."""
    if "jax" not in sys.modules:
        return False
    bridge = sys.modules.get("jax._src.xla_bridge")
    started = getattr(bridge, "backends_are_initialized", None)
    return bool(started()) if callable(started) else True


def keras_module() -> ModuleType:
    """The Keras the trainer's modules are written against in this process: Keras 3 (on JAX) when
    ``KERAS_BACKEND`` is jax, else tf-keras of TensorFlow's release (``tfpipe.runtime.deps.require_keras``)."""
    if keras_backend_set() == "jax":
        if not keras_3_installed():
            raise MissingDependency("KERAS_BACKEND is jax, but Keras 3 is not installed: pip install 'tfpipe[jax]'")
        return require("keras")
    from tfpipe.runtime.deps import require_keras

    return require_keras()


def is_keras_3(keras: ModuleType) -> bool:
    return keras.__name__ == "keras" and int(keras.__version__.split(".")[0]) >= 3


def running() -> str:
    """The backend of the trainer's Keras in this process: ``jax`` or ``tf``."""
    return "jax" if keras_backend_set() == "jax" else "tf"


def weights_file(base: str) -> str:
    """The name of a weights file saved at ``base``: Keras 3 wants ``.weights.h5``; tf-keras writes a TensorFlow
    checkpoint (``base.index``, ``base.data-*``)."""
    return f"{base}.weights.h5" if running() == "jax" else base


def tensor_ops() -> Any:
    """The few tensor functions the schedules and metrics use, from the running backend: ``keras.ops`` (Keras 3),
    else TensorFlow's of the same meaning."""
    if running() == "jax":
        return require("keras").ops
    import tensorflow as tf

    return SimpleNamespace(
        cast=tf.cast, cos=tf.cos, clip=tf.clip_by_value, where=tf.where, reshape=tf.reshape, log=tf.math.log,
        sum=tf.reduce_sum, mean=tf.reduce_mean,
    )  # fmt: skip


class JaxDevices:
    """Keras 3's ``DataParallel`` over ``devices`` (JAX's), with the strategy interface the trainer uses: a scope
    the model is built and trained in, the replica count, and datasets made once for the whole global batch
    (Keras shards each batch over the devices)."""

    def __init__(self, devices: list[Any], kind: str) -> None:
        import keras

        self.devices, self.kind = devices, kind
        self.distribution = keras.distribution.DataParallel(devices=devices)
        self.num_replicas_in_sync = len(devices)
        self.num_hosts = 1

    @contextlib.contextmanager
    def scope(self) -> Iterator[None]:
        with self.distribution.scope():
            yield

    @property
    def extended(self) -> JaxDevices:  # what train.accel.strategy.input_pipelines reads of a strategy
        return self

    def distribute_datasets_from_function(self, make: Any) -> Any:
        """One input pipeline of the global batch (``make`` asked for one pipeline and one replica)."""
        import tensorflow as tf

        return make(tf.distribute.InputContext())

    def experimental_distribute_dataset(self, dataset: Any) -> Any:
        return dataset

    def describe(self) -> str:
        """``8 TPU v5 lite cores`` / ``8 CPU devices (XLA host devices)`` / ``1 GPU``."""
        n, first = len(self.devices), self.devices[0]
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
        raise BadSetting(
            f"{option('strategy', 'multiworker')} is TensorFlow's (TF_CONFIG): use {option('backend', 'tf')}; "
            f"with {option('backend', 'jax')} one machine's devices train"
        )
    if replicas is not None and replicas != 1 and strategy in ("tpu", "gpu"):
        raise TfpipeError(
            f"{option('replicas')} sets CPU devices ({option('strategy', 'cpu')}); a {strategy.upper()} job uses "
            "every core or device it finds"
        )
    import jax

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


def resolve(choice: Choice, strategy: Any, replicas: int | None) -> tuple[Any, str]:
    """(the strategy or JAX devices, their kind: tpu, gpu or cpu) for a job on ``choice``'s backend."""
    if isinstance(strategy, JaxDevices):  # made already (a notebook's devices cell)
        return strategy, strategy.kind
    if choice.name == "jax":
        devices = jax_devices(strategy, replicas)
        return devices, devices.kind
    from train.accel.strategy import resolve_strategy

    return resolve_strategy(strategy, replicas)


def resolve_devices(strategy: str = "auto", replicas: int | None = None, backend: str = "auto") -> tuple[Any, str]:
    """A notebook's devices cell, on either backend: (the strategy or JAX devices, their kind) -- the TPU, else
    the GPUs, else ``replicas`` CPU replicas -- after choosing the backend (``auto``: Keras 3 on JAX on Kaggle's
    TPU v5e, whose TensorFlow has no TPU support; said in one line) and readying the process for it. Pass what it
    returns as ``FitConfig(strategy=...)`` and ``predict(strategy=...)``.

    Example (the notebook's cell 3, before anything starts TensorFlow's or JAX's devices)::

        strategy, kind = resolve_devices("auto", replicas=8)
    """
    choice = ready(backend, strategy, replicas)
    found, kind = resolve(choice, strategy, replicas)
    print(f"tfpipe: {describe(choice, found, kind)}", flush=True)
    return found, kind


def describe(choice: Choice, strategy: Any, kind: str) -> str:
    """The first line of a job: the backend and its devices (``Keras 3 on JAX, 8 TPU v5 lite cores``)."""
    if isinstance(strategy, JaxDevices):
        where = strategy.describe()
    else:
        n = strategy.num_replicas_in_sync
        virtual = " virtual" if kind == "cpu" and n > 1 else ""
        where = f"{n}{virtual} {kind.upper()} replica{'s' * (n > 1)}"
    why = f" ({option('backend', 'auto')}: {choice.why})" if choice.why else ""
    return f"{choice.words}, {where}{why}"
