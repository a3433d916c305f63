"""A shard folder, for every reader and writer: names, ``manifest.json``, and opening one to read.

A folder written by ``tfpipe.write`` holds shards named
``{split}[-fold{f}]-{i}-of-{n}-{count}.tfrec`` (the record count at the end is
the Kaggle convention that notebooks read with a regex) and ``manifest.json``
(classes, counts, folds, sizes, image settings). ``open_shards`` is the one
place that turns what a user passes as ``records`` -- such a folder, a glob
pattern or a list of files, local or ``gs://`` -- into files in written order
with their counts, checks folds and sizes, and refuses everything else with one
message; ``verify`` reads every record and checks both CRCs without
TensorFlow. The writer's side (planning, staged writing) is ``tfpipe.writer.staging``.

All file access goes through ``tfpipe.runtime.fs`` (``tf.io.gfile`` for ``gs://`` and
other remote paths), so a bucket works like a folder.
"""

from __future__ import annotations

import dataclasses
import numbers
import os
import posixpath
from collections.abc import Iterable, Sequence

from tfpipe.format.checks import check_first_records, check_sizes
from tfpipe.format.manifest import (
    MANIFEST,
    SPLIT_NAME,
    Manifest,
    ShardEntry,
    StoredImages,
)
from tfpipe.format.names import SHARD_NAMES
from tfpipe.format.tfrecord import CorruptRecord, read_records
from tfpipe.runtime import fs
from tfpipe.runtime.errors import ShardsChanged, TfpipeError, check_count, option


def check_split(split: object) -> None:
    """A split is the first part of every shard name: letters, digits, ``_ . -``, no folder separators."""
    if not isinstance(split, str) or not SPLIT_NAME.fullmatch(split):
        raise TfpipeError(
            f"{option('split')} {split!r} cannot start a file name: use letters, digits, _ . - (e.g. train, "
            "test, extra_2019)"
        )


def shard_counts(files: Iterable[str], manifest: Manifest | None = None) -> dict[str, int | None]:
    """Records per file, from the manifest or else the count at the end of the name (None: unknown)."""
    listed = {s.file: s.count for s in manifest.shards} if manifest else {}
    out: dict[str, int | None] = {}
    for f in files:
        name = posixpath.basename(f)
        out[f] = listed.get(name, SHARD_NAMES.count(name))
    return out


