"""The prediction engine behind ``train.predict`` (TensorFlow and tf-keras): a run's model over shards.

``train.predict`` holds the command line (no TensorFlow, so ``--help`` is instant) and calls ``predict`` here.
Rows follow the shards' written order and are keyed by the CSV id stored in each record. Works under any
strategy: batches are padded to static shapes and the padding rows are dropped.
"""

from __future__ import annotations

import contextlib
import logging
import math
import sys
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import numpy.typing as npt
import tensorflow as tf

import tfpipe
from tfpipe.format.shards import UNKNOWN_COUNT, Records, Shards
from tfpipe.runtime import console
from tfpipe.runtime.console import counted
from tfpipe.runtime.errors import TfpipeError, check_count, check_fraction, check_path, in_command, option
from train import backends as backend
from train.accel.cluster import check_one_machine
from train.accel.strategy import quick_teardown
from train.backends import KerasMixin, complete, keras_module
from train.backends.choice import for_run, trained_backend
from train.decide.tuning import Predictor, describe
from train.keras.config import PredictConfig
from train.keras.run_model import load_run
from train.prediction.scores import evaluate_labeled, seen_rows
from train.prediction.submission import check_submission_target, planned_output, submission_table, write_submission
from train.prediction.target import (
    Target,
    near_chance_lines,
    open_target,
    target_thresholds,
    threshold_words,
    tta_worth,
)
from train.runs import run as run_files
from train.runs.run import RunConfig

if TYPE_CHECKING:
    import pandas as pd

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
    ids: Sequence[str] | None = None,
) -> npt.NDArray[np.float32]:
    """Model outputs [N, C] for every record of ``records`` in written order, averaged over ``tta`` views.

    The model must have been built in ``strategy.scope()`` (or loaded there). Every replica gets a full padded
    batch, so shapes stay static; the rows whose weight marks them padding are dropped. Each row carries a hash
    of its record's ``image_name`` through the model, checked against ``ids`` (the caller's, read in another
    pass; default: read here first): a shard swapped or replaced while this job ran (same count, other
    images) is an error, never a row holding another image's probabilities.
    """
    check_tta(tta)
    n = tfpipe.count_examples(records, folds)
    expected = name_hashes(tfpipe.image_names(records, folds) if ids is None else ids)
    global_batch = batch_size * strategy.num_replicas_in_sync
    steps = math.ceil(n / global_batch)
    total = np.zeros((n, num_classes), np.float64)
    with strategy.scope():
        weighed = passing_weights(model)
    for k in range(tta):

        def dataset_fn(ctx: tf.distribute.InputContext, k: int = k) -> tf.data.Dataset:
            ds = tfpipe.make_dataset(
                records,
                ctx.get_per_replica_batch_size(global_batch),
                image_size=image_size,
                folds=folds,
                num_classes=num_classes,
                pad_batches=True,
                with_ids=True,
                input_context=ctx,
            )
            view = lambda images, _, weight, name: ((tta_view(images, k), weight, name_hashes(name)),)  # noqa: E731
            return ds.map(view)

        ds = backend.current().datasets(strategy, dataset_fn)
        if progress:
            print(
                f"train.predict: view {k + 1}/{tta}: {n} image{'s' * (n != 1)} in {steps} step{'s' * (steps != 1)} "
                f"of {global_batch}",
                flush=True,
            )
        with strategy.scope():  # Keras 3 on JAX: each batch sharded over the devices
            outputs, weights, hashes = predicted(weighed, ds, steps, progress)
        total += real_rows(outputs, weights, hashes, expected, records)
    return (total / tta).astype(np.float32)


def predicted(model: Any, ds: Any, steps: int, progress: bool) -> Any:
    """``model.predict`` over ``steps`` steps of ``ds``, with Keras' bar on a terminal, step lines of ours
    elsewhere (a log, CI), and a heartbeat while the step compiles."""
    beat = console.Heartbeat("train.predict")
    if progress:
        beat.start("still compiling the prediction step")
    bar = progress and console.on_terminal()
    try:
        said = [complete(PredictionProgress)(beat, steps, bar)] if progress else []
        with quick_teardown():  # the iterator is made and ended inside predict
            return model.predict(ds, steps=steps, verbose=int(bar), callbacks=said)
    finally:
        beat.close()


def passing_weights(model: Any) -> Any:
    """``model`` taking ``(images, weights, name hashes)`` and giving ``[outputs, weights, name hashes]``: each row's
    weight and name ride along with it through ``predict``, which gathers the replicas' rows, so which rows are
    padding, and which image each row is, are read, not assumed. (int32 and float32: a TPU takes no strings.)"""
    keras = keras_module()
    images = keras.Input(model.input_shape[1:], dtype=model.inputs[0].dtype)
    weights, names = keras.Input((), dtype="float32"), keras.Input((), dtype="int32")
    identity = keras.layers.Identity
    return keras.Model([images, weights, names], [model(images), identity()(weights), identity()(names)])


