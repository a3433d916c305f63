"""Blend: the weighted mean of several models' probabilities -- runs, CV folders, the PyTorch recipes' -- scored
on their out-of-fold predictions, with thresholds tuned on the blend, and applied to their test predictions.

    python -m train.blend --oof runs/cv-b0/oof.csv runs/cv-b3/oof-tta2.csv --weights 0.4,0.6 \
        --test b0.csv b3.csv --out blend.csv

``--oof`` files are ``train.cv``'s ``oof.csv`` (or any CSV with ``image_name``, one probability column per
class and the true ``labels``); ``--test`` files are submissions written with ``--probabilities`` (the id column
first, then one column per class), given in the same order. Rows are matched by id; the class columns must be the
same, in the same order, and the ids the same set, else one line names the file. Each OOF's score and the
blend's are printed by the CVs' ``--metric`` (or ``--metric``; multi-label thresholds tuned on the blended OOF
predictions for it); ``--search-weights`` searches the weights on the OOF rows by that metric (scipy's Nelder-Mead,
``train.decide.weights``) and prints them with their OOF score and the equal weights'. The blended
test predictions are labelled at those thresholds, in a labels column named as the training CSV's label column
(``labels`` when the CV folders do not say); ``--sample-submission FILE`` gives the blend the competition's header,
id order and form instead. No TensorFlow here.
"""

from __future__ import annotations

import argparse
import dataclasses
import posixpath
import sys
from collections.abc import Sequence
from typing import Any

import numpy as np

from tfpipe.runtime import fs
from tfpipe.runtime.errors import ArgumentParser, TfpipeError, check_path, option, run_cli
from tfpipe.sources.labels import is_missing, present
from train.decide.evaluation import Scores, headline, score
from train.decide.metrics import METRICS, Metric, metric_of
from train.decide.weights import Searched, search_weights
from train.prediction.probabilities import agreed_kind, check_probabilities, kind_of
from train.prediction.sample import SAMPLE_HELP
from train.prediction.submission import label_names
from train.runs import run as run_files
from train.runs.cv_folder import OOF_COLUMNS, CVResult, fold_run, is_cv_folder

LABELS = "labels"


@dataclasses.dataclass(frozen=True)
class Blend:
    """What ``blend`` found: the weights (summing to 1), the class names, the thresholds tuned on the blended
    OOF predictions, each input's OOF scores and the blend's (``train.decide.evaluation.score``'s form), and the
    blended test submission (None without test files)."""

    weights: tuple[float, ...]
    classes: tuple[str, ...]
    thresholds: tuple[float, ...]
    scores: tuple[Scores, ...]  # of each OOF file, at thresholds tuned on it
    blended: Scores
    single_label: bool = False  # read from the data: labels by argmax, no thresholds
    submission: Any = None  # a pandas DataFrame
    metric: Metric = METRICS["roc_auc"]  # the figure that leads the lines, tunes thresholds and weighs the blend
    searched: Searched | None = None  # with search_weights: the weights found, their OOF score, the equal weights'


