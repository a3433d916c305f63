"""A run folder (``train.fit --run``): the one module that knows its file names and reads them back validated.

    runs/NAME/config.json        RunConfig: what predicting needs (classes, input size, fit, single/multi-label,
                                 the training shards' dataset id, the validation fold) and every setting used
    runs/NAME/model.keras        the trained model (model-swa.keras: the SWA average)
    runs/NAME/thresholds.json    per-class thresholds tuned on validation (multi-label)
    runs/NAME/history.csv        one row per epoch (scores, learning rate, images/s, seconds); metrics.json: the
                                 run's figures
    runs/NAME/train_digests.txt  the digest of every image trained on (with the report): what train.predict
                                 knows them by, whatever their names
    runs/NAME/state.json         finished phases, for --resume; backup/, checkpoints/, logs/: Keras' own

Everything read back (``RunConfig.load``, ``read_state``, ``load_thresholds``, ``load_digests``) is validated
first and a problem is one ``RunMismatch`` (a ``TfpipeError``) naming the file and the field. No TensorFlow here.
"""

from __future__ import annotations

import dataclasses
import json
import os
import posixpath
import re
from collections.abc import Sequence
from typing import Any, NamedTuple

from tfpipe.format.manifest import FITS, LABEL_COLUMN, MANIFEST
from tfpipe.format.names import SHARD_NAMES
from tfpipe.format.shards import Shards, fold_split, holdout_split
from tfpipe.runtime import fs
from tfpipe.runtime.errors import RunMismatch
from train.runs import files
from train.runs.files import FILES

CONFIG = "config.json"
MODEL = "model.keras"
MODEL_SWA = "model-swa.keras"
SWA_SUFFIX = "-swa"  # of the SWA model's report files: val_predictions-swa.csv, thresholds-swa.json, ...
THRESHOLDS = "thresholds.json"
VAL_PREDICTIONS = "val_predictions.csv"  # the report's (train.keras.report writes it)
TRAIN_DIGESTS = "train_digests.txt"  # the report's: the digest of every image trained on, one a line
HISTORY = "history.csv"
STATE = "state.json"
METRICS = "metrics.json"
SWA_AVERAGE = "swa-average.npz"
BACKUP = "backup"
CHECKPOINTS = "checkpoints"
LOGS = "logs"
BURN_DONE = f"{CHECKPOINTS}/burn-done"  # the weights after the burn-in phase, for --resume (TensorFlow's files)
# Every name train.fit writes in a run folder besides the report's files (train.keras.report): what a job that fails
# before its first epoch is saved removes again from a folder that was new or empty when it started.
WRITTEN = (CONFIG, MODEL, MODEL_SWA, THRESHOLDS, HISTORY, STATE, METRICS, SWA_AVERAGE, BACKUP, CHECKPOINTS, LOGS, FILES)
ROC_PNG, PREDICTIONS_PNG, CURVES_PNG = "roc.png", "predictions.png", "learning_curves.png"  # the report's pictures
REPORT = (VAL_PREDICTIONS, TRAIN_DIGESTS, THRESHOLDS, ROC_PNG, PREDICTIONS_PNG, CURVES_PNG)  # each also with SWA_SUFFIX
TORCH_MODEL, TORCH_MODEL_SWA = "model.pt", "model-swa.pt"  # the PyTorch recipes' weights (train.torch.run)
RECIPES = ("torch_ddp", "lightning_swa")  # the PyTorch recipes (examples/) whose runs config.json can name
# 1: no version field (fit and dataset id unknown); 2: run_version, fit, dataset_id, num_classes;
# 3: files.json (train.runs.files), replicas_in_sync, global_batch_size, train_examples; label_column optional
# (a run without it names its submission's labels column "labels"); processes optional (without it: resumed unchecked).
RUN_VERSION = 3
CV_FILE = "cv.json"  # a CV folder's plan and scores (train.runs.cv_folder)
# The version of config.json, and of cv.json, from which a folder keeps files.json (train.runs.files)
RECORDED_SINCE = {CONFIG: ("run_version", 3), CV_FILE: ("cv_version", 2)}
IMAGES_PER_SEC, EPOCH_SECONDS = "images_per_sec", "seconds"  # history.csv's timing of each epoch (not scores)
OWN_SIZES = "own"  # config.json's stored_image_size for training shards written without --image-size


TEMPORARY = re.compile(r"^(?P<name>.+)\.tmp-[0-9a-f]{8}(?P<ext>\.keras)?$")  # fs.temporary_name's, save_model's


