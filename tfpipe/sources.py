"""Where images and labels come from: a Kaggle-style CSV or a folder per class.

Each source becomes a list of ``Item``s in input order plus the class names.
Everything here runs in the main process before any image is touched, so a
missing column, a missing file or an unknown label is reported before work
starts.

Labels are read one way only. Every label -- in a label list, a class column,
a one-hot column's name, a class folder's name or ``classes=`` / ``--classes``
-- is compared and stored in Unicode NFC, so ``café`` typed (NFC) or pasted
from a macOS file name (NFD) is one class. Whitespace around a label is
dropped; an invisible character left in it (zero-width space or joiner,
byte-order mark, no-break or other non-ASCII space, any other Unicode format or
control character) is an error naming row, column and the character. Two
spellings of one label -- case (``Cat``/``cat``), compatibility form
(``ｃａｔ``/``cat``, ``²``/``2``), a stray separator (``cat,``/``cat``) or one
number written two ways (``5``/``05``/``+5``/``5.0``; ASCII digits) -- are an
error naming both: merging them is the user's decision. With a separator that
is not whitespace (``--sep ,``), a label holding a space is refused unless
class names contain spaces (``--spaces-in-names`` / ``spaces_in_names``).
"""

from __future__ import annotations

import ast
import collections
import csv
import dataclasses
import decimal
import io
import posixpath
import re
import unicodedata
from collections.abc import Collection, Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Protocol, TypeAlias, overload, runtime_checkable

import pandas as pd

from tfpipe import fs
from tfpipe.errors import TfpipeError, in_command, option

IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png")  # tried, in order, for ids without extension
FOLDER_EXTENSIONS = (".jpg", ".jpeg", ".png", ".bmp", ".webp", ".tif", ".tiff", ".gif")


@dataclasses.dataclass(frozen=True)
class Item:
    """One image to write: its path, its id (stored as ``image_name``), label names and group (the patient, video
    or site it comes from: all of a group share one fold; None without groups)."""

    path: str
    name: str
    labels: tuple[str, ...] = ()
    data: bytes | None = dataclasses.field(default=None, repr=False)  # encoded image, when not from a file
    group: str | None = None


@dataclasses.dataclass(frozen=True)
class LabelFormat:
    """How labels are laid out in the CSV.

    Exactly one of: ``labels_col`` (a separated list per row, the default),
    ``label_cols`` (one-hot columns) or ``class_col`` (one class per row).
    ``spaces_in_names``: class names contain spaces (``golden retriever``), so a label
    list read with a separator that is not whitespace (``sep=","``) may hold them;
    without it such a label is refused, because lists separated by spaces read with
    ``sep=","`` look exactly like that. A class column, one-hot column names and class
    folder names are the user's own names and may always hold spaces.
    """

    labels_col: str = "labels"
    sep: str = " "
    label_cols: tuple[str, ...] = ()
    class_col: str | None = None
    spaces_in_names: bool = False

    @property
    def single_label(self) -> bool:
        return self.class_col is not None


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
    taken = {image_col: "ids", **dict.fromkeys(_label_columns(label_format) if labeled else (), "labels")}
    groups = _groups(df, group_col, csv_path, taken) if group_col is not None else [None] * len(ids)
    labels = _labels(df, label_format, csv_path) if labeled else [()] * len(ids)
    check_label_spellings(labels, csv_path)
    return [(i + 1, name, labels, group) for i, (name, labels, group) in enumerate(zip(ids, labels, groups))]


def _label_columns(fmt: LabelFormat) -> set[str]:
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
        if not cell.strip():
            raise TfpipeError(
                f"{where}: empty group; every image needs its group (give an image of no known group a name of its own)"
            )
        group = clean_label(cell.strip(), where, makes="a group")
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
        if not name:
            raise TfpipeError(f"{csv_path}: row {row}: empty id in column {image_col!r}")
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


