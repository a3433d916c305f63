"""A cross-validation folder (``train.cv --run CV_DIR``): a run folder a fold, and the CV's own files. The one
module that knows their names and reads ``cv.json`` back validated; no TensorFlow here.

    CV_DIR/cv.json            the plan (shards, folds, the settings every fold shares and their digest, TTA views)
                              and, once every fold is trained, the out-of-fold scores of each model
    CV_DIR/fold-0/ ...        one run folder a fold, as train.fit writes it (train.predict, --resume work on each)
    CV_DIR/oof.csv            every validation image once: image_name, image_digest, fold, one probability column
                              per class, labels (the true ones); -swa, -tta4: of the SWA models, over 4 views
    CV_DIR/thresholds.json    per-class thresholds tuned on oof.csv (-swa, -tta4 as oof.csv's)
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import statistics
from collections.abc import Sequence
from typing import Any

from tfpipe.runtime import fs
from tfpipe.runtime.errors import RunMismatch, TfpipeError, option
from train.decide.choice import better_model
from train.decide.evaluation import Scores, scores_problem
from train.decide.metrics import Metric, better, run_metric, value
from train.runs import files
from train.runs import run as run_files
from train.runs.run import RunConfig, same_setting

CV_FILE = run_files.CV_FILE
OOF = "oof.csv"
# 2: files.json records the OOF files, thresholds and each fold's model (train.runs.files); 3: --metric (the
# folds' balanced accuracy and log-loss, each model's best fold)
CV_VERSION = 3
FOLD_RUN = "fold-{}"  # a fold's run folder inside the CV folder
# Settings each fold's run has of its own; every other setting is the CV's, the same for every fold.
PER_FOLD = ("run", "fold", "resume", "overwrite", "verbose", "strategy", "replicas", "save_every")
OOF_COLUMNS = ("image_name", "image_digest", "fold", "labels")  # oof.csv's columns besides the classes
# the fold figures whose spread cv.json gives (FoldScores' figures; the last two single-label only)
SPREAD = ("roc_auc_macro", "exact_match", "f1_micro", "f1_macro", "balanced_accuracy", "log_loss")
NEWER_FOLD_FIGURES = ("balanced_accuracy", "log_loss")  # absent from a version-2 cv.json


def fold_run(cv: str, fold: int) -> str:
    """``CV_DIR/fold-3``: the run folder of fold 3."""
    return run_files.path(cv, FOLD_RUN.format(fold))


def fold_model(fold: int, swa: bool) -> str:
    """``fold-2/model.keras``: a fold's model, as the CV folder's ``files.json`` names it."""
    return f"{FOLD_RUN.format(fold)}/{run_files.model_files(swa)[0]}"


def is_cv_folder(folder: str) -> bool:
    """Whether ``folder`` is a CV folder (holds ``cv.json``) rather than a run."""
    return fs.exists(run_files.path(folder, CV_FILE))


def oof_name(swa: bool = False, views: int = 1) -> str:
    """``oof.csv`` of the final models over one view; ``oof-swa-tta4.csv`` of the SWA models over 4."""
    return run_files.variant(OOF, swa, views)


def shared_settings(settings: dict[str, Any]) -> dict[str, Any]:
    """The settings every fold shares (all but ``PER_FOLD``), as JSON values."""
    return {k: v for k, v in json.loads(json.dumps(settings, default=str)).items() if k not in PER_FOLD}


def settings_digest(settings: dict[str, Any]) -> str:
    """16 hex digits naming the shared settings: equal digests, equal settings."""
    return hashlib.sha256(json.dumps(shared_settings(settings), sort_keys=True).encode()).hexdigest()[:16]


@dataclasses.dataclass(frozen=True)
class FoldScores:
    """One fold's validation images scored on their own, at the OOF thresholds."""

    fold: int
    examples: int
    roc_auc_macro: float | None
    exact_match: float | None
    f1_micro: float | None
    f1_macro: float | None
    balanced_accuracy: float | None = None
    log_loss: float | None = None