@dataclasses.dataclass(frozen=True)
class Shards:
    """Opened ``records``: files in written order, the folder's validated ``Manifest`` and the folder (both None
    for a glob or a list). Pass it on instead of the path: it is opened and checked once."""

    files: tuple[str, ...]
    manifest: Manifest | None = None
    folder: str | None = None

    def __str__(self) -> str:
        """What messages name (opened shards are passed on in place of a path): the folder, or the files."""
        if self.folder:
            return self.folder
        if len(self.files) == 1:
            return self.files[0]
        return f"{self.files[0]} and {len(self.files) - 1} more shard files" if self.files else "no shard files"

    @property
    def counts(self) -> dict[str, int | None]:
        return shard_counts(self.files, self.manifest)

    @property
    def num_examples(self) -> int | None:
        """Records in ``files``: from the manifest, else from the counts in the names (None if unknown)."""
        counts = self.counts.values()
        known = [n for n in counts if n is not None]
        return None if len(known) < len(counts) else sum(known)

    @property
    def images(self) -> StoredImages | None:
        return self.manifest.image if self.manifest else None

    @property
    def image_size(self) -> int | None:
        return self.manifest.image.image_size if self.manifest else None

    @property
    def image_format(self) -> str | None:
        return self.manifest.image.format if self.manifest else None

    @property
    def num_classes(self) -> int | None:
        return self.manifest.num_classes if self.manifest else None

    @property
    def classes(self) -> list[str] | None:
        return list(self.manifest.classes) if self.manifest else None

    @property
    def labeled(self) -> bool:
        """False when the manifest says the records carry no ``target``; True for unknown (foreign) shards."""
        return self.manifest.labeled if self.manifest else True

    @property
    def num_folds(self) -> int | None:
        """K of shards written with ``num_folds=K``; None without folds or without a manifest."""
        return self.manifest.num_folds if self.manifest else None

    @property
    def single_label(self) -> bool | None:
        return self.manifest.single_label if self.manifest else None

    @property
    def multi_label(self) -> bool:
        """True when the manifest says an image may hold several labels (one-hot targets would drop some)."""
        return self.manifest is not None and self.manifest.labeled and not self.manifest.one_label_each

    def describe_labels(self) -> str:
        """``multi-label data (up to 3 labels an image; manifest.json: single_label false)``, for messages."""
        most = self.manifest.max_labels if self.manifest else None
        return (
            f"multi-label data ({f'up to {most} labels an image' if most else 'several labels an image'}; "
            f"{MANIFEST}: single_label false)"
        )

    @property
    def id_column(self) -> str:
        """The source's id column (a submission's key): ``image`` when unknown."""
        return self.manifest.id_column if self.manifest else "image"

    def absolute(self) -> Shards:
        """These shards with local paths made absolute: what another process (a tf.data service worker, started
        in another folder) resolves the same way. ``gs://`` paths stay as they are."""

        def absolute(path: str) -> str:
            return path if fs.is_remote(path) else os.path.abspath(path)

        folder = absolute(self.folder) if self.folder else self.folder
        return dataclasses.replace(self, files=tuple(absolute(f) for f in self.files), folder=folder)

    @property
    def dataset_id(self) -> str | None:
        return self.manifest.dataset_id if self.manifest else None

    def check_unchanged(self, sizes: bool = False) -> None:
        """Raises if the folder was rewritten (another dataset id, or no manifest) since it was opened: a job
        reading it must not go on claiming classes or records the folder no longer holds. With ``sizes``, also
        if a shard's size is no longer the manifest's (a shard replaced in place by one of the same count: one
        stat a file, for a job's last check before it writes what it read)."""
        if self.manifest is None or self.folder is None:  # no folder (Shards built by hand): nothing to re-read
            return
        if sizes:
            check_sizes(self.files, self.manifest, self.folder)
        try:
            now = Manifest.load(self.folder).dataset_id
        except TfpipeError:
            now = None
        if now != self.manifest.dataset_id:
            raise ShardsChanged(
                f"{self.folder} was rewritten while this job read it (dataset id "
                f"{self.manifest.dataset_id}, now {now or 'none: no valid manifest'}); nothing of this "
                "job is kept as finished -- run it again on the new shards"
            )


Records = str | Sequence[str] | Shards  # what every reader takes: a folder, a glob, files, or opened Shards


def open_shards(records: Records, folds: Sequence[int] | None = None, any_schema: bool = False) -> Shards:
    """Opens what a user calls ``records``: the one resolver behind every reader, ``inspect`` and ``train``.

    Args:
      records: a folder written by ``tfpipe.write`` (local or ``gs://``), a glob pattern, a list of files,
        or ``Shards`` already opened.
      folds: fold ids to keep (the folder must have been written with ``num_folds``); None keeps all.
      any_schema: accept files without a manifest whose records are not tfpipe's (``inspect``); otherwise the
        first record of each such file must hold tfpipe's ``image`` feature.

    Returns:
      ``Shards`` with files sorted by name (the written order), sizes checked against the manifest.

    Raises:
      TfpipeError: no such folder or files, no manifest in a folder, folds the shards do not have, or a
        shard missing or of another size than the manifest says.
    """
    if isinstance(records, Shards):
        shards = records
    elif not isinstance(records, str) and isinstance(records, Sequence):  # a list (or tuple, ...) of files
        shards = with_their_manifest(tuple(sorted(_listed_files(records))))
    elif records and fs.isdir(records):
        manifest = Manifest.load(records)
        shards = Shards(tuple(sorted(posixpath.join(records, name) for name in manifest.files)), manifest, records)
    else:
        shards = with_their_manifest(tuple(sorted(fs.glob(records))) if records else ())
    if folds is not None:
        shards = select_folds(shards, check_fold_ids(folds), records)
    if not shards.files:
        raise TfpipeError(f"{records or repr(records)}: no shard files found")
    if shards.manifest and shards.folder is not None and not isinstance(records, Shards):  # a folder: records
        check_sizes(shards.files, shards.manifest, shards.folder)
    elif not shards.manifest and not isinstance(records, Shards) and not any_schema:
        check_first_records(shards.files)
    return shards