STRAY = ",;|\t\n\r\v\f"  # separators that, left inside a label, would silently create a new class
INVISIBLE = frozenset({"Cf", "Cc", "Zs", "Zl", "Zp"})  # format (zero-width, BOM), control, spaces, line breaks
# Characters that draw nothing although their category says otherwise (Unicode's Default_Ignorable_Code_Point
# outside Cf, and blank letters): variation selectors, the combining grapheme joiner, Hangul fillers, the blank
# Braille pattern. ``circle`` + U+FE0F looks exactly like ``circle``.
BLANK_RANGES = (
    (0x034F, 0x034F),
    (0x115F, 0x1160),
    (0x17B4, 0x17B5),
    (0x180B, 0x180F),
    (0x2800, 0x2800),
    (0x3164, 0x3164),
    (0xFE00, 0xFE0F),
    (0xFFA0, 0xFFA0),
    (0xE0100, 0xE01EF),
)
ASCII_SPACE = " \t\n\r\v\f"  # what is stripped around a label; any other blank character is refused
ASCII_INTEGER = re.compile(r"[+-]?[0-9]+")  # labels sorted as numbers (str.isdigit also takes "²", "①")
ASCII_NUMBER = re.compile(r"[+-]?(?:[0-9]+\.?[0-9]*|\.[0-9]+)")  # "5", "05", "+5", "5.0": one number


@overload
def nfc(text: str) -> str: ...
@overload
def nfc(text: None) -> None: ...
def nfc(text: str | None) -> str | None:
    """``text`` in Unicode NFC (None stays None): how labels and column names are compared and stored."""
    return None if text is None else unicodedata.normalize("NFC", text)


def clean_label(label: str, where: str, makes: str = "a class") -> str:
    """A label (or group: ``makes`` "a group") as it is compared and stored: in NFC, with no invisible character
    (a Unicode format or control character, or a space other than the ASCII one) -- such a character is an
    error naming it and ``where``."""
    if label.isascii() and label.isprintable():  # the common case, without a look at each character
        return label
    for char in label:
        if char != " " and (
            unicodedata.category(char) in INVISIBLE or any(lo <= ord(char) <= hi for lo, hi in BLANK_RANGES)
        ):
            name = unicodedata.name(char, "a control character")
            raise TfpipeError(
                f"{where} holds U+{ord(char):04X} {name}, an invisible character that would make "
                f"{makes} of its own; remove it"
            )
    return nfc(label)


def check_label_spellings(labels: Iterable[Iterable[str]], csv_path: str) -> None:
    """Refuses label spellings that would silently become extra classes.

    Two labels that differ only in case ("Cat", "cat"), in Unicode compatibility
    form ("ｃａｔ", "cat"), by a stray separator glued to one ("cat," next to
    "cat"), or that are one number written two ways ("5", "05", "5.0"), are
    errors naming both spellings and their first rows: merging them is the
    user's decision.
    """
    first_row: dict[str, str] = {}
    for row, row_labels in enumerate(labels, start=1):
        for label in row_labels:
            first_row.setdefault(label, f"row {row}")
    refuse_twin_spellings(first_row, csv_path)


def refuse_twin_spellings(first_seen: Mapping[str, str], origin: str, what: str = "labels") -> None:
    """``first_seen``: label (or group: ``what``) -> where it is first seen ("row 3", "folder 'Cat'"); two
    spellings of one label are an error naming both, as ``check_label_spellings`` says."""
    by_key: dict[str | decimal.Decimal, list[str]] = {}
    for label in first_seen:
        by_key.setdefault(_spelling(label), []).append(label)
    for key, spellings in by_key.items():
        if len(spellings) > 1:
            a, b = spellings[:2]
            how = (
                "are one number written two ways"
                if isinstance(key, decimal.Decimal)
                else "differ only in case, Unicode compatibility form or a stray separator"
            )
            stray = not isinstance(key, decimal.Decimal) and what == "labels"
            hint = " (or set the separator: --sep / LabelFormat.sep)" if stray else ""
            raise TfpipeError(
                f"{origin}: {what} {a!r} ({first_seen[a]}) and {b!r} ({first_seen[b]}) {how}; make "
                f"them one spelling{hint}"
            )