@dataclasses.dataclass(frozen=True)
class ModelScores:
    """The out-of-fold scores of one model of every fold (``model.keras`` or ``model-swa.keras``) over ``views``
    TTA views: ``scores`` over every OOF row at the thresholds tuned on them (``train.decide.evaluation.score``'s form),
    and each fold's rows on their own."""

    model: str
    views: int
    oof: str  # the file of the OOF predictions, in the CV folder
    thresholds: str | None  # the thresholds file, in the CV folder (None: single-label, argmax)
    scores: Scores
    folds: tuple[FoldScores, ...]
    one_view: Scores | None = None  # with views > 1: the same OOF rows over 1 view (train.decide.tta)

    def best_fold(self, metric: Metric) -> FoldScores | None:
        """The fold whose own rows score best by ``metric`` (None: no fold has the figure): what a single fold
        model is worth beside the ensemble."""
        scored = [f for f in self.folds if value(dataclasses.asdict(f), metric) is not None]
        best = None
        for f in scored:
            if best is None or better(dataclasses.asdict(f), dataclasses.asdict(best), metric):
                best = f
        return best

    def spread(self) -> dict[str, dict[str, float]]:
        """Mean, standard deviation, lowest and highest of each of the folds' figures."""
        found = {}
        for key in SPREAD:
            values = [v for f in self.folds if (v := getattr(f, key)) is not None]
            if values:
                sd = statistics.stdev(values) if len(values) > 1 else 0.0
                found[key] = {"mean": statistics.fmean(values), "sd": sd, "min": min(values), "max": max(values)}
        return found


@dataclasses.dataclass(frozen=True)
class CVResult:
    """``cv.json``: the plan of a cross-validation, and its results once every fold is trained (``finished``)."""

    records: str
    dataset_id: str
    num_folds: int
    folds: tuple[int, ...]
    classes: tuple[str, ...]
    single_label: bool
    tta: int  # the TTA views of the OOF predictions cv.json scores
    settings: dict[str, Any]  # the shared settings (``shared_settings``)
    replicas: int  # the replicas every fold trains on (the global batch and the scaled LR follow them)
    models: tuple[ModelScores, ...] = ()  # the final models' OOF scores, then the SWA models' (when trained)
    submits: str | None = None  # the model train.predict uses by default: the better OOF figure of ``metric``

    @property
    def finished(self) -> bool:
        return bool(self.models)

    @property
    def digest(self) -> str:
        return settings_digest(self.settings)

    @property
    def metric(self) -> Metric:
        """The metric the CV decides by (its folds' ``--metric``, one of the shared settings)."""
        return run_metric(self.settings, self.single_label)

    def scores_of(self, swa: bool) -> ModelScores | None:
        name = run_files.model_files(swa)[0]
        return next((m for m in self.models if m.model == name), None)

    def to_dict(self) -> dict[str, Any]:
        data = dataclasses.asdict(self)
        data["models"] = [
            dict(dataclasses.asdict(m), spread=m.spread(), best_fold=_asdict(m.best_fold(self.metric)))
            for m in self.models
        ]
        data["metric"] = self.metric.name  # also in settings: said at the top for a reader
        return dict(data, cv_version=CV_VERSION, settings_digest=self.digest)

    def save(self, cv: str) -> None:
        text = json.dumps(self.to_dict(), indent=1, ensure_ascii=False, allow_nan=False)
        fs.write_atomic(run_files.path(cv, CV_FILE), text + "\n")
        files.record(cv, [CV_FILE])  # its scores choose the models train.predict uses

    @classmethod
    def load(cls, cv: str, checked: bool = True) -> CVResult:
        """Reads and validates ``cv/cv.json``, ``checked`` against the folder's record (``train.runs.files``;
        ``train.inspect`` shows what is wrong with it instead)."""
        p = run_files.path(cv, CV_FILE)
        if not fs.exists(p):
            raise TfpipeError(f"{cv}: no {CV_FILE}; is this a folder written by train.cv?")
        result = from_dict(fs.read_json(p, "CV file"), p)
        if checked:
            run_files.check_file(
                cv, CV_FILE, f"its scores choose the CV's models; train the CV again ({option('overwrite', True)})"
            )
        return result


def _bad(p: str, key: str, what: str, value: Any) -> TfpipeError:
    shown = repr(value) if len(repr(value)) <= 60 else repr(value)[:57] + "..."
    return TfpipeError(f"{p}: field {key!r} {what} (got {shown}); the CV folder was edited or damaged")


def _check(p: str, data: dict[str, Any], key: str, ok: bool, what: str) -> None:
    if not ok:
        raise _bad(p, key, what, data.get(key))


