"""How labels are spelled, one way for every source.

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
import dataclasses
import decimal
import re
import unicodedata
from collections.abc import Iterable, Mapping, Sequence
from typing import overload

from tfpipe.runtime.errors import TfpipeError, option


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
    error naming it and ``where``; so is a missing-value spelling (``is_missing``: a class or group named ``None``
    or ``NA`` reads back as an empty cell in the CSVs tfpipe writes, e.g. ``oof.csv``), wherever it comes from (a
    CSV, a class folder, ``--classes``)."""
    if is_missing(label):
        raise TfpipeError(
            f"{where}: {label.strip()!r} is a missing-value spelling, not {makes} (CSV tools read it as an empty "
            "cell); rename it"
        )
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


LIST_SEP = "list"  # LabelFormat.sep / --sep for cells holding Python lists: ['cat', 'dog']
# What pandas reads as a missing value by default (``pandas.read_csv``'s ``na_values``), and "None" (what Python
# writes for one), in any case: a cell spelt so is an empty cell some tool wrote out, never an id, group or label.
MISSING = frozenset(
    s.casefold()
    for s in ("#N/A", "#N/A N/A", "#NA", "-1.#IND", "-1.#QNAN", "-NaN", "-nan", "1.#IND", "1.#QNAN", "<NA>", "N/A",
              "NA", "NULL", "NaN", "None", "n/a", "nan", "null")
)  # fmt: skip


def is_missing(value: str) -> bool:
    """Whether ``value`` (whitespace around it off) is a missing-value spelling (``MISSING``, any case)."""
    return value.strip().casefold() in MISSING


def present(cell: str, where: str, what: str, fix: str) -> str:
    """The one missing-value rule of every CSV column read (ids, groups, classes; a label list's items use
    ``MISSING`` in ``label_cell``): ``cell`` without the whitespace around it, or one line naming ``where`` (the
    file, row and column) when it is empty or a missing-value spelling (``nan``: what pandas writes for an empty
    cell after ``astype(str)``), which would otherwise be read as one real ``what`` shared by every such row."""
    value = cell.strip()
    if not value:
        raise TfpipeError(f"{where}: empty {what}; {fix}")
    if is_missing(value):
        article = "an" if what[0] in "aeiou" else "a"
        raise TfpipeError(f"{where}: {value!r} is a missing-value spelling, not {article} {what}; {fix}")
    return value


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
        if is_missing(label):
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
