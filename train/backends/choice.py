"""Which backend a job trains or predicts with, chosen once, before Keras and JAX start (``--backend
auto|tf|jax``): ``choose`` says which and, for ``auto``, why; ``ready`` sets what the process needs for it
(``KERAS_BACKEND=jax``, XLA's host devices for N CPU replicas) or says in one line that it is too late; a run is
predicted or continued by its own backend (``for_run``). Nothing here imports Keras, TensorFlow or JAX: the
backends themselves are ``train.backends.tf`` and ``train.backends.jax``.

The process's Keras is the one ``KERAS_BACKEND`` names, as Keras itself decides: ``jax`` -> Keras 3 on JAX,
anything else -> tf-keras. Importing tfpipe sets nothing.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.metadata
import importlib.util
import os
import re
import sys
from typing import Any

from tfpipe.runtime import fs
from tfpipe.runtime.deps import MissingDependency
from tfpipe.runtime.errors import BadSetting, NoAccelerator, TfpipeError, option
from train.accel.tpus import tpu_present
from train.keras.names import BACKENDS

HOST_DEVICES = "--xla_force_host_platform_device_count"  # XLA's flag: N devices on the host CPU
NAMES = {"tf": "tf-keras on TensorFlow", "jax": "Keras 3 on JAX"}


@dataclasses.dataclass(frozen=True)
class Choice:
    """The backend a job trains or predicts with (``tf`` or ``jax``), when ``auto`` chose it why, and the run
    folder whose own backend it is (a run predicted or continued: its model file is this backend's Keras')."""

    name: str
    why: str = ""
    run: str = ""

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
    and JAX are there; else tf (the default). A strategy object (a notebook's own) is TensorFlow's."""
    if asked not in BACKENDS:
        raise BadSetting(f"unknown backend {asked!r}: use one of {', '.join(BACKENDS)}")
    if asked != "auto":
        return Choice(asked)
    if getattr(strategy, "backend", None) == "jax":  # train.backends.jax.JaxDevices, a notebook's devices cell
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


def ready(asked: str, strategy: Any = "auto", replicas: int | None = None, resume: str | None = None) -> Choice:
    """``choose`` and ``use_backend``: what a command (train.fit, train.cv) calls before it imports its engine.
    ``resume``: the run (or CV) folder a ``--resume`` continues; ``auto`` then takes the backend it started with."""
    choice = resumed(asked, strategy, resume) or choose(asked, strategy)
    use_backend(choice, strategy, replicas)
    return choice


def resumed(asked: str, strategy: Any, folder: str | None) -> Choice | None:
    """The backend of the run (or CV) in ``folder`` that ``--resume`` continues with ``auto`` (a backup and a
    model are their Keras'), or None where there is none to continue yet, or the backend was asked for (a
    different one is refused when the run's settings are compared) or given by a notebook's devices."""
    from train.runs import run as run_files
    from train.runs.cv_folder import is_cv_folder

    if asked != "auto" or folder is None or not isinstance(strategy, str):
        return None
    if not (fs.exists(run_files.path(folder, run_files.CONFIG)) or is_cv_folder(folder)):
        return None
    return Choice(trained_backend(folder), "the run's own backend", folder)


def for_run(asked: str, trained_with: str, run: str) -> Choice:
    """The backend that predicts (or continues) ``run``, trained with ``trained_with`` (tf for a run whose
    config.json does not record it): ``auto`` takes the run's own; another backend is refused in one line (a model
    file is its Keras')."""
    if asked not in BACKENDS:
        raise BadSetting(f"unknown backend {asked!r}: use one of {', '.join(BACKENDS)}")
    if asked in ("auto", trained_with):
        return Choice(trained_with, "the run's own backend" if asked == "auto" else "", run)
    raise BadSetting(
        f"{run} was trained with {option('backend', trained_with)} ({NAMES[trained_with]}), whose model file "
        f"{NAMES[asked]} does not load: predict it with {option('backend', trained_with)} (or auto)"
    )


def trained_backend(folder: str) -> str:
    """The backend a run folder, or a CV folder's folds, trained with (``config.json``'s setting; tf where it is
    not recorded)."""
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
            raise NoAccelerator(no_tpu_support(choice))
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
    if strategy in ("cpu", "auto", "multiworker") and replicas and replicas > 1:
        ask_host_devices(replicas, exact=strategy == "multiworker")  # a cluster's processes: each its N devices


def no_tpu_support(choice: Choice) -> str:
    """Why the TPU here cannot run ``choice`` (tf) and what can: another backend, unless the model file of the run
    it predicts or continues (``choice.run``) is tf-keras', which only tf-keras loads."""
    build = f"this TensorFlow build ({tensorflow_build() or 'none'}) has no TPU support"
    pair = "install the matching tensorflow-tpu and libtpu pair"
    if choice.run:
        return (
            f"{choice.run} was trained with {option('backend', 'tf')} ({NAMES['tf']}), whose model file only "
            f"tf-keras loads, and {build}: use {option('strategy', 'cpu')} (the host CPU), or {pair}"
        )
    return (
        f"{build}, so the TPU here cannot train with {option('backend', 'tf')}: use {option('backend', 'jax')} "
        f"(Keras 3 on JAX), or {pair} (or {option('strategy', 'cpu')} for the host CPU)"
    )


def check_engine(choice: Choice) -> None:
    """One Keras a process (Keras itself binds its backend once): a process whose trainer started on one backend
    (its module in ``sys.modules``) cannot train with the other."""
    other = "jax" if choice.name == "tf" else "tf"
    if f"train.backends.{other}" in sys.modules:
        raise BadSetting(
            f"tfpipe's trainer is already loaded with {NAMES[other]} in this process (one backend a process): run "
            f"{option('backend', choice.name)} in a new process (in a notebook: restart the kernel)"
        )


def ask_host_devices(n: int, exact: bool = False) -> None:
    """``XLA_FLAGS`` asks XLA for (at least, unless ``exact``) ``n`` host CPU devices, unless JAX has already made
    its devices (then ``jax_devices`` says so when it finds fewer)."""
    if jax_started():
        return
    flags = os.environ.get("XLA_FLAGS", "")
    found = re.search(rf"{HOST_DEVICES}=(\d+)", flags)
    if found and (int(found[1]) == n or (int(found[1]) > n and not exact)):
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