def _spelling(label: str) -> str | decimal.Decimal:
    """What the spellings of one label share: NFKC (full-width letters, "²"), case-folded, stray separators off;
    a number written with ASCII digits is its value."""
    text = unicodedata.normalize("NFKC", label).strip(STRAY).casefold()
    return decimal.Decimal(text) if ASCII_NUMBER.fullmatch(text) else text


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


def check_separator(fmt: LabelFormat) -> None:
    """An empty separator (an unset variable: ``--sep "$SEP"``) would split on every kind of blank, and
    ``spaces_in_names`` means nothing when the separator itself is a space."""
    if not fmt.sep:
        raise TfpipeError(
            f"{option('sep')} is empty (an unset variable?); give the separator, e.g. {option('sep', ',')}"
        )
    if fmt.spaces_in_names and fmt.sep != LIST_SEP and fmt.sep.isspace():
        raise TfpipeError(
            f"{option('spaces_in_names', True)} needs a separator that is not a space (with "
            f"{option('sep', fmt.sep)} 'golden retriever' is two labels); set {option('sep')}"
        )


def _class_labels(df: pd.DataFrame, class_col: str, csv_path: str) -> list[tuple[str, ...]]:
    """One class per row (a class may hold spaces: the column holds one name, never a list)."""
    _require_columns(df, [class_col], csv_path, "class_col")
    out: list[tuple[str, ...]] = []
    for row, value in enumerate(df[class_col], start=1):
        if not value.strip(ASCII_SPACE) or value.strip(ASCII_SPACE) in MISSING:
            raise TfpipeError(
                f"{csv_path}: row {row}: no class in column {class_col!r} ({value!r}); "
                "single-label data needs one class per row"
            )
        out.append((clean_label(value.strip(ASCII_SPACE), f"{csv_path}: row {row}, column {class_col!r}: {value!r}"),))
    return out


LIST_SEP = "list"  # LabelFormat.sep / --sep for cells holding Python lists: ['cat', 'dog']
MISSING = frozenset({"nan", "NaN", "NAN", "<NA>", "None", "null", "NULL", "N/A", "n/a", "#N/A"})  # pandas' "missing"


def label_cell(
    cell: str, sep: str, row: int, column: str, csv_path: str, *, spaces_in_names: bool = False
) -> tuple[str, ...]:
    """One cell of a separated label list -> label names in NFC (whitespace around labels and empty items
    dropped, a repeated label counted once). What cannot be read one way only is an error naming row, column and
    value: a separator other than ``sep`` glued to a label (``"cat, dog"`` with ``sep=" "``), a Python list
    without ``sep="list"``, a missing-value spelling (``nan``, ``None``) standing in for "no labels", an
    invisible character (``clean_label``), or -- with a separator that is not whitespace and without
    ``spaces_in_names`` -- a label holding a space (``"circle cross"`` with ``sep=","``: lists separated by
    spaces, read with the wrong separator)."""
    where = f"{csv_path}: row {row}, column {column!r}: {cell!r}"
    text = cell.strip()
    labels: Sequence[str]
    if sep == LIST_SEP:
        labels = _python_list(text, where)
    elif text.startswith("[") and text.endswith("]"):
        raise TfpipeError(f"{where} is a Python list; read such cells with {option('sep', LIST_SEP)}")
    else:
        labels = [t.strip(ASCII_SPACE) for t in cell.split(sep)]
    labels = tuple(dict.fromkeys(t for t in labels if t))
    no_spaces = not spaces_in_names and sep not in (LIST_SEP, "", None) and not sep.isspace()
    cleaned: list[str] = []
    for label in labels:
        stray = [c for c in STRAY if c in label and c != sep]
        if stray and sep != LIST_SEP:
            raise TfpipeError(
                f"{where} holds {stray[0]!r} but the separator is {sep!r}; set the separator "
                f"({option('sep', stray[0])}) or remove the {stray[0]!r}"
            )
        if label in MISSING:
            raise TfpipeError(
                f"{where} holds {label!r}, a missing-value spelling, not a label; leave the cell "
                "empty for an image without labels"
            )
        cleaned.append(clean_label(label, where))
        if no_spaces and " " in label:
            raise TfpipeError(
                f"{where} holds {label!r}, a label with a space, but the separator is {sep!r}; if "
                f"class names contain spaces say so ({option('spaces_in_names', True)}), else set "
                f"the separator ({option('sep', ' ')})"
            )
    return tuple(dict.fromkeys(cleaned))  # NFC can make two spellings in one cell one label


