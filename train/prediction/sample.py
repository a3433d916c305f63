"""The competition's ``sample_submission.csv`` followed (``--sample-submission``, for ``train.predict`` and
``train.blend``): the submission takes its header, its id column, its ids in its order -- each predicted id once,
no other -- and its form: after the id column either exactly the class names (one probability column per class,
in the sample's order) or one column, the labels column under the sample's name. No TensorFlow here.

    sample = read_sample("sample_submission.csv", classes)      # the header and the ids, checked
    labels, probabilities = sample_form(sample, probabilities=False, labels=None)
    check_sample_ids(sample, ids, "records/test")               # every predicted id once, and no other
    df = follow_sample(table, sample)                           # its columns, its rows' order
"""

from __future__ import annotations

import collections
import csv
import dataclasses
import io
from collections.abc import Sequence
from typing import TYPE_CHECKING

from tfpipe.runtime import fs
from tfpipe.runtime.console import counted
from tfpipe.runtime.errors import TfpipeError, option

if TYPE_CHECKING:
    import pandas as pd

SAMPLE_HELP = (  # --sample-submission's help, train.predict's and train.blend's
    "the competition's sample_submission.csv: its header, id column and id order (every id once); class columns "
    "there: the probability form (one column per class), else one labels column named as it names it"
)
SHOWN_CHARS = 40  # of a cell quoted in a message
SAMPLE_LIMIT = 2**30  # bytes: a sample submission of a million rows is ~30 MB; a larger file is not one


@dataclasses.dataclass(frozen=True)
class SampleSubmission:
    """A sample submission read and checked: its ``path``, its ``columns`` (the id column first), its ``ids`` in
    its order (each once), and whether its other columns are the class names (``probabilities``) or one labels
    column."""

    path: str
    columns: tuple[str, ...]
    ids: tuple[str, ...]
    probabilities: bool

    @property
    def id_column(self) -> str:
        return self.columns[0]

    @property
    def label_column(self) -> str | None:
        """The labels column's name (None: the probabilities' form)."""
        return None if self.probabilities else self.columns[1]


def read_sample(path: str, classes: Sequence[str]) -> SampleSubmission:
    """``path`` (local or ``gs://``) read and checked against the run's ``classes``: a CSV whose header names
    each column once, whose rows have no more fields than it, whose first column holds each id once, and whose
    other columns are the class names or one labels column. Anything else is one ``TfpipeError`` naming the
    file."""
    if not fs.exists(path):
        raise TfpipeError(f"{path}: no such file; {option('sample_submission')} names the competition's CSV")
    if fs.isdir(path):
        raise TfpipeError(f"{path} is a folder; {option('sample_submission')} names the competition's CSV file")
    try:
        text = fs.read_bytes(path, SAMPLE_LIMIT).decode("utf-8-sig")
    except UnicodeDecodeError as e:
        raise TfpipeError(f"{path}: not UTF-8 text ({e.reason} at byte {e.start}); not a sample submission") from None
    try:  # newline=None: the line ends of every platform (\r\n, \n, an old Mac's \r)
        rows = [row for row in csv.reader(io.StringIO(text, newline=None)) if row]  # blank lines skipped
    except csv.Error as e:  # a field over the csv module's limit, a NUL byte, ...
        raise TfpipeError(f"{path}: not a CSV file ({e}); not a sample submission") from None
    if not rows:
        raise TfpipeError(f"{path}: an empty file, not a sample submission")
    columns, body = tuple(rows[0]), rows[1:]
    twice = [c for c, n in collections.Counter(columns).items() if n > 1]
    if twice:
        raise TfpipeError(f"{path}: the header names column {shown(twice[0])} twice; a submission names each once")
    long = next((i for i, row in enumerate(body, start=2) if len(row) > len(columns)), None)
    if long is not None:
        raise TfpipeError(
            f"{path}: line {long} has {len(body[long - 2])} fields, the header {len(columns)}; a row holds the "
            "header's columns (a comma at the end of each line?)"
        )
    probabilities = _form(path, columns, classes)
    ids = tuple(row[0] for row in body)
    repeated = [i for i, n in collections.Counter(ids).items() if n > 1]
    if repeated:
        raise TfpipeError(
            f"{path}: {counted(len(repeated), 'id')} in two rows or more (e.g. {shown(repeated[0])}); a submission "
            "keys each image once"
        )
    return SampleSubmission(path, columns, ids, probabilities)


