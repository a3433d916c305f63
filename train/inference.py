"""The prediction engine behind ``train.predict`` (TensorFlow and tf-keras): a run's model over shards.

``train.predict`` holds the command line (no TensorFlow, so ``--help`` is instant) and calls ``predict`` here.
Rows follow the shards' written order and are keyed by the CSV id stored in each record. Works under any
strategy: batches are padded to static shapes and the padding rows are dropped.
"""
import json
import math
import posixpath

import numpy as np

from tfpipe.deps import require_keras

keras = require_keras()  # tf-keras of TensorFlow's release, or MissingDependency saying what to install
import tensorflow as tf  # noqa: E402

import tfpipe
from tfpipe import fs
from tfpipe.errors import TfpipeError, check_count, check_fraction, check_path, option
from tfpipe.shards import read_manifest
from train.strategy import resolve_strategy

RUN_CONFIG = "config.json"  # written by train.fit: classes, image size, head type
THRESHOLDS = "thresholds.json"  # per-class thresholds tuned on validation by train.fit
ZOOM = 0.875  # TTA crops keep 87.5% of the side (the usual 224/256)
# TTA views, in order: (crop box [y1, x1, y2, x2] in relative coordinates, horizontal flip).
_C = (1 - ZOOM) / 2
TTA_VIEWS = (
    ((0, 0, 1, 1), False), ((0, 0, 1, 1), True),  # the image and its mirror
    ((_C, _C, 1 - _C, 1 - _C), False), ((_C, _C, 1 - _C, 1 - _C), True),  # centre zoom
    ((0, 0, ZOOM, ZOOM), False), ((0, 1 - ZOOM, ZOOM, 1), True),  # corner zooms
    ((1 - ZOOM, 0, 1, ZOOM), True), ((1 - ZOOM, 1 - ZOOM, 1, 1), False),
)


def tta_view(images, k):
    """View ``k`` of a uint8 batch [B, S, S, 3]: view 0 is the batch itself, then mirror and zoomed crops."""
    box, flip = TTA_VIEWS[k]
    if box != (0, 0, 1, 1):
        n, size = tf.shape(images)[0], images.shape[1:3]
        boxes = tf.tile(tf.constant([box], tf.float32), [n, 1])
        crops = tf.image.crop_and_resize(tf.cast(images, tf.float32), boxes, tf.range(n), size)
        images = tf.saturate_cast(tf.round(crops), tf.uint8)
    return tf.reverse(images, axis=[2]) if flip else images


def read_run_config(run):
    """A ``train.fit`` run folder's ``config.json`` (classes, input size, head, settings)."""
    path = f"{run}/{RUN_CONFIG}"
    if not fs.exists(path):
        raise TfpipeError(f"{run}: no {RUN_CONFIG}; is this a run folder written by train.fit?")
    return json.loads(fs.read_text(path))


def load_run(run):
    """(model, run config) of a ``train.fit`` run folder."""
    config = read_run_config(run)
    model_path = f"{run}/model.keras"
    if not fs.exists(model_path):
        raise TfpipeError(f"{run}: no model.keras; the run did not finish (continue it with train.fit --resume)")
    return load_model(model_path), config


def load_model(path):
    from train.models import custom_objects

    return keras.models.load_model(path, custom_objects=custom_objects(), compile=False)


def predict_probabilities(model, source, strategy, *, batch_size, image_size, num_classes, folds=None, tta=1,
                          progress=False):
    """Model outputs [N, C] for every record of ``source`` in written order, averaged over ``tta`` views.

    The model must have been built in ``strategy.scope()`` (or loaded there).
    Every replica gets a full padded batch, so shapes stay static; the padding
    rows (at the end, in written order) are dropped.
    """
    check_tta(tta)
    n = tfpipe.count_examples(source, folds)
    global_batch = batch_size * strategy.num_replicas_in_sync
    steps = math.ceil(n / global_batch)
    total = np.zeros((n, num_classes), np.float64)
    for k in range(tta):
        def dataset_fn(ctx, k=k):
            ds = tfpipe.make_dataset(source, ctx.get_per_replica_batch_size(global_batch), image_size=image_size,
                                     folds=folds, num_classes=num_classes, pad_batches=True, input_context=ctx)
            return ds.map(lambda images, targets, weights: tta_view(images, k))

        ds = strategy.distribute_datasets_from_function(dataset_fn)
        if progress:
            print(f"train.predict: view {k + 1}/{tta}: {n} images in {steps} steps of {global_batch}", flush=True)
        total += model.predict(ds, steps=steps, verbose=1 if progress else 0)[:n]  # Keras' progress bar
    return (total / tta).astype(np.float32)


def check_tta(tta):
    if not 1 <= tta <= len(TTA_VIEWS):
        raise TfpipeError(f"{option('tta')} must be in 1..{len(TTA_VIEWS)} (got {tta})")


def labels_at(probs, classes, thresholds, single_label):
    """Space-separated predicted class names per row: argmax for single-label, else every class above its threshold."""
    if single_label:
        return [classes[i] for i in probs.argmax(axis=1)]
    above = probs >= np.asarray(thresholds)[None, :]
    return [" ".join(c for c, on in zip(classes, row) if on) for row in above]


