"""A Kaggle-style CSV read into rows: the image ids, each row's labels in one of three layouts (``LabelFormat``:
a separated list, one-hot columns, a class column) and its group, every cell checked before any image is
touched. ``tfpipe.sources.source.Source`` turns the rows into items."""

from __future__ import annotations

import collections
import csv
import io
import re
from collections.abc import Iterable, Mapping, Sequence
from typing import TypeAlias

import pandas as pd

from tfpipe.runtime import fs
from tfpipe.runtime.errors import TfpipeError, in_command, option
from tfpipe.sources.labels import (
    ASCII_SPACE,
    LabelFormat,
    check_label_spellings,
    check_separator,
    clean_label,
    is_missing,
    label_cell,
    nfc,
    present,
    refuse_twin_spellings,
)

Row: TypeAlias = tuple[int, str, tuple[str, ...], str | None]  # (data row from 1, image id, labels, group)


ID_LIKE = re.compile(r"image|id$|^id|file|name|path", re.IGNORECASE)  # columns that may hold the image ids


def read_csv(
    csv_path: str,
    *,
    image_col: str = "image",
    label_format: LabelFormat = LabelFormat(),
    labeled: bool = True,
    group_col: str | None = None,
) -> list[Row]:
    """Reads a CSV into (row number, image id, label names, group) tuples.

    Args:
      csv_path: the CSV file (UTF-8, with or without a byte-order mark).
      image_col: column holding the image file name or id.
      label_format: a ``LabelFormat``.
      labeled: False for unlabeled (test) data: label columns are not read.
      group_col: column holding each image's group (patient, video, site), or None.

    Returns:
      A list of (row, id, tuple of label names, group or None); ``row`` counts data rows from 1.
    """
    df = _read_table(csv_path)
    image_col = nfc(image_col)
    _require_columns(df, [image_col], csv_path, "image_col")
    ids = [v.strip() for v in df[image_col]]
    _check_ids(ids, image_col, csv_path)
    taken = {image_col: "ids", **dict.fromkeys(label_columns(label_format) if labeled else (), "labels")}
    groups = _groups(df, group_col, csv_path, taken) if group_col is not None else [None] * len(ids)
    labels = _labels(df, label_format, csv_path) if labeled else [()] * len(ids)
    check_label_spellings(labels, csv_path)
    return [(i + 1, name, labels, group) for i, (name, labels, group) in enumerate(zip(ids, labels, groups))]


def label_columns(fmt: LabelFormat) -> set[str]:
    """The CSV columns ``fmt`` reads labels from."""
    if fmt.class_col is not None:
        return {nfc(fmt.class_col)}
    return {nfc(c) for c in fmt.label_cols} if fmt.label_cols else {nfc(fmt.labels_col)}


def _groups(df: pd.DataFrame, group_col: str, csv_path: str, taken: Mapping[str, str]) -> list[str]:
    """The group of every row (whitespace around it off), checked as labels are: an empty cell, an invisible
    character, or two spellings of one group (``P3``/``p3``, ``03``/``3``) is an error naming the rows -- each
    would split a patient between folds while the writer said none is."""
    group_col = nfc(group_col)
    if group_col in taken:  # the ids or the labels: no grouping, or grouping by the answer
        raise TfpipeError(
            f"{option('group_col', group_col)} names the column of the {taken[group_col]}; name the column of each "
            "image's group (its patient, video, site)"
        )
    _require_columns(df, [group_col], csv_path, "group_col")
    groups: list[str] = []
    first_row: dict[str, str] = {}
    for row, cell in enumerate(df[group_col], start=1):
        where = f"{csv_path}: row {row}, column {group_col!r}"
        fix = "every image needs its group (give an image of no known group a name of its own)"
        value = present(cell, where, "group", fix)
        group = clean_label(value, where, makes="a group")
        first_row.setdefault(group, f"row {row}")
        groups.append(group)
    refuse_twin_spellings(first_row, csv_path, what="groups")
    return groups


