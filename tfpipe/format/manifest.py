"""``manifest.json``: what a shard folder holds, as one typed, versioned, validated object.

``tfpipe.write`` builds a ``Manifest`` and saves it; every reader loads it back through ``Manifest.load``, which
checks everything before anything is used: the manifest version, each field's type and range, file names
confined to the folder, counts that add up, classes that are unique non-empty strings, image settings from the
known set, and the ``dataset_id`` against the content (an edited manifest no longer matches its id). A manifest
that fails is one ``TfpipeError`` naming the file and the field. Nothing outside this module reads a manifest by
key.

``dataset_id`` names one written dataset: a hash of the manifest's own content (inputs' fingerprint, classes,
shards with their byte sizes, ...), so a byte-identical rewrite keeps its id and any other write gets a new one.
A run records the id of the shards it trained on; a job reading a folder notices when it was rewritten.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import posixpath
import re
from typing import Any

from tfpipe.format.names import SHARD_NAMES
from tfpipe.runtime import fs
from tfpipe.runtime.errors import BadFile, TfpipeError

MANIFEST = "manifest.json"
STAGING = ".staging"
PROGRESS = "progress.json"  # finished staged shards, for --resume
# 1: no version field, no dataset_id; 2: dataset_id, label counts, version field.
MANIFEST_VERSION = 2
FITS = ("stretch", "crop", "pad")
FORMATS = ("jpeg", "png")
SPLIT_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]*")
LABEL_COLUMN = "labels"  # a submission's labels column when the training CSV named none (one-hot columns, folders)


@dataclasses.dataclass(frozen=True)
class ShardEntry:
    """One shard file of the folder: its name (no folder part), records, fold (None without folds), bytes."""

    file: str
    count: int
    fold: int | None = None
    bytes: int | None = None


@dataclasses.dataclass(frozen=True)
class StoredImages:
    """How the stored images were made (``ImageSpec`` as written): ``image_size`` None keeps source sizes."""

    image_size: int | None = None
    fit: str = "stretch"
    format: str = "jpeg"
    quality: int = 95
    max_pixels: int | None = None
    max_bytes: int | None = None

    @property
    def effective_fit(self) -> str:
        """How a non-square source reached the model's square input: the writer's ``fit`` when it resized,
        else the reader's resize, which stretches."""
        return self.fit if self.image_size else "stretch"