def blend(
    oof: Sequence[str],
    test: Sequence[str] = (),
    out: str | None = None,
    *,
    weights: Sequence[float] | None = None,
    single_label: bool | None = None,
    probabilities: bool = False,
    overwrite: bool = False,
    sample_submission: str | None = None,
    metric: str | None = None,
    search: bool = False,
) -> Blend:
    """Blends the OOF files ``oof`` (and, given, the test files ``test``, one per OOF file in the same order,
    written to ``out``) with ``weights`` (default: equal). Single- or multi-label is read from the CV folders
    beside the OOF files, else from their rows (``oof_kind``); ``single_label`` given must agree. An OOF file of a
    CV folder is checked against its record first (``train.runs.files``). ``sample_submission`` (the
    competition's ``sample_submission.csv``): the blended submission takes its header, id column, ids in its order
    (the test files' ids, each once) and its form (class columns: the probabilities; one column: the labels);
    without it the labels column is named as the training CSV's (the CV folders' runs recorded it), else
    ``labels``. ``metric`` (scikit-learn's name, ``train.decide.metrics``; default: the one the CVs decided by,
    else ``roc_auc``) leads the scores and tunes multi-label thresholds; ``search`` searches the weights on the OOF
    rows by it, from equal weights (``weights`` must then be left out). Example::

        from train.blend import blend
        found = blend(["runs/cv-a/oof.csv", "runs/cv-b/oof.csv"], ["a.csv", "b.csv"], "blend.csv", weights=[1, 2])
        found.blended["roc_auc_macro"]
    """
    check_inputs(oof, test, out)
    if sample_submission and not test:
        raise TfpipeError(
            f"{option('sample_submission')} shapes the blended test submission; give {option('test')} too"
        )
    if search and weights is not None:
        raise TfpipeError(f"{option('search_weights', True)} searches the weights: leave out {option('weights')}")
    w = normalised(weights, len(oof))
    cvs = [checked_oof(p) for p in oof]
    tables = [read_table(p, oof=True) for p in oof]
    classes, ids, truth = agreed(tables, oof, oof=True)
    probs = [aligned(t, ids, classes, p) for t, p in zip(tables, oof)]
    single_label = oof_kind(oof, cvs, truth, probs, single_label)
    decides = blend_metric(oof, metric, single_label)
    searched = search_weights(probs, truth, single_label, decides) if search else None
    w = searched.weights if searched else w
    alone = tuple(score(p, truth, classes, _tuned(p, truth, single_label, decides), single_label) for p in probs)
    mixed = np.tensordot(np.asarray(w), np.stack(probs), axes=1)
    thresholds = _tuned(mixed, truth, single_label, decides, classes)
    blended = score(mixed, truth, classes, thresholds, single_label)
    found = Blend(w, tuple(classes), tuple(thresholds), alone, blended, single_label, None, decides, searched)
    if test:
        written = blend_test(
            test, out, found, single_label, probabilities, overwrite,
            sample=sample_submission, label_column=label_column_of(oof),
        )  # fmt: skip
        found = dataclasses.replace(found, submission=written)
    return found


def checked_oof(path: str) -> bool | None:
    """An OOF file in a CV folder (``cv.json`` beside it) is the one train.cv recorded there; returns that CV's
    single-label (None: a file of no CV folder, read as it is)."""
    folder, name = posixpath.split(path)
    if not is_cv_folder(folder or "."):
        return None
    cv = CVResult.load(folder or ".")
    run_files.check_file(folder or ".", name, "blend the OOF file train.cv wrote, or run train.cv again")
    return cv.single_label


def oof_kind(
    paths: Sequence[str], cvs: Sequence[bool | None], truth: Any, probs: Sequence[Any], asked: bool | None
) -> bool:
    """Single-label (True) or multi-label: each file's as its CV folder recorded, else read from its rows, one
    kind for every file (``train.prediction.probabilities.agreed_kind``); ``asked`` must agree."""
    found = agreed_kind(paths, probs, cvs, truth)
    if asked is not None and asked != found:
        why = "its CV's cv.json says so" if cvs[0] is not None else kind_of(probs[0], truth)[1]
        if asked:
            raise TfpipeError(
                f"{option('single_label')}: {paths[0]} holds multi-label predictions ({why}), where a single-label "
                "model's (a softmax) sum to 1 in every row with one true label; leave the flag out to blend them "
                "as multi-label, with thresholds tuned per class"
            )
        raise TfpipeError(f"{paths[0]} holds single-label predictions ({why}); leave single_label=False out")
    return found


def _tuned(probs: Any, truth: Any, single_label: bool, metric: Metric, say: Sequence[str] = ()) -> list[float]:
    """Thresholds tuned on ``probs``; with the class names ``say``, each decision against tuning one line."""
    from train.decide.tuning import tune

    if single_label:
        return [0.5] * probs.shape[1]
    tuned = tune(probs, truth, 0.5, metric)
    for note in tuned.notes(say, 0.5, "OOF") if say else ():
        print(f"train.blend: thresholds of the blend: {note}", flush=True)
    return tuned.thresholds


def blend_metric(oof: Sequence[str], asked: str | None, single_label: bool) -> Metric:
    """The metric a blend decides by: ``asked``, else the one the CV folders beside the OOF files decided by
    (CVs that decided by different ones: one line asking for ``--metric``), else ``roc_auc``; one line when it
    does not apply to the blend's kind."""
    if asked is None:
        folders = [f for f in (posixpath.dirname(p) or "." for p in oof) if is_cv_folder(f)]
        found = {f: CVResult.load(f).metric.name for f in folders}
        if len(set(found.values())) > 1:
            said = ", ".join(f"{f}: {m}" for f, m in found.items())
            raise TfpipeError(f"the CVs decided by different metrics ({said}); {option('metric')} names the blend's")
        asked = next(iter(found.values()), None)
    return metric_of(asked, single_label)