def _read_table(csv_path: str) -> pd.DataFrame:
    """The CSV as a frame of strings; unreadable, undecodable or ambiguous (a column named twice) is an error."""
    try:
        if not fs.exists(csv_path):
            raise TfpipeError(f"{csv_path}: CSV file not found")
        if fs.isdir(csv_path):
            raise TfpipeError(f"{csv_path} is a folder; --csv names a CSV file")
        fs.check_regular(csv_path, "CSV file")  # a FIFO would hang the read, /dev/zero never end
        with fs.open(csv_path, "rb") as f:
            text = f.read().decode("utf-8-sig")
        header = _check_row_lengths(text, csv_path)
        twice = [c for c, n in collections.Counter(nfc(h.strip()) for h in header).items() if n > 1]
        if twice:
            raise TfpipeError(
                f"{csv_path}: the header names column {twice[0]!r} twice; which one holds the data "
                "is ambiguous, so rename or drop one"
            )
        df = pd.read_csv(io.StringIO(text), dtype=str, keep_default_na=False, skipinitialspace=False)
        df.columns = [nfc(c) for c in df.columns]  # one-hot columns are class names, compared in NFC
        return df
    except OSError as e:
        raise TfpipeError(f"{csv_path}: cannot read the CSV ({e.strerror or e})") from None
    except (pd.errors.ParserError, pd.errors.EmptyDataError, UnicodeDecodeError) as e:
        raise TfpipeError(f"{csv_path}: cannot parse CSV ({str(e).splitlines()[0]})") from None


def _check_row_lengths(text: str, csv_path: str) -> list[str]:
    """The header; a row with more or fewer fields than it is an error naming the row. (pandas reads a first row
    with one field more as an index column, shifting every column; later rows it pads or refuses with a message
    about tokenizing.) Blank lines are skipped, as pandas does."""
    rows = csv.reader(io.StringIO(text))
    try:
        header = next(rows, [])
        for row in rows:
            if row and len(row) != len(header):
                raise TfpipeError(
                    f"{csv_path}: line {rows.line_num} has {len(row)} field{'s' * (len(row) != 1)} where the header "
                    f"has {len(header)} ({', '.join(map(repr, header[:4]))}{', ...' * (len(header) > 4)}); a stray or "
                    "missing comma, or a label with a comma not in quotes?"
                )
    except csv.Error as e:  # a carriage return inside a field not in quotes ("new-line character seen ...")
        what = "a line break inside a field that is not in quotes" if "new-line" in str(e) else str(e)
        raise TfpipeError(f"{csv_path}: line {rows.line_num}: {what}; put the field in quotes or remove it") from None
    return header


def _check_ids(ids: Sequence[str], image_col: str, csv_path: str) -> None:
    """Ids key the records and the submission: an empty or repeated id, or one reaching outside the images
    folder (``../``, an absolute path), is an error naming its rows. (Two spellings of one file are caught
    when ids are matched to files.)"""
    first: dict[str, int] = {}
    for row, name in enumerate(ids, start=1):
        present(name, f"{csv_path}: row {row}, column {image_col!r}", "id", "every row needs its image's id")
        if name in first:
            raise TfpipeError(
                f"{csv_path}: id {name!r} appears twice (rows {first[name]} and {row}); ids must be unique"
            )
        parts = name.replace("\\", "/").split("/")
        if name.startswith(("/", "\\")) or "://" in name or ".." in parts or (len(name) > 1 and name[1] == ":"):
            raise TfpipeError(
                f"{csv_path}: row {row}: id {name!r} in column {image_col!r} points outside the "
                "images folder; ids are file names (or sub-paths) inside --images"
            )
        first[name] = row


def _require_columns(df: pd.DataFrame, columns: Iterable[str], csv_path: str, setting: str) -> None:
    """Each of ``columns`` (named by the user's ``setting``) is in the CSV; else one line naming the setting to
    change and, for the image column, the one column that looks like an id when there is one."""
    missing = [c for c in columns if c not in df.columns]
    if missing:
        guesses = [c for c in df.columns if setting == "image_col" and ID_LIKE.search(c)]
        fix = option(setting, guesses[0]) if len(guesses) == 1 else option(setting)
        raise TfpipeError(f"{csv_path}: column {missing[0]!r} not found (columns: {', '.join(df.columns)}); set {fix}")


def _labels(df: pd.DataFrame, fmt: LabelFormat, csv_path: str) -> list[tuple[str, ...]]:
    if fmt.label_cols:
        return _one_hot_labels(df, fmt.label_cols, csv_path)
    if fmt.class_col is not None:
        return _class_labels(df, nfc(fmt.class_col), csv_path)
    check_separator(fmt)
    labels_col = nfc(fmt.labels_col)
    if labels_col not in df.columns:
        raise TfpipeError(
            f"{csv_path}: column {fmt.labels_col!r} not found (columns: {', '.join(df.columns)}); "
            f"name the labels with {option('labels_col')}, {option('label_cols')} or {option('class_col')}"
            f"{'' if in_command() else ' (LabelFormat)'}, or, for images without labels, pass "
            f"{option('unlabeled', True, python='Source(..., labeled=False)')}"
        )
    return [
        label_cell(cell, fmt.sep, row, labels_col, csv_path, spaces_in_names=fmt.spaces_in_names)
        for row, cell in enumerate(df[labels_col], start=1)
    ]