def from_dict(data: Any, p: str) -> CVResult:
    """Validates a ``cv.json``'s content (``p`` names it in errors)."""
    if not isinstance(data, dict):
        raise TfpipeError(f"{p}: not a JSON object; the CV folder is damaged")
    version: Any = data.get("cv_version")
    _check(p, data, "cv_version", type(version) is int and version >= 1, "must be a whole number >= 1")
    if version > CV_VERSION:
        raise TfpipeError(f"{p}: CV version {version} was written by a newer tfpipe; upgrade tfpipe")
    n: Any = data.get("num_folds")
    folds: Any = data.get("folds")
    _check(p, data, "num_folds", type(n) is int and n >= 2, "must be a whole number >= 2")
    _check(p, data, "folds", _fold_list(folds, n), f"must list distinct folds in 0..{n - 1}")
    for key in ("records", "dataset_id"):
        _check(p, data, key, isinstance(data.get(key), str) and bool(data[key]), "must be a non-empty string")
    classes: Any = data.get("classes")
    _check(p, data, "classes", _names(classes), "must list the class names")
    _check(p, data, "single_label", type(data.get("single_label")) is bool, "must be true or false")
    _check(p, data, "tta", type(data.get("tta")) is int and 1 <= data["tta"] <= 8, "must be in 1..8")
    _check(p, data, "settings", isinstance(data.get("settings"), dict), "must be an object")
    _check(p, data, "replicas", type(data.get("replicas")) is int and data["replicas"] >= 1, "must be a count")
    settings = shared_settings(data["settings"])
    _check(p, data, "settings_digest", data.get("settings_digest") == settings_digest(settings), "must be the digest")
    models = data.get("models", [])
    _check(p, data, "models", isinstance(models, list) and len(models) <= 2, "must list at most two models")
    parsed = tuple(_model(m, p) for m in models)
    names = [m.model for m in parsed]
    _check(p, data, "models", names in ([], [run_files.MODEL], [run_files.MODEL, run_files.MODEL_SWA]), "in order")
    for m in parsed:
        _check(p, data, "folds", [f.fold for f in m.folds] == folds, "must be the folds each model was scored on")
        _check(p, data, "tta", m.views == data["tta"], "must be the views of the models' scores")
    submits = data.get("submits")
    metric = run_metric(settings, data["single_label"])
    said = data.get("metric", metric.name)  # said at the top for a reader (absent from a version-2 cv.json)
    _check(p, data, "metric", said == metric.name, f"must be the settings' metric ({metric.name})")
    _check(p, data, "submits", submits == submitted_model(parsed, metric), f"must name the better OOF {metric.words}")
    return CVResult(
        data["records"], data["dataset_id"], n, tuple(folds), tuple(classes), data["single_label"], data["tta"],
        settings, data["replicas"], parsed, submits,
    )  # fmt: skip


def submitted_model(models: Sequence[ModelScores], metric: Metric) -> str | None:
    """The model a CV submits with: the SWA models when their OOF figure of ``metric`` beats the final ones';
    None unscored."""
    if not models:
        return None
    return run_files.model_files(len(models) == 2 and better_model(models[0].scores, models[-1].scores, metric))[0]


def _fold_list(folds: Any, n: Any) -> bool:
    return (
        isinstance(folds, list)
        and bool(folds)
        and all(type(f) is int and 0 <= f < n for f in folds)
        and len(set(folds)) == len(folds)
    )


def _names(classes: Any) -> bool:
    return isinstance(classes, list) and bool(classes) and all(isinstance(c, str) and c for c in classes)


def _plain_name(name: Any) -> bool:
    """A file name inside the CV folder: never a path that leaves it."""
    return isinstance(name, str) and bool(name) and "/" not in name and "\\" not in name and name not in (".", "..")


def _model(data: Any, p: str) -> ModelScores:
    """One entry of ``cv.json``'s ``models``, validated."""
    if not isinstance(data, dict):
        raise _bad(p, "models", "must hold objects", data)
    _check(p, data, "model", data.get("model") in (run_files.MODEL, run_files.MODEL_SWA), "must name a model file")
    _check(p, data, "views", type(data.get("views")) is int and 1 <= data["views"] <= 8, "must be in 1..8")
    _check(p, data, "oof", _plain_name(data.get("oof")), "must name a file in the CV folder")
    thresholds = data.get("thresholds")
    _check(p, data, "thresholds", thresholds is None or _plain_name(thresholds), "must name a file in the CV folder")
    _check(p, data, "scores", _scores(data.get("scores")), "must hold the OOF scores (numbers in [0, 1] or null)")
    folds: Any = data.get("folds")
    _check(p, data, "folds", isinstance(folds, list), "must list the folds' scores")
    one = data.get("one_view")
    _check(p, data, "one_view", one is None or (data["views"] > 1 and _scores(one)), "must hold 1-view OOF scores")
    return ModelScores(
        data["model"], data["views"], data["oof"], thresholds, data["scores"], tuple(_fold(f, p) for f in folds), one
    )