def check_inputs(oof: Sequence[str], test: Sequence[str], out: str | None) -> None:
    if len(oof) < 2:
        raise TfpipeError(f"a blend needs the OOF predictions of at least two models ({option('oof')}; got {len(oof)})")
    if test and len(test) != len(oof):
        raise TfpipeError(
            f"{option('test')}: {len(test)} test file{'s' * (len(test) != 1)} for {len(oof)} OOF file"
            f"{'s' * (len(oof) != 1)}; give each model's test predictions, in the same order"
        )
    if test and not out:
        raise TfpipeError(f"{option('test')} blends test predictions: {option('out')} names the CSV to write")
    check_path(out=out)
    twice = next((p for i, p in enumerate(oof) if any(fs.same_path(p, q) for q in oof[:i])), None)
    if twice is not None:
        raise TfpipeError(f"{option('oof')}: {twice} is given twice; a blend mixes the predictions of other models")
    if out and any(fs.same_path(out, p) for p in (*oof, *test)):
        raise TfpipeError(f"{option('out')} {out} is one of the blend's inputs; write the blend to another file")


def normalised(weights: Sequence[float] | None, n: int) -> tuple[float, ...]:
    """The weights as given, scaled to sum to 1 (equal when None); each must be a number >= 0, some above 0."""
    if weights is None:
        return (1 / n,) * n
    if len(weights) != n or not all(isinstance(x, (int, float)) and np.isfinite(x) and x >= 0 for x in weights):
        raise TfpipeError(f"{option('weights')} takes {n} numbers >= 0, one a file (got {list(weights)})")
    top = float(max(weights))
    if top <= 0:
        raise TfpipeError(f"{option('weights')} are all 0; give some weight")
    scaled = [float(x) / top for x in weights]  # first to at most 1: a sum of huge weights would overflow
    return tuple(x / sum(scaled) for x in scaled)


def read_table(path: str, oof: bool) -> Any:
    """A probabilities CSV: an OOF file (``image_name`` ... ``labels``) or a submission with ``--probabilities``
    (the id column first), as a DataFrame indexed by id with only its class columns (and, for OOF, labels)."""
    import pandas as pd

    if not fs.exists(path):
        raise TfpipeError(f"{path} does not exist")
    with fs.open(path) as f:
        try:
            table = pd.read_csv(f, dtype=str, keep_default_na=False)
        except (ValueError, pd.errors.ParserError) as e:
            raise TfpipeError(f"{path}: not a CSV file ({str(e)[:80]})") from None
    key = "image_name" if oof else table.columns[0] if len(table.columns) else None
    if key not in table.columns or (oof and LABELS not in table.columns):
        what = f"image_name and {LABELS} columns (train.cv's oof.csv)" if oof else "an id column and class columns"
        raise TfpipeError(f"{path}: not a predictions file: no {what}")
    for row, cell in enumerate(table[key], start=1):  # the one missing-value rule of a column we read
        present(cell, f"{path}: row {row}, column {key!r}", "id", "every row needs its image's id")
    if table[key].duplicated().any():
        raise TfpipeError(f"{path}: the id {table[key][table[key].duplicated()].iloc[0]!r} is in two rows")
    dropped = [c for c in table.columns if (c in OOF_COLUMNS and (c != LABELS or not oof)) or c == key]
    return table.drop(columns=dropped).set_index(pd.Index(table[key], name=key))


def without_labels(table: Any, classes: Sequence[str], path: str) -> Any:
    """A test file's probability columns: its one column of labels beside them, whatever its name (train.predict
    ``--probabilities --labels`` names it as the training CSV did), left out -- the blend labels anew; any
    other column that is no class of the OOF files is refused naming it."""
    import pandas as pd

    extra = [c for c in table.columns if c not in classes]
    labels = [c for c in extra if pd.to_numeric(table[c], errors="coerce").isna().any()]  # not probabilities
    others = [c for c in extra if c not in labels[:1]]
    if others:
        raise TfpipeError(
            f"{path}: column {others[0]!r} is no class of the OOF files ({', '.join(classes[:6])}); a test file "
            "holds the id column, the probability columns and at most one labels column"
        )
    return table.drop(columns=labels)


