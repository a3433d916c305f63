"""Where images and labels come from: a Kaggle-style CSV or a folder per class.

Each source becomes a list of ``Item``s in input order plus the class names.
Everything here runs in the main process before any image is touched, so a
missing column, a missing file or an unknown label is reported before work
starts.
"""
import dataclasses

import pandas as pd

from tfpipe import fs
from tfpipe.errors import TfpipeError, option

IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png")  # tried, in order, for ids without extension
FOLDER_EXTENSIONS = (".jpg", ".jpeg", ".png", ".bmp", ".webp", ".tif", ".tiff", ".gif")


@dataclasses.dataclass(frozen=True)
class Item:
    """One image to write: its path, its id (stored as ``image_name``) and label names."""

    path: str
    name: str
    labels: tuple = ()
    data: bytes | None = dataclasses.field(default=None, repr=False)  # encoded image, when not from a file


@dataclasses.dataclass(frozen=True)
class LabelFormat:
    """How labels are laid out in the CSV.

    Exactly one of: ``labels_col`` (a separated list per row, the default),
    ``label_cols`` (one-hot columns) or ``class_col`` (one class per row).
    """

    labels_col: str = "labels"
    sep: str = " "
    label_cols: tuple = ()
    class_col: str | None = None

    @property
    def single_label(self):
        return self.class_col is not None


def read_csv(csv_path, *, image_col="image", label_format=LabelFormat(), labeled=True):
    """Reads a CSV into (row number, image id, label names) triples.

    Args:
      csv_path: the CSV file.
      image_col: column holding the image file name or id.
      label_format: a ``LabelFormat``.
      labeled: False for unlabeled (test) data: label columns are not read.

    Returns:
      A list of (row, id, tuple of label names); ``row`` counts data rows from 1.
    """
    try:
        if not fs.exists(csv_path):
            raise FileNotFoundError(csv_path)
        with fs.open(csv_path, "r") as f:
            df = pd.read_csv(f, dtype=str, keep_default_na=False, skipinitialspace=False)
    except FileNotFoundError:
        raise TfpipeError(f"{csv_path}: CSV file not found") from None
    except (pd.errors.ParserError, pd.errors.EmptyDataError, UnicodeDecodeError) as e:
        raise TfpipeError(f"{csv_path}: cannot parse CSV ({str(e).splitlines()[0]})") from None
    _require_columns(df, [image_col], csv_path)
    ids = [v.strip() for v in df[image_col]]
    _check_ids(ids, image_col, csv_path)
    if not labeled:
        return [(i + 1, name, ()) for i, name in enumerate(ids)]
    labels = _labels(df, label_format, csv_path)
    check_label_spellings(labels, csv_path)
    return [(i + 1, name, labels) for i, (name, labels) in enumerate(zip(ids, labels))]


def _check_ids(ids, image_col, csv_path):
    """Ids key the records and the submission: an empty or repeated id is an error naming its rows."""
    first = {}
    for row, name in enumerate(ids, start=1):
        if not name:
            raise TfpipeError(f"{csv_path}: row {row}: empty id in column {image_col!r}")
        if name in first:
            raise TfpipeError(f"{csv_path}: id {name!r} appears twice (rows {first[name]} and {row}); "
                              "ids must be unique")
        first[name] = row


STRAY = ",;|"  # separators that, left inside a label, would silently create a new class


def check_label_spellings(labels, csv_path):
    """Refuses label spellings that would silently become extra classes.

    Two labels that differ only in case ("Cat", "cat"), or a label with a stray
    separator glued to it ("cat," next to "cat"), are errors naming both
    spellings and their first rows: merging them is the user's decision.
    """
    first_row = {}
    for row, row_labels in enumerate(labels, start=1):
        for label in row_labels:
            first_row.setdefault(label, row)
    by_key = {}
    for label in first_row:
        by_key.setdefault(label.strip(STRAY).casefold(), []).append(label)
    for spellings in by_key.values():
        if len(spellings) > 1:
            a, b = spellings[:2]
            raise TfpipeError(f"{csv_path}: labels {a!r} (row {first_row[a]}) and {b!r} (row {first_row[b]}) differ "
                              "only in case or a stray separator; make them one spelling (or set the separator: --sep / LabelFormat.sep)")


def _require_columns(df, columns, csv_path):
    missing = [c for c in columns if c not in df.columns]
    if missing:
        raise TfpipeError(f"{csv_path}: column {missing[0]!r} not found (columns: {', '.join(df.columns)})")


def _labels(df, fmt, csv_path):
    if fmt.label_cols:
        return _one_hot_labels(df, fmt.label_cols, csv_path)
    if fmt.class_col is not None:
        _require_columns(df, [fmt.class_col], csv_path)
        out = []
        for row, value in enumerate(df[fmt.class_col], start=1):
            if not value.strip():
                raise TfpipeError(f"{csv_path}: row {row}: empty class in column {fmt.class_col!r}")
            out.append((value.strip(),))
        return out
    if fmt.labels_col not in df.columns:
        raise TfpipeError(f"{csv_path}: column {fmt.labels_col!r} not found (columns: {', '.join(df.columns)}); "
                          "name the labels with --labels-col, --label-cols or --class-col (LabelFormat in Python)")
    sep = fmt.sep or None
    # Whitespace around labels and empty items (doubled or trailing separators) are dropped; a repeated
    # label counts once.
    return [tuple(dict.fromkeys(t.strip() for t in cell.split(sep) if t.strip())) for cell in df[fmt.labels_col]]


