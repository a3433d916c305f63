"""The prediction engine behind ``train.predict`` (TensorFlow and tf-keras): a run's model over shards.

``train.predict`` holds the command line (no TensorFlow, so ``--help`` is instant) and calls ``predict`` here.
Rows follow the shards' written order and are keyed by the CSV id stored in each record. Works under any
strategy: batches are padded to static shapes and the padding rows are dropped.
"""

from __future__ import annotations

import math
import tempfile
import zipfile
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, NamedTuple

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
from tfpipe import console, fs
from tfpipe.deprecations import renamed_arguments
from tfpipe.errors import TfpipeError, check_count, check_fraction, check_path, in_command, option
from tfpipe.shards import Records, Shards
from train import run as run_files
from train.run import RunConfig, training_parts
from train.strategy import quick_teardown, resolve_strategy
from train.submission import (
    check_column_names,
    check_destination,
    check_ids_once,
    check_labels_can_be_joined,
    check_run_fits_records,
    submission_table,
    write_submission,
)

KERAS_CONFIG, KERAS_WEIGHTS = "config.json", "model.weights.h5"  # the members of a .keras archive (Keras 2.13+)
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


def load_run(run: str, config: RunConfig | None = None, swa: bool = False) -> tuple[Any, RunConfig]:
    """(model, run config) of a ``train.fit`` run folder -- its final model, or with ``swa`` its SWA average; the
    model must output the run's classes."""
    config = config or RunConfig.load(run)
    check_model_present(run, swa)
    model_path = run_files.path(run, run_files.model_files(swa)[0])
    model = load_model(model_path)
    check_model_fits_run(model, config, model_path)
    return model, config


def check_model_present(run: str, swa: bool) -> None:
    """The model asked for is in the run folder, else one line saying why it is not."""
    name = run_files.model_files(swa)[0]
    if fs.exists(run_files.path(run, name)):
        return
    recipe = RunConfig.load(run).recipe
    if recipe:
        raise TfpipeError(
            f"{run} is a run of the PyTorch recipe {recipe} (model.pt): train.predict predicts train.fit's runs; "
            "predict with the recipe's --predict"
        )
    finished = run_files.read_state(run).get("finished", False)
    if swa and finished:
        raise TfpipeError(
            f"{run}: no {name}; the run was trained without {option('swa_epochs')} (predict with its model.keras)"
        )
    raise TfpipeError(f"{run}: no {name}; the run did not finish (continue it with train.fit --resume)")


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


def _archive(f: Any, path: str) -> zipfile.ZipFile:
    try:
        return zipfile.ZipFile(f)
    except zipfile.BadZipFile:
        raise TfpipeError(f"{path}: not a Keras model file (a .keras file is a zip archive); it is damaged") from None


def load_model(path: str) -> Any:
    """A ``.keras`` model file (uncompiled), also from ``gs://``.

    Keras reads the weights in place inside the zip archive, where every backward seek of h5py re-reads the
    archive member from its start: an EfficientNet-B0 took 27 s to load on one replica and about 45 s under 8
    (seconds of silence before prediction). Here the archive is read once, front to back: its config builds the
    model, and its weights file, extracted to a temporary folder, is loaded as a plain file (3.5 s, the same
    weights bit for bit). An archive without those two members is refused in one line (Keras' loader raised a
    ValueError with a traceback)."""
    from train.models import custom_objects

    with fs.open(path, "rb") as f, _archive(f, path) as archive:
        missing = sorted({KERAS_CONFIG, KERAS_WEIGHTS} - set(archive.namelist()))
        if missing:  # every .keras file tf-keras 2.18+ saves holds both
            raise TfpipeError(f"{path}: a zip archive without {' and '.join(missing)}; not a model train.fit saved")
        config = archive.read(KERAS_CONFIG)
        fs.parse_json(config, path, f"its {KERAS_CONFIG}")  # as strictly as every JSON file read back
        with tempfile.TemporaryDirectory(prefix="tfpipe-model-") as folder:
            try:
                model = keras.models.model_from_json(config.decode("utf-8"), custom_objects=custom_objects())
            except (ValueError, TypeError, KeyError, AttributeError) as e:  # fields of the wrong kind or missing
                raise TfpipeError(
                    f"{path}: its {KERAS_CONFIG} does not describe a model Keras can build ({type(e).__name__}: "
                    f"{str(e).splitlines()[0][:200] if str(e) else 'no detail'}); the model file is damaged"
                ) from None
            model.load_weights(archive.extract(KERAS_WEIGHTS, folder))
    return model


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
        beat = console.Heartbeat("train.predict")
        if progress:
            beat.start("still compiling the prediction step")
        bar = progress and console.on_terminal()  # Keras' bar on a terminal; elsewhere (a log, CI) step lines of ours
        try:
            said = [PredictionProgress(beat, steps, bar)] if progress else []
            with quick_teardown():  # the iterator is made and ended inside predict
                total += model.predict(ds, steps=steps, verbose=int(bar), callbacks=said)[:n]
        finally:
            beat.close()
    return (total / tta).astype(np.float32)


