"""The plan of a training run: one frozen, typed ``Plan`` of small parts -- what the model sees (``DataPlan``),
the model, the optimizer, the devices, the schedule and the run folder. ``train.keras.planning`` makes it from a
``FitConfig`` (the flags, or a notebook's config); the trainer, ``train.cv``'s folds and the preflight take it, and
nothing revises it once made. No TensorFlow here."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any, NamedTuple

from train.decide.metrics import Metric, metric_of

if TYPE_CHECKING:
    from tfpipe.format.shards import Shards
    from tfpipe.tf.augment import Augment
    from train.keras.config import FitConfig
    from train.runs.run import Parts


@dataclasses.dataclass(frozen=True)
class ModelPlan:
    """The model: its builder's name, input side, classes and head (softmax for ``single_label``, else sigmoid),
    initial weights (None: random), precision (None: the devices' default), the loss's label smoothing and the
    threshold its per-epoch metrics label at."""

    name: str
    num_classes: int
    image_size: int
    single_label: bool
    weights: str | None = None
    precision: str | None = None
    label_smoothing: float = 0.0
    threshold: float = 0.5


@dataclasses.dataclass(frozen=True)
class OptimizerPlan:
    """The optimizer by name and its learning rate per replica (scaled with the replicas as the run starts)."""

    name: str = "adam"
    lr: float = 2e-4
    weight_decay: float = 0.0
    schedule: str = "cosine"
    warmup_epochs: float = 1.0
    burn_lr: float | None = None  # the burn-in's (None: ``lr``)


@dataclasses.dataclass(frozen=True)
class DataPlan:
    """What a run trains and validates on: the shards (opened once), their training and validation ``parts``
    (``fold``), the batch per replica and how the training input is drawn."""

    records: str
    shards: Shards
    parts: Parts
    fold: int | None
    batch_size: int
    train_examples: int
    augment: Augment
    sampling: str | None = None
    class_weight: str | None = None
    seed: int | None = None
    deterministic: bool = False
    data_service: str | None = None


class Devices(NamedTuple):
    """Where a run trains: the backend's name, its devices (a ``tf.distribute`` strategy, or the JAX backend's
    ``JaxDevices``), their kind (tpu, gpu, cpu), how many replicas train in sync, and how many processes (hosts)
    train them together (a cluster's: TensorFlow's workers, JAX's processes)."""

    backend: str
    handle: Any
    kind: str
    replicas: int
    processes: int = 1


@dataclasses.dataclass(frozen=True)
class Schedule:
    """The epochs (the burn-in's with the backbone frozen, then the fine-tuning's), an epoch's steps, the steps
    Keras runs per compiled call (at most an epoch's), SWA's epochs and the in-epoch backups."""

    epochs: int
    burn_epochs: int
    swa_epochs: int
    steps: int
    steps_per_execution: int
    save_every: int | None = None


@dataclasses.dataclass(frozen=True)
class RunPlan:
    """The run folder and what the job does with it and says: resume it, replace it, write the report, how
    verbose, the metric its decisions go by, and the user's extra Keras callbacks."""

    folder: str
    metric: str = "roc_auc"
    resume: bool = False
    overwrite: bool = False
    report: bool = True
    verbose: int = 2
    callbacks: tuple[Any, ...] = ()


@dataclasses.dataclass(frozen=True)
class Plan:
    """A training run, decided: ``settings`` is the configuration as decided (``config.json`` records it and a
    resume compares it); the parts are what the trainer reads."""

    data: DataPlan
    model: ModelPlan
    optimizer: OptimizerPlan
    devices: Devices
    schedule: Schedule
    run: RunPlan
    settings: FitConfig

    @property
    def global_batch(self) -> int:
        return self.data.batch_size * self.devices.replicas

    @property
    def metric(self) -> Metric:
        return metric_of(self.run.metric, self.model.single_label)

    def in_folder(self, folder: str, verbose: int, overwrite: bool) -> Plan:
        """The same plan writing to another ``folder`` (a multi-worker job's other workers train in one of their
        own, quiet, never replacing it)."""
        run = dataclasses.replace(self.run, folder=folder, verbose=verbose, overwrite=overwrite)
        return dataclasses.replace(self, run=run)