def _listed_files(records: Sequence[object]) -> list[str]:
    """A list's items as shard file paths: each a path (``str`` or ``os.PathLike``) of a file that exists, else an
    error naming it (a folder in a list is not its files: the folder itself is ``records``)."""
    files = []
    for item in records:
        f = os.fspath(item) if isinstance(item, (str, os.PathLike)) else None
        if not isinstance(f, str):  # bytes paths too: every other path here is text
            raise TfpipeError(f"records lists {item!r}, not a path: a list of records names shard files")
        if fs.isdir(f):
            raise TfpipeError(f"records lists the folder {f}: a list names shard files; pass the folder itself")
        if not fs.exists(f):
            raise TfpipeError(f"records lists {f}, which does not exist")
        files.append(f)
    return files


def with_their_manifest(files: tuple[str, ...]) -> Shards:
    """A glob's or a list's files, read with the ``manifest.json`` of the folder that holds them: the same classes,
    folds, sizes and rewrite check as naming the folder (a glob beside its manifest is no way around them). Every
    file must be one the manifest lists. Files of several shard folders are read together only when every folder
    has a manifest and they agree on what a record means (classes in order, labels, image settings): each file is
    checked against its own folder's manifest, and the files read with one manifest listing them all (no dataset
    id: no one folder's identity). Files without a manifest carry no claims and are read as they are."""
    seen: dict[str, str] = {}
    for f in files:  # a file given twice would be read twice: its records counted and scored twice
        same = f if fs.is_remote(f) else os.path.realpath(f)
        if same in seen:
            raise TfpipeError(f"{f} is given twice (as {seen[same]} and {f}); list each shard file once")
        seen[same] = f
    folders = sorted({posixpath.dirname(f) or "." for f in files})
    manifests = {d: Manifest.load(d) for d in folders if fs.exists(posixpath.join(d, MANIFEST))}
    for f in files:
        manifest = manifests.get(posixpath.dirname(f) or ".")
        if manifest is not None and posixpath.basename(f) not in manifest.files:
            raise TfpipeError(
                f"{f}: not a shard of its folder ({MANIFEST} there does not list it): a leftover or another "
                "dataset's file -- leave it out of the glob or list"
            )
    if not manifests:
        return Shards(files)
    if len(folders) == 1:
        return Shards(files, manifests[folders[0]], folders[0])
    return Shards(files, _one_manifest(files, folders, manifests))


def _one_manifest(files: Sequence[str], folders: Sequence[str], manifests: dict[str, Manifest]) -> Manifest:
    """The manifest of files from several shard folders that mean the same (else an error naming two folders)."""
    bare = [d for d in folders if d not in manifests]
    if bare:
        raise TfpipeError(
            f"the files given come from {bare[0]}, which has no {MANIFEST}, and from {next(iter(manifests))}, which "
            "has one: its claims (classes, labels) would not hold for the others -- read them apart"
        )
    first, *rest = folders
    for d in rest:
        differ = [k for k, v in _meaning(manifests[d]).items() if v != _meaning(manifests[first])[k]]
        if differ:
            raise TfpipeError(
                f"the files given come from {first} and {d}, whose {MANIFEST} files differ in {', '.join(differ)}: "
                "their records mean different things -- read one folder at a time"
            )
    entries: list[ShardEntry] = []
    seen: dict[str, str] = {}
    for d in folders:
        chosen = [f for f in files if (posixpath.dirname(f) or ".") == d]
        check_sizes(chosen, manifests[d], d)
        names = {posixpath.basename(f) for f in chosen}
        for entry in manifests[d].shards:
            if entry.file in names:
                if entry.file in seen:
                    raise TfpipeError(
                        f"the files given hold two shards named {entry.file} (in {seen[entry.file]} and {d}); "
                        "read one folder at a time"
                    )
                seen[entry.file] = d
                entries.append(entry)
    most = [m.max_labels for m in manifests.values()]
    folds = {m.num_folds for m in manifests.values()}
    return dataclasses.replace(
        manifests[first],
        shards=tuple(entries),
        max_labels=None if None in most else max(m for m in most if m is not None),
        num_folds=folds.pop() if len(folds) == 1 else None,
        dataset_id="",
        fingerprint=None,
        skipped=(),
    )


def _meaning(manifest: Manifest) -> dict[str, object]:
    """What a manifest says a record means: two folders read together must agree on all of it."""
    return {
        "classes": manifest.classes,
        "labeled": manifest.labeled,
        "single_label": manifest.single_label,
        "image size": manifest.image.image_size,
        "resize": manifest.image.effective_fit,
        "image format": manifest.image.format,
    }


