"""What a run or CV folder holds is what it claims: ``files.json``, the record of every file a decision reads.

    runs/NAME/files.json   {"files": {"model.keras": {"sha256": ..., "bytes": ..., "model": null, "views": null},
                                      "thresholds.json": {..., "model": "model.keras", "views": 1}, ...}}
    CV_DIR/files.json      the same for oof.csv, the CV's thresholds files and each fold's model ("fold-2/model.keras")

The job that writes a model, a thresholds file, a predictions or OOF file records its SHA-256 here, and for
thresholds and predictions the model and TTA views they belong to. Every reader checks a file against its record
before it uses it (``check``): a file edited, or copied from another run or fold, is one ``RunMismatch`` line
naming the file and what it should be -- never used silently. A folder without ``files.json`` has no record: its files
are used with a warning saying they are not checked. No TensorFlow here.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import posixpath
import re
import warnings
from collections.abc import Iterable
from typing import Any

from tfpipe.runtime import fs
from tfpipe.runtime.errors import RunMismatch

FILES = "files.json"
FILES_VERSION = 1
_SHA256 = re.compile("[0-9a-f]{64}")
_NAME = re.compile(r"(fold-\d+/)?[^/\\]+")  # a file of the folder, or of one of a CV's fold folders


class NotAsRecorded(RunMismatch):
    """A file that is not the one its folder's record names (edited, copied in, or not recorded at all)."""


@dataclasses.dataclass(frozen=True)
class Entry:
    """One recorded file: its digest and size, and for thresholds and predictions the model file and view count
    they belong to (None for a model)."""

    sha256: str
    bytes: int
    model: str | None = None
    views: int | None = None

    def made_for(self) -> str:
        if self.model is None:
            return ""
        return f" (of {self.model}, {self.views} view{'s' * (self.views != 1)})"


def digest(path: str) -> tuple[str, int]:
    """(SHA-256 in hex, size in bytes) of the file ``path``, local or remote, read once front to back."""
    h, n = hashlib.sha256(), 0
    with fs.open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
            n += len(chunk)
    return h.hexdigest(), n


def read(folder: str) -> dict[str, Entry] | None:
    """``folder/files.json``'s entries, validated (a problem is one ``RunMismatch`` line); None when there is none."""
    p = posixpath.join(folder, FILES)
    if not fs.exists(p):
        return None
    data = fs.read_json(p, "record of files")
    files = data.get("files") if isinstance(data, dict) else None
    if not isinstance(data, dict) or data.get("files_version") != FILES_VERSION or not isinstance(files, dict):
        raise RunMismatch(f"{p}: not a record of files tfpipe wrote; the folder was edited or damaged")
    return {name: _entry(name, value, p) for name, value in files.items()}


def _entry(name: str, value: Any, p: str) -> Entry:
    fields = {f.name for f in dataclasses.fields(Entry)}
    ok = (
        _NAME.fullmatch(name) is not None
        and name not in (".", "..")
        and isinstance(value, dict)
        and set(value) == fields
        and isinstance(value["sha256"], str)
        and _SHA256.fullmatch(value["sha256"]) is not None
        and type(value["bytes"]) is int
        and value["bytes"] >= 0
        and (value["model"] is None or isinstance(value["model"], str))
        and (value["views"] is None or (type(value["views"]) is int and 1 <= value["views"] <= 8))
    )
    if not ok:
        raise RunMismatch(f"{p}: its entry {name!r} is not a file's record; the folder was edited or damaged")
    return Entry(**value)


def record(folder: str, names: Iterable[str], model: str | None = None, views: int | None = None) -> None:
    """Records the files ``names`` of ``folder`` as they are now (``model``, ``views``: what they belong to)."""
    entries = read(folder) or {}
    for name in names:
        sha, size = digest(posixpath.join(folder, name))
        entries[name] = Entry(sha, size, model, views)
    _save(folder, entries)


def _save(folder: str, entries: dict[str, Entry]) -> None:
    files = {k: dataclasses.asdict(v) for k, v in sorted(entries.items())}
    text = json.dumps({"files_version": FILES_VERSION, "files": files}, indent=1, ensure_ascii=False)
    fs.write_atomic(posixpath.join(folder, FILES), text + "\n")


def check(
    folder: str,
    name: str,
    *,
    required: bool,
    model: str | None = None,
    views: int | None = None,
    remedy: str,
) -> None:
    """``folder/name`` is the file its job recorded (and, given ``model`` and ``views``, recorded as belonging to
    them), else one ``RunMismatch`` line naming it, what it should be, and ``remedy``. ``required``: the folder's
    ``config.json`` or ``cv.json`` says it keeps the record (its absence is then a problem too); without it, a
    folder with no record is used with a warning."""
    p = posixpath.join(folder, name)
    entries = read(folder)
    if entries is None:
        if required:
            raise NotAsRecorded(
                f"{posixpath.join(folder, FILES)}: missing, the record of the files this folder's job wrote; "
                f"{name} cannot be checked against it -- {remedy}"
            )
        warnings.warn(f"{folder} was written by an earlier tfpipe, which kept no record of its files: {name} "
                      "is used unchecked", stacklevel=2)  # fmt: skip
        return
    problem = _problem(p, entries.get(name), model, views)
    if problem:
        raise NotAsRecorded(f"{p}: {problem} -- {remedy}")


def _problem(p: str, entry: Entry | None, model: str | None, views: int | None) -> str | None:
    if entry is None:
        return f"not in {FILES}, the record of the files this folder's job wrote: copied in from elsewhere?"
    if model is not None and (entry.model, entry.views) != (model, views):
        return f"recorded as the file{entry.made_for()}, not of {model}, {views} view{'s' * (views != 1)}"
    sha, size = digest(p)
    if sha != entry.sha256:
        return (
            f"not the file this folder's job wrote{entry.made_for()}: its SHA-256 is {sha[:12]}... ({size} bytes), "
            f"{FILES} records {entry.sha256[:12]}... ({entry.bytes} bytes) -- edited, or copied from another run "
            "or fold?"
        )
    return None


def problems(folder: str, missing: bool = True) -> list[str]:
    """Each recorded file of ``folder`` that is not as recorded (with ``missing``: or gone), in one line:
    ``train.inspect``'s."""
    entries = read(folder)
    found = []
    for name, entry in sorted((entries or {}).items()):
        p = posixpath.join(folder, name)
        if not fs.exists(p):
            found += [f"{name}: recorded in {FILES}, now missing"] * missing
            continue
        problem = _problem(p, entry, None, None)
        if problem:
            found.append(f"{name}: {problem}")
    return found
