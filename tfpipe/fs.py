"""A thin file layer: local paths through the standard library, anything with a scheme
(``gs://``, ``ram://``, ...) through ``tf.io.gfile``.

Local writes then need no TensorFlow at all, which saves the writer ~4 s of
import at start-up; remote paths behave exactly as ``tf.io.gfile`` does.
"""
import builtins
import glob as _glob
import os
import shutil


def is_remote(path):
    return "://" in str(path)


def _gfile():
    from tfpipe.deps import require  # defer: only remote paths need TensorFlow

    return require("tensorflow").io.gfile


def exists(path):
    return _gfile().exists(path) if is_remote(path) else os.path.exists(path)


def isdir(path):
    return _gfile().isdir(path) if is_remote(path) else os.path.isdir(path)


def makedirs(path):
    return _gfile().makedirs(path) if is_remote(path) else os.makedirs(path, exist_ok=True)


def listdir(path):
    """Entry names (sub-folders without the trailing slash gfile adds)."""
    if is_remote(path):
        return [n.rstrip("/") for n in _gfile().listdir(path)]
    return os.listdir(path)


def isfile(path):
    return exists(path) and not isdir(path) if is_remote(path) else os.path.isfile(path)


def join(*parts):
    return "/".join(p.rstrip("/") for p in parts[:-1]) + "/" + parts[-1] if is_remote(parts[0]) else os.path.join(*parts)


def glob(pattern):
    return _gfile().glob(pattern) if is_remote(pattern) else _glob.glob(pattern)


def rename(src, dst, overwrite=False):
    if is_remote(src):
        return _gfile().rename(src, dst, overwrite=overwrite)
    if not overwrite and os.path.exists(dst):
        raise FileExistsError(dst)
    os.replace(src, dst)  # atomic on one filesystem


def remove(path):
    return _gfile().remove(path) if is_remote(path) else os.remove(path)


def rmtree(path):
    return _gfile().rmtree(path) if is_remote(path) else shutil.rmtree(path)


def write_atomic(path, data):
    """Writes ``data`` (str or bytes) to ``path`` through a temporary name, so ``path`` is complete or absent
    (also on buckets, where rename is copy + delete)."""
    tmp = path + ".tmp"
    data = data.encode("utf-8") if isinstance(data, str) else data  # UTF-8 whatever the locale says
    try:
        with open(tmp, "wb") as f:
            f.write(data)
    except BaseException:  # e.g. a full disk: leave no half-written temporary behind
        if exists(tmp):
            remove(tmp)
        raise
    rename(tmp, path, overwrite=True)


def read_text(path):
    with open(path, "rb") as f:
        return f.read().decode("utf-8")


def identity(path):
    """(size, modification time in ns) of a file: what tells a changed input from the one written before."""
    if is_remote(path):
        st = _gfile().stat(path)
        return st.length, st.mtime_nsec
    st = os.stat(path)
    return st.st_size, st.st_mtime_ns


def size(path):
    return _gfile().stat(path).length if is_remote(path) else os.path.getsize(path)


def open(path, mode="r"):  # noqa: A001  (mirrors builtins.open)
    return _gfile().GFile(path, mode) if is_remote(path) else builtins.open(path, mode)