class PredictionProgress(keras.callbacks.Callback):
    """The heartbeat's subject while Keras predicts: compiling until the first batch is done, then nothing while
    Keras' ``bar`` moves or, without one, the step reached (``predicting: step 12/40 (15 s)``), then what
    happens between the last batch and ``predict`` returning."""

    def __init__(self, beat: console.Heartbeat, steps: int, bar: bool) -> None:
        super().__init__()
        self.beat, self.steps, self.bar = beat, steps, bar

    def on_predict_batch_end(self, batch: int, logs: dict[str, Any] | None = None) -> None:
        if self.bar:
            self.beat.stop()
        elif batch == 0:
            self.beat.start(f"predicting: step 1/{self.steps}")
        else:
            self.beat.update(f"predicting: step {batch + 1}/{self.steps}")

    def on_predict_end(self, logs: dict[str, Any] | None = None) -> None:
        # until predict returns: TensorFlow destroys the input pipeline holding the GIL, at times for a minute
        self.beat.start_outside("still collecting the predictions")


def check_tta(tta: int) -> None:
    if not 1 <= tta <= len(TTA_VIEWS):
        raise TfpipeError(f"{option('tta')} must be in 1..{len(TTA_VIEWS)} (got {tta})")


def tune_thresholds(
    probs: npt.NDArray[np.floating[Any]], targets: npt.NDArray[np.floating[Any]], default: float
) -> list[float]:
    """Per-class thresholds maximising validation F1 (``default`` for a class with no positive).

    Each lies halfway between the lowest score called positive and the next lower score: the same labels on the
    validation images, but no validation score sits exactly on a threshold, where float noise of another batch
    layout or device (1e-7) would flip its label."""
    from sklearn.metrics import precision_recall_curve

    out = []
    for c in range(targets.shape[1]):
        if targets[:, c].sum() == 0:
            out.append(default)
            continue
        precision, recall, thresholds = precision_recall_curve(targets[:, c], probs[:, c])
        f1 = 2 * precision * recall / np.maximum(precision + recall, 1e-12)
        best = int(np.argmax(f1[:-1]))
        below = probs[:, c][probs[:, c] < thresholds[best]]
        out.append((float(thresholds[best]) + (float(below.max()) if below.size else 0.0)) / 2)
    return out


