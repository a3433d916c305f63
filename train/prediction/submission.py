"""The submission CSV and the checks before one is written, for ``train.predict`` and the PyTorch recipes alike
(no TensorFlow here): does a run fit the shards it is to predict, the destination may be written, the labels
column, the table, and its writing (whole, with its hash recorded: ``train.prediction.written``).

    from train.prediction.submission import check_run_fits_records, submission_table, write_submission
    check_run_fits_records(config, test_shards, "records/demo/test")    # classes, sizes, fit: one line if not
    df = submission_table(probs, ids, "image", config, thresholds=[0.5] * len(config.classes), probabilities=False)
    write_submission("submission.csv", df.to_csv(index=False), overwrite=False)
"""

from __future__ import annotations

import json
import os
import posixpath
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, NamedTuple

import numpy as np
import numpy.typing as npt

from tfpipe.format.manifest import LABEL_COLUMN
from tfpipe.format.shards import Records, Shards
from tfpipe.runtime import fs
from tfpipe.runtime.errors import TfpipeError, in_command, option
from train.decide.evaluation import predicted_hits
from train.prediction import written
from train.prediction.sample import (
    SampleSubmission,
    check_sample_ids,
    follow_sample,
    read_sample,
    sample_form,
    sample_id_column,
)
from train.runs import run as run_files
from train.runs.run import RunConfig

if TYPE_CHECKING:
    import pandas as pd

    from train.keras.config import PredictConfig


def labels_at(
    probs: npt.NDArray[np.floating[Any]], classes: Sequence[str], thresholds: Sequence[float], single_label: bool
) -> list[str]:
    """Space-separated predicted class names per row: argmax for single-label, else every class at or above its
    threshold (``train.decide.evaluation.predicted_hits``, what the scores count)."""
    return label_strings(predicted_hits(probs, thresholds, single_label), classes)


def label_strings(hits: npt.NDArray[np.bool_], classes: Sequence[str]) -> list[str]:
    """The class names of each row of boolean ``hits`` [N, C], a labels cell (predicted or true): separated by
    spaces, as Kaggle's submissions are; one class is its name as it is; several, where a class name holds a space
    (``big circle``), a JSON list (``["big circle", "cross"]``), which ``label_names`` reads back."""
    spaced = any(len(c.split()) != 1 for c in classes)
    out = []
    for row in hits:
        names = [c for c, on in zip(classes, row) if on]
        out.append(json.dumps(names, ensure_ascii=False) if spaced and len(names) > 1 else " ".join(names))
    return out


def label_names(cell: str, classes: Sequence[str]) -> list[str]:
    """The class names of a labels cell ``label_strings`` wrote: one class's name as it is, a JSON list, or names
    separated by spaces (empty: none). Whether each is a class is the caller's check."""
    if cell in classes:
        return [cell]
    if cell.startswith("["):
        try:
            names = json.loads(cell)
        except json.JSONDecodeError:
            names = None
        if isinstance(names, list) and all(isinstance(n, str) for n in names):
            return names
    return cell.split()


def check_column_names(
    id_column: str, classes: Sequence[str], labels: bool, probabilities: bool, label_column: str = LABEL_COLUMN
) -> None:
    """Every column of the submission has its own name: a class named like the id column (or like the labels
    column, ``label_column``, beside it) would make two columns one when the CSV is read back."""
    names = [id_column, *([label_column] if labels else []), *(classes if probabilities else [])]
    twice = next((n for i, n in enumerate(names) if n in names[:i]), None)
    if twice is not None:
        raise TfpipeError(
            f"the submission would hold two columns named {twice!r} (the id column, the labels column or a "
            f"class); choose another {option('id_column')}"
            + (", or write the labels and the probabilities in two runs" if labels and probabilities else "")
        )


def submission_table(
    probs: npt.NDArray[np.float32],
    ids: Sequence[str],
    id_column: str,
    config: RunConfig,
    thresholds: list[float] | None,
    probabilities: bool,
    label_column: str | None = None,
) -> pd.DataFrame:
    """The submission: ``id_column``, the labels at ``thresholds`` (space-separated; none when ``thresholds`` is
    None) in ``label_column`` (default: the run's, named as its training CSV's), then one probability column per
    class with ``probabilities``."""
    import pandas as pd

    classes = list(config.classes)
    df = pd.DataFrame({id_column: list(ids)})
    if thresholds is not None:
        df[label_column or config.label_column] = labels_at(probs, classes, thresholds, config.single_label)
    if probabilities:
        df = pd.concat([df, pd.DataFrame(probs, columns=classes)], axis=1)
    return df