@dataclasses.dataclass(frozen=True)
class Manifest:
    """A shard folder's ``manifest.json``. Build one with the fields; read one with ``Manifest.load(folder)``."""

    split: str
    classes: tuple[str, ...]
    shards: tuple[ShardEntry, ...]
    labeled: bool = True
    single_label: bool = False
    max_labels: int | None = None  # most labels on one image (None: not recorded, as in version-1 manifests)
    id_column: str = "image"
    image: StoredImages = StoredImages()
    num_folds: int | None = None  # K; its name on disk, the JSON key, is "folds" (docs/glossary.md)
    group_column: str | None = None  # folds keep each group of this CSV column together (written only when set)
    seed: int = 0
    fingerprint: str | None = None  # the job (inputs, labels, plan, settings): --resume's identity
    skipped: tuple[dict, ...] = ()
    label_format: dict | None = None
    schema: dict | None = None
    tfpipe_version: str = ""
    dataset_id: str = ""  # filled in by ``with_id`` / ``load``
    version: int = MANIFEST_VERSION

    @property
    def num_classes(self) -> int:
        return len(self.classes)

    @property
    def num_examples(self) -> int:
        return sum(s.count for s in self.shards)

    @property
    def files(self) -> tuple[str, ...]:
        return tuple(s.file for s in self.shards)

    @property
    def label_column(self) -> str:
        """The training CSV's label column, whose name a submission's labels column takes: the class column
        (``--class-col``) or the label lists' (``--labels-col``); ``labels`` for one-hot columns, a folder per
        class, TFDS, and manifests that recorded no layout (``label_format``, validated on ``load``)."""
        fmt = self.label_format or {}
        if fmt.get("class_col"):
            return str(fmt["class_col"])
        return LABEL_COLUMN if fmt.get("label_cols") else str(fmt.get("labels_col") or LABEL_COLUMN)

    @property
    def one_label_each(self) -> bool:
        """Whether every record holds at most one label, so one-hot or class-id targets lose nothing."""
        return self.single_label or (self.max_labels is not None and self.max_labels <= 1)

    def __repr__(self) -> str:
        """One line (a notebook cell ending in ``write_shards(...)`` shows this, not ~80 lines of fields); every
        field is still an attribute, and ``to_dict()`` gives them all."""
        folds = f", {self.num_folds} folds" if self.num_folds else ""
        folds += f" by group {self.group_column!r}" if self.group_column else ""
        labels = f"{self.num_classes} classes" if self.labeled else "unlabeled"
        size = f"{self.image.image_size} px" if self.image.image_size else "original size"
        skipped = f", {len(self.skipped)} skipped" if self.skipped else ""
        return (
            f"Manifest(split={self.split!r}: {self.num_examples} records in {len(self.shards)} shards{folds}, "
            f"{labels}, {size} {self.image.format}{skipped}, dataset_id={self.dataset_id!r})"
        )

    def to_dict(self) -> dict[str, Any]:
        """The JSON form (``num_classes`` and ``num_examples`` included for people and other tools)."""
        d = {("folds" if k == "num_folds" else k): v for k, v in dataclasses.asdict(self).items()}
        if self.group_column is None:
            del d["group_column"]  # no key without groups: their JSON and dataset id stay those of manifests lacking it
        d.update(
            num_classes=self.num_classes,
            num_examples=self.num_examples,
            classes=list(self.classes),
            shards=[dataclasses.asdict(s) for s in self.shards],
            skipped=list(self.skipped),
        )
        return d

    def with_id(self) -> Manifest:
        """This manifest with ``dataset_id`` set from its content."""
        return dataclasses.replace(self, dataset_id=content_id(self.to_dict()))

    def save(self, folder: str) -> None:
        """Writes ``folder/manifest.json`` through a temporary name, so it is never half-written."""
        text = json.dumps(self.with_id().to_dict(), indent=1, ensure_ascii=False) + "\n"
        fs.write_atomic(posixpath.join(folder, MANIFEST), text)

    @classmethod
    def load(cls, folder: str) -> Manifest:
        """Reads and validates ``folder/manifest.json``; any problem is one ``TfpipeError`` naming the field."""
        path = posixpath.join(folder, MANIFEST)
        if not fs.exists(path):
            raise _missing(folder)
        return from_dict(fs.read_json(path, "manifest"), path)

    def __getitem__(self, key: str) -> Any:
        """A Manifest is not a dict: a dict read is a TypeError naming the attribute to use instead."""
        raise TypeError(f"manifest[{key!r}] was removed in tfpipe 1.0 (a Manifest is not a dict): use manifest.{key}")


def content_id(data: dict) -> str:
    """The dataset id of a manifest's JSON form: a hash of everything in it except the id itself."""
    rest = {k: v for k, v in data.items() if k != "dataset_id"}
    return hashlib.sha256(json.dumps(rest, sort_keys=True, ensure_ascii=False).encode()).hexdigest()[:16]


# the files that mark a run folder (train.fit's, a PyTorch recipe's) or a CV folder (train.cv's)
RUN_MARKS = ("cv.json", "config.json")


def _missing(folder: str) -> TfpipeError:
    if fs.exists(posixpath.join(folder, STAGING, PROGRESS)):
        return TfpipeError(
            f"{folder}: no {MANIFEST}: its write was interrupted; finish it with python -m tfpipe.write ... --resume"
        )
    if not fs.exists(folder):
        return TfpipeError(f"{folder}: folder not found")
    run = next((n for n in RUN_MARKS if fs.exists(posixpath.join(folder, n))), None)
    if run:  # what a user returning to a run a week later types first
        return TfpipeError(
            f"{folder}: a run folder ({run}), not shards; read it back with python -m train.inspect {folder} "
            "(its shards: the records it names)"
        )
    return TfpipeError(
        f"{folder}: no {MANIFEST} (not a folder written by tfpipe.write); to read other "
        f"shards pass a glob such as {folder}/*.tfrec with num_classes and image_size"
    )


