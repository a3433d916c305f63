"""The prediction engine behind ``train.predict`` (TensorFlow and tf-keras): a run's model over shards.

``train.predict`` holds the command line (no TensorFlow, so ``--help`` is instant) and calls ``predict`` here.
Rows follow the shards' written order and are keyed by the CSV id stored in each record. Works under any
strategy: batches are padded to static shapes and the padding rows are dropped.
"""

from __future__ import annotations

import hashlib
import math
import posixpath
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import numpy.typing as npt

from tfpipe.deps import require_keras

if TYPE_CHECKING:
    import pandas as pd
    import tf_keras as keras
else:
    keras = require_keras()  # tf-keras of TensorFlow's release, or MissingDependency saying what to install
import tensorflow as tf

import tfpipe
from tfpipe import fs
from tfpipe.deprecations import renamed_arguments
from tfpipe.errors import TfpipeError, check_count, check_fraction, check_path, option
from tfpipe.shards import Records, Shards
from train import run as run_files
from train.run import RunConfig
from train.strategy import resolve_strategy

ZOOM = 0.875  # TTA crops keep 87.5% of the side (the usual 224/256)
# TTA views, in order: (crop box [y1, x1, y2, x2] in relative coordinates, horizontal flip).
_C = (1 - ZOOM) / 2
TTA_VIEWS = (
    ((0, 0, 1, 1), False),
    ((0, 0, 1, 1), True),  # the image and its mirror
    ((_C, _C, 1 - _C, 1 - _C), False),
    ((_C, _C, 1 - _C, 1 - _C), True),  # centre zoom
    ((0, 0, ZOOM, ZOOM), False),
    ((0, 1 - ZOOM, ZOOM, 1), True),  # corner zooms
    ((1 - ZOOM, 0, 1, ZOOM), True),
    ((1 - ZOOM, 1 - ZOOM, 1, 1), False),
)


def tta_view(images: tf.Tensor, k: int) -> tf.Tensor:
    """View ``k`` of a uint8 batch [B, S, S, 3]: view 0 is the batch itself, then mirror and zoomed crops."""
    box, flip = TTA_VIEWS[k]
    if box != (0, 0, 1, 1):
        n, size = tf.shape(images)[0], images.shape[1:3]
        boxes = tf.tile(tf.constant([box], tf.float32), [n, 1])
        crops = tf.image.crop_and_resize(tf.cast(images, tf.float32), boxes, tf.range(n), size)
        images = tf.saturate_cast(tf.round(crops), tf.uint8)
    return tf.reverse(images, axis=[2]) if flip else images


def read_run_config(run: str) -> RunConfig:
    """A ``train.fit`` run folder's validated ``RunConfig`` (``train.run``)."""
    return RunConfig.load(run)


def load_run(run: str, config: RunConfig | None = None) -> tuple[Any, RunConfig]:
    """(model, run config) of a ``train.fit`` run folder; the model must output the run's classes."""
    config = config or RunConfig.load(run)
    model_path = run_files.path(run, run_files.MODEL)
    if not fs.exists(model_path):
        raise TfpipeError(f"{run}: no {run_files.MODEL}; the run did not finish (continue it with train.fit --resume)")
    model = load_model(model_path)
    check_model_fits_run(model, config, model_path)
    return model, config


def check_model_fits_run(model: Any, config: RunConfig, model_path: str) -> None:
    """The model must be the run's: its class count, input size and head (softmax for single-label runs,
    sigmoid for multi-label ones) as ``config.json`` says; a model file copied from another run is refused."""
    outputs, size = model.output_shape[-1], tuple(model.input_shape[1:3])
    activation = getattr(getattr(model.layers[-1], "activation", None), "__name__", None)
    expected = "softmax" if config.single_label else "sigmoid"
    if outputs != len(config.classes):
        problem = f"outputs {outputs} class{'es' * (outputs != 1)}, but {run_files.CONFIG} lists {len(config.classes)}"
    elif size != (config.image_size, config.image_size) and None not in size:
        problem = f"takes {size[0]}x{size[1]} px, but {run_files.CONFIG} says {config.image_size}"
    elif activation in ("softmax", "sigmoid") and activation != expected:
        problem = (
            f"ends in {activation}, but the run is {'single' if config.single_label else 'multi'}-label ({expected})"
        )
    else:
        return
    raise TfpipeError(f"{model_path} {problem}; the model file belongs to another run")


