"""``train.predict``'s scores on labeled shards: exact figures (``train.decide.evaluation``) over all rows, and, on the
run's own training shards, apart for the rows the run held out and the rows it trained on (found by their
images' digests, whatever their names), so a score on trained-on images is never taken for a test score."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, NamedTuple

import numpy as np
import numpy.typing as npt

import tfpipe
from tfpipe.format.shards import Records, Shards
from tfpipe.runtime import fs
from tfpipe.runtime.errors import TfpipeError, in_command
from train.decide.metrics import DEFAULT, METRICS, run_metric
from train.runs import run as run_files
from train.runs.run import RunConfig, training_parts

if TYPE_CHECKING:
    pass


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
    when the run has no ``val_predictions.csv`` (``--no-report``). A ``val_predictions.csv`` without digests:
    its validation images are matched by id (``ids``), which the lines printed say."""
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
    apart: bool = True,
) -> dict[str, Any]:
    """Scores of ``probs`` against the labels ``shards`` hold (``train.decide.evaluation.score``), printed with
    ``progress`` (always under the command): all the images, first. When they are the run's own training shards,
    the rows it held out and the rows it trained on are scored apart as well: only the first say anything about
    unseen images. Other shards holding images the run ``seen`` (the same stored image: its own data written
    again) are scored apart likewise: the images it validated on, trained on, and never saw (``others`` instead
    of ``unseen`` when the run recorded no training digests: perhaps trained on). Without ``apart`` (a CV's fold
    ensemble, each of whose images some fold trained on) every image is scored together only."""
    result = _scores_of_parts(shards, config, probs, thresholds, threshold_words, seen, apart)
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
    apart: bool,
) -> dict[str, Any]:
    from train.decide.evaluation import score

    classes = list(config.classes)
    targets = tfpipe.read_targets(shards, len(classes))
    own = bool(config.dataset_id) and shards.dataset_id == config.dataset_id
    result: dict[str, Any] = {"thresholds": threshold_words, "own_training_shards": own}
    result["metric"] = run_metric(config.settings, config.single_label).name  # what leads each line
    result["all"] = score(probs, targets, classes, thresholds, config.single_label)  # every image given, always
    parts = _parts(shards, config, own, seen) if apart else None
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
    from train.decide.evaluation import class_table, headline

    metric = METRICS[result.get("metric", DEFAULT)]

    def line(what: str, scores: dict[str, Any]) -> str:
        return (
            f"train.predict: {what} ({scores['examples']} image{'s' * (scores['examples'] != 1)}), "
            f"{result['thresholds']}: {headline(scores, metric)}"
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