def agreed(tables: Sequence[Any], paths: Sequence[str], oof: bool) -> tuple[list[str], list[str], Any]:
    """The class names, ids (the first file's order) and, for OOF files, the multi-hot truth: the same in every
    file, else one line naming the first that differs."""
    for table, path in zip(tables, paths):
        if not [c for c in table.columns if c != LABELS]:
            raise TfpipeError(f"{path}: no probability columns (write the predictions with --probabilities)")
        if oof:
            check_oof_labels(table[LABELS], [c for c in table.columns if c != LABELS], path)
    first = tables[0]
    classes = [c for c in first.columns if c != LABELS]
    ids = list(first.index)
    for table, path in zip(tables[1:], paths[1:]):
        theirs = [c for c in table.columns if c != LABELS]
        if theirs != classes:
            raise TfpipeError(
                f"{path}: classes {', '.join(theirs[:6])} are not {paths[0]}'s ({', '.join(classes[:6])})"
            )
        missing = sorted(set(ids) ^ set(table.index))
        if missing:
            raise TfpipeError(f"{path}: the ids are not {paths[0]}'s (e.g. {missing[0]!r} is in one only)")
        if oof and list(table.loc[ids, LABELS]) != list(first[LABELS]):
            bad = next(i for i in ids if table.loc[i, LABELS] != first.loc[i, LABELS])
            raise TfpipeError(f"{path}: the labels of {bad!r} are not {paths[0]}'s; these are not OOF of one dataset")
    truth = (
        np.array([[c in set(label_names(row, classes)) for c in classes] for row in first[LABELS]], np.float32)
        if oof
        else None
    )
    return classes, ids, truth


def check_oof_labels(cells: Any, classes: Sequence[str], path: str) -> None:
    """Each OOF ``labels`` cell is the true labels, as ``label_strings`` writes them (empty: none): a missing-value
    spelling or a name that is not one of the class columns is refused naming its row (it would be read as "no
    labels", and the blend's scores and thresholds tuned on a wrong truth)."""
    known = set(classes)
    for row, cell in enumerate(cells, start=1):
        for label in label_names(cell, classes):
            where = f"{path}: row {row}, column {LABELS!r}"
            if is_missing(label):
                raise TfpipeError(f"{where}: {label!r} is a missing-value spelling, not a label (empty: none)")
            if label not in known:
                raise TfpipeError(
                    f"{where}: {label!r} is not one of the class columns ({', '.join(classes[:6])}); labels are class "
                    "names separated by spaces, as train.cv writes them"
                )


def aligned(table: Any, ids: Sequence[str], classes: Sequence[str], path: str) -> Any:
    """The probabilities [N, C] of ``table`` (read from ``path``) in the order of ``ids``, checked to be
    probabilities (``train.prediction.probabilities``; the rows named as the file holds them)."""
    import pandas as pd

    in_file = table[list(classes)].apply(pd.to_numeric, errors="coerce").to_numpy(np.float64)
    check_probabilities(path, in_file, classes, cells=table[list(classes)].to_numpy())
    return in_file[table.index.get_indexer(list(ids))]


def blend_test(
    test: Sequence[str],
    out: str | None,
    found: Blend,
    single_label: bool,
    probabilities: bool,
    overwrite: bool,
    *,
    sample: str | None = None,
    label_column: str = LABELS,
) -> Any:
    """The blended test predictions, labelled at the blend's thresholds (in ``label_column``), written to
    ``out``; with ``sample`` (a sample submission) in its columns, form and id order."""
    import pandas as pd

    from train.prediction.sample import check_sample_ids, follow_sample, read_sample, sample_form
    from train.prediction.submission import check_destination, labels_at, write_submission

    assert out is not None
    check_destination(out, overwrite)
    followed = read_sample(sample, found.classes) if sample else None
    labels, probabilities = sample_form(followed, probabilities) if followed else (True, probabilities)
    tables = [without_labels(read_table(p, oof=False), found.classes, p) for p in test]
    classes, ids, _ = agreed(tables, test, oof=False)
    if classes != list(found.classes):
        lacks = [c for c in found.classes if c not in classes]
        said = f"lacks class {lacks[0]!r}" if lacks else "holds the classes in another order"
        raise TfpipeError(f"{test[0]}: {said} of the OOF files ({', '.join(found.classes[:6])})")
    if followed:
        check_sample_ids(followed, ids, test[0])
    probs = np.stack([aligned(t, ids, classes, p) for t, p in zip(tables, test)])
    if single_label:
        for path, values in zip(test, probs):
            check_probabilities(path, values, classes, single_label)  # the OOF files' kind: a softmax's rows
    mixed = np.tensordot(np.asarray(found.weights), probs, axes=1)
    df = pd.DataFrame({followed.id_column if followed else tables[0].index.name: ids})  # else the first file's
    if labels:
        named = followed.label_column if followed and followed.label_column else label_column
        df[named] = labels_at(mixed, classes, found.thresholds, single_label)
    if probabilities:
        df = pd.concat([df, pd.DataFrame(mixed.astype(np.float32), columns=classes)], axis=1)
    df = follow_sample(df, followed) if followed else df
    write_submission(out, df.to_csv(index=False), overwrite)
    return df


