"""Where images and labels come from: a Kaggle-style CSV or a folder per class.

Each source becomes a list of ``Item``s in input order plus the class names.
Everything here runs in the main process before any image is touched, so a
missing column, a missing file or an unknown label is reported before work
starts.

The rules every label is read by are ``tfpipe.sources.labels``'s; a CSV's layouts are read in ``tfpipe.sources.csv``.
"""

from __future__ import annotations

import dataclasses
import posixpath
from collections.abc import Collection, Iterable, Sequence
from typing import TYPE_CHECKING, Protocol, runtime_checkable

from tfpipe.runtime import fs
from tfpipe.runtime.errors import TfpipeError, option
from tfpipe.sources.csv import Row, read_csv
from tfpipe.sources.labels import ASCII_INTEGER, clean_label, nfc, refuse_twin_spellings
from tfpipe.sources.labels import LabelFormat as LabelFormat  # also importable as tfpipe.sources.source.LabelFormat

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