def predict(
    run: str,
    records: Records,
    out: str = "submission.csv",
    *,
    tta: int = 1,
    threshold: float | None = None,
    probabilities: bool = False,
    labels: bool | None = None,
    strategy: str | tf.distribute.Strategy = "auto",
    replicas: int | None = None,
    batch_size: int = 32,
    id_column: str | None = None,
    overwrite: bool = False,
    progress: bool = True,
    swa: bool = False,
) -> pd.DataFrame:
    """Writes the submission of run folder ``run`` on the shards ``records``; returns it as a DataFrame.

    Called through ``train.predict.predict`` (see its example). Everything the run and the shards claim is
    checked against each other before the model is loaded; the records are opened once. Labeled shards are
    scored too (``train.evaluation``): printed with ``progress``, and in ``df.attrs["evaluation"]``.
    """
    labels = check_arguments(run, records, tta, threshold, probabilities, labels, batch_size, replicas)
    strat, _ = resolve_strategy(strategy, replicas)  # first: virtual CPUs need a TensorFlow that has run nothing
    config = RunConfig.load(run)
    check_model_present(run, swa)
    shards = tfpipe.open_shards(records)
    check_destination(out, overwrite)
    check_run_fits_records(config, shards, records)
    if labels:
        check_labels_can_be_joined(config.classes, config.single_label)
    # the labels, and the scores of labeled shards, need thresholds (probabilities alone do not)
    thresholds = _thresholds(run, config, threshold, swa) if labels or shards.labeled else []
    id_column = id_column or shards.id_column
    check_column_names(id_column, config.classes, labels, probabilities)
    ids = tfpipe.image_names(shards)
    check_ids_once(ids, records)
    batch_size = _batch_for(_num_examples(shards, records), batch_size, strat.num_replicas_in_sync, progress)
    model, config = _load_for(strat, run, config, swa, progress)
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
    df = submission_table(probs, ids, id_column, config, thresholds if labels else None, probabilities)
    shards.check_unchanged()  # before any score is printed: the predictions are of the shards that were opened
    if shards.labeled:
        how = (_threshold_words(run, config, threshold, swa), records, progress, seen_rows(run, ids, shards))
        df.attrs["evaluation"] = evaluate_labeled(shards, config, probs, thresholds, *how)
    shards.check_unchanged()  # the ids and predictions above are of the shards that were opened
    if out:
        write_submission(out, df.to_csv(index=False), overwrite)
    return df


def _load_for(
    strategy: tf.distribute.Strategy, run: str, config: RunConfig, swa: bool, progress: bool
) -> tuple[Any, RunConfig]:
    """``load_run`` in ``strategy``'s scope (its variables placed on every replica), saying what it loads."""
    name = run_files.model_files(swa)[0]
    with (
        strategy.scope(),
        console.saying("train.predict", f"loading {run}/{name}", "still loading the model", progress),
    ):
        return load_run(run, config, swa)


def check_arguments(
    run: str,
    records: Records,
    tta: int,
    threshold: float | None,
    probabilities: bool,
    labels: bool | None,
    batch_size: int,
    replicas: int | None,
) -> bool:
    """``predict``'s arguments on their own (before anything is opened); returns whether labels are written."""
    check_path(run=run, records=records)
    check_count(1, batch_size=batch_size, replicas=replicas)
    check_fraction(threshold=threshold)
    check_tta(tta)
    return check_columns(labels, probabilities, threshold)


def check_columns(labels: bool | None, probabilities: bool, threshold: float | None) -> bool:
    """Whether the labels column is written: by default unless ``probabilities``; both together with
    ``labels=True``. A ``threshold`` only makes labels, so it is refused when there are none."""
    labels = not probabilities if labels is None else labels
    if not (labels or probabilities):
        raise TfpipeError(
            f"nothing to write: no labels column and no probabilities; pass {option('probabilities', True)}"
        )
    if threshold is not None and not labels:
        raise TfpipeError(
            f"{option('threshold')} makes the labels column, which {option('probabilities', True)} alone does not "
            f"write; add {option('labels', True)} for both, or leave out {option('threshold')}"
        )
    return labels


def held_out_rows(shards: Shards, config: RunConfig) -> npt.NDArray[np.bool_] | None:
    """Which rows of ``shards`` (the run's own training shards, in written order) the run validated on and never
    trained on: its validation fold, or the last shards it held out; None when the record counts are unknown."""
    if shards.num_folds and config.fold is None:
        return None  # not a run of these shards after all (train.fit always picks a fold of shards with folds)
    parts = training_parts(shards, config.fold, float(config.settings.get("val_fraction", 0.2)))
    held = set(tfpipe.open_shards(parts.validation, parts.validation_folds).files)
    counts = shards.counts
    if any(counts[f] is None for f in shards.files):
        return None
    return np.concatenate([np.full(counts[f] or 0, f in held) for f in shards.files]).astype(bool)