def load_model(path: str) -> Any:
    from train.models import custom_objects

    return keras.models.load_model(path, custom_objects=custom_objects(), compile=False)


@renamed_arguments(source="records")
def predict_probabilities(
    model: Any,
    records: Records,
    strategy: tf.distribute.Strategy,
    *,
    batch_size: int,
    image_size: int | None,
    num_classes: int,
    folds: Sequence[int] | None = None,
    tta: int = 1,
    progress: bool = False,
) -> npt.NDArray[np.float32]:
    """Model outputs [N, C] for every record of ``records`` in written order, averaged over ``tta`` views.

    The model must have been built in ``strategy.scope()`` (or loaded there).
    Every replica gets a full padded batch, so shapes stay static; the padding
    rows (at the end, in written order) are dropped.
    """
    check_tta(tta)
    n = tfpipe.count_examples(records, folds)
    global_batch = batch_size * strategy.num_replicas_in_sync
    steps = math.ceil(n / global_batch)
    total = np.zeros((n, num_classes), np.float64)
    for k in range(tta):

        def dataset_fn(ctx: tf.distribute.InputContext, k: int = k) -> tf.data.Dataset:
            ds = tfpipe.make_dataset(
                records,
                ctx.get_per_replica_batch_size(global_batch),
                image_size=image_size,
                folds=folds,
                num_classes=num_classes,
                pad_batches=True,
                input_context=ctx,
            )
            return ds.map(lambda images, targets, weights: tta_view(images, k))

        ds = strategy.distribute_datasets_from_function(dataset_fn)
        if progress:
            print(
                f"train.predict: view {k + 1}/{tta}: {n} image{'s' * (n != 1)} in {steps} step{'s' * (steps != 1)} "
                f"of {global_batch}",
                flush=True,
            )
        total += model.predict(ds, steps=steps, verbose=1 if progress else 0)[:n]  # Keras' progress bar
    return (total / tta).astype(np.float32)


def check_tta(tta: int) -> None:
    if not 1 <= tta <= len(TTA_VIEWS):
        raise TfpipeError(f"{option('tta')} must be in 1..{len(TTA_VIEWS)} (got {tta})")


def labels_at(
    probs: npt.NDArray[np.floating[Any]], classes: Sequence[str], thresholds: Sequence[float], single_label: bool
) -> list[str]:
    """Space-separated predicted class names per row: argmax for single-label, else every class above its threshold."""
    if single_label:
        return [classes[i] for i in probs.argmax(axis=1)]
    above = probs >= np.asarray(thresholds)[None, :]
    return [" ".join(c for c, on in zip(classes, row) if on) for row in above]


def tune_thresholds(
    probs: npt.NDArray[np.floating[Any]], targets: npt.NDArray[np.floating[Any]], default: float
) -> list[float]:
    """Per-class thresholds maximising validation F1 (``default`` for a class with no positive)."""
    from sklearn.metrics import precision_recall_curve

    out = []
    for c in range(targets.shape[1]):
        if targets[:, c].sum() == 0:
            out.append(default)
            continue
        precision, recall, thresholds = precision_recall_curve(targets[:, c], probs[:, c])
        f1 = 2 * precision * recall / np.maximum(precision + recall, 1e-12)
        out.append(float(thresholds[int(np.argmax(f1[:-1]))]))
    return out