def check_destination(out: str, overwrite: bool, flag: str = "out") -> None:
    """Before any predicting: ``out`` must be a regular file name whose folder exists (created if missing). An
    existing file is replaced only when ``train.predict`` wrote it and nobody changed it since (its hash is
    recorded in this user's state folder: ``train.prediction.written``), or with ``overwrite``: never a
    ``train.csv``, a manifest or anything else named as ``out`` by mistake, whatever its columns. A FIFO or a
    device (``/dev/stdout``) is never written, nor a link (written over, it would become a file), nor -- even
    with ``overwrite`` -- a file of tfpipe's own contracts (a run's ``config.json`` or weights, a
    ``manifest.json``, a shard). ``flag``: the setting that named it (``out``, ``save_probabilities``)."""
    if not out:
        return
    if fs.isdir(out) or out.endswith("/"):
        raise TfpipeError(f"{out} is a folder; {option(flag)} names the CSV file to write")
    if run_files.contract_file(posixpath.basename(out)):
        raise TfpipeError(
            f"{out} is a name tfpipe's own files have (a run's, a shard folder's); a submission never replaces one "
            f"-- choose another {option(flag)}"
        )
    for path in (out, written.legacy_record(out)):
        if fs.exists(path):
            fs.check_regular(path)  # a FIFO would hang the hash, a device be replaced by a file
    if not fs.is_remote(out) and os.path.islink(out):
        raise TfpipeError(f"{out} is a link; {option(flag)} names the file itself (the link would become a file)")
    if fs.exists(out) and not overwrite and not written.wrote_it(out):
        raise TfpipeError(
            f"{out} exists and was not written by train.predict (or was changed since); it is not "
            f"replaced -- choose another {option(flag)} or pass {option('overwrite', True)}"
        )
    folder = posixpath.dirname(out)
    if folder and not fs.isdir(folder):
        if fs.exists(folder):
            raise TfpipeError(f"{folder} is a file, so {out} cannot be written")
        fs.makedirs(folder)
    if not fs.is_remote(out) and not os.access(folder or ".", os.W_OK | os.X_OK):  # before, not after, predicting
        raise TfpipeError(f"{folder or '.'}: this user cannot write there, so {out} cannot be written; choose another")


def write_submission(out: str, text: str, overwrite: bool, flag: str = "out") -> None:
    """Writes ``out`` whole (complete or absent, also on gs://) and records its hash in this user's state folder,
    not beside it (``train.prediction.written``; ``flag``: the setting that named it)."""
    check_destination(out, overwrite, flag)  # again: another job may have put a file there while this one predicted
    data = text.encode("utf-8")
    fs.write_atomic(out, data)
    written.record(out, data)


def check_run_fits_records(config: RunConfig, shards: Shards, records: Records, prog: str = "train.predict") -> None:
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
    check_stored_size(config, shards.image_size, records)
    fit = shards.manifest.image.effective_fit  # shards.images, of a folder with a manifest
    if config.fit and fit != config.fit:
        raise TfpipeError(
            f"{records}: images fitted to a square by {fit!r}, the run's training images by "
            f"{config.fit!r}; write the shards again with "
            f"{option('fit', config.fit, python=f'ImageSpec(fit={config.fit!r})')}"
        )
    if config.single_label and shards.multi_label:
        raise TfpipeError(
            f"{records}: {shards.describe_labels()}, but the run is single-label (one class an "
            "image); predict them with a multi-label run"
        )
    if shards.labeled and config.dataset_id and shards.dataset_id == config.dataset_id:
        print(
            f"{prog}: warning: {records} are the shards this run trained on (dataset id "
            f"{config.dataset_id}): predictions of its training images say nothing about unseen images",
            file=sys.stderr,
            flush=True,
        )


def check_stored_size(config: RunConfig, stored: int | None, records: Records) -> None:
    """The one size rule of train.fit and train.predict: the reader resizes stored images to the model's input
    (``image_size``), so shards to predict must be stored as the training shards were -- at the same size, or
    both at their own sizes (``stored`` None, written without ``--image-size``) -- then they are resized exactly
    as in training. A run that did not record it is taken to have trained at the stored size."""
    trained = config.stored_size or config.image_size
    if (stored or run_files.OWN_SIZES) == trained or (stored is None and config.stored_size is None):
        return  # the second: a run that did not record it, shards without a fixed size: nothing to compare
    resized = f", resized to {config.image_size} px as read" if trained != config.image_size else ""
    if trained == run_files.OWN_SIZES:
        fix = f"without {option('image_size')}" if in_command() else "with ImageSpec(image_size=None)"
    else:
        fix = "with " + option("image_size", trained, python=f"ImageSpec(image_size={trained})")
    raise TfpipeError(
        f"{records}: images stored at {_stored(stored)}, the run's training images at {_stored(trained)}{resized}; "
        f"write the shards again {fix}"
    )


def _stored(size: int | str | None) -> str:
    return f"{size} px" if isinstance(size, int) else "their own sizes (written without a fixed size)"


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


TWO_FOLDERS = (
    "records, and a submission keys each image once (two folders of one dataset read together?); predict one folder"
)