def _scores(scores: Any) -> bool:
    """``train.decide.evaluation.score``'s form: its figures each null or a number in [0, 1], its image count, the
    per-class table."""
    return scores_problem(scores) is None and type(scores.get("examples")) is int


def _fraction(x: Any) -> bool:
    return x is None or (isinstance(x, (int, float)) and not isinstance(x, bool) and 0 <= x <= 1)


def _fold(data: Any, p: str) -> FoldScores:
    fields = [f.name for f in dataclasses.fields(FoldScores)]
    required = [k for k in fields if k not in NEWER_FOLD_FIGURES]
    if not isinstance(data, dict) or not set(required) <= set(data) <= set(fields):
        raise _bad(p, "folds", f"must hold objects of {', '.join(fields)}", data)
    ok = type(data["fold"]) is int and type(data["examples"]) is int
    loss = data.get("log_loss")
    ok = ok and (loss is None or (isinstance(loss, (int, float)) and not isinstance(loss, bool) and loss >= 0))
    if not ok or not all(_fraction(data.get(k)) for k in fields[2:] if k != "log_loss"):
        raise _bad(p, "folds", "must hold a fold, its image count and numbers", data)
    return FoldScores(**data)


def _asdict(fold: FoldScores | None) -> dict[str, Any] | None:
    return None if fold is None else dataclasses.asdict(fold)


def checked_fold_run(cv_folder: str, cv: CVResult, fold: int) -> tuple[str, RunConfig]:
    """Fold ``fold``'s run folder of the CV in ``cv_folder`` and its config, checked to be there and of the CV
    (``check_fold_run``); whether it finished and holds a model is the caller's question."""
    run = fold_run(cv_folder, fold)
    if not fs.exists(run_files.path(run, run_files.CONFIG)):
        raise RunMismatch(f"{run}: fold {fold}'s run is missing from the cross-validation {cv_folder}")
    config = RunConfig.load(run)
    check_fold_run(run, config, cv, fold)
    return run, config


def check_fold_run(run: str, config: RunConfig, cv: CVResult, fold: int) -> None:
    """A fold's run folder (its ``config``) must be of CV ``cv`` and of fold ``fold``: validated on that fold,
    its classes, shards and every shared setting alike (but a ``steps_per_execution`` cut to an epoch's steps,
    which train.fit records as used: a fold's epoch may be shorter than the CV's setting)."""
    if config.fold != fold:
        raise RunMismatch(
            f"{run} holds the run of fold {config.fold} (its {run_files.CONFIG}), not of fold {fold}; a fold folder "
            f"was copied or renamed -- put the fold's own run back, or replace the CV with {option('overwrite', True)}"
        )
    if tuple(config.classes) != cv.classes:
        raise RunMismatch(f"{run}: its classes are not those of {CV_FILE}; one of the two was edited or damaged")
    shards = config.dataset_id != cv.dataset_id
    if shards or any(not same_setting(k, config.settings.get(k), v) for k, v in cv.settings.items()):
        raise RunMismatch(
            f"{run} holds a run of other {'shards' if shards else 'settings'} than its CV's ({CV_FILE}); a CV "
            f"folder never mixes them -- move it away, or replace the CV with {option('overwrite', True)}"
        )


def fold_scores(fold: int, scores: Scores) -> FoldScores:
    """A fold's entry from ``train.decide.evaluation.score``'s result over its rows."""
    figures: dict[str, Any] = {f.name: scores.get(f.name) for f in dataclasses.fields(FoldScores)[2:]}
    return FoldScores(fold, scores["examples"], **figures)


def described_folds(folds: Sequence[int]) -> str:
    """``folds 0, 1, 2``: for lines and errors."""
    return f"fold{'s' * (len(folds) != 1)} {', '.join(map(str, folds))}"