def tune_thresholds(probs, targets, default):
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


def predict(run, records, out="submission.csv", *, tta=1, threshold=None, probabilities=False, strategy="auto",
            replicas=None, batch_size=32, id_column=None, progress=True):
    """Writes the submission of run folder ``run`` on the shards ``records``; returns it as a DataFrame.

    Called through ``train.predict.predict`` (see its example).
    """
    import pandas as pd

    check_path(run=run, records=records)
    check_count(1, batch_size=batch_size, replicas=replicas)
    check_fraction(threshold=threshold)
    check_tta(tta)
    strat, _ = resolve_strategy(strategy, replicas)  # first: virtual CPUs need a TensorFlow that has run nothing
    config = read_run_config(run)
    check_run_fits_records(config, records)
    if not probabilities:
        check_labels_can_be_joined(config["classes"], config["single_label"])
    id_column = id_column or _id_column(records)
    columns = [id_column, *(config["classes"] if probabilities else ["labels"])]
    ids = tfpipe.image_names(records)
    _check_destination(out, columns, ids)
    with strat.scope():  # variables placed on every replica
        model, config = load_run(run)
    classes, size = config["classes"], config["image_size"]
    with tfpipe.naming_corrupt_shards(records):
        probs = predict_probabilities(model, records, strat, batch_size=batch_size, image_size=size,
                                      num_classes=len(classes), tta=tta, progress=progress)
    if probabilities:
        df = pd.DataFrame(probs, columns=classes)
        df.insert(0, id_column, ids)
    else:
        thresholds = _thresholds(run, classes, threshold, config)
        df = pd.DataFrame({id_column: ids, "labels": labels_at(probs, classes, thresholds, config["single_label"])})
    if out:
        fs.write_atomic(out, df.to_csv(index=False))  # complete or absent, also on gs://
    return df


def _check_destination(out, columns, ids):
    """Before any predicting: ``out`` must be a file name whose folder exists (created if missing). An existing
    file there is replaced only when it is an earlier submission for these records (same columns, same ids in
    the same order: a re-run), never a CSV, manifest or anything else named as ``out`` by mistake -- a
    ``train.csv`` often has a submission's header, but not the test ids."""
    if not out:
        return
    if fs.isdir(out):
        raise TfpipeError(f"{out} is a folder; {option('out')} names the CSV file to write")
    if fs.exists(out) and not _is_submission(out, columns, ids):
        raise TfpipeError(f"{out} exists and is not an earlier submission for these records (columns "
                          f"{','.join(columns)}, {len(ids)} ids in order); it is not replaced -- remove it or choose "
                          f"another {option('out')}")
    folder = posixpath.dirname(out)
    if folder and not fs.isdir(folder):
        if fs.exists(folder):
            raise TfpipeError(f"{folder} is a file, so {out} cannot be written")
        fs.makedirs(folder)


def _is_submission(path, columns, ids):
    import pandas as pd

    try:
        with fs.open(path, "rb") as f:
            table = pd.read_csv(f, dtype=str, keep_default_na=False)
    except (ValueError, UnicodeDecodeError):  # not a CSV at all (pandas' parser errors are ValueErrors)
        return False
    return list(table.columns) == list(columns) and table.iloc[:, 0].tolist() == list(ids)


def check_run_fits_records(config, records):
    """A run predicts only shards of its own classes (in its order) at its own input size: anything else would
    be a full submission of wrong labels, or of silently resized images. Shards without a manifest (a glob)
    carry no claims to check."""
    shards = tfpipe.open_shards(records)
    if shards.classes and list(shards.classes) != list(config["classes"]):  # unlabeled shards list none
        raise TfpipeError(f"{records}: its classes ({_listed(shards.classes)}) are not the run's "
                          f"({_listed(config['classes'])}); predict with a run trained on these classes")
    if shards.image_size and shards.image_size != config["image_size"]:
        raise TfpipeError(f"{records}: images stored at {shards.image_size} px, the run was trained at "
                          f"{config['image_size']} px; write the shards again with --image-size "
                          f"{config['image_size']}")


def check_labels_can_be_joined(classes, single_label):
    """A multi-label submission joins each row's labels with spaces: a class named ``New York`` (a one-hot
    column or a folder name) would be read back as two labels, so such runs write probabilities instead."""
    spaced = [c for c in classes if not c or any(ch.isspace() for ch in c)]
    if spaced and not single_label:
        raise TfpipeError(f"class {spaced[0]!r} holds a space, so a space-separated labels column would read back "
                          f"as other labels; write one probability column per class ({option('probabilities', True)})")


def _listed(classes, most=6):
    return ", ".join(classes[:most]) + (f", ... {len(classes)} in all" if len(classes) > most else "")


def _id_column(records):
    try:
        return read_manifest(records).get("id_column", "image")
    except TfpipeError:  # a glob or a list of files: no manifest
        return "image"


def _thresholds(run, classes, threshold, config):
    if threshold is not None:
        return [threshold] * len(classes)
    path = f"{run}/{THRESHOLDS}"
    if fs.exists(path):
        tuned = json.loads(fs.read_text(path))
        return [tuned[c] for c in classes]
    return [config.get("threshold", 0.5)] * len(classes)
