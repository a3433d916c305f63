"""A thin file layer: local paths through the standard library, anything with a scheme
(``gs://``, ``ram://``, ...) through ``tf.io.gfile``.

Local writes then need no TensorFlow at all, which saves the writer TensorFlow's
import (seconds) at start-up; remote paths behave exactly as ``tf.io.gfile`` does.
"""

from __future__ import annotations

import builtins
import glob as _glob
import os
import shutil
from typing import IO, Any


def is_remote(path: str) -> bool:
    return "://" in str(path)


def _gfile() -> Any:
    from tfpipe.runtime.deps import require  # defer: only remote paths need TensorFlow

    return require("tensorflow").io.gfile


def same_path(a: str, b: str) -> bool:
    """Whether two paths name one file or folder: local ones resolved (links, ``..``), remote ones as written."""
    if is_remote(a) or is_remote(b):
        return a.rstrip("/") == b.rstrip("/")
    return os.path.realpath(a) == os.path.realpath(b)


def exists(path: str) -> bool:
    return _gfile().exists(path) if is_remote(path) else os.path.exists(path)


def isdir(path: str) -> bool:
    return _gfile().isdir(path) if is_remote(path) else os.path.isdir(path)


def makedirs(path: str) -> None:
    """Makes the folder ``path`` and its parents (none there yet: nothing); a local one that cannot be made is a
    ``TfpipeError`` naming the culprit -- the file standing where a folder must be, or the folder this user cannot
    write in -- rather than ``path: Not a directory``."""
    if is_remote(path):
        _gfile().makedirs(path)
        return
    try:
        os.makedirs(path, exist_ok=True)
    except OSError as e:
        from tfpipe.runtime.errors import TfpipeError

        above = os.path.abspath(path)
        while not os.path.lexists(above) and os.path.dirname(above) != above:
            above = os.path.dirname(above)
        if isinstance(e, (FileExistsError, NotADirectoryError)) and not os.path.isdir(above):
            raise TfpipeError(f"{above} is a file, so the folder {path} cannot be made") from None
        raise TfpipeError(
            f"cannot make the folder {path} ({e.strerror or e} in {above}); choose a folder this user can write in"
        ) from None


def listdir(path: str) -> list[str]:
    """Entry names (sub-folders without the trailing slash gfile adds)."""
    if is_remote(path):
        return [n.rstrip("/") for n in _gfile().listdir(path)]
    return os.listdir(path)


def isfile(path: str) -> bool:
    return exists(path) and not isdir(path) if is_remote(path) else os.path.isfile(path)


def join(*parts: str) -> str:
    return (
        "/".join(p.rstrip("/") for p in parts[:-1]) + "/" + parts[-1] if is_remote(parts[0]) else os.path.join(*parts)
    )


def glob(pattern: str) -> list[str]:
    return _gfile().glob(pattern) if is_remote(pattern) else _glob.glob(pattern)


def rename(src: str, dst: str, overwrite: bool = False) -> None:
    if is_remote(src):
        return _gfile().rename(src, dst, overwrite=overwrite)
    if not overwrite and os.path.exists(dst):
        raise FileExistsError(dst)
    os.replace(src, dst)  # atomic on one filesystem


def remove(path: str) -> None:
    if is_remote(path):
        _gfile().remove(path)
    else:
        os.remove(path)


def rmtree(path: str) -> None:
    if is_remote(path):
        _gfile().rmtree(path)
    else:
        shutil.rmtree(path)


def temporary_name(path: str) -> str:
    """A name beside ``path`` no one else uses (``path.tmp-1a2b3c4d``): a fixed ``path.tmp`` would replace a user's
    file of that name, or write through a link of that name into whatever it points to."""
    import uuid

    return f"{path}.tmp-{uuid.uuid4().hex[:8]}"


def write_atomic(path: str, data: str | bytes) -> None:
    """Writes ``data`` (str or bytes) to ``path`` through a temporary name of its own, so ``path`` is complete or
    absent (also on buckets, where rename is copy + delete). Locally the temporary is created exclusively, never
    through a link."""
    tmp = temporary_name(path)
    data = data.encode("utf-8") if isinstance(data, str) else data  # UTF-8 whatever the locale says
    try:
        with open(tmp, "wb") if is_remote(tmp) else builtins.open(tmp, "xb") as f:
            f.write(data)
    except BaseException as e:  # e.g. a full disk: leave no half-written temporary behind
        if exists(tmp):
            remove(tmp)
        if isinstance(e, OSError) and e.filename in (None, tmp):  # name the file meant, not its temporary
            raise OSError(e.errno, e.strerror, path) from None
        raise
    rename(tmp, path, overwrite=True)


METADATA_LIMIT = 256 * 2**20  # the largest manifest, run config or record file tfpipe reads back (bytes)


