"""The backends: one module each, as Keras keeps one package a backend (``keras/src/backend/jax/``, ...).

- ``train.backends.tf``: tf-keras (Keras 2 of TensorFlow's release) under a ``tf.distribute`` strategy --
  ``TPUStrategy``, ``MirroredStrategy`` over GPUs or virtual CPU replicas, multi-worker (``train.accel``).
- ``train.backends.jax``: Keras 3 on JAX, one SPMD program over every device (``keras.distribution.DataParallel``):
  the TPU's cores, the GPUs, or N XLA host devices on a CPU (``--replicas N``).

A job chooses its backend once, before Keras starts (``train.backends.choice``). The trainer, prediction and the
preflight are written against ``Backend`` and ask ``current()`` for the process's; what differs between the two
lives in their modules, not in branches of the trainer. A third backend is a third module with these members.

Keras is bound late: outside this package no module binds a Keras when imported, so importing the trainer ties a
process to no backend. A class of tfpipe's that extends a Keras class (a callback, the F1 metric, a schedule) is
written as a ``KerasMixin``, and ``complete`` makes it a class of the process's Keras where it is used.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from types import ModuleType
from typing import TYPE_CHECKING, Any, ClassVar, Protocol, TypeVar, cast

from tfpipe.runtime.errors import option
from train.backends.choice import NAMES, Choice, keras_backend_set, ready
from train.backends.choice import use_backend as use_backend  # with Choice and ready: what a command readies

if TYPE_CHECKING:
    from train.accel.workers import Workers
    from train.keras.backup import Phase


class Backend(Protocol):
    """What differs between the backends: their Keras, their devices and how a dataset reaches them, the weights
    file, a phase's backup within an epoch, batch-norm statistics across replicas, the EfficientNets."""

    name: str  # "tf" or "jax": config.json's and --backend's word
    traces_per_replica: bool  # the training step is traced once per replica of this machine (tf-keras)
    replica_batch_norm: bool  # each replica keeps its own batch-norm statistics, synced before a validation

    def keras(self) -> ModuleType:
        """The Keras module the trainer calls (``tf_keras`` or ``keras``)."""
        ...

    def devices(self, strategy: Any, replicas: int | None) -> tuple[Any, str]:
        """(the devices a job runs on, their kind: tpu, gpu or cpu) by the strategy names of ``--strategy``; the
        devices have ``scope()`` and ``num_replicas_in_sync``."""
        ...

    def describe_devices(self, devices: Any, kind: str) -> str:
        """``8 virtual CPU replicas`` / ``8 TPU v5 lite cores``: the devices in a job's first line."""
        ...

    def input_pipelines(self, devices: Any) -> int:
        """How many input pipelines (hosts) ``datasets`` makes."""
        ...

    def datasets(self, devices: Any, make: Callable[[Any], Any]) -> Any:
        """What ``model.fit`` iterates: ``make(input_context)`` (a ``tf.data`` pipeline of this host's batches)
        distributed over ``devices``."""
        ...

    def workers(self, devices: Any) -> Workers:
        """The processes that train with ``devices`` (one alone, or a cluster's), as this one sees them."""
        ...

    def this_machine(self, devices: Any) -> Any:
        """Devices of this process alone, for the chief of a cluster to score and report with once training ends
        (no step waits for processes that have ended)."""
        ...

    def weights_file(self, base: str) -> str:
        """The name of a weights file saved at ``base``."""
        ...

    def tensor_ops(self) -> Any:
        """The few tensor functions the schedules, metrics and weighted loss use (``keras.ops``' names)."""
        ...

    def backup(self, folder: str, phase: Phase, every: int | None, say: bool) -> Any:
        """The callback that backs a phase up within epochs (``train.keras.backup.BackupPolicy`` says when)."""
        ...

    def fits(
        self, callbacks: Sequence[Any], model: Any, phase: Phase, initial_epoch: int
    ) -> list[tuple[int, int, int]]:
        """The ``model.fit`` calls of a phase, as (initial epoch, epochs, steps of the first epoch already done),
        after the phase's backup (among ``callbacks``) is restored."""
        ...

    def sync_batch_norm(self, model: Any, layers: list[Any]) -> None:
        """Gives every replica the batch-norm statistics of ``layers`` the saved model has."""
        ...

    def recompute_batch_norm(self, model: Any, layers: list[Any], dataset: Any, steps: int, devices: Any) -> None:
        """Sets ``layers``' moving statistics to their exact mean over ``steps`` training batches of ``dataset``."""
        ...

    def build_before_tracing(self, metric: Any, shape: tuple[int | None, ...]) -> None:
        """Makes ``metric``'s variables now where the first traced step would make them (and be traced again)."""
        ...

    def efficientnet(self, variant: str, input_shape: tuple[int, int, int], weights: str | None) -> tuple[Any, bool]:
        """EfficientNet-B``variant`` without its top, and whether it normalises its [0, 255] input itself."""
        ...

    def custom_objects(self, classes: dict[str, Any]) -> dict[str, Any]:
        """What loading a model file needs, given tfpipe's own Keras ``classes`` a file may name (completed: the F1
        metric, the schedules), by the names the file gives them."""
        ...