def remove_half_saved(run: str) -> None:
    """Removes what a job killed while saving a run file left under its temporary name (``model.tmp-1a2b3c4d.keras``,
    ``config.json.tmp-1a2b3c4d``): only names of files train.fit writes."""
    for name in fs.listdir(run):
        m = TEMPORARY.match(name)
        if m and m["name"] + (m["ext"] or "") in WRITTEN and not fs.isdir(path(run, name)):
            fs.remove(path(run, name))


def swa_name(name: str) -> str:
    """``val_predictions.csv`` -> ``val_predictions-swa.csv``: the SWA model's report file of that name."""
    stem, dot, ext = name.rpartition(".")
    return f"{stem}{SWA_SUFFIX}{dot}{ext}"


def views_name(name: str, views: int) -> str:
    """``thresholds.json`` -> ``thresholds-tta4.json``: the file of that name for predictions averaged over
    ``views`` TTA views (a threshold set belongs to one model and one view count); one view keeps the name."""
    stem, dot, ext = name.rpartition(".")
    return name if views == 1 else f"{stem}-tta{views}{dot}{ext}"


def variant(name: str, swa: bool = False, views: int = 1) -> str:
    """A per-model, per-view file's name: ``val_predictions.csv`` -> ``val_predictions-swa-tta4.csv``."""
    return views_name(swa_name(name) if swa else name, views)


TUNED = (VAL_PREDICTIONS, THRESHOLDS)  # the files train.predict tunes for other view counts (train.decide.tuning)
_VIEWS = re.compile(r"^(?P<stem>.+)-tta[2-8](?P<ext>\.\w+)$")


def written_by_fit(name: str) -> bool:
    """Whether ``name`` in a run folder is one train.fit writes (a run file, a report file, one of those under a
    temporary name, the tuning files for other view counts): what ``train.fit --overwrite`` replaces, and nothing
    else."""
    m = TEMPORARY.match(name)
    if m:
        name = m["name"] + (m["ext"] or "")
    viewed = _VIEWS.match(name)
    if viewed and viewed["stem"] + viewed["ext"] in {variant(n, swa) for n in TUNED for swa in (False, True)}:
        return True
    return name in WRITTEN or name in REPORT or name in {swa_name(n) for n in REPORT}


# The files train.fit writes inside LOGS (TensorBoard), CHECKPOINTS and BACKUP (TensorFlow checkpoints: the best
# epoch's, the burn-in's weights, the backups)
FOLDER_FILE = re.compile(
    r"^(events\.out\.tfevents\..+|checkpoint|best\..+|burn-done\..+|ckpt-\d+\..+|.+\.tmp-[0-9a-f]{8}.*"
    r"|latest\.weights\.h5|position\.json)$"  # the last two: Keras 3's backup (train.backends.jax.StepBackup)
)


def foreign_in_folders(run: str) -> list[str]:
    """Files inside a local run's ``logs/``, ``checkpoints/`` and ``backup/`` that train.fit does not write (a
    user's notes), as paths under ``run``: ``--overwrite`` removes those folders whole, so it refuses while any is
    there. A bucket's folders are not walked (objects there are train.fit's to replace)."""
    if fs.is_remote(run):
        return []
    found = []
    for folder in (LOGS, CHECKPOINTS, BACKUP):
        top = path(run, folder)
        if os.path.islink(top) or not os.path.isdir(top):
            continue  # a link is removed as a link, its target untouched
        for parent, _, names in os.walk(top):
            found += [os.path.relpath(os.path.join(parent, f), run) for f in names if not FOLDER_FILE.match(f)]
    return sorted(found)


def contract_file(name: str) -> bool:
    """Whether a file's ``name`` is one of tfpipe's own contracts -- a run file or report file, a recipe's weights,
    a shard folder's manifest or a shard: never written over by a submission, whatever ``overwrite`` says."""
    return written_by_fit(name) or name in (TORCH_MODEL, TORCH_MODEL_SWA, MANIFEST) or SHARD_NAMES.is_shard(name)


def path(run: str, name: str) -> str:
    """``run/name`` for a run folder, local or ``gs://``."""
    return posixpath.join(run, name)