def checked_num_classes(records: object, shards: Shards, num_classes: int | None) -> int:
    """The number of classes a reader uses: ``num_classes`` or the manifest's; the two must agree (fewer classes
    would drop labels), and shards without a manifest need it given. Shards written unlabeled have none: 0."""
    if num_classes and shards.num_classes and num_classes != shards.num_classes:
        raise TfpipeError(
            f"{records}: num_classes={num_classes}, but the shards hold {shards.num_classes} classes "
            f"({MANIFEST}); labels would be lost"
        )
    classes = num_classes or shards.num_classes
    if not classes and shards.manifest is not None and not shards.labeled:
        return 0  # written unlabeled: images and ids, and targets of width 0 (num_classes=C gives C zeros)
    if not classes:
        raise TfpipeError(f"{records}: no {MANIFEST} to read the classes from; pass num_classes")
    return classes


def check_fold_ids(folds: object) -> list[int]:
    """``folds`` are fold ids, a list of whole numbers: a count there is a mix-up with
    ``num_folds``, and an empty list would select nothing."""
    ids = list(folds) if isinstance(folds, Iterable) and not isinstance(folds, (str, bytes)) else None
    if ids is None or any(isinstance(f, bool) or not isinstance(f, numbers.Integral) for f in ids):
        raise TfpipeError(
            f"folds are fold ids, a list such as folds=[0, 1] (got {folds!r}); the number of folds K is "
            "num_folds, given when the shards are written"
        )
    if not ids:
        raise TfpipeError("folds=[] selects no fold; folds=None reads every fold")
    return [int(f) for f in ids]


def select_folds(shards: Shards, folds: Sequence[int], records: object) -> Shards:
    """The shards of ``folds`` only; folds the shards were not written with are an error."""
    manifest = shards.manifest
    k = manifest.num_folds if manifest else None
    if manifest is None or not k:
        raise TfpipeError(
            f"{records}: folds {list(folds)} were asked for, but these shards were written without "
            "folds (tfpipe.write --num-folds K)"
        )
    outside = [f for f in folds if f not in range(k)]
    if outside:
        raise TfpipeError(f"{records}: folds {outside} outside 0..{k - 1} (written with {k} folds)")
    fold_of = {s.file: s.fold for s in manifest.shards}
    keep = set(folds)
    return dataclasses.replace(
        shards, files=tuple(f for f in shards.files if fold_of.get(posixpath.basename(f)) in keep)
    )


def fold_split(records: Records, fold: int) -> tuple[list[int], list[int]]:
    """(training folds, validation folds) for validating on ``fold`` of a folded shard folder."""
    check_count(0, fold=fold)
    k = open_shards(records).num_folds
    if not k:
        raise TfpipeError(f"{records}: written without folds; cannot pick validation fold {fold}")
    if fold not in range(k):
        raise TfpipeError(f"{records}: fold {fold} outside 0..{k - 1}")
    return [f for f in range(k) if f != fold], [fold]


def holdout_split(shards: Shards, val_fraction: float) -> tuple[Shards, Shards]:
    """(training, validation) ``Shards`` holding out the last shards, about ``val_fraction`` of them."""
    files = shards.files
    if len(files) < 2:
        raise TfpipeError(f"{files[0]}: one shard cannot be split for validation; write it with folds or more shards")
    n_val = min(len(files) - 1, max(1, round(val_fraction * len(files))))
    return dataclasses.replace(shards, files=files[:-n_val]), dataclasses.replace(shards, files=files[-n_val:])


NAMED_COUNT = "the Kaggle convention NAME-COUNT.tfrec; rename a file whose name ends in another number"
UNKNOWN_COUNT = (
    "record count unknown (no manifest and no count in the file names): name each file NAME-COUNT.tfrec (the Kaggle "
    "convention), or write the shards with tfpipe.write"
)


def verify(shards: Shards) -> list[str]:
    """Reads every record of every shard, checking both CRCs (no TensorFlow) and the counts the manifest or the
    names give. Returns a list of problems, one line each."""
    problems: list[str] = []

    for path, expected in shards.counts.items():
        try:
            n = sum(1 for _ in read_records(path))
        except CorruptRecord as e:
            problems.append(str(e))
            continue
        if expected is not None and n != expected:
            named = "" if shards.manifest else f" (the number its name ends in, read as its count: {NAMED_COUNT})"
            problems.append(f"{path}: holds {n} records, expected {expected}{named}")
    return problems