def get(name: str) -> Backend:
    """The backend named ``name`` (``tf`` or ``jax``); its module binds its Keras when first imported, so this is
    called once the process is ready for it (``choice.ready``)."""
    if name == "jax":
        from train.backends import jax

        return jax.BACKEND
    from train.backends import tf

    return tf.BACKEND


def current() -> Backend:
    """This process's backend: Keras 3 on JAX where ``KERAS_BACKEND`` is jax, else tf-keras."""
    return get("jax" if keras_backend_set() == "jax" else "tf")


def keras_module() -> ModuleType:
    """The Keras of this process's backend."""
    return current().keras()


class KerasMixin:
    """A class of tfpipe's written without Keras, which ``complete`` makes a class of the process's Keras: the
    Keras class at ``KERAS_BASE`` (a path in the Keras module: ``"callbacks.Callback"``) follows it among the
    completed class's bases, so its methods, and its ``super()`` calls, reach Keras' own. A class saved in model
    files and registered with Keras names its ``KERAS_PACKAGE`` (``"tfpipe"``: saved as ``tfpipe>F1Score``); one
    with none is found through ``train.keras.models.custom_objects`` under its own name."""

    KERAS_BASE: ClassVar[str]
    KERAS_PACKAGE: ClassVar[str | None] = None

    if TYPE_CHECKING:

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            """The Keras class that completes a mixin takes its own arguments."""

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> Any:
        """An instance of the completed class: tf-keras' loader finds a class it has no registration for by its
        module and name, which is the mixin's."""
        keras_class: Any = super(KerasMixin, complete(cls))
        return keras_class.from_config(config)


Mixin = TypeVar("Mixin", bound=KerasMixin)


def complete(cls: type[Mixin]) -> type[Mixin]:
    """``cls`` as a class of this process's Keras: ``cls`` first, then its ``KERAS_BASE``, under the mixin's own
    module and name (what Keras writes in a model file); made once per class and Keras, and registered there
    under ``KERAS_PACKAGE`` if it has one. A class that already is one is its own completion."""
    mixin: type = cls  # the cache's key (mypy finds no __hash__ on a type[...] it checks as Hashable)
    return cast("type[Mixin]", _completed(mixin, keras_module()))


@functools.cache
def _completed(cls: type[KerasMixin], keras: ModuleType) -> type[KerasMixin]:
    base: Any = functools.reduce(getattr, cls.KERAS_BASE.split("."), keras)  # the Keras class at KERAS_BASE
    if issubclass(cls, base):
        return cls
    made = type(cls.__name__, (cls, base), {"__module__": cls.__module__, "__qualname__": cls.__qualname__})
    if cls.KERAS_PACKAGE:
        keras.utils.register_keras_serializable(package=cls.KERAS_PACKAGE)(made)
    return made


def resolve(choice: Choice, strategy: Any, replicas: int | None) -> tuple[Any, str]:
    """(the strategy or JAX devices, their kind: tpu, gpu or cpu) for a job on ``choice``'s backend; devices made
    already (a notebook's devices cell) are taken as they are."""
    return get(choice.name).devices(strategy, replicas)


def describe(choice: Choice, devices: Any, kind: str) -> str:
    """The first line of a job: the backend and its devices (``Keras 3 on JAX, 8 TPU v5 lite cores``)."""
    why = f" ({option('backend', 'auto')}: {choice.why})" if choice.why else ""
    return f"{NAMES[choice.name]}, {get(choice.name).describe_devices(devices, kind)}{why}"


def resolve_devices(strategy: str = "auto", replicas: int | None = None, backend: str = "auto") -> tuple[Any, str]:
    """A notebook's devices cell, on either backend: (the strategy or JAX devices, their kind) -- the TPU, else
    the GPUs, else ``replicas`` CPU replicas -- after choosing the backend (``auto``: Keras 3 on JAX on Kaggle's
    TPU v5e, whose TensorFlow has no TPU support; said in one line) and readying the process for it. Pass what it
    returns as ``FitConfig(strategy=...)`` and ``predict(strategy=...)``.

    Example (the notebook's devices cell, before anything starts TensorFlow's or JAX's devices)::

        strategy, kind = resolve_devices("auto", replicas=8)
    """
    choice = ready(backend, strategy, replicas)
    found, kind = resolve(choice, strategy, replicas)
    print(f"tfpipe: {describe(choice, found, kind)}", flush=True)
    return found, kind