@dataclasses.dataclass(frozen=True)
class RunConfig:
    """``config.json`` of a run: what prediction depends on, plus ``settings`` (every ``FitConfig`` field used)."""

    classes: tuple[str, ...]
    image_size: int
    single_label: bool
    fit: str | None  # how the training shards' images were made square (None: unknown, version-1 runs)
    dataset_id: str | None  # the training shards' dataset id (None: unknown, version-1 runs)
    fold: int | None  # the validation fold (None: the last shards were held out)
    records: str
    settings: dict[str, Any] = dataclasses.field(default_factory=dict)
    version: int = RUN_VERSION
    # The size the training shards' images were stored at, which the reader resized to ``image_size``:
    # OWN_SIZES when written without a fixed size, None when unknown (not recorded). Shards to predict
    # must be stored alike.
    stored_size: int | str | None = None
    # The training CSV's label column (``Manifest.label_column``): the submission's labels column is named so.
    label_column: str = LABEL_COLUMN

    @property
    def recipe(self) -> str | None:
        """The PyTorch recipe that wrote this run (``train.torch.run``: a ``model.pt``, no Keras model); None for
        train.fit's runs."""
        recipe = self.settings.get("recipe")
        return recipe if isinstance(recipe, str) else None

    def to_dict(self) -> dict[str, Any]:
        """The JSON form: the settings flat at the top level, the contract's fields over them."""
        return dict(
            self.settings,
            classes=list(self.classes),
            num_classes=len(self.classes),
            image_size=self.image_size,
            single_label=self.single_label,
            fit=self.fit,
            dataset_id=self.dataset_id,
            fold=self.fold,
            records=self.records,
            stored_image_size=self.stored_size,
            label_column=self.label_column,
            run_version=self.version,
        )

    def save(self, run: str) -> None:
        fs.write_atomic(path(run, CONFIG), json.dumps(self.to_dict(), indent=1, default=str, ensure_ascii=False) + "\n")

    @classmethod
    def load(cls, run: str) -> RunConfig:
        """Reads and validates ``run/config.json``."""
        p = path(run, CONFIG)
        if not fs.exists(p):
            raise RunMismatch(f"{run}: no {CONFIG}; is this a run folder written by train.fit?")
        return from_dict(_read_json(p), p)


def _read_json(p: str) -> Any:
    return fs.read_json(p, "run file")


def _bad(p: str, key: str, what: str, value: Any) -> RunMismatch:
    shown = repr(value) if len(repr(value)) <= 60 else repr(value)[:57] + "..."
    return RunMismatch(f"{p}: field {key!r} {what} (got {shown}); the run folder was edited or damaged")


def from_dict(data: Any, p: str) -> RunConfig:
    """Validates a ``config.json``'s content (``p`` names it in errors)."""
    if not isinstance(data, dict):
        raise RunMismatch(f"{p}: not a JSON object; the run folder is damaged")
    version = data.get("run_version", 1)
    if type(version) is not int or version < 1:
        raise _bad(p, "run_version", "must be a whole number >= 1", version)
    if version > RUN_VERSION:
        raise RunMismatch(f"{p}: run version {version} was written by a newer tfpipe; upgrade tfpipe")
    classes = _classes(data, p)
    size, single = data.get("image_size"), data.get("single_label")
    if type(size) is not int or size < 1:
        raise _bad(p, "image_size", "must be a whole number of pixels", size)
    if type(single) is not bool:
        raise _bad(p, "single_label", "must be true or false", single)
    fit, dataset_id, fold = data.get("fit"), data.get("dataset_id"), data.get("fold")
    if version >= 2 and fit not in FITS:
        raise _bad(p, "fit", f"must be one of {', '.join(FITS)}", fit)
    if version >= 2 and not (dataset_id is None or isinstance(dataset_id, str)):
        raise _bad(p, "dataset_id", "must be a string", dataset_id)
    if not (fold is None or (type(fold) is int and fold >= 0)):
        raise _bad(p, "fold", "must be a fold number or null", fold)
    stored = data.get("stored_image_size")
    if not (stored is None or stored == OWN_SIZES or (type(stored) is int and stored >= 1)):
        raise _bad(p, "stored_image_size", f"must be a whole number of pixels, {OWN_SIZES!r} or null", stored)
    _check_records_and_recipe(data, p)
    threshold = data.get("threshold", 0.5)
    if not isinstance(threshold, (int, float)) or isinstance(threshold, bool) or not 0 < threshold < 1:
        raise _bad(p, "threshold", "must be between 0 and 1", threshold)
    return RunConfig(
        classes=tuple(classes),
        image_size=size,
        single_label=single,
        fit=fit if version >= 2 else None,
        dataset_id=dataset_id if version >= 2 else None,
        fold=fold,
        records=str(data.get("records", "")),
        settings=data,
        version=version,
        stored_size=stored,
        label_column=_label_column(data, p),
    )