class Seen(NamedTuple):
    """Which rows of shards to predict hold images a run saw, by content: ``validated`` (in its
    ``val_predictions.csv``) and ``trained`` (in its ``train_digests.txt``; None when it has none)."""

    validated: npt.NDArray[np.bool_]
    trained: npt.NDArray[np.bool_] | None


def seen_rows(run: str, ids: Sequence[str], shards: Shards) -> Seen | None:
    """Which rows of ``shards`` hold images the run validated on or trained on, by content: the digest of the
    stored image, whatever its id (two datasets may both hold an ``img_0001``, and a copy may be renamed). None
    when the run has no ``val_predictions.csv`` (``--no-report``). Runs before tfpipe 1.1 recorded no digests:
    their validation images are matched by id (``ids``), which the lines printed say."""
    import pandas as pd

    path = run_files.path(run, run_files.VAL_PREDICTIONS)
    if not fs.exists(path):
        return None
    with fs.open(path) as f:
        table = pd.read_csv(f, dtype=str, keep_default_na=False)
    key = "image_digest" if "image_digest" in table.columns else "image_name"
    if key not in table.columns:
        raise TfpipeError(f"{path}: no image_name column; the file is damaged (train.fit writes it with its report)")
    digests = tfpipe.image_digests(shards)
    validated = set(table[key])
    trained = run_files.load_digests(run)
    return Seen(
        np.array([i in validated for i in (digests if key == "image_digest" else ids)], dtype=bool),
        None if trained is None else np.array([d in trained for d in digests], dtype=bool),
    )


def evaluate_labeled(
    shards: Shards,
    config: RunConfig,
    probs: npt.NDArray[np.float32],
    thresholds: Sequence[float],
    threshold_words: str,
    records: Records,
    progress: bool,
    seen: Seen | None = None,
) -> dict[str, Any]:
    """Scores of ``probs`` against the labels ``shards`` hold (``train.evaluation.score``), printed with
    ``progress`` (always under the command): all the images, first. When they are the run's own training shards,
    the rows it held out and the rows it trained on are scored apart as well: only the first say anything about
    unseen images. Other shards holding images the run ``seen`` (the same stored image: its own data written
    again) are scored apart likewise: the images it validated on, trained on, and never saw (``others`` instead
    of ``unseen`` when the run recorded no training digests: perhaps trained on)."""
    result = _scores_of_parts(shards, config, probs, thresholds, threshold_words, seen)
    if progress or in_command():  # the command prints its scores also with --no-progress (a result, not progress)
        print("\n".join(evaluation_lines(result, records)), flush=True)
    return result


def _scores_of_parts(
    shards: Shards,
    config: RunConfig,
    probs: npt.NDArray[np.float32],
    thresholds: Sequence[float],
    threshold_words: str,
    seen: Seen | None,
) -> dict[str, Any]:
    from train.evaluation import score

    classes = list(config.classes)
    targets = tfpipe.read_targets(shards, len(classes))
    own = bool(config.dataset_id) and shards.dataset_id == config.dataset_id
    result: dict[str, Any] = {"thresholds": threshold_words, "own_training_shards": own}
    result["all"] = score(probs, targets, classes, thresholds, config.single_label)  # every image given, always
    parts = _parts(shards, config, own, seen)
    if parts is None or any(len(rows) != len(probs) for rows in parts.values()):
        return result
    for part, rows in parts.items():
        if rows.any():
            result[part] = score(probs[rows], targets[rows], classes, thresholds, config.single_label)
    if "held_out" in result:
        result["held_out_what"] = (
            "found in its val_predictions.csv"
            if not own
            else f"fold {config.fold}"
            if config.fold is not None
            else "the last shards"
        )
    return result


def _parts(shards: Shards, config: RunConfig, own: bool, seen: Seen | None) -> dict[str, npt.NDArray[np.bool_]] | None:
    """The rows to score apart (None: no part known): of the run's own training shards, those it held out and
    those it trained on; of other shards, the images it validated on, trained on, and the rest."""
    if own:
        held = held_out_rows(shards, config)
        return None if held is None else {"held_out": held, "trained_on": ~held}
    if seen is None:
        return None
    trained = seen.trained if seen.trained is not None else np.zeros_like(seen.validated)
    if not (seen.validated.any() or trained.any()):
        return None
    rest = "unseen" if seen.trained is not None else "others"  # unknown training images: perhaps trained on
    return {"held_out": seen.validated, "trained_on": trained & ~seen.validated, rest: ~(seen.validated | trained)}