def _python_list(text: str, where: str) -> list[str]:
    """A cell like ``['cat', 'dog']`` (what pandas writes for a list column) -> its strings; ``[]`` or empty: none."""
    if not text:
        return []
    try:
        value = ast.literal_eval(text)
    except (ValueError, SyntaxError):
        value = None
    if not isinstance(value, (list, tuple)) or not all(isinstance(v, (str, int)) for v in value):
        raise TfpipeError(f"{where} is not a Python list of labels (expected e.g. ['cat', 'dog'] or [])")
    return [str(v).strip() for v in value]


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


@runtime_checkable
class SourceProtocol(Protocol):
    """What ``write_shards`` reads from a source; ``Source`` and ``TfdsSource`` are the two that tfpipe has.

    A source of your own (a database, another dataset library) works when it has these members.
    """

    @property
    def labeled(self) -> bool:
        """False: the records carry no ``target`` (on the command line ``--unlabeled``)."""

    @property
    def classes(self) -> Sequence[str] | None:
        """The source's own class order, or None for sorted labels (or the caller's ``classes=``)."""

    @property
    def single_label(self) -> bool:
        """One class per image by construction (a class column, a TFDS ``ClassLabel``)."""

    @property
    def id_column(self) -> str:
        """The name of the id column a submission is keyed by (stored in the manifest)."""

    @property
    def label_format(self) -> LabelFormat | None:
        """How a CSV lays out its labels (recorded in the manifest), None for other sources."""

    @property
    def origin(self) -> str:
        """What error messages name: the CSV, the images folder, the dataset."""

    def items(self, skip_bad: bool = False) -> tuple[list[Item], list[dict[str, str]]]:
        """(items in input order, skipped images with their reasons)."""
        ...


@dataclasses.dataclass(frozen=True)
class Source:
    """Images with a Kaggle-style CSV, or (``csv=None``) a folder per class -- or, unlabeled, a flat folder.

    Satisfies ``SourceProtocol`` (as ``TfdsSource`` does); ``tfpipe.open_source`` makes either from the
    command line's words.
    """

    images: str
    csv: str | None = None
    image_col: str = "image"
    label_format: LabelFormat = LabelFormat()
    labeled: bool = True
    group_col: str | None = None  # the CSV column of each image's group: folds keep a group together
    classes = None  # the class order comes from the labels (or the caller's classes=)

    @property
    def single_label(self) -> bool:
        return self.label_format.single_label

    @property
    def id_column(self) -> str:
        """The CSV column of the ids (a submission's key); a folder's ids are ``CLASS/file`` in ``image``."""
        return self.image_col if self.csv else "image"

    @property
    def origin(self) -> str:
        return self.csv or self.images

    def items(self, skip_bad: bool = False) -> tuple[list[Item], list[dict[str, str]]]:
        """(items in input order, skipped); missing images are errors unless ``skip_bad``."""
        return collect_items(self, skip_bad)