def _label_column(data: dict[str, Any], p: str) -> str:
    label_column = data.get("label_column", LABEL_COLUMN)  # LABEL_COLUMN when not recorded
    if not isinstance(label_column, str) or not label_column.strip():
        raise _bad(p, "label_column", "must name the training CSV's label column", label_column)
    return label_column


def _check_records_and_recipe(data: dict[str, Any], p: str) -> None:
    records, recipe = data.get("records", ""), data.get("recipe")
    if not isinstance(records, (str, list)):  # a folder, a glob, or (from Python) a list of files
        raise _bad(p, "records", "must name the training shards", records)
    if not (recipe is None or recipe in RECIPES):
        raise _bad(p, "recipe", f"must be one of {', '.join(RECIPES)} or absent (train.fit's runs)", recipe)


def _classes(data: dict[str, Any], p: str) -> list[str]:
    """``config.json``'s class names, validated (and its ``num_classes``, when given, against them)."""
    classes = data.get("classes")
    if not isinstance(classes, list) or not classes or not all(isinstance(c, str) and c.strip() for c in classes):
        raise _bad(p, "classes", "must list the class names (non-empty strings)", classes)
    if len(set(classes)) != len(classes):
        raise _bad(p, "classes", "lists a class twice", classes)
    n = len(classes)
    if "num_classes" in data and data["num_classes"] != n:
        raise _bad(p, "num_classes", f"does not match the {n} class{'es' * (n != 1)} listed", data["num_classes"])
    return classes


def read_state(run: str) -> dict[str, Any]:
    """``state.json``: ``burn_done``, ``finished`` (booleans) and ``stops``, the jobs stopped by a signal
    (``{"signal": "SIGTERM", "at": "epoch 2, step 5"}`` each, ``at`` empty when not at a step); {} before the
    first phase ends or stop."""
    p = path(run, STATE)
    if not fs.exists(p):
        return {}
    state = _read_json(p)
    flags = {k: v for k, v in state.items() if k != "stops"} if isinstance(state, dict) else None
    stops = state.get("stops", []) if isinstance(state, dict) else None
    if flags is None or not all(isinstance(v, bool) for v in flags.values()) or not _stops(stops):
        raise RunMismatch(
            f"{p}: expected an object of true/false flags and a list of stops (got {state!r}); the run folder is "
            "damaged"
        )
    return state


def _stops(stops: object) -> bool:
    """Whether ``stops`` is a list of {"signal": a signal's name, "at": text}."""
    return isinstance(stops, list) and all(
        isinstance(s, dict) and set(s) == {"signal", "at"} and s["signal"] in ("SIGINT", "SIGTERM")
        and isinstance(s["at"], str)
        for s in stops
    )  # fmt: skip


def write_state(run: str, state: dict[str, Any]) -> None:
    fs.write_atomic(path(run, STATE), json.dumps(state))


def record_stop(run: str, signal_name: str, at: str) -> None:
    """Adds a job stopped by ``signal_name`` (at ``at``: "epoch 2, step 5", or "") to ``state.json``'s stops."""
    state = read_state(run)
    write_state(run, dict(state, stops=[*state.get("stops", []), {"signal": signal_name, "at": at}]))


def save_digests(run: str, digests: Sequence[str]) -> None:
    """``train_digests.txt``: what ``train.predict`` knows the images a run trained on by, whatever their names;
    a first line gives their number, so a file cut short is known."""
    lines = [f"# images trained on: {len(digests)}", *digests]
    fs.write_atomic(path(run, TRAIN_DIGESTS), "".join(f"{line}\n" for line in lines))
    files.record(run, [TRAIN_DIGESTS])


def load_digests(run: str) -> set[str] | None:
    """The digests ``save_digests`` wrote, validated (each 16 hex digits, as many as the first line says); None
    when the run has none (``--no-report``, or a run that recorded none)."""
    p = path(run, TRAIN_DIGESTS)
    if not fs.exists(p):
        return None
    head, *lines = fs.read_text(p).split("\n")
    count = _COUNT.fullmatch(head)
    bad = next((line for line in lines[:-1] if not _DIGEST.fullmatch(line)), None)
    if count is None or bad is not None or lines[-1:] != [""] or len(lines) - 1 != int(count.group(1)):
        what = (
            f"{bad!r} is not an image digest (16 hex digits a line)"
            if bad is not None
            else f"it does not hold the number of digests its first line says ({head[:40]!r})"
        )
        raise RunMismatch(f"{p}: {what}; the run folder was edited or damaged")
    check_file(run, TRAIN_DIGESTS, "train the run again, or copy the run's own file back")
    return set(lines[:-1])


