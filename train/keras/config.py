"""The training configuration, ``FitConfig``: one field per flag of ``python -m train.fit``, and what ``train.fit.fit``
takes; ``train.keras.planning`` turns it into the ``Plan`` the engine (``train.keras.trainer``) trains. No TensorFlow
here: the command's ``--help`` answers at once.

    from train.keras.config import FitConfig   # also train.fit.FitConfig, the same class
    cfg = FitConfig(records="records/demo/train", run="runs/b0", strategy="tpu", epochs=12)
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

from train.accel.tpus import DEFAULT_TPU

if TYPE_CHECKING:
    import tensorflow as tf

    from tfpipe.format.shards import Records
    from tfpipe.tf.augment import Augment


PREFLIGHT_ONLY = ("preflight", "tpu")  # settings of the preflight (train.preflight), not of a training run


@dataclasses.dataclass
class FitConfig:
    """Everything ``fit`` needs; the command line maps one flag to each field.

    ``records`` is the shard folder to train on, ``run`` the run folder to write.
    """

    records: str = "records/demo/train"
    run: str = "runs/demo"
    strategy: str | tf.distribute.Strategy = "auto"  # a name (``STRATEGIES``) or a strategy you already made
    replicas: int | None = None
    backend: str = "auto"  # tf (tf-keras, TensorFlow's strategies), jax (Keras 3 on JAX) or auto (train.backends)
    data_service: str | None = None  # grpc://HOST:PORT: a tf.data service's workers decode the training images
    model: str = "efficientnet-b0"
    weights: str | None = None  # None (random), "imagenet" (downloads) or a weights file; "none" = None
    image_size: int | None = None
    batch_size: int = 16
    epochs: int = 10
    steps_per_execution: int = 8
    lr: float = 2e-4
    schedule: str = "cosine"
    warmup_epochs: float = 1.0
    optimizer: str = "adam"
    weight_decay: float = 0.0
    label_smoothing: float = 0.0
    fold: int | None = None  # validation fold; None: fold 0 of shards with folds, else the last shards
    val_fraction: float = 0.2
    burn_epochs: int = 0
    burn_lr: float | None = None
    precision: str | None = None
    augment: Augment | None = None  # a tfpipe.Augment; None: Augment() (the default augmentation)
    threshold: float = 0.5
    single_label: bool | None = None
    metric: str = "roc_auc"  # the figure that decides (train.decide.metrics.METRICS): final vs SWA, thresholds, TTA
    class_weight: str | None = None  # "balanced": each class's loss weighed by its training images' rarity
    sampling: str | None = None  # "balanced": single-label training batches drawn evenly over the classes
    seed: int | None = None
    deterministic: bool = False  # seeded input order and augmentation, deterministic TensorFlow ops (slower)
    resume: bool = False
    save_every: int | None = None  # back up within an epoch every N steps; None: every 10 minutes; 0: epoch ends
    overwrite: bool = False  # replace the run in ``run`` (the files train.fit wrote there; others stay)
    swa_epochs: int = 0  # average the weights of the last N epochs (stochastic weight averaging)
    report: bool = True  # validation predictions, tuned thresholds and pictures after training
    verbose: int = 2  # 0 silent, 1 Keras' progress bar, 2 lines (one per epoch, and progress every 15 s)
    callbacks: tuple[Any, ...] = ()  # extra Keras callbacks (from Python), run after the built-in ones
    preflight: bool = (
        False  # compile a step with XLA as a TPU would and report, instead of training (train.preflight.check)
    )
    tpu: str = DEFAULT_TPU  # the TPU the preflight checks against: a name of train.accel.tpus.TPUS (v2, v3, v4, v5e)


@dataclasses.dataclass(frozen=True)
class PredictConfig:
    """Everything ``train.predict.predict`` needs; the command line maps one flag to each field (``--run``,
    ``--records``, ``--out``, ``--tta``, ...), and ``predict(run, records, out, **options)`` builds one.

    ``run`` is a run folder of ``train.fit`` or a CV folder of ``train.cv`` (its fold ensemble); ``records`` the
    shards to predict (a folder, a glob, files or ``Shards``); ``out`` the CSV to write (None or "": none).
    ``swa``: True the SWA model, False the final one, None the one with the better validation AUC (said).
    """

    run: str
    records: Records
    out: str | None = "submission.csv"
    tta: int = 1  # TTA views to average (train.prediction.inference.TTA_VIEWS)
    threshold: float | None = None  # one threshold for every class (default: those tuned for the model and views)
    probabilities: bool = False  # one probability column per class instead of the labels
    labels: bool | None = None  # the labels column (default: unless probabilities)
    strategy: str | tf.distribute.Strategy = "auto"
    replicas: int | None = None
    backend: str = "auto"  # auto: the run's own backend where it can run (train.backends.choice)
    batch_size: int = 32  # per replica
    id_column: str | None = None  # default: the CSV's, from the manifest
    overwrite: bool = False  # replace out whatever it holds
    progress: bool = True  # a progress bar and the lines saying what happens
    swa: bool | None = None
    sample_submission: str | None = None  # the competition's CSV: header, id column, ids and their order, form
    save_probabilities: str | None = None  # also the test probabilities here (a CV's each fold's too: -fold-K)