class _Fields:
    """Typed reads of one JSON object, each failure a ``TfpipeError`` naming the file and the field."""

    def __init__(self, data: Any, path: str, prefix: str = "") -> None:
        if not isinstance(data, dict):
            what = f"{prefix.rstrip('.') or 'the manifest'} is not a JSON object"
            raise BadFile(path, what, "the manifest is damaged -- write the shards again")
        self.data, self.path, self.prefix = data, path, prefix

    def bad(self, key: str, what: str) -> BadFile:
        value = self.data.get(key, "(missing)")
        shown = repr(value) if len(repr(value)) <= 60 else repr(value)[:57] + "..."
        field = f"field '{self.prefix}{key}' {what} (got {shown})"
        return BadFile(self.path, field, "the manifest was edited or damaged -- write the shards again")

    def get(
        self,
        key: str,
        types: type[Any] | tuple[type[Any], ...],
        *,
        default: Any = ...,
        low: int | None = None,
        choices: tuple[object, ...] | None = None,
    ) -> Any:
        if key not in self.data:
            if default is ...:
                raise self.bad(key, "is required")
            return default
        value = self.data[key]
        if value is None and default is None:
            return None
        numeric = isinstance(value, int) and not isinstance(value, bool)
        if not isinstance(value, types) or (types is int and not numeric):
            names = " or ".join(t.__name__ for t in (types if isinstance(types, tuple) else (types,)))
            raise self.bad(key, f"must be {'a whole number' if types is int else names}")
        if low is not None and value < low:
            raise self.bad(key, f"must be at least {low}")
        if choices is not None and value not in choices:
            raise self.bad(key, f"must be one of {', '.join(map(str, choices))}")
        return value


def from_dict(data: Any, path: str) -> Manifest:
    """Validates a manifest's JSON form (``path`` names it in errors) and returns the ``Manifest``."""
    f = _Fields(data, path)
    version = f.get("version", int, default=1, low=1)
    if version > MANIFEST_VERSION:
        newer = f"manifest version {version} was written by a newer tfpipe (this one reads up to {MANIFEST_VERSION})"
        raise BadFile(path, newer, "upgrade tfpipe")
    split = f.get("split", str)
    if not SPLIT_NAME.fullmatch(split):
        raise f.bad("split", "is not a shard-name prefix")
    classes = _classes(f)
    labeled = f.get("labeled", bool, default=True)
    num_folds = f.get("folds", int, default=None, low=2)
    shards = _shards(f, num_folds)
    manifest = Manifest(
        split=split,
        classes=classes,
        shards=shards,
        labeled=labeled,
        single_label=f.get("single_label", bool, default=False),
        max_labels=f.get("max_labels", int, default=None, low=0),
        id_column=_non_empty(f, "id_column", "image"),
        image=_images(_Fields(f.get("image", dict, default={}), path, "image.")),
        num_folds=num_folds,
        group_column=_group_column(f, num_folds),
        seed=f.get("seed", int, default=0, low=0),
        fingerprint=f.get("fingerprint", str, default=None),
        skipped=tuple(_skipped(f)),
        label_format=_label_format(f),
        schema=f.get("schema", dict, default=None),
        tfpipe_version=f.get("tfpipe_version", str, default=""),
        dataset_id="",
        version=MANIFEST_VERSION,
    )
    _check_totals(f, manifest)
    return dataclasses.replace(manifest, dataset_id=_dataset_id(f, version))


def _group_column(f: _Fields, num_folds: int | None) -> str | None:
    column = f.get("group_column", str, default=None)
    if column is not None and (not column or num_folds is None):
        raise f.bad("group_column", "names the CSV column folds were made by: not empty, and only with folds")
    return column


def _label_format(f: _Fields) -> dict | None:
    """The CSV's label layout as written (``LabelFormat``'s fields); the columns it names (``label_column``'s
    source) are checked: non-empty strings, a list of them for the one-hot columns."""
    fmt = f.get("label_format", dict, default=None)
    if fmt is None:
        return None
    g = _Fields(fmt, f.path, "label_format.")
    _non_empty(g, "labels_col", LABEL_COLUMN)
    if not (g.get("class_col", str, default=None) or "x").strip():
        raise g.bad("class_col", "is empty")
    if not all(isinstance(c, str) and c.strip() for c in g.get("label_cols", list, default=[])):
        raise g.bad("label_cols", "must list the one-hot columns' names")
    return fmt