def check_ids_once(ids: Sequence[str], records: Records, said: str = TWO_FOLDERS) -> None:
    """A submission keys each image once: records holding an id twice (two folders of one dataset, read
    together) are refused rather than written as two rows of one id. ``said``: what the line says after "is in
    two" (the validation report says why tfpipe's own shards could hold one twice)."""
    seen: set[str] = set()
    for i in ids:
        if i in seen:
            raise TfpipeError(f"{records}: the id {i!r} is in two {said}")
        seen.add(i)


def check_submission_target(
    config: RunConfig, shards: Shards, records: Records, out: str, overwrite: bool, prog: str = "train.predict"
) -> None:
    """The checks before a submission of ``config``'s run over ``shards`` is made, for ``train.predict`` and the
    recipes' ``--predict`` alike, as soon as the shards are open: ``out`` may be written and the run fits the
    shards. ``check_submission_columns`` follows, once the ids are read."""
    check_destination(out, overwrite)
    check_run_fits_records(config, shards, records, prog)


def check_submission_columns(
    config: RunConfig,
    ids: Sequence[str],
    records: Records,
    columns: tuple[str, bool, bool],
    label_column: str | None = None,
) -> None:
    """The rest, before any prediction: the columns (``(id column, labels, probabilities)``; the labels in
    ``label_column``, default the run's) can be written, each of the shards' ``ids`` once."""
    id_column, labels, probabilities = columns
    if labels:
        check_labels_can_be_joined(config.classes, config.single_label)
    check_column_names(id_column, config.classes, labels, probabilities, label_column or config.label_column)
    check_ids_once(ids, records)


def probabilities_paths(save: str, folds: Sequence[int] = ()) -> list[str]:
    """``--save-probabilities FILE``'s files: FILE (the model's probabilities, a fold ensemble's mean), then a
    CV's each fold's model's, FILE with ``-fold-K`` before its extension (``test-probs-fold-2.csv``)."""
    stem, ext = posixpath.splitext(save)
    return [save, *(f"{stem}-fold-{k}{ext}" for k in folds)]


def check_probabilities_paths(paths: Sequence[str], out: str, overwrite: bool) -> None:
    """Before any predicting: each of ``paths`` may be written as ``out`` may (``check_destination``: a file
    train.predict wrote and nobody changed, else only with ``overwrite``), and none is ``out`` or another."""
    for i, path in enumerate(paths):
        if (out and fs.same_path(path, out)) or any(fs.same_path(path, p) for p in paths[:i]):
            raise TfpipeError(
                f"{option('save_probabilities')}: {path} would also be written as {option('out')} or as another "
                "probabilities file; name another file"
            )
        check_destination(path, overwrite, "save_probabilities")


class Output(NamedTuple):
    """What ``predict`` writes, decided before any prediction: the id column, the labels column (in
    ``label_column``), the probabilities, the sample submission followed, ``--save-probabilities``' files."""

    id_column: str
    labels: bool
    probabilities: bool
    label_column: str
    sample: SampleSubmission | None
    saved: list[str]

    def table(
        self, probs: npt.NDArray[np.float32], ids: Sequence[str], config: RunConfig, thresholds: list[float]
    ) -> pd.DataFrame:
        """The submission of ``probs`` (rows of ``ids``) labelled at ``thresholds``, in the sample's columns
        and order when there is one."""
        labelled = thresholds if self.labels else None
        df = submission_table(probs, ids, self.id_column, config, labelled, self.probabilities, self.label_column)
        return df if self.sample is None else follow_sample(df, self.sample)


def planned_output(
    cfg: PredictConfig, config: RunConfig, folds: Sequence[int], shards: tuple[str, Sequence[str], bool]
) -> Output:
    """What ``cfg`` writes with the run of ``config`` (a CV's: of ``folds``) over shards (``(their id column,
    their ids, whether the flags ask for labels)``), checked before any prediction: the sample's header, form
    and ids (``--sample-submission``) or the flags' columns, each id once, and the files of
    ``--save-probabilities`` (a CV's each fold's too)."""
    shards_id_column, ids, labels = shards
    sample = read_sample(cfg.sample_submission, config.classes) if cfg.sample_submission else None
    id_column, probabilities = cfg.id_column or shards_id_column, cfg.probabilities
    label_column = config.label_column  # the training CSV's name
    if sample is not None:
        labels, probabilities = sample_form(sample, cfg.probabilities, cfg.labels, cfg.threshold)
        id_column, label_column = sample_id_column(sample, cfg.id_column), sample.label_column or label_column
    check_submission_columns(config, ids, cfg.records, (id_column, labels, probabilities), label_column)
    if sample is not None:
        check_sample_ids(sample, ids, cfg.records)
    saved = probabilities_paths(cfg.save_probabilities, folds) if cfg.save_probabilities else []
    check_probabilities_paths(saved, cfg.out or "", cfg.overwrite)
    return Output(id_column, labels, probabilities, label_column, sample, saved)
