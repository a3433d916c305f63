"""Thresholds tuned on the predictions they serve (the model a folder submits with is ``train.decide.choice``).

A run's report tunes ``thresholds.json`` on its model's single-view validation predictions. Predictions averaged
over N TTA views are less extreme than one view's (on real data a held-back exact-match can fall by a
tenth at 4 views under the single-view thresholds, the AUC unchanged), so ``train.predict --tta N``
labels at thresholds tuned on N-view predictions of the same validation images by the same model. They are tuned
here the first time a model and view count are asked for, and recorded beside the others::

    runs/NAME/val_predictions-tta4.csv    the validation images predicted by model.keras over 4 views
    runs/NAME/thresholds-tta4.json        per-class thresholds tuned on them (-swa-tta4: the SWA model's)

A CV folder's thresholds are tuned the same way on its out-of-fold predictions (``train.crossval.engine``).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence, Set
from typing import Any, NamedTuple

import numpy as np
import numpy.typing as npt

import tfpipe
from tfpipe.format.shards import Shards
from tfpipe.runtime import fs
from tfpipe.runtime.console import counted
from tfpipe.runtime.errors import TfpipeError, option
from train.decide.evaluation import figure
from train.decide.metrics import Metric
from train.prediction.probabilities import check_probabilities
from train.prediction.submission import label_strings
from train.runs import files
from train.runs import run as run_files
from train.runs.cv_folder import CVResult, fold_model, fold_run, oof_name
from train.runs.run import RunConfig, training_parts
from train.runs.thresholds import load_thresholds, save_thresholds

Array = npt.NDArray[Any]


class Predictions(NamedTuple):
    """Validation (or out-of-fold) predictions: the images by name and digest, in written order, their
    probabilities [N, C] and multi-hot targets [N, C]."""

    names: list[str]
    digests: list[str]
    probs: Array
    targets: Array


def validation_shards(run: str, config: RunConfig, why: str) -> tuple[Shards, list[int] | None]:
    """The records run ``run`` validated on (its training shards' fold, or last shards), opened and checked to be
    the shards it trained beside (their dataset id); ``why`` they are needed, for the error when they are not."""
    if not fs.exists(config.records):
        raise TfpipeError(
            f"{why} needs the validation images of {run}, in its training shards {config.records}, which are not "
            f"there; predict where they are, or pass {option('threshold')} to label every class at one threshold"
        )
    shards = tfpipe.open_shards(config.records)
    if config.dataset_id and shards.dataset_id != config.dataset_id:
        raise TfpipeError(
            f"{why} needs the validation images of {run}, but {config.records} holds other shards than it trained "
            f"on (dataset id {shards.dataset_id}, the run's {config.dataset_id}): rewritten since, or a relative "
            f"path resolved from another folder than the run's; pass {option('threshold')} instead"
        )
    parts = training_parts(shards, config.fold, float(config.settings.get("val_fraction", 0.2)))
    return parts.validation, parts.validation_folds


def validation_predictions(
    run: str,
    config: RunConfig,
    *,
    swa: bool,
    views: int,
    predict: Callable[[Shards, list[int] | None], Array],
    why: str,
) -> Predictions:
    """The run's validation images as its final model (or ``swa`` model) predicts them over ``views`` TTA views:
    read from the run folder when recorded (the report's ``val_predictions.csv`` for one view), else made with
    ``predict(records, folds)`` and recorded. A recorded file is checked against the images first."""
    records, folds = validation_shards(run, config, why)
    classes = list(config.classes)
    names, digests = tfpipe.image_names(records, folds), tfpipe.image_digests(records, folds)
    targets = tfpipe.read_targets(records, len(classes), folds)
    name = run_files.variant(run_files.VAL_PREDICTIONS, swa, views)
    recorded, model = run_files.path(run, name), run_files.model_name(run, swa)
    if fs.exists(recorded):
        run_files.check_file(run, name, f"delete it to predict anew ({why})", model, views)
        probs = read_probabilities(recorded, classes, digests, config.single_label)
    else:
        probs = predict(records, folds)
        write_predictions(recorded, names, digests, targets, probs, classes)
        files.record(run, [name], model, views)
    return Predictions(names, digests, probs, targets)


def read_probabilities(path: str, classes: Sequence[str], digests: Sequence[str], single_label: bool) -> Array:
    """The class columns of a predictions file (``image_digest`` first, one column per class), validated as
    input: its rows must be ``digests`` in order and its values probabilities, each row summing to 1 when
    ``single_label`` (``train.prediction.probabilities``)."""
    import pandas as pd

    with fs.open(path) as f:
        try:
            table = pd.read_csv(f, dtype={"image_digest": str}, keep_default_na=False)
        except (ValueError, pd.errors.ParserError) as e:
            raise TfpipeError(f"{path}: not a CSV file ({str(e)[:80]}); it was edited or damaged") from None
    missing = [c for c in ("image_digest", *classes) if c not in table.columns]
    if missing:
        raise TfpipeError(f"{path}: no column {missing[0]!r}; it was edited or damaged (delete it to predict anew)")
    if list(table["image_digest"]) != list(digests):
        raise TfpipeError(
            f"{path}: its rows are not the validation images in their written order; it was edited or belongs "
            "to other shards (delete it to predict anew)"
        )
    probs = pd.DataFrame(table[list(classes)]).apply(pd.to_numeric, errors="coerce").to_numpy(np.float64)
    try:
        return check_probabilities(path, probs, classes, single_label).astype(np.float32)
    except TfpipeError as e:
        raise TfpipeError(f"{e}; it was edited or damaged (delete it to predict anew)") from None


def write_predictions(
    path: str, names: Sequence[str], digests: Sequence[str], targets: Array, probs: Array, classes: Sequence[str]
) -> None:
    """A predictions file as the report writes one: ``image_name``, ``image_digest``, ``true`` (the labels), one
    probability column per class."""
    import pandas as pd

    truth = label_strings(targets > 0, classes)
    table = pd.DataFrame({"image_name": list(names), "image_digest": list(digests), "true": truth})
    fs.write_atomic(path, pd.concat([table, pd.DataFrame(probs, columns=list(classes))], axis=1).to_csv(index=False))


def tune_thresholds(
    probs: npt.NDArray[np.floating[Any]],
    targets: npt.NDArray[np.floating[Any]],
    default: float,
    metric: Metric | None = None,
) -> list[float]:
    """``tune``'s thresholds alone: for a search that scores many candidates and says nothing of each."""
    return tune(probs, targets, default, metric).thresholds


class NearChance(NamedTuple):
    """A class left at the default threshold because its AUC on the tuning predictions does not tell it from
    chance: the threshold tuning found for it, and the share of rows each labels against the share that hold it."""

    column: int
    auc: float
    bound: float  # the AUC that would (``chance_bound``)
    tuned: float
    tuned_share: float
    default_share: float
    true_share: float


class Tuned(NamedTuple):
    """Thresholds tuned on predictions, with what was decided against tuning: classes near chance
    (``NearChance``) and whether the default everywhere scored at least as well as the tuned set (``naive``:
    the judge's key, the two figures), which it then is."""

    thresholds: list[float]
    near_chance: tuple[NearChance, ...] = ()
    naive: tuple[str, float, float] | None = None

    def notes(self, classes: Sequence[str], default: float, on: str) -> list[str]:
        """A line for each decision against tuning, ``on`` naming the predictions (``validation``, ``OOF``)."""
        lines = [
            f"{classes[n.column]!r}: {on} AUC {n.auc:.3f} does not tell it from chance ({n.bound:.3f} would, on "
            f"these images): its tuned threshold {n.tuned:.3f} would label {n.tuned_share:.0%} of the images, "
            f"{n.true_share:.0%} hold it; labelled at {default:g} ({n.default_share:.0%}) instead"
            for n in self.near_chance
        ]
        if self.naive is not None:
            key, tuned, naive = self.naive
            lines.append(
                f"the tuned thresholds scored {key} {tuned:.4f} on the {on} predictions, {default:g} for every class "
                f"{naive:.4f}: every class labelled at {default:g}"
            )
        return lines


def tune(
    probs: npt.NDArray[np.floating[Any]],
    targets: npt.NDArray[np.floating[Any]],
    default: float,
    metric: Metric | None = None,
) -> Tuned:
    """Per-class thresholds maximising ``metric`` on these predictions: each class's F1 (what F1 macro is the
    mean of, and the start for the rest; ``default`` for a class with no positive), then, for ``exact_match``
    and ``f1_micro``, which couple the classes, two rounds of coordinate ascent (``ascended``). Two decisions
    against tuning, for what it would do on unseen images: a class whose AUC is near chance (``chance_bound``)
    keeps ``default`` (a class the model cannot rank gets its best F1 by being labelled everywhere), and the
    default for every class is kept when it scores at least as well as the tuned set (``naive_judge``).

    Each lies halfway between the lowest score called positive and the next lower score: the same labels on the
    validation images, but no validation score sits exactly on a threshold, where float noise of another batch
    layout or device (1e-7) would flip its label."""
    found = f1_thresholds(probs, targets, default)
    near = near_chance(probs, targets, found, default)
    out = [default if c in {n.column for n in near} else t for c, t in enumerate(found)]
    if metric is not None and metric.name in ASCENDED:
        for _ in range(ASCENT_ROUNDS):
            out = ascended(probs, targets > 0, out, metric.name, fixed={n.column for n in near})
    key = naive_judge(metric)
    tuned, naive = (figure(probs, targets, t, False, key) for t in (out, [default] * len(out)))
    if tuned is not None and naive is not None and naive >= tuned and out != [default] * len(out):
        return Tuned([default] * len(out), tuple(near), (key, tuned, naive))
    return Tuned(out, tuple(near))


def naive_judge(metric: Metric | None) -> str:
    """The figure tuned thresholds must beat the default at: the run's metric where thresholds change it
    (exact-match and F1 micro judge the whole set), else F1 macro (what per-class tuning serves)."""
    return metric.key if metric is not None and metric.key in ("exact_match", "f1_micro", "f1_macro") else "f1_macro"


CHANCE_ERRORS = 2.0  # standard errors above 0.5 an AUC needs to be told from chance


def chance_bound(positives: int, rows: int) -> float | None:
    """The AUC a class needs, over ``rows`` rows of which ``positives`` hold it, to be told from chance: 0.5 plus
    ``CHANCE_ERRORS`` standard errors of the AUC of a model that cannot rank it (the Mann-Whitney statistic's
    under no difference: sqrt((n + 1) / (12 n1 n0)), Hanley & McNeil 1982). None: no AUC without both kinds."""
    negatives = rows - positives
    if positives <= 0 or negatives <= 0:
        return None
    return 0.5 + CHANCE_ERRORS * float(np.sqrt((rows + 1) / (12.0 * positives * negatives)))


def near_chance(probs: Array, targets: Array, tuned: Sequence[float], default: float) -> list[NearChance]:
    """The classes whose AUC on these predictions is below ``chance_bound``, with what ``tuned`` and ``default``
    would label."""
    from sklearn.metrics import roc_auc_score

    out, truth = [], targets > 0
    for c in range(truth.shape[1]):
        bound = chance_bound(int(truth[:, c].sum()), len(truth))
        if bound is None:
            continue
        auc = float(roc_auc_score(truth[:, c], probs[:, c]))
        if auc < bound:
            tuned_share, default_share = (float(np.mean(probs[:, c] >= t)) for t in (tuned[c], default))
            out.append(
                NearChance(c, auc, bound, float(tuned[c]), tuned_share, default_share, float(truth[:, c].mean()))
            )
    return out


ASCENDED = ("exact_match", "f1_micro")  # the metrics per-class F1 does not maximise
ASCENT_ROUNDS = 2  # passes over the classes; a third moved no threshold on the tests' sets


def f1_thresholds(
    probs: npt.NDArray[np.floating[Any]], targets: npt.NDArray[np.floating[Any]], default: float
) -> list[float]:
    """Each class's threshold maximising its own F1 (``tune_thresholds``' first step)."""
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


def ascended(
    probs: Array, truth: Array, thresholds: Sequence[float], metric: str, fixed: Set[int] = frozenset()
) -> list[float]:
    """One pass of coordinate ascent: each class's threshold (but the ``fixed`` classes') moved, the others'
    held, to the cut of its sorted scores that maximises ``metric`` (``exact_match`` or ``f1_micro``) over every
    row; kept where none is strictly better. A new threshold lies halfway between scores, as ``f1_thresholds``'
    do."""
    out = list(thresholds)
    for c in (c for c in range(truth.shape[1]) if c not in fixed):
        hits = probs >= np.asarray(out)[None, :]
        others = np.delete(hits == truth, c, axis=1).all(axis=1)  # rows every other class gets right
        order = np.argsort(-probs[:, c], kind="stable")
        p, t = probs[order, c].astype(np.float64), truth[order, c]
        tp = np.concatenate([[0], np.cumsum(t)])  # the top k rows called positive: k = 0..N
        k = np.arange(len(p) + 1)
        if metric == "exact_match":
            ok = others[order]
            right = (
                np.concatenate([[0], np.cumsum(t & ok)]) + (ok & ~t).sum() - np.concatenate([[0], np.cumsum(~t & ok)])
            )
        else:
            rest = np.delete(hits, c, axis=1), np.delete(truth, c, axis=1)
            tp_o = (rest[0] & rest[1]).sum()
            wrong_o = (rest[0] != rest[1]).sum()
            right = 2 * (tp_o + tp) / np.maximum(2 * (tp_o + tp) + wrong_o + (k - tp) + (t.sum() - tp), 1)
        cut = np.concatenate([[p[0] < 1], p[:-1] > p[1:], [True]])  # between distinct scores (k = 0: none)
        now = int((p >= out[c]).sum())
        best = int(np.flatnonzero(cut)[np.argmax(right[cut])])
        if right[best] > right[now] + 1e-12:
            out[c] = (p[0] + 1.0) / 2 if best == 0 else (p[best - 1] + (p[best] if best < len(p) else 0.0)) / 2
    return out


def tuned_thresholds(
    folder: str,
    classes: Sequence[str],
    *,
    swa: bool,
    views: int,
    default: float,
    predictions: Callable[[], Predictions],
    prog: str,
    metric: Metric | None = None,
) -> list[float]:
    """The per-class thresholds of ``folder`` (a run or a CV folder) for its final or ``swa`` model over
    ``views`` views: recorded ones, else tuned on ``predictions()`` (the same model, the same views) and
    recorded. A folder that cannot be written (a read-only Kaggle input) is said, and tuned again next time."""
    recorded = load_thresholds(folder, classes, swa, views)
    if recorded is not None:
        return recorded
    found = predictions()
    tuned = tune(found.probs, found.targets, default, metric)
    thresholds = tuned.thresholds
    for note in tuned.notes(classes, default, "validation"):
        print(f"{prog}: thresholds of {describe(swa, views)}: {note}", flush=True)
    name = run_files.model_files(swa, views)[1]
    try:
        model = run_files.model_name(folder, swa)
        save_thresholds(folder, classes, thresholds, model, run_files.SWA_SUFFIX if swa else "", views)
        kept = f"-> {run_files.path(folder, name)}"
    except (OSError, TfpipeError) as e:
        kept = f"not recorded ({folder} cannot be written: {str(e)[:60]}); tuned again next time"
    print(
        f"{prog}: thresholds for {describe(swa, views)} tuned on {counted(len(found.probs), 'image')} predicted "
        f"alike {kept}",
        flush=True,
    )
    return thresholds


# (run folder, its config, validation records, their folds) -> the probabilities [N, C] of the model and views
# the caller chose: how a missing prediction file is made (inference's predict_probabilities, with a model)
Predictor = Callable[[str, RunConfig, Shards, "list[int] | None"], Array]


def out_of_fold(cv: CVResult, folder: str, *, swa: bool, views: int, predict: Predictor) -> tuple[Predictions, Array]:
    """Every fold's validation images as that fold's model (final, or ``swa``) predicts them over ``views`` views,
    fold after fold, and the fold of each row: the out-of-fold predictions of CV folder ``folder``."""
    found, fold_of = [], []
    for k in cv.folds:
        run = fold_run(folder, k)
        config = RunConfig.load(run)
        p = validation_predictions(
            run, config, swa=swa, views=views, predict=functools.partial(predict, run, config), why="train.cv's OOF"
        )
        found.append(p)
        fold_of.append(np.full(len(p.names), k))
    joined = Predictions(
        [n for p in found for n in p.names],
        [d for p in found for d in p.digests],
        np.concatenate([p.probs for p in found]),
        np.concatenate([p.targets for p in found]),
    )
    return joined, np.concatenate(fold_of)


def write_oof(cv: CVResult, folder: str, found: Predictions, fold_of: Array, *, swa: bool, views: int) -> str:
    """The OOF file of the fold models (final, or ``swa``) over ``views`` (``oof.csv``: image_name, image_digest,
    fold, one probability column per class, labels, the true ones), recorded in the CV folder's ``files.json``
    with the fold models that predicted it; returns its name."""
    import pandas as pd

    name = oof_name(swa, views)
    table = pd.DataFrame({"image_name": found.names, "image_digest": found.digests, "fold": fold_of})
    labels = label_strings(found.targets > 0, cv.classes)
    table = pd.concat([table, pd.DataFrame(found.probs, columns=list(cv.classes))], axis=1)
    fs.write_atomic(run_files.path(folder, name), table.assign(labels=labels).to_csv(index=False))
    model = run_files.model_files(swa)[0]
    files.record(folder, [name], model, views)
    files.record(folder, [fold_model(k, swa) for k in cv.folds])
    return name


def oof_thresholds(
    cv: CVResult, folder: str, *, swa: bool, views: int, predict: Predictor, default: float, prog: str
) -> list[float]:
    """A CV folder's thresholds for its final (or ``swa``) models over ``views`` views: recorded, or tuned on the
    out-of-fold predictions made alike (``oof-tta4.csv`` written beside them)."""

    def predictions() -> Predictions:
        found, fold_of = out_of_fold(cv, folder, swa=swa, views=views, predict=predict)
        write_oof(cv, folder, found, fold_of, swa=swa, views=views)
        return found

    return tuned_thresholds(
        folder, cv.classes, swa=swa, views=views, default=default, predictions=predictions, prog=prog, metric=cv.metric
    )


def describe(swa: bool, views: int) -> str:
    """``model.keras, 1 view`` / ``model-swa.keras, 4 TTA views``: which model and views a score belongs to."""
    return f"{run_files.model_files(swa)[0]}, {views} {'TTA views' if views > 1 else 'view'}"