def _one_hot_labels(df, label_cols, csv_path):
    _require_columns(df, label_cols, csv_path)
    out = []
    for row, values in enumerate(df[list(label_cols)].itertuples(index=False), start=1):
        labels = []
        for col, value in zip(label_cols, values):
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


@dataclasses.dataclass(frozen=True)
class Source:
    """Images with a Kaggle-style CSV, or (``csv=None``) a folder per class -- or, unlabeled, a flat folder.

    Every writer source has this small protocol (``TfdsSource`` too): ``items(skip_bad)``, ``classes``
    (the source's own class order, or None for sorted labels), ``single_label``, ``id_column`` and
    ``labeled`` (False: the records carry no ``target``; a property of the source, on the command line
    ``--unlabeled``).
    """

    images: str
    csv: str | None = None
    image_col: str = "image"
    label_format: LabelFormat = LabelFormat()
    labeled: bool = True
    classes = None  # the class order comes from the labels (or the caller's classes=)

    @property
    def single_label(self):
        return self.label_format.single_label

    @property
    def id_column(self):
        """The CSV column of the ids (a submission's key); a folder's ids are ``CLASS/file`` in ``image``."""
        return self.image_col if self.csv else "image"

    def items(self, skip_bad=False):
        """(items in input order, skipped); missing images are errors unless ``skip_bad``."""
        return collect_items(self, skip_bad)


def collect_items(source, skip_bad):
    """Returns (items, skipped) for a ``Source``; missing images are errors unless skipped."""
    if source.csv is None:
        if source.labeled:
            return read_folder_tree(source.images), []
        if not fs.isdir(source.images):
            raise TfpipeError(f"{source.images}: images folder not found")
        rows = [(i + 1, f, ()) for i, f in enumerate(sorted(fs.listdir(source.images)))
                if not f.startswith(".") and fs.isfile(fs.join(source.images, f))]
        csv_name = source.images
    else:
        rows = read_csv(source.csv, image_col=source.image_col, label_format=source.label_format,
                        labeled=source.labeled)
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


def resolve_images(rows, images_dir, csv_path):
    """Maps each CSV id to a file in ``images_dir``.

    An id may be a relative file name or a name without extension, in which
    case .jpg, .jpeg and .png are tried. The folder is listed once, so this is
    fast for large datasets.

    Returns:
      (items, missing): ``Item``s for the rows found, and (row, id) of those not found.
    """
    if not fs.isdir(images_dir):
        raise TfpipeError(f"{images_dir}: images folder not found")
    listing = set(fs.listdir(images_dir))
    items, missing = [], []
    for row, name, labels in rows:
        path = _find_image(name, images_dir, listing)
        if path is None:
            missing.append((row, name))
        else:
            items.append(Item(path, name, labels))
    return items, missing


def _find_image(name, images_dir, listing):
    candidates = [name] + [name + ext for ext in IMAGE_EXTENSIONS + tuple(e.upper() for e in IMAGE_EXTENSIONS)]
    for candidate in candidates:
        path = fs.join(images_dir, candidate)
        if candidate in listing or ("/" in candidate and fs.isfile(path)):  # ids may hold a sub-folder
            return path
    return None


def read_folder_tree(root):
    """Reads a folder-per-class tree: ``root/CLASS/*.jpg``; ids are ``CLASS/file``."""
    if not fs.isdir(root):
        raise TfpipeError(f"{root}: images folder not found")
    items = []
    for cls in sorted(d for d in fs.listdir(root) if not d.startswith(".") and fs.isdir(fs.join(root, d))):
        found = [f for f in sorted(fs.listdir(fs.join(root, cls))) if f.lower().endswith(FOLDER_EXTENSIONS)]
        if not found:
            raise TfpipeError(f"{fs.join(root, cls)}: class folder holds no images "
                              f"({', '.join(FOLDER_EXTENSIONS)}); remove it or add its images")
        items += [Item(fs.join(root, cls, f), f"{cls}/{f}", (cls,)) for f in found]
    if not items:
        raise TfpipeError(f"{root}: no class folders with images found (expected {root}/CLASS/*.jpg)")
    return items


def class_names(items, classes=None):
    """The class list: ``classes`` if given (checked), else sorted unique labels.

    Labels that are all integers sort numerically, so class "10" has index 10
    when the labels are 0..N.
    """
    seen = dict.fromkeys(label for item in items for label in item.labels)
    if classes is None:
        names = list(seen)
        numeric = all(n.lstrip("-").isdigit() for n in names)
        return sorted(names, key=int) if numeric and names else sorted(names)
    if len(set(classes)) != len(classes):
        raise TfpipeError(f"{option('classes')} lists a class twice: {', '.join(classes)}")
    known = set(classes)
    for item in items:
        for label in item.labels:
            if label not in known:
                raise TfpipeError(f"unknown label {label!r} for image {item.name!r} (not in {option('classes')})")
    return list(classes)


def targets(items, classes):
    """Sorted class indices for every item."""
    index = {name: i for i, name in enumerate(classes)}
    return [sorted(index[label] for label in item.labels) for item in items]