def not_regular(mode: int) -> str | None:
    """What a file of ``os.stat`` mode ``mode`` is when it is not a regular file (``a FIFO (named pipe)``), else
    None. A FIFO would hang a read, ``/dev/zero`` never ends: every reader of local files asks this first."""
    import stat

    kinds = (
        (stat.S_ISDIR, "a folder"),
        (stat.S_ISFIFO, "a FIFO (named pipe)"),
        (stat.S_ISCHR, "a character device"),
        (stat.S_ISBLK, "a block device"),
        (stat.S_ISSOCK, "a socket"),
    )
    return next((kind for is_kind, kind in kinds if is_kind(mode)), None if stat.S_ISREG(mode) else "not a file")


def check_regular(path: str, what: str = "file") -> int:
    """Refuses a local ``path`` that is not a regular file, naming what it is. Returns its size. Remote paths are
    objects and pass."""
    if is_remote(path):
        return size(path)
    st = os.stat(path)
    kind = not_regular(st.st_mode)
    if kind:
        from tfpipe.runtime.errors import BadFile

        raise BadFile(path, f"is {kind}, not a regular {what}", joined=" ")
    return st.st_size


def read_text(path: str, limit: int | None = None) -> str:
    """A text file (UTF-8); with ``limit``, a file that is not regular or is larger is a ``TfpipeError``, and so
    is one that is not UTF-8 text."""
    try:
        return read_bytes(path, limit).decode("utf-8")
    except UnicodeDecodeError as e:
        from tfpipe.runtime.errors import BadFile

        raise BadFile(path, f"is not UTF-8 text ({e.reason} at byte {e.start})", "the file is damaged", " ") from None


def read_bytes(path: str, limit: int | None = None) -> bytes:
    """A file's bytes; with ``limit``, a file that is not regular or is larger is a ``TfpipeError``."""
    if limit is not None:
        n = check_regular(path)
        if n > limit:
            from tfpipe.runtime.errors import BadFile

            raise BadFile(
                path, f"is {n:,} bytes, more than the {limit:,} such a file can be", "it is not tfpipe's", " "
            )
    with open(path, "rb") as f:
        return f.read()


class KeyTwice(Exception):
    """A JSON object naming one key twice (``json`` keeps the last silently)."""


def object_once(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """``json``'s ``object_pairs_hook`` that refuses a key given twice (``KeyTwice``) instead of keeping the last."""
    obj: dict[str, Any] = {}
    for key, value in pairs:
        if key in obj:
            raise KeyTwice(key)
        obj[key] = value
    return obj


def read_json(path: str, what: str = "file") -> Any:
    """A JSON file tfpipe wrote (manifest, run config, progress, lock), read as input: a regular file of bounded
    size and valid JSON with no key given twice in an object, else a ``TfpipeError`` naming it -- never a hang, a
    ``MemoryError`` or a ``RecursionError`` on nested junk, never the last of two values chosen silently."""
    return parse_json(read_bytes(path, METADATA_LIMIT), path, what)


def parse_json(data: bytes, path: str, what: str = "file") -> Any:
    """``data`` (UTF-8 bytes of ``what`` in ``path``) as strict JSON, as ``read_json`` reads a file: every problem
    a ``TfpipeError`` naming ``path`` and ``what``."""
    import json

    from tfpipe.runtime.errors import BadFile

    try:
        return json.loads(data.decode("utf-8"), object_pairs_hook=object_once)
    except KeyTwice as e:
        twice = f"{what} gives the key {e.args[0]!r} twice, and which one counts is a guess"
        raise BadFile(path, twice, "the file was edited or damaged") from None
    except UnicodeDecodeError as e:
        raise BadFile(path, f"{what} is not UTF-8 text ({e.reason})") from None
    except RecursionError:
        raise BadFile(path, f"{what} is nested too deeply to be tfpipe's", "the file is damaged") from None
    except ValueError as e:  # JSONDecodeError, and Python's limit on the digits of an int
        raise BadFile(path, f"{what} is not valid JSON ({e})", "the file is damaged") from None


def identity(path: str, follow_links: bool = True) -> tuple[int, int]:
    """(size, modification time in ns) of a file: what tells a changed input from the one written before.
    ``follow_links=False``: of a local link itself, not its target (a bucket has no links)."""
    if is_remote(path):
        st = _gfile().stat(path)
        return st.length, st.mtime_nsec
    st = os.stat(path) if follow_links else os.lstat(path)
    return st.st_size, st.st_mtime_ns


def size(path: str) -> int:
    return _gfile().stat(path).length if is_remote(path) else os.path.getsize(path)


def open(path: str, mode: str = "r") -> IO[Any]:
    return _gfile().GFile(path, mode) if is_remote(path) else builtins.open(path, mode)