def _classes(f: _Fields) -> tuple[str, ...]:
    classes = f.get("classes", list)
    if not all(isinstance(c, str) and c.strip() for c in classes):
        raise f.bad("classes", "must list non-empty strings")
    if len(set(classes)) != len(classes):
        raise f.bad("classes", "lists a class twice")
    return tuple(classes)


def _non_empty(f: _Fields, key: str, default: str) -> str:
    value = f.get(key, str, default=default)
    if not value.strip():
        raise f.bad(key, "is empty")
    return value


def _shards(f: _Fields, num_folds: int | None) -> tuple[ShardEntry, ...]:
    listed = f.get("shards", list)
    if not listed:
        raise f.bad("shards", "lists no shard")
    entries = []
    for i, item in enumerate(listed):
        s = _Fields(item, f.path, f"shards[{i}].")
        name = s.get("file", str)
        check_shard_file_name(name, s)
        fold = s.get("fold", int, default=None, low=0)
        if (num_folds is None) != (fold is None) or (fold is not None and fold >= num_folds):
            raise s.bad("fold", f"does not fit the {num_folds or 'no'} folds the manifest declares")
        entries.append(ShardEntry(name, s.get("count", int, low=0), fold, s.get("bytes", int, default=None, low=0)))
    names = [e.file for e in entries]
    if len(set(names)) != len(names):
        raise f.bad("shards", "lists a file twice")
    return tuple(entries)


def check_shard_file_name(name: str, s: _Fields) -> None:
    """A listed shard is a plain ``*.tfrec`` name inside the folder: never ``..``, a sub-path or an absolute path,
    which ``--overwrite`` would otherwise delete and readers read."""
    if (
        not SHARD_NAMES.is_shard(name)
        or name != posixpath.basename(name)
        or "\\" in name
        or name.startswith(".")
        or "://" in name
        or "\0" in name
    ):
        raise s.bad("file", "must be a shard file name inside the folder (*.tfrec, no folder part)")


def _images(f: _Fields) -> StoredImages:
    size = f.get("image_size", int, default=None, low=1)
    if size is None and "size" in f.data:  # manifests that lack image_size name it "size"
        size = f.get("size", int, default=None, low=1)
    return StoredImages(
        image_size=size,
        fit=f.get("fit", str, default="stretch", choices=FITS),
        format=f.get("format", str, default="jpeg", choices=FORMATS),
        quality=f.get("quality", int, default=95, choices=tuple(range(1, 101))),
        max_pixels=f.get("max_pixels", int, default=None, low=1),
        max_bytes=f.get("max_bytes", int, default=None, low=1),
    )


def _skipped(f: _Fields) -> list[dict]:
    skipped = f.get("skipped", list, default=[])
    for i, item in enumerate(skipped):
        s = _Fields(item, f.path, f"skipped[{i}].")
        s.get("image", str)
        s.get("reason", str)
    return skipped


def _check_totals(f: _Fields, m: Manifest) -> None:
    """The counts a manifest repeats must agree with its shards and classes."""
    if "num_classes" in f.data and f.get("num_classes", int, low=0) != m.num_classes:
        raise f.bad("num_classes", f"does not match the {m.num_classes} classes listed")
    if "num_examples" in f.data and f.get("num_examples", int, low=0) != m.num_examples:
        raise f.bad("num_examples", f"does not match the shards' counts, which add up to {m.num_examples}")
    if m.labeled and not m.classes:
        raise f.bad("classes", "is empty, but the records are labeled")
    if m.max_labels is not None and m.max_labels > m.num_classes:
        raise f.bad("max_labels", f"exceeds the {m.num_classes} classes")


def _dataset_id(f: _Fields, version: int) -> str:
    """The recorded id, checked against the content (version 2); a version-1 manifest without one gets one from it."""
    computed = content_id(f.data)
    if version < 2 and "dataset_id" not in f.data:  # an id present is checked whatever the version says
        return computed
    recorded = f.get("dataset_id", str)
    if recorded != computed:
        edited = (
            f"its content no longer matches its dataset_id {recorded} (the manifest was edited after tfpipe.write "
            "wrote it)"
        )
        raise BadFile(f.path, edited, "write the shards again")
    return recorded
