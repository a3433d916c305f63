"""A run's or CV folder's thresholds files (``thresholds.json``, ``-swa``, ``-tta4``): written with their record
(``train.runs.files``: the model and views they were tuned for) and read back validated and checked against it.
No TensorFlow here."""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from typing import Any

from tfpipe.runtime import fs
from tfpipe.runtime.errors import RunMismatch, option
from train.runs import files
from train.runs.run import _read_json, check_file, model_files, model_name, path, views_name


def save_thresholds(
    run: str, classes: Sequence[str], thresholds: Sequence[float], model: str, suffix: str = "", views: int = 1
) -> None:
    """``thresholds.json`` (``suffix`` "-swa": the SWA model's; ``views`` > 1: tuned on predictions averaged over
    that many TTA views) in ``run``, a run folder or a CV folder, recorded in its ``files.json`` as tuned for
    ``model`` (its file's name) over ``views``."""
    name = views_name(f"thresholds{suffix}.json", views)
    fs.write_atomic(path(run, name), json.dumps(dict(zip(classes, thresholds)), indent=1, ensure_ascii=False) + "\n")
    files.record(run, [name], model, views)


def load_thresholds(
    run: str, classes: Sequence[str], swa: bool = False, views: int = 1, remedy: str | None = None
) -> list[float] | None:
    """The tuned per-class thresholds in ``classes`` order (with ``swa``, the SWA model's; for ``views`` TTA
    views), or None when the folder has none (single-label runs, views not tuned yet). A file naming other
    classes (copied from another run) or holding a value outside [0, 1] is an error, ending with ``remedy``
    (default: train.predict's ``--threshold``)."""
    p = path(run, model_files(swa, views)[1])
    if not fs.exists(p):
        return None
    remedy = remedy or f"pass {option('threshold')} to label at one threshold"
    tuned = _read_json(p)
    if not isinstance(tuned, dict):
        raise RunMismatch(
            f"{p}: expected an object of class name: threshold (got a {type(tuned).__name__}: {_short(tuned)}); the "
            f"file was edited or damaged -- {remedy}"
        )
    if sorted(tuned) != sorted(classes):
        named = sorted(tuned)
        raise RunMismatch(
            f"{p}: names classes {_short(named)}, not the run's ({_short(classes)}); it belongs to another run -- "
            f"{remedy}"
        )
    values = [tuned[c] for c in classes]
    for c, v in zip(classes, values):
        if not isinstance(v, (int, float)) or isinstance(v, bool) or not math.isfinite(v) or not 0 <= v <= 1:
            raise RunMismatch(f"{p}: threshold of {c!r} is {v!r}, not a number in [0, 1]; the file is damaged")
    check_file(run, model_files(swa, views)[1], remedy, model_name(run, swa), views)  # the one its job tuned
    return [float(v) for v in values]


def _short(names: Any, most: int = 6) -> str:
    names = list(names) if isinstance(names, (list, tuple)) else [repr(names)]
    return ", ".join(map(str, names[:most])) + (f", ... {len(names)} in all" if len(names) > most else "")