def predict(
    run: str,
    records: Records,
    out: str = "submission.csv",
    *,
    tta: int = 1,
    threshold: float | None = None,
    probabilities: bool = False,
    strategy: str | tf.distribute.Strategy = "auto",
    replicas: int | None = None,
    batch_size: int = 32,
    id_column: str | None = None,
    overwrite: bool = False,
    progress: bool = True,
) -> pd.DataFrame:
    """Writes the submission of run folder ``run`` on the shards ``records``; returns it as a DataFrame.

    Called through ``train.predict.predict`` (see its example). Everything the run and the shards claim is
    checked against each other before the model is loaded; the records are opened once.
    """
    check_path(run=run, records=records)
    check_count(1, batch_size=batch_size, replicas=replicas)
    check_fraction(threshold=threshold)
    check_tta(tta)
    strat, _ = resolve_strategy(strategy, replicas)  # first: virtual CPUs need a TensorFlow that has run nothing
    config = RunConfig.load(run)
    shards = tfpipe.open_shards(records)
    check_destination(out, overwrite)
    check_run_fits_records(config, shards, records)
    if not probabilities:
        check_labels_can_be_joined(config.classes, config.single_label)
    thresholds = None if probabilities else _thresholds(run, config, threshold)
    id_column = id_column or shards.id_column
    ids = tfpipe.image_names(shards)
    batch_size = _batch_for(_num_examples(shards, records), batch_size, strat.num_replicas_in_sync, progress)
    with strat.scope():  # variables placed on every replica
        model, config = load_run(run, config)
    classes = list(config.classes)
    with tfpipe.naming_corrupt_shards(shards):
        probs = predict_probabilities(
            model,
            shards,
            strat,
            batch_size=batch_size,
            image_size=config.image_size,
            num_classes=len(classes),
            tta=tta,
            progress=progress,
        )
    df = _submission_table(probs, ids, id_column, config, thresholds)
    shards.check_unchanged()  # the ids and predictions above are of the shards that were opened
    if out:
        write_submission(out, df.to_csv(index=False), overwrite)
    return df


def _submission_table(
    probs: npt.NDArray[np.float32],
    ids: Sequence[str],
    id_column: str,
    config: RunConfig,
    thresholds: list[float] | None,
) -> pd.DataFrame:
    """The submission: ``id_column``, then one probability column per class when ``thresholds`` is None
    (``probabilities``), else the labels at ``thresholds`` (space-separated)."""
    import pandas as pd

    classes = list(config.classes)
    columns = [id_column, *(classes if thresholds is None else ["labels"])]
    if thresholds is None:
        df = pd.DataFrame(probs, columns=classes)
        df.insert(0, id_column, ids)
    else:
        df = pd.DataFrame({id_column: ids, "labels": labels_at(probs, classes, thresholds, config.single_label)})
    return df[columns]


def _num_examples(shards: Shards, records: Records) -> int:
    """Records in ``shards``, from the manifest or the counts in the shard names; unknown (foreign shards named
    without counts) is an error naming ``records``, as ``tfpipe.count_examples`` says it."""
    n = shards.num_examples
    if n is None:
        raise TfpipeError(f"{records}: record count unknown (no manifest and no count in the file names)")
    return n


def _batch_for(n: int, batch_size: int, replicas: int, progress: bool) -> int:
    """The per-replica batch: a global batch larger than the records would only predict padding (gigabytes of
    it), so it is capped, with a line saying so."""
    most = max(1, math.ceil(n / replicas))
    if batch_size <= most:
        return batch_size
    if progress:
        print(
            f"train.predict: {option('batch_size', batch_size)} is more than {n} "
            f"{'images need' if n != 1 else 'image needs'} on {replicas} replica{'s' * (replicas > 1)}; using {most}",
            flush=True,
        )
    return most


def check_destination(out: str, overwrite: bool) -> None:
    """Before any predicting: ``out`` must be a regular file name whose folder exists (created if missing). An
    existing file is replaced only when ``train.predict`` wrote it and nobody changed it since (its hash is
    recorded beside it in ``.NAME.tfpipe``), or with ``overwrite``: never a ``train.csv``, a manifest or anything
    else named as ``out`` by mistake, whatever its columns. A FIFO or a device (``/dev/stdout``) is never written."""
    if not out:
        return
    if fs.isdir(out):
        raise TfpipeError(f"{out} is a folder; {option('out')} names the CSV file to write")
    for path in (out, _record_path(out)):
        if fs.exists(path):
            fs.check_regular(path)  # a FIFO would hang the hash, a device be replaced by a file
    if fs.exists(out) and not overwrite and not _wrote_it(out):
        raise TfpipeError(
            f"{out} exists and was not written by train.predict (or was changed since); it is not "
            f"replaced -- choose another {option('out')} or pass {option('overwrite', True)}"
        )
    folder = posixpath.dirname(out)
    if folder and not fs.isdir(folder):
        if fs.exists(folder):
            raise TfpipeError(f"{folder} is a file, so {out} cannot be written")
        fs.makedirs(folder)