def collect_items(source: Source, skip_bad: bool) -> tuple[list[Item], list[dict[str, str]]]:
    """Returns (items, skipped) for a ``Source``; missing images are errors unless skipped."""
    if source.csv is None:
        if source.group_col is not None:
            raise TfpipeError(f"{option('group_col')} names a CSV column, and images in a folder per class have no CSV")
        if source.labeled:
            return read_folder_tree(source.images), []
        if not fs.isdir(source.images):
            raise _no_images_folder(source.images)
        # Every entry but a folder: a FIFO, device or broken link is then named when it is read, not left out.
        rows: list[Row] = [
            (i + 1, f, (), None)
            for i, f in enumerate(sorted(fs.listdir(source.images)))
            if not f.startswith(".") and not fs.isdir(fs.join(source.images, f))
        ]
        for _, f, _, _ in rows:
            check_utf8(f, source.images)
        csv_name = source.images
    else:
        rows = read_csv(
            source.csv,
            image_col=source.image_col,
            label_format=source.label_format,
            labeled=source.labeled,
            group_col=source.group_col,
        )
        csv_name = source.csv
    items, missing = resolve_images(rows, source.images, csv_name)
    if missing and not skip_bad:
        row, name = missing[0]
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise TfpipeError(f"{csv_name}: row {row}: image {name!r} not found in {source.images}{more}")
    skipped = [{"image": name, "reason": "file not found"} for _, name in missing]
    if not items:
        raise TfpipeError(f"{csv_name}: no images to write")
    return items, skipped


def _no_images_folder(path: str) -> TfpipeError:
    """What to say of an images folder that is not one: missing, or a file standing there."""
    if fs.exists(path):
        return TfpipeError(f"{path} is a file; {option('images')} names the folder that holds the images")
    return TfpipeError(f"{path}: images folder not found")


def resolve_images(rows: Iterable[Row], images_dir: str, csv_path: str) -> tuple[list[Item], list[tuple[int, str]]]:
    """Maps each CSV id to a file in ``images_dir``.

    An id may be a relative file name or a name without extension, in which
    case .jpg, .jpeg and .png (and their upper-case forms) are tried. The folder
    is listed once, so this is fast for large datasets. An id matching two
    files (``x`` with ``x.jpg`` and ``x.png``), and two ids reaching one file
    (``x`` and ``x.jpg``, ``a/../x.jpg``), are errors naming both: either would
    silently pick one image or label one image twice.

    Returns:
      (items, missing): ``Item``s for the rows found, and (row, id) of those not found.
    """
    if not fs.isdir(images_dir):
        raise _no_images_folder(images_dir)
    listing = set(fs.listdir(images_dir))
    items: list[Item] = []
    missing: list[tuple[int, str]] = []
    row_of_file: dict[str, tuple[int, str]] = {}
    for row, name, labels, group in rows:
        found = _find_images(name, images_dir, listing)
        if len(found) > 1:
            raise TfpipeError(
                f"{csv_path}: row {row}: id {name!r} matches {found[0]!r} and {found[1]!r}; "
                "name the file with its extension"
            )
        if not found:
            missing.append((row, name))
            continue
        key = posixpath.normpath(found[0])
        if key in row_of_file:
            first_row, first_name = row_of_file[key]
            raise TfpipeError(
                f"{csv_path}: rows {first_row} and {row} ({first_name!r} and {name!r}) are both "
                f"{found[0]}; one image would be written twice with different labels"
            )
        row_of_file[key] = (row, name)
        items.append(Item(fs.join(images_dir, found[0]), name, labels, group=group))
    return items, missing


def _find_images(name: str, images_dir: str, listing: Collection[str]) -> list[str]:
    """The files (relative to ``images_dir``) an id names: itself if it is a file, else the id plus each known
    extension that exists. More than one is ambiguous."""
    candidates = [name] + [name + ext for ext in IMAGE_EXTENSIONS + tuple(e.upper() for e in IMAGE_EXTENSIONS)]
    found: list[str] = []
    for candidate in candidates:
        if candidate in listing or ("/" in candidate and _is_entry(fs.join(images_dir, candidate))):  # sub-folders
            if candidate == name:
                return [candidate]
            found.append(candidate)
    return found