def label_column_of(oof: Sequence[str]) -> str:
    """The blended labels column's name without a sample: the training CSV's label column, as the runs of the
    CV folders beside the OOF files recorded it (when they agree), else ``labels``."""
    from train.runs.run import RunConfig

    names = set()
    for path in oof:
        folder = posixpath.dirname(path) or "."
        if is_cv_folder(folder):
            run = fold_run(folder, CVResult.load(folder).folds[0])
            if fs.exists(run_files.path(run, run_files.CONFIG)):  # a CV folder copied without its fold runs: none
                names.add(RunConfig.load(run).label_column)
    return names.pop() if len(names) == 1 else LABELS


def lines(found: Blend, oof: Sequence[str]) -> list[str]:
    """What the command prints: each OOF file's score, then the blend's."""

    m = found.metric
    how = "labels by argmax" if found.single_label else f"at thresholds tuned on its own OOF predictions for {m.words}"
    said = [f"train.blend: {p}: {headline(s, m)} ({how})" for p, s in zip(oof, found.scores)]
    weights = ", ".join(f"{w:.3f}" for w in found.weights)
    if found.searched is not None:
        equal, best = (_figure(v) for v in (found.searched.equal_score, found.searched.score))
        said.append(
            f"train.blend: weights searched on the OOF rows by {m.words}: {weights} score {best} there, "
            f"equal weights {equal}"
        )
    said.append(f"train.blend: the blend (weights {weights}): {headline(found.blended, m)} ({how})")
    return said


def _figure(v: float | None) -> str:
    return "-" if v is None else f"{v:.4f}"


def build_parser() -> ArgumentParser:
    p = ArgumentParser(prog="python -m train.blend", description=(__doc__ or "").split("\n\n")[0])
    p.add_argument("--oof", nargs="+", required=True, help="OOF files (train.cv's oof.csv), one a model")
    p.add_argument("--test", nargs="+", default=[], help="test predictions (--probabilities), one an OOF file")
    p.add_argument("--out", help="the blended submission to write (with --test)")
    p.add_argument("--weights", type=_numbers, help="one weight a file, e.g. 0.4,0.6 (default: equal)")
    p.add_argument(
        "--search-weights",
        action="store_true",
        help="search the weights on the OOF rows by --metric (scipy's Nelder-Mead, from equal weights)",
    )
    p.add_argument(
        "--metric",
        help="the figure that leads the lines, tunes thresholds and weighs the search (scikit-learn's names: "
        "roc_auc, accuracy, balanced_accuracy, f1_macro, log_loss, exact_match, f1_micro; default: the CVs')",
    )
    p.add_argument(
        "--single-label",
        action="store_true",
        default=None,
        help="assert single-label (labels by argmax); the kind is read from the CVs or the rows anyway",
    )
    p.add_argument("--probabilities", action="store_true", help="the blended probabilities after the labels")
    p.add_argument("--overwrite", action="store_true", help="replace --out whatever it holds")
    p.add_argument(
        "--sample-submission",
        metavar="FILE",
        help=SAMPLE_HELP,
    )
    return p


def _numbers(text: str) -> list[float]:
    try:
        return [float(x) for x in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"numbers separated by commas (e.g. 0.4,0.6), not {text!r}") from None


def run_command(args: argparse.Namespace) -> None:
    found = blend(
        args.oof, args.test, args.out, weights=args.weights, single_label=args.single_label,
        probabilities=args.probabilities, overwrite=args.overwrite, sample_submission=args.sample_submission,
        metric=args.metric, search=args.search_weights,
    )  # fmt: skip
    print("\n".join(lines(found, args.oof)), flush=True)
    if args.test:
        n = len(found.submission)
        print(f"train.blend: wrote {n} row{'s' * (n != 1)} -> {args.out}", flush=True)


def main(argv: Sequence[str] | None = None) -> int:
    return run_cli("train.blend", run_command, build_parser().parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