_DIGEST = re.compile("[0-9a-f]{16}")
_COUNT = re.compile(r"# images trained on: (\d+)")


def read_history(run: str) -> list[dict[str, str]] | None:
    """``history.csv``'s rows, validated as input: a header naming ``epoch``, every row as many fields, epochs
    0, 1, 2, ... each once. None when there is none yet (before the first epoch ends)."""
    import csv
    import io

    p = path(run, HISTORY)
    if not fs.exists(p):
        return None
    try:
        rows = list(csv.reader(io.StringIO(fs.read_text(p))))
    except csv.Error as e:
        raise RunMismatch(f"{p}: not a CSV file ({e}); the run folder was edited or damaged") from None
    header, body = (rows[0], rows[1:]) if rows else ([], [])
    if "epoch" not in header:
        raise RunMismatch(f"{p}: no header naming the epoch column; the run folder was edited or damaged")
    for n, row in enumerate(body):
        epoch = row[header.index("epoch")] if len(row) == len(header) else None
        if epoch != str(n):
            why = (
                f"{len(row)} fields where the header has {len(header)}"
                if epoch is None
                else f"epoch {epoch!r} where epoch {n} belongs (each epoch once, in order)"
            )
            raise RunMismatch(f"{p}: line {n + 2} has {why}; the run folder was edited or damaged")
    return [dict(zip(header, row)) for row in body]


def keeps_record(folder: str) -> bool:
    """Whether ``folder`` (a run or a CV folder) holds a ``config.json`` or ``cv.json`` of a version that records
    its files (``files.json``): its absence there is then a problem, not a folder that never kept one."""
    for name, (key, since) in RECORDED_SINCE.items():
        if fs.exists(path(folder, name)):
            data = _read_json(path(folder, name))
            version = data.get(key, 1) if isinstance(data, dict) else 1
            return type(version) is int and version >= since
    return False


def check_file(folder: str, name: str, remedy: str, model: str | None = None, views: int | None = None) -> None:
    """``folder/name`` is the file recorded in the folder's ``files.json`` (``train.runs.files.check``)."""
    files.check(folder, name, required=keeps_record(folder), model=model, views=views, remedy=remedy)


def model_files(swa: bool = False, views: int = 1) -> tuple[str, str]:
    """(model file, thresholds file) of a run's final model, or with ``swa`` of its SWA average
    (``train.fit --swa-epochs``), whose report tunes thresholds of its own; the thresholds for predictions
    averaged over ``views`` TTA views (``thresholds-tta4.json``: ``train.decide.tuning`` tunes them on demand)."""
    return (MODEL_SWA, variant(THRESHOLDS, True, views)) if swa else (MODEL, variant(THRESHOLDS, False, views))


def model_name(folder: str, swa: bool) -> str:
    """The file name of the final (or ``swa``) model of a run folder (a PyTorch recipe's ``model.pt``) or of each
    fold of a CV folder."""
    recipe = fs.exists(path(folder, CONFIG)) and RunConfig.load(folder).recipe
    return (TORCH_MODEL_SWA if swa else TORCH_MODEL) if recipe else model_files(swa)[0]


def same_setting(key: str, used: Any, planned: Any) -> bool:
    """Whether a setting a run recorded (``used``, from its ``config.json``) is the one ``planned`` now: equal, or
    for ``steps_per_execution`` cut to an epoch's steps (train.fit records the value used, never more than
    planned)."""
    if key == "steps_per_execution" and type(used) is int and type(planned) is int:
        return 1 <= used <= planned
    return bool(used == planned)


class Parts(NamedTuple):
    """The records a run trains on and validates on: shards, and the fold ids to read (None: all)."""

    train: Shards
    train_folds: list[int] | None
    validation: Shards
    validation_folds: list[int] | None


def training_parts(shards: Shards, fold: int | None, val_fraction: float) -> Parts:
    """By fold when the shards have folds, else the last shards (about ``val_fraction`` of them) are held out."""
    if shards.num_folds:
        assert fold is not None, "make_plan picks fold 0 of shards with folds"
        train_folds, val_folds = fold_split(shards, fold)
        return Parts(shards, train_folds, shards, val_folds)
    train_shards, val_shards = holdout_split(shards, val_fraction)
    return Parts(train_shards, None, val_shards, None)