def _is_entry(path: str) -> bool:
    """Anything but a folder (a FIFO or device is named when it is read, instead of reported missing)."""
    return fs.exists(path) and not fs.isdir(path)


def read_folder_tree(root: str) -> list[Item]:
    """Reads a folder-per-class tree: ``root/CLASS/*.jpg``; ids are ``CLASS/file``.

    A folder's name is its class, spaces included (the user's own name, not a list); like every label it is
    compared in NFC and may hold no invisible character, and two folders spelling one label two ways (``Cat``
    and ``cat``, ``5`` and ``05``) are an error naming both.
    """
    if not fs.isdir(root):
        raise _no_images_folder(root)
    items: list[Item] = []
    first_seen: dict[str, str] = {}
    for cls in sorted(d for d in fs.listdir(root) if not d.startswith(".") and fs.isdir(fs.join(root, d))):
        check_utf8(cls, root)
        label = clean_label(cls, f"{root}: class folder {cls!r}")
        first_seen.setdefault(label, f"folder {cls!r}")
        found = [f for f in sorted(fs.listdir(fs.join(root, cls))) if f.lower().endswith(FOLDER_EXTENSIONS)]
        for f in found:
            check_utf8(f, fs.join(root, cls))
        if not found:
            raise TfpipeError(
                f"{fs.join(root, cls)}: class folder holds no images "
                f"({', '.join(FOLDER_EXTENSIONS)}); remove it or add its images"
            )
        items += [Item(fs.join(root, cls, f), f"{cls}/{f}", (label,)) for f in found]
    if not items:
        raise TfpipeError(f"{root}: no class folders with images found (expected {root}/CLASS/*.jpg)")
    refuse_twin_spellings(first_seen, root)
    return items


def check_utf8(name: str, folder: str) -> None:
    """A file name becomes an id (UTF-8 text in every record and the submission); one that is not valid UTF-8
    (``os.listdir`` gives it with surrogates) is an error naming it."""
    try:
        name.encode("utf-8")
    except UnicodeEncodeError:
        shown = name.encode("utf-8", "surrogateescape")
        raise TfpipeError(
            f"{folder}: file name {shown!r} is not valid UTF-8; ids are stored as UTF-8 text, so "
            "rename it (e.g. convmv -f latin1 -t utf-8)"
        ) from None


def class_names(items: Sequence[Item], classes: Sequence[str] | None = None) -> list[str]:
    """The class list: ``classes`` if given (checked, in NFC like every label), else sorted unique labels.

    Labels that are all integers written with ASCII digits sort numerically, so
    class "10" has index 10 when the labels are 0..N ("²" or "①" are names).
    """
    seen = dict.fromkeys(nfc(label) for item in items for label in item.labels)
    if classes is None:
        names = list(seen)
        numeric = all(ASCII_INTEGER.fullmatch(n) for n in names)
        return sorted(names, key=int) if numeric and names else sorted(names)
    classes = [clean_label(name, f"{option('classes')}: {name!r}") for name in classes]
    if len(set(classes)) != len(classes):
        raise TfpipeError(f"{option('classes')} lists a class twice: {', '.join(classes)}")
    known = set(classes)
    for item in items:
        for label in item.labels:
            if nfc(label) not in known:
                raise TfpipeError(f"unknown label {label!r} for image {item.name!r} (not in {option('classes')})")
    return classes


def targets(items: Iterable[Item], classes: Sequence[str]) -> list[list[int]]:
    """Sorted class indices for every item (labels compared in NFC, as ``class_names`` stores them)."""
    index = {name: i for i, name in enumerate(classes)}
    return [sorted(index[nfc(label)] for label in item.labels) for item in items]


if TYPE_CHECKING:  # the type checker proves that Source has every member write_shards reads
    _source: type[SourceProtocol] = Source
