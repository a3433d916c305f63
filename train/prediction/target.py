"""What ``train.predict`` predicts with: a run's model, or every fold's model of a CV folder (the fold ensemble:
the mean of their probabilities); which one (final or SWA: by default the better by validation, said in one line);
and the thresholds for the views it averages (tuned on predictions made alike, ``train.decide.tuning``).

    target = open_target("runs/cv", swa=None, prog="train.predict")   # a run folder or a CV folder
    thresholds = target_thresholds(target, None, views=4, predictor=..., prog="train.predict")
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import numpy.typing as npt

from tfpipe.runtime import fs
from tfpipe.runtime.errors import TfpipeError, option
from train.decide.choice import choice_line, run_choice, run_scores
from train.decide.evaluation import is_count, is_number
from train.decide.metrics import Metric, run_metric, value
from train.decide.tta import Worth, scored_at_own_thresholds, views_worth
from train.decide.tuning import Predictions, Predictor, chance_bound, describe, oof_thresholds, tuned_thresholds
from train.keras.run_model import check_model_present
from train.runs import run as run_files
from train.runs.cv_folder import CVResult, checked_fold_run, fold_model, is_cv_folder, oof_name
from train.runs.run import RunConfig
from train.runs.thresholds import load_thresholds

Array = npt.NDArray[Any]


@dataclasses.dataclass(frozen=True)
class Target:
    """A run (one member) or a CV folder (``cv``; a member a fold), and the model of each to predict with."""

    folder: str
    members: tuple[tuple[str, RunConfig], ...]  # (run folder, its config)
    swa: bool
    cv: CVResult | None = None

    @property
    def config(self) -> RunConfig:
        return self.members[0][1]  # every member has the same classes, input and shards (checked)

    @property
    def metric(self) -> Metric:
        """The metric the folder decides by (a CV's, or the run's ``--metric``)."""
        return self.cv.metric if self.cv else run_metric(self.config.settings, self.config.single_label)

    def describe(self, views: int) -> str:
        """Which model and views the predictions are of: for the score lines."""
        model = describe(self.swa, views)
        return f"the mean of {len(self.members)} fold models ({model} each)" if self.cv else model


def open_target(folder: str, swa: bool | None, prog: str, say: bool = True) -> Target:
    """The run or CV folder ``folder``, checked: a CV must be finished, each fold a run of its settings holding
    the model asked for. ``swa`` None picks the model with the better validation AUC (a CV's: OOF), said."""
    if not is_cv_folder(folder):
        config = RunConfig.load(folder)
        chosen, line = run_choice(folder, swa)
        check_model_present(folder, chosen)
        members: tuple[tuple[str, RunConfig], ...] = ((folder, config),)
        cv = None
    else:
        cv = CVResult.load(folder)
        if not cv.finished:
            raise TfpipeError(
                f"{folder}: the cross-validation did not finish (no out-of-fold scores in its cv.json); continue "
                f"it with train.cv {option('resume', True)}"
            )
        chosen, line = cv_choice(cv, swa)
        members = tuple(fold_member(folder, cv, k, chosen) for k in cv.folds)
    if line and say:
        print(f"{prog}: {line}", flush=True)
    return Target(folder, members, chosen, cv)


def fold_member(cv_folder: str, cv: CVResult, fold: int, swa: bool) -> tuple[str, RunConfig]:
    """Fold ``fold``'s run of a finished CV, checked to be of the CV and to hold the model asked for."""
    run, config = checked_fold_run(cv_folder, cv, fold)
    if not run_files.read_state(run).get("finished"):
        raise TfpipeError(f"{run}: fold {fold} did not finish; continue it with train.cv {option('resume', True)}")
    check_model_present(run, swa)
    model = fold_model(fold, swa)
    run_files.check_file(
        cv_folder, model, f"a CV's models are those its OOF predictions were scored with; put the fold's own "
        f"{run_files.model_files(swa)[0]} back, or train the CV again ({option('overwrite', True)})",
    )  # fmt: skip
    return run, config


def cv_choice(cv: CVResult, swa: bool | None) -> tuple[bool, str | None]:
    """(swa, the line saying why) for a CV folder: ``swa`` as given, else the models cv.json submits with (the
    better OOF figure of its metric)."""
    final, averaged = cv.scores_of(False), cv.scores_of(True)
    if swa is not None or averaged is None or final is None:
        return bool(swa), None
    chosen, metric = cv.submits == run_files.MODEL_SWA, cv.metric
    shown = value(final.scores, metric), value(averaged.scores, metric)
    return chosen, choice_line(chosen, *shown, "OOF", metric, whose="the fold models' ")


def target_thresholds(
    target: Target, threshold: float | None, views: int, predictor: Predictor, prog: str
) -> list[float]:
    """Per-class thresholds: ``threshold`` for all; else, for a multi-label target, those tuned for its model
    and ``views`` (a CV's on its OOF predictions, a run's on its validation images), tuned now when never asked
    for before (``predictor`` predicts what is missing); else the run's default."""
    config = target.config
    default = float(config.settings.get("threshold", 0.5))
    if threshold is not None and config.single_label:
        raise TfpipeError(
            f"{option('threshold', threshold)}: {target.folder} is single-label, labelled by argmax (one class an "
            f"image), no threshold; leave out {option('threshold')}"
        )
    if threshold is not None:
        return [threshold] * len(config.classes)
    if config.single_label:
        return [default] * len(config.classes)
    if target.cv is not None:
        return oof_thresholds(
            target.cv, target.folder, swa=target.swa, views=views, predict=predictor, default=default, prog=prog
        )
    run = target.folder
    if views == 1:
        return run_thresholds(run, config, target.swa)
    from train.decide.tuning import validation_predictions

    return tuned_thresholds(
        run,
        config.classes,
        swa=target.swa,
        views=views,
        default=default,
        metric=run_metric(config.settings, config.single_label),
        predictions=functools.partial(
            validation_predictions,
            run,
            config,
            swa=target.swa,
            views=views,
            predict=functools.partial(predictor, run, config),
            why=f"labelling {views}-view predictions ({option('tta', views)})",
        ),
        prog=prog,
    )


def tta_worth(target: Target, views: int, predictor_for: Callable[[int], Predictor]) -> tuple[Worth, str]:
    """What ``views`` TTA views did to the target's held-out predictions by its metric (``train.decide.tta``),
    and which rows those are: a CV's OOF rows (from cv.json when it scored these views, else predicted alike
    fold by fold), a run's validation images. ``predictor_for(n)`` predicts what is missing over n views."""
    config, metric, swa = target.config, target.metric, target.swa
    model = run_files.model_files(swa)[0]
    if target.cv is not None:
        rows = f"the OOF rows ({len(target.cv.folds)} fold models' {model}, each on its own fold)"
        m = target.cv.scores_of(swa)
        if m is not None and m.views == views and m.one_view is not None:
            return views_worth(m.one_view, m.scores, views, metric), rows
    else:
        rows = f"{target.folder}'s validation images ({model})"
    default = float(config.settings.get("threshold", 0.5))
    one, many = (
        scored_at_own_thresholds(f.probs, f.targets, list(config.classes), config.single_label, metric, default)
        for f in (held_out(target, v, predictor_for(v)) for v in (1, views))
    )
    return views_worth(one, many, views, metric), rows


def held_out(target: Target, views: int, predictor: Predictor) -> Predictions:
    """The target's held-out images as its model predicts them over ``views`` views: a CV's OOF rows, a run's
    validation images (each read back where recorded, else predicted with ``predictor`` and recorded)."""
    from train.decide.tuning import out_of_fold, validation_predictions

    if target.cv is not None:
        return out_of_fold(target.cv, target.folder, swa=target.swa, views=views, predict=predictor)[0]
    run, config = target.folder, target.config
    predict = functools.partial(predictor, run, config)
    why = f"measuring {option('tta', views)}"
    return validation_predictions(run, config, swa=target.swa, views=views, predict=predict, why=why)


def run_thresholds(run: str, config: RunConfig, swa: bool) -> list[float]:
    """A run's thresholds for one view: tuned by its report (validated; with ``swa`` the SWA model's), else its
    default for runs trained without the report."""
    tuned = load_thresholds(run, list(config.classes), swa)
    default = float(config.settings.get("threshold", 0.5))
    if tuned is None and config.settings.get("report", True):
        # train.fit wrote them with its report: labels at one threshold instead would change without a word
        raise TfpipeError(
            f"{run_files.path(run, run_files.model_files(swa)[1])} is missing (the tuned per-class thresholds "
            f"train.fit wrote with its report); copy it with the run, or pass {option('threshold', default)} to "
            "label every class at one threshold"
        )
    return tuned if tuned is not None else [default] * len(config.classes)


def threshold_words(target: Target, threshold: float | None, views: int) -> str:
    """Which model and views predicted, and how the labels were decided, for the score lines."""
    return f"{target.describe(views)}, {_labels_words(target, threshold, views)}"


def _labels_words(target: Target, threshold: float | None, views: int) -> str:
    config = target.config
    if config.single_label:
        return "labels by argmax"
    if threshold is not None:
        return f"labels at threshold {threshold:g}"
    name = run_files.model_files(target.swa, views)[1]
    if target.cv is not None:
        return f"labels at the CV's thresholds tuned on {oof_name(target.swa, views)} ({name})"
    if fs.exists(run_files.path(target.folder, name)):
        return f"labels at the run's thresholds tuned for it ({name})"
    return f"labels at the run's threshold {config.settings.get('threshold', 0.5):g}"


def recorded_report(target: Target) -> tuple[Any, str]:
    """The scores the folder recorded for the model that predicts (a CV's OOF ones, a run's validation ones;
    None when it recorded none), and the words for them."""
    if target.cv is not None:
        found = target.cv.scores_of(swa=target.swa)
        return (found.scores if found else None), "OOF"
    scores = run_scores(target.folder)
    return (scores.swa_report if target.swa else scores.final_report), "validation"


def near_chance_lines(target: Target, probs: Array, thresholds: Sequence[float]) -> list[str]:
    """A line for each class whose recorded AUC does not tell it from chance (``train.decide.tuning.chance_bound``):
    what its threshold does to these images, against the share of the scored images that hold it. Multi-label
    targets only (single-label ones label by argmax)."""
    report, on = recorded_report(target)
    table = report.get("per_class") if isinstance(report, dict) else None
    examples = report.get("examples") if isinstance(report, dict) else None
    if target.config.single_label or not thresholds or not isinstance(table, dict) or not is_count(examples):
        return []
    if not examples:
        return []
    lines = []
    for c, name in enumerate(target.config.classes):
        row: Any = table.get(name) if isinstance(table.get(name), dict) else {}
        auc, positives = row.get("roc_auc"), row.get("positives")
        if not (is_count(positives) and positives is not None and is_number(auc)):
            continue
        bound = chance_bound(positives, int(examples))
        if bound is not None and auc < bound:
            share = float(np.mean(probs[:, c] >= thresholds[c]))
            lines.append(
                f"{name!r}: {on} AUC {auc:.3f} does not tell it from chance ({bound:.3f} would, on its "
                f"{examples} images); its threshold {thresholds[c]:.3g} labels it on {share:.0%} of these images, "
                f"{positives / int(examples):.0%} of the {on} images hold it"
            )
    return lines