def _class_labels(df: pd.DataFrame, class_col: str, csv_path: str) -> list[tuple[str, ...]]:
    """One class per row (a class may hold spaces: the column holds one name, never a list)."""
    _require_columns(df, [class_col], csv_path, "class_col")
    out: list[tuple[str, ...]] = []
    for row, value in enumerate(df[class_col], start=1):
        where = f"{csv_path}: row {row}, column {class_col!r}"
        present(value.strip(ASCII_SPACE), where, "class", "single-label data needs one class per row")
        out.append((clean_label(value.strip(ASCII_SPACE), f"{where}: {value!r}"),))
    return out


def _one_hot_labels(df: pd.DataFrame, label_cols: Iterable[str], csv_path: str) -> list[tuple[str, ...]]:
    """Each named 0/1 column is a class; its name (in NFC, as the CSV header is read) is the label."""
    label_cols = [nfc(col) for col in label_cols]
    _require_columns(df, label_cols, csv_path, "label_cols")
    for col in label_cols:
        clean_label(col, f"{csv_path}: label column {col!r}")
    out: list[tuple[str, ...]] = []
    for row, values in enumerate(df[label_cols].itertuples(index=False), start=1):
        labels: list[str] = []
        for col, value in zip(label_cols, values):
            flag: float | None
            try:
                flag = float(value)
            except ValueError:
                flag = None
            if flag not in (0.0, 1.0):
                raise TfpipeError(f"{csv_path}: row {row}: column {col!r} holds {value!r}, expected 0 or 1")
            if flag == 1.0:
                labels.append(col)
        out.append(tuple(labels))
    return out


# Column names that usually hold an image's group: its patient, scene, video, ... (tfpipe.write warns of such a
# column left out of --group-col: folds by image would let validation over-promise)
GROUP_WORDS = frozenset(
    (
        "patient",
        "subject",
        "scene",
        "video",
        "site",
        "study",
        "case",
        "session",
        "individual",
        "group",
        "camera",
        "location",
        "series",
        "clip",
        "user",
        "animal",
        "plant",
        "specimen",
        "slide",
        "sequence",
    )
)


# Words after a group's name that make a column its id, not another thing about it: patient_id, StudyInstanceUID
ID_WORDS = frozenset(("id", "ids", "uid", "no", "num", "number", "name", "code", "key", "instance", "index", "idx"))


def reads_like_a_group(column: str) -> bool:
    """Whether a column's name says it holds a group: its last word, after id-like words (``patientId``,
    ``StudyInstanceUID``, ``Case Number``, ``scene_id``), is a group word or its plural; ``site_count`` or
    ``camera_model`` say something else about the group."""
    words = [w.casefold() for w in re.findall(r"[A-Z]+(?![a-z])|[A-Z]?[a-z]+", column)]
    while words and words[-1] in ID_WORDS:
        words.pop()
    last = words[-1] if words else ""
    glued = next((last[: -len(w)] for w in ID_WORDS if last.endswith(w) and last[: -len(w)] in GROUP_WORDS), None)
    if glued:  # patientid, caseno: one word
        last = glued
    if last == "group" and len(words) > 1:  # AgeGroup, BloodGroup: a covariate, not who the image belongs to
        return False
    return last in GROUP_WORDS or (last.endswith("s") and last[:-1] in GROUP_WORDS)


def group_like_columns(csv_path: str, used: Sequence[str], num_folds: int) -> list[tuple[str, int, int]]:
    """(column, distinct values, rows) of each column not in ``used`` whose name reads like a group and that
    ``--group-col`` would take for ``num_folds`` folds: no empty cell, at least ``num_folds`` values, and values
    that repeat (two rows a value or more, on average). A hint to pass ``--group-col``, never a refusal."""
    df = _read_table(csv_path)
    found = []
    for column in df.columns:
        if column in used or not reads_like_a_group(str(column)):
            continue
        values = df[column].str.strip()
        distinct = values.nunique()
        if not values.map(is_missing).any() and distinct >= max(num_folds, 2) and len(df) >= 2 * distinct:
            found.append((str(column), int(distinct), len(df)))
    return found