def name_hashes(names: Sequence[str] | tf.Tensor) -> Any:
    """A 31-bit hash of each image name (int32; TensorFlow's fingerprint, the same in the pipeline and here)."""
    return tf.cast(tf.strings.to_hash_bucket_fast(names, 2**31 - 1), tf.int32)


def real_rows(
    outputs: np.ndarray, weights: np.ndarray, hashes: np.ndarray, expected: Any, records: Records
) -> np.ndarray:
    """The rows of ``outputs`` whose weight marks them real (padding has weight 0), which must be the records
    whose names were read, in their order: a pass that found another number of records, or other images, is an
    error, never a table of shifted rows."""
    real, names, expected = outputs[weights > 0], hashes[weights > 0], np.asarray(expected)
    if len(real) != len(expected):
        raise TfpipeError(
            f"{records}: a pass read {counted(len(real), 'record')}, the shards count {len(expected)}; run it again"
        )
    differ = np.flatnonzero(names != expected)
    if len(differ):
        raise TfpipeError(
            f"{records}: row {differ[0] + 1} of the predictions is another image than the one read before (a shard "
            "swapped or replaced while this job ran?); nothing of this pass counts -- run it again once the shards "
            "are whole (python -m tfpipe.inspect --verify)"
        )
    return real


class PredictionProgress(KerasMixin):
    """The heartbeat's subject while Keras predicts: compiling until the first batch is done, then nothing while
    Keras' ``bar`` moves or, without one, the step reached (``predicting: step 12/40 (15 s)``), then what
    happens between the last batch and ``predict`` returning."""

    KERAS_BASE = "callbacks.Callback"

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


def predict(cfg: PredictConfig) -> pd.DataFrame:
    """Writes the submission of ``cfg.run`` (a run folder, or a CV folder's fold ensemble) on the shards
    ``cfg.records`` to ``cfg.out``; returns it as a DataFrame.

    Called through ``train.predict.predict`` (see its example). Everything the run and the shards claim is
    checked against each other before the model is loaded; the records are opened once. Labeled shards are
    scored too (``train.decide.evaluation``): printed with ``progress``, and in ``df.attrs["evaluation"]``.
    """
    check_one_machine(cfg.strategy)
    labels = check_arguments(
        cfg.run, cfg.records, cfg.tta, cfg.threshold, cfg.probabilities, cfg.labels, cfg.batch_size, cfg.replicas
    )
    choice = for_run(cfg.backend, trained_backend(cfg.run), cfg.run)
    backend.use_backend(choice, cfg.strategy, cfg.replicas)  # train.predict.predict readied it, a caller may not
    strategy, _ = backend.resolve(choice, cfg.strategy, cfg.replicas)  # first: virtual CPUs need a fresh start
    target = open_target(cfg.run, cfg.swa, PROG, say=cfg.progress or in_command())
    config = target.config
    shards = tfpipe.open_shards(cfg.records)
    check_submission_target(config, shards, cfg.records, cfg.out or "", cfg.overwrite)
    _num_examples(shards, cfg.records)  # predicting needs each file's count: said before any pass warns of it
    ids = tfpipe.image_names(shards)
    output = planned_output(cfg, config, target.cv.folds if target.cv else (), (shards.id_column, ids, labels))
    # the labels, and the scores of labeled shards, need thresholds (probabilities alone do not)
    predictor = validation_predictor(strategy, cfg.batch_size, swa=target.swa, views=cfg.tta, progress=cfg.progress)
    needed = output.labels or shards.labeled
    thresholds = target_thresholds(target, cfg.threshold, cfg.tta, predictor, PROG) if needed else []
    if cfg.tta > 1:
        say_tta_worth(cfg, strategy, target)
    probs, each = ensemble_probabilities(cfg, strategy, target, shards, ids)
    df = output.table(probs, ids, config, thresholds)
    for line in near_chance_lines(target, probs, thresholds) if output.labels and cfg.threshold is None else ():
        print(f"{PROG}: {line}", flush=True)
    df.attrs["model"] = target.describe(cfg.tta)  # which model and views the predictions are of
    shards.check_unchanged(sizes=True)  # before any score is printed: the predictions are of the shards opened
    if shards.labeled:
        seen = None if target.cv else seen_rows(cfg.run, ids, shards)  # every image of a CV's was trained on
        how = (threshold_words(target, cfg.threshold, cfg.tta), cfg.records, cfg.progress, seen, target.cv is None)
        df.attrs["evaluation"] = evaluate_labeled(shards, config, probs, thresholds, *how)
    shards.check_unchanged()  # the ids and predictions above are of the shards that were opened
    if cfg.out:
        write_submission(cfg.out, df.to_csv(index=False), cfg.overwrite)
    for path, found in zip(output.saved, [probs, *each] if target.cv else [probs]):
        table = submission_table(found, ids, output.id_column, config, None, True)  # the form blend --test reads
        write_submission(path, table.to_csv(index=False), cfg.overwrite, "save_probabilities")
    return df


