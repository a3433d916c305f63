"""The record of the files a submission writer made (``train.predict``'s CSVs, ``train.blend``'s, a recipe's
``--predict``): the SHA-256 of each, kept in this user's state folder -- not beside the file, so the folder it is
in (``/kaggle/working``, whose every file is the notebook's output) holds only what was asked for. A file is
replaced without ``--overwrite`` only when its bytes are those recorded (``wrote_it``).

    record("submission.csv", data)     # after writing it
    wrote_it("submission.csv")         # True until someone changes or replaces the file

The state folder is ``$XDG_STATE_HOME/tfpipe/written`` (``~/.local/state/tfpipe/written`` without it), one small
file per path written. A record lost (another machine, the folder cleared) only means ``--overwrite`` is needed
to replace the file. Earlier versions kept the record beside the file (``.NAME.tfpipe``): still honoured, and
removed when the file is written again.
"""

from __future__ import annotations

import hashlib
import json
import os
import posixpath
import warnings

from tfpipe.runtime import fs
from tfpipe.runtime.errors import TfpipeError, option, os_error_line

STATE_ENV = "XDG_STATE_HOME"  # the XDG base directory of state that outlives a process (records of writes)


def state_folder() -> str:
    """Where the records are: ``$XDG_STATE_HOME/tfpipe/written``, else ``~/.local/state/tfpipe/written``."""
    root = os.environ.get(STATE_ENV) or os.path.join(os.path.expanduser("~"), ".local", "state")
    return os.path.join(root, "tfpipe", "written")


def _key(path: str) -> str:
    """The path a record is of: a bucket's URL as given; a local file by its folder's real path (a relative name or
    a link to the folder is the same file)."""
    if fs.is_remote(path):
        return path
    return os.path.join(os.path.realpath(os.path.dirname(os.path.abspath(path))), os.path.basename(path))


def record_path(path: str) -> str:
    """The record of ``path`` in the state folder: one per path, so two jobs writing two files never meet."""
    return os.path.join(state_folder(), hashlib.sha256(_key(path).encode("utf-8")).hexdigest()[:32] + ".json")


def legacy_record(path: str) -> str:
    """``.submission.csv.tfpipe`` beside ``submission.csv``: where an earlier tfpipe recorded it."""
    return posixpath.join(posixpath.dirname(path), f".{posixpath.basename(path)}.tfpipe")


def recorded(path: str) -> str | None:
    """The SHA-256 recorded for ``path`` (the state folder's record, else a legacy one beside it); None: none."""
    mine = record_path(path)
    try:
        if os.path.isfile(mine):
            entry = json.loads(fs.read_text(mine, limit=4096))
            if isinstance(entry, dict) and entry.get("path") == _key(path):
                return str(entry.get("sha256"))
        old = legacy_record(path)
        return fs.read_text(old, limit=4096).strip() if fs.isfile(old) else None
    except (TfpipeError, OSError, UnicodeDecodeError, ValueError):  # unreadable: as if there were none
        return None


def record(path: str, data: bytes) -> None:
    """Records that ``data`` was just written to ``path``, and removes a legacy record beside it. A state folder
    that cannot be written is a warning, not an error: the file is written, and replacing it needs
    ``--overwrite``."""
    entry = json.dumps({"path": _key(path), "sha256": hashlib.sha256(data).hexdigest()}) + "\n"
    try:
        os.makedirs(state_folder(), exist_ok=True)
        fs.write_atomic(record_path(path), entry)
    except OSError as e:
        warnings.warn(
            f"{path} is written, but its record is not ({os_error_line(e)}): replacing it later needs "
            f"{option('overwrite', True)}",
            stacklevel=2,
        )
    old = legacy_record(path)
    if fs.isfile(old):
        fs.remove(old)


def sha256_of(path: str) -> str:
    h = hashlib.sha256()
    with fs.open(path, "rb") as f:
        for block in iter(lambda: f.read(2**20), b""):
            h.update(block)
    return h.hexdigest()


def wrote_it(path: str) -> bool:
    """Whether ``path`` is byte for byte the file recorded as written there."""
    if not fs.isfile(path):  # gone, or a FIFO whose hash would wait forever
        return False
    digest = recorded(path)
    return digest is not None and digest == sha256_of(path)