def shown(cell: str) -> str:
    """A cell as a message quotes it: ``repr``, cut to ``SHOWN_CHARS`` (a line stays one line, whatever the file
    holds)."""
    return repr(cell) if len(cell) <= SHOWN_CHARS else f"{cell[:SHOWN_CHARS]!r}... ({len(cell)} characters)"


def _form(path: str, columns: tuple[str, ...], classes: Sequence[str]) -> bool:
    """Whether the columns after the id column are the class names (True) or one labels column (False); a
    one-column sample of a one-class run whose column is the class is the probabilities' form."""
    if not columns:
        raise TfpipeError(f"{path}: an empty file, not a sample submission")
    rest = columns[1:]
    if len(rest) == len(classes) and set(rest) == set(classes):
        return True
    if len(rest) == 1 and rest[0] not in classes:
        return False
    names = ", ".join(classes[:6]) + (f", ... {len(classes)} in all" if len(classes) > 6 else "")
    got = ", ".join(map(shown, rest[:6])) + (f", ... {len(rest)} in all" if len(rest) > 6 else "") if rest else "none"
    raise TfpipeError(
        f"{path}: expected the id column, then one labels column or one column per class ({names}: the "
        f"probabilities' form); its columns after {shown(columns[0])} are {got}"
    )


def sample_form(
    sample: SampleSubmission, probabilities: bool, labels: bool | None = None, threshold: float | None = None
) -> tuple[bool, bool]:
    """(labels, probabilities) as the sample has them: its columns decide the form, so a flag asking for the
    other one (``--probabilities`` on a labels column, ``--labels`` or ``--threshold`` on class columns) is
    refused in one line."""
    if not sample.probabilities:
        if probabilities:
            raise TfpipeError(
                f"{sample.path}: its one column {shown(sample.columns[1])} is a labels column, not one column per "
                f"class; leave out {option('probabilities', True)} (the sample decides the form)"
            )
        return True, False
    asked = option("labels", True) if labels else option("threshold") if threshold is not None else None
    if asked:
        raise TfpipeError(
            f"{sample.path}: its columns are the class names (one probability each), no labels column; leave out "
            f"{asked} (the sample decides the form)"
        )
    return False, True


def sample_id_column(sample: SampleSubmission, asked: str | None) -> str:
    """The sample's id column, the submission's; an ``id_column`` asked for that is another is refused."""
    if asked is not None and asked != sample.id_column:
        raise TfpipeError(
            f"{sample.path}: its id column is {shown(sample.id_column)}, {option('id_column', asked)} asks for "
            f"another; leave out {option('id_column')} (the sample decides the header)"
        )
    return sample.id_column


def check_sample_ids(sample: SampleSubmission, ids: Sequence[str], predicted: object) -> None:
    """The sample's ids are the ``ids`` predicted (of ``predicted``: the shards, the test files), no other and
    none missing (each once: ``read_sample``)."""
    known = set(ids)
    foreign = [i for i in sample.ids if i not in known]
    if foreign:
        raise TfpipeError(
            f"{sample.path}: {counted(len(foreign), 'id')} not predicted (not in {predicted}; e.g. "
            f"{shown(foreign[0])}); predict the competition's test images"
        )
    wanted = set(sample.ids)
    missing = [i for i in ids if i not in wanted]
    if missing:
        raise TfpipeError(
            f"{sample.path}: lacks {counted(len(missing), 'predicted id')} (of {predicted}; e.g. {shown(missing[0])}); "
            "predict the competition's test images, and only those"
        )


def follow_sample(table: pd.DataFrame, sample: SampleSubmission) -> pd.DataFrame:
    """``table`` (keyed by ``sample.id_column``, holding its columns) with exactly the sample's columns in its
    order and its rows in the sample's id order."""
    keyed = table.set_index(sample.id_column)
    return keyed.loc[list(sample.ids)].reset_index()[list(sample.columns)]