def say_tta_worth(cfg: PredictConfig, strategy: tf.distribute.Strategy, target: Target) -> None:
    """One line before the test images are predicted: what ``cfg.tta`` views did to the same model's held-out
    predictions by the run's metric (a CV's OOF rows, a run's validation images), to stderr as a warning when
    they scored worse than one view; said also without ``progress``, a warning most of all."""

    def predictor_for(views: int) -> Predictor:
        return validation_predictor(strategy, cfg.batch_size, swa=target.swa, views=views, progress=cfg.progress)

    worth, rows = tta_worth(target, cfg.tta, predictor_for)
    print(worth.line(PROG, rows), file=sys.stderr if worth.hurts else sys.stdout, flush=True)


def ensemble_probabilities(
    cfg: PredictConfig, strategy: tf.distribute.Strategy, target: Target, shards: Shards, ids: Sequence[str]
) -> tuple[npt.NDArray[np.float32], list[npt.NDArray[np.float32]]]:
    """The probabilities of every record of ``shards`` (whose names are ``ids``): the run's model's, or the mean
    of a CV's fold models'; and each model's (a CV's each fold's, in its folds' order), predicted once."""
    n = _num_examples(shards, cfg.records)
    batch_size = _batch_for(n, cfg.batch_size, strategy.num_replicas_in_sync, cfg.progress)
    found = [
        _member_probabilities(strategy, m, target.swa, shards, (batch_size, cfg.tta, cfg.progress), ids)
        for m in target.members
    ]
    return np.mean(found, axis=0).astype(np.float32), found


PROG = "train.predict"


def _member_probabilities(
    strategy: tf.distribute.Strategy,
    member: tuple[str, RunConfig],
    swa: bool,
    shards: Shards,
    how: tuple[int, int, bool],
    ids: Sequence[str],
) -> npt.NDArray[np.float32]:
    """One model's probabilities of every record of ``shards``: a run's, or one fold's of a CV (``how``: the
    batch size, the views, progress)."""
    batch_size, tta, progress = how
    run, config = member
    model, config = _load_for(strategy, run, config, swa, progress)
    with tfpipe.naming_corrupt_shards(shards), forgotten_after():
        return predict_probabilities(
            model,
            shards,
            strategy,
            batch_size=batch_size,
            image_size=config.image_size,
            num_classes=len(config.classes),
            tta=tta,
            progress=progress,
            ids=ids,
        )


@contextlib.contextmanager
def forgotten_after() -> Iterator[None]:
    """One model of several (a fold ensemble's) predicting: TensorFlow's warning that a prediction function is
    traced again held back (each new model traces its own, and TensorFlow counts them together: a warning from
    the sixth on, with nothing to fix), and Keras' global state cleared after it, its memory freed."""
    logger = tf.get_logger()
    level = logger.level
    logger.setLevel(max(level, logging.ERROR))
    try:
        yield
    finally:
        logger.setLevel(level)
        keras_module().backend.clear_session()


def _load_for(
    strategy: tf.distribute.Strategy, run: str, config: RunConfig, swa: bool, progress: bool
) -> tuple[Any, RunConfig]:
    """``load_run`` in ``strategy``'s scope (its variables placed on every replica), saying what it loads."""
    name = run_files.model_files(swa)[0]
    with (
        strategy.scope(),
        console.saying(PROG, f"loading {run}/{name}", "still loading the model", progress),
    ):
        return load_run(run, config, swa)


def validation_predictor(
    strategy: tf.distribute.Strategy, batch_size: int, *, swa: bool, views: int, progress: bool, prog: str = PROG
) -> Predictor:
    """How ``train.decide.tuning`` makes the validation predictions a run lacks: its model (final, or ``swa``) loaded
    under ``strategy``, its validation records predicted over ``views`` views."""

    def predict(run: str, config: RunConfig, records: Shards, folds: list[int] | None) -> npt.NDArray[np.float32]:
        model, config = _load_for(strategy, run, config, swa, progress)
        n = tfpipe.count_examples(records, folds)
        if progress:
            print(
                f"{prog}: predicting {run}'s {counted(n, 'validation image')} with {describe(swa, views)}",
                flush=True,
            )
        with forgotten_after():
            return predict_probabilities(
                model,
                records,
                strategy,
                batch_size=_batch_for(n, batch_size, strategy.num_replicas_in_sync, False),
                image_size=config.image_size,
                num_classes=len(config.classes),
                folds=folds,
                tta=views,
            )

    return predict


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


def _num_examples(shards: Shards, records: Records) -> int:
    """Records in ``shards``, from the manifest or the counts in the shard names; unknown (foreign shards named
    without counts) is an error naming ``records``, as ``tfpipe.count_examples`` says it."""
    n = shards.num_examples
    if n is None:
        raise TfpipeError(f"{records}: {UNKNOWN_COUNT}")
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