def _record_path(out: str) -> str:
    """``.submission.csv.tfpipe`` beside ``submission.csv``: the SHA-256 of what train.predict wrote there (one
    record per file, so two predictions into one folder never lose each other's)."""
    return posixpath.join(posixpath.dirname(out), f".{posixpath.basename(out)}.tfpipe")


def _sha256(path: str) -> str:
    h = hashlib.sha256()
    with fs.open(path, "rb") as f:
        for block in iter(lambda: f.read(2**20), b""):
            h.update(block)
    return h.hexdigest()


def _wrote_it(out: str) -> bool:
    """Whether ``out`` is byte for byte the file train.predict recorded writing there."""
    record = _record_path(out)
    if not fs.exists(record):
        return False
    try:
        recorded = fs.read_text(record, limit=4096).strip()
    except (TfpipeError, UnicodeDecodeError):
        return False
    return recorded == _sha256(out)


def write_submission(out: str, text: str, overwrite: bool) -> None:
    """Writes ``out`` whole (complete or absent, also on gs://) and records its hash beside it."""
    check_destination(out, overwrite)  # again: another job may have put a file there while this one predicted
    data = text.encode("utf-8")
    fs.write_atomic(out, data)
    fs.write_atomic(_record_path(out), hashlib.sha256(data).hexdigest() + "\n")


def check_run_fits_records(config: RunConfig, shards: Shards, records: Records) -> None:
    """A run predicts only shards made the way its training shards were: its own classes (in its order), its
    input size, the same fit (stretch/crop/pad); a single-label run never predicts multi-label shards. Anything
    else would be a full submission of wrong labels, or of differently framed images. Labeled shards the run
    trained on get a warning. Shards without a manifest (a glob) carry no claims to check."""
    if shards.manifest is None:
        return
    if shards.classes and list(shards.classes) != list(config.classes):  # unlabeled shards list none
        raise TfpipeError(
            f"{records}: its classes ({_listed(shards.classes)}) are not the run's "
            f"({_listed(config.classes)}); predict with a run trained on these classes"
        )
    if shards.image_size and shards.image_size != config.image_size:
        raise TfpipeError(
            f"{records}: images stored at {shards.image_size} px, the run was trained at "
            f"{config.image_size} px; write the shards again with --image-size {config.image_size}"
        )
    fit = shards.manifest.image.effective_fit  # shards.images, of a folder with a manifest
    if config.fit and fit != config.fit:
        raise TfpipeError(
            f"{records}: images fitted to a square by {fit!r}, the run's training images by "
            f"{config.fit!r}; write the shards again with --fit {config.fit}"
        )
    if config.single_label and shards.multi_label:
        raise TfpipeError(
            f"{records}: {shards.describe_labels()}, but the run is single-label (one class an "
            "image); predict them with a multi-label run"
        )
    if shards.labeled and config.dataset_id and shards.dataset_id == config.dataset_id:
        print(
            f"train.predict: warning: {records} are the shards this run trained on (dataset id "
            f"{config.dataset_id}): predictions of its training images say nothing about unseen images",
            file=sys.stderr,
            flush=True,
        )


def check_labels_can_be_joined(classes: Sequence[str], single_label: bool) -> None:
    """A multi-label submission joins each row's labels with spaces: a class named ``New York`` (a one-hot
    column or a folder name) would be read back as two labels, so such runs write probabilities instead."""
    spaced = [c for c in classes if not c or any(ch.isspace() for ch in c)]
    if spaced and not single_label:
        raise TfpipeError(
            f"class {spaced[0]!r} holds a space, so a space-separated labels column would read back "
            f"as other labels; write one probability column per class ({option('probabilities', True)})"
        )


def _listed(classes: Sequence[str], most: int = 6) -> str:
    return ", ".join(classes[:most]) + (f", ... {len(classes)} in all" if len(classes) > most else "")


def _thresholds(run: str, config: RunConfig, threshold: float | None) -> list[float]:
    """Per-class thresholds: ``threshold`` for all, else the run's tuned ones (validated), else the run's default."""
    if threshold is not None:
        return [threshold] * len(config.classes)
    tuned = run_files.load_thresholds(run, list(config.classes))
    return tuned if tuned is not None else [config.settings.get("threshold", 0.5)] * len(config.classes)