def evaluation_lines(result: dict[str, Any], records: object) -> list[str]:
    """What train.predict prints of ``evaluate_labeled``'s result: a line per part, the class table of the
    images that say the most about unseen ones."""
    from train.evaluation import class_table, headline

    def line(what: str, scores: dict[str, Any]) -> str:
        auc = scores["roc_auc_macro"]
        return (
            f"train.predict: {what} ({scores['examples']} image{'s' * (scores['examples'] != 1)}), "
            f"{result['thresholds']}: AUC {'-' if auc is None else f'{auc:.4f}'} (exact, macro), {headline(scores)}"
        )

    everything = line(f"scores on the labeled shards {records}", result["all"])
    if not any(part in result for part in ("held_out", "trained_on", "unseen", "others")):
        return [everything, *class_table(result["all"])]
    lines = [everything]
    if not result["own_training_shards"]:
        lines.insert(0, _own_data_warning(result))
    if "held_out" in result:
        lines.append(line(f"scores on the images the run held out ({result['held_out_what']})", result["held_out"]))
    if "unseen" in result:
        lines.append(line("scores on the images the run never saw", result["unseen"]))
    if "others" in result:
        lines.append(line("scores on the other images (perhaps trained on)", result["others"]))
    if "trained_on" in result:
        lines.append(
            line("scores on the images it trained on (they say nothing about unseen ones)", result["trained_on"])
        )
    table = "unseen" if "unseen" in result else "held_out" if "held_out" in result else None
    if table is not None:
        what = "it never saw" if table == "unseen" else f"the run held out ({result['held_out_what']})"
        lines.append(f"  per class, on the images {what}:")
        lines += class_table(result[table])
    return lines


def _own_data_warning(result: dict[str, Any]) -> str:
    """Shards that are not the run's own holding images it saw: its own data, written again."""
    counts = [
        f"{result[part]['examples']} {what}"
        for part, what in (("held_out", "it validated on"), ("trained_on", "it trained on"))
        if part in result
    ]
    perhaps = "others" in result  # the run recorded no training digests
    return (
        f"train.predict: warning: of these images {' and '.join(counts)} (the same stored images as in the run's "
        f"{run_files.VAL_PREDICTIONS} and {run_files.TRAIN_DIGESTS}): these shards hold its own data, written again"
        + (f", and the other rows may be images it trained on (the run has no {run_files.TRAIN_DIGESTS})" * perhaps)
    )


def _threshold_words(run: str, config: RunConfig, threshold: float | None, swa: bool = False) -> str:
    """How the predicted labels were decided, for the score lines."""
    if config.single_label:
        return "labels by argmax"
    if threshold is not None:
        return f"labels at threshold {threshold:g}"
    tuned = run_files.model_files(swa)[1]
    if fs.exists(run_files.path(run, tuned)):
        return f"labels at the run's tuned thresholds ({tuned})"
    return f"labels at the run's threshold {config.settings.get('threshold', 0.5):g}"


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


def _thresholds(run: str, config: RunConfig, threshold: float | None, swa: bool = False) -> list[float]:
    """Per-class thresholds: ``threshold`` for all, else the run's tuned ones (validated; with ``swa`` those of the
    SWA model's report), else the run's default."""
    if threshold is not None:
        return [threshold] * len(config.classes)
    tuned = run_files.load_thresholds(run, list(config.classes), swa)
    default = float(config.settings.get("threshold", 0.5))
    if tuned is None and not config.single_label and config.settings.get("report", True):
        # train.fit wrote them with its report: labels at one threshold instead would change without a word
        raise TfpipeError(
            f"{run_files.path(run, run_files.model_files(swa)[1])} is missing (the tuned per-class thresholds "
            f"train.fit wrote with its report); copy it with the run, or pass {option('threshold', default)} to "
            "label every class at one threshold"
        )
    return tuned if tuned is not None else [default] * len(config.classes)
