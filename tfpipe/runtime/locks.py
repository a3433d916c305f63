"""One job per folder: the lock file (``.tfpipe-write.lock``) ``tfpipe.write`` and ``train.fit`` hold while they
write a shard folder or a run folder. A lock names its holder (host, pid, a token of its own); one left by a job
that died is taken over, one that is junk or unreadable is never guessed about (the error says how to clear it).
"""

from __future__ import annotations

import json
import os
import posixpath
import socket
import threading
import time
import uuid
from collections.abc import Mapping
from typing import Any, Literal

from tfpipe.runtime import fs
from tfpipe.runtime.errors import BadFile, TfpipeError, option

LOCK = ".tfpipe-write.lock"  # who is writing this folder now (outside .staging, which a new write clears)
STALE_SECONDS = 10  # an empty or unreadable lock older than this is left by a job that died creating it
METADATA_LOCK_LIMIT = 2**16  # a lock file is a few hundred bytes: what is compared of one


class _HeldHere:
    """The lock tokens this process holds now. A lock's owner is its token, not its host and pid: two jobs of one
    process (two threads calling ``write_shards`` into one folder) share the pid, and a lock naming this pid
    belongs to a live job exactly when its token is held here (else a job of this process that ended without
    removing it left it)."""

    def __init__(self) -> None:
        self._ids: set[str] = set()
        self._guard = threading.Lock()

    def add(self, token: str) -> None:
        with self._guard:
            self._ids.add(token)

    def discard(self, token: str) -> None:
        with self._guard:
            self._ids.discard(token)

    def __contains__(self, token: object) -> bool:
        with self._guard:
            return token in self._ids


HELD_HERE = _HeldHere()  # process state by nature, as a threading.Lock is: filled only while a job holds a lock


def locked_folder(out_dir: str, job: str, fingerprint: str | None = None, setting: str = "out") -> WriteLock:
    """``out_dir`` made (never over a file) and a ``WriteLock`` on it for ``job`` (``tfpipe.write``, ``train.fit``):
    ``with locked_folder(run, "train.fit", setting="run") as lock:``; ``setting`` is what errors call the folder."""
    check_not_a_file(out_dir, setting)
    fs.makedirs(out_dir)
    return WriteLock(out_dir, fingerprint, job)


def check_not_a_file(out_dir: str, setting: str) -> None:
    if fs.exists(out_dir) and not fs.isdir(out_dir):
        raise TfpipeError(f"{out_dir} is a file; {option(setting)} names a folder")


LOCK_TRIES = 20
EMPTY_LOCK_WAIT = 0.05  # seconds between looks at a lock another job has created but not yet written (1 s in all)


class WriteLock:
    """One job per folder (a dataset's writer, a run's trainer): a lock file naming the job (a unique token, host,
    pid, fingerprint), taken before anything in the folder is touched and removed when the job ends.

    Locally the file is created exclusively (``O_EXCL``: atomic). On ``gs://`` and other remote filesystems,
    which have no exclusive create through ``tf.io.gfile``, it is advisory: write, read back, and check again
    before committing (``check``), the usual answer on object stores. A lock left by a job that died on this
    host (``kill -9``) is taken over; one from another host is refused with the way out. A lock of another job of
    this same process (another thread) is live: the job is its token, not its pid (``HELD_HERE``).
    """

    def __init__(self, out_dir: str, fingerprint: str | None, job: str = "tfpipe.write") -> None:
        self.path, self.job = posixpath.join(out_dir, LOCK), job
        self.token: dict[str, Any] = {
            "id": uuid.uuid4().hex,
            "host": socket.gethostname(),
            "pid": os.getpid(),
            "started": time.strftime("%Y-%m-%d %H:%M:%S"),
            "fingerprint": fingerprint,
        }

    def __enter__(self) -> WriteLock:
        HELD_HERE.add(self.token["id"])  # before the file exists: another thread reading it finds a live job
        try:
            for _ in range(LOCK_TRIES):  # again after taking a dead job's lock away, or after waiting on an empty one
                if self._create():
                    return self
                judged = self._file_id()
                holder = self._holder(refuse_junk=True)
                if holder is not None and not self._dead(holder):
                    raise TfpipeError(self._busy(holder))
                if holder is not None or self._stale():
                    self._take_away(judged)
                else:  # created this instant and not written yet: its job names itself in a moment
                    time.sleep(EMPTY_LOCK_WAIT)
            raise TfpipeError(self._busy(self._holder() or {}))
        except BaseException:
            HELD_HERE.discard(self.token["id"])
            raise

    def _file_id(self, path: str | None = None) -> tuple[int, int, int, bytes] | None:
        """The lock file's (device, inode, modification time, content) locally: which file a judgement of it was
        about (an inode number alone is reused at once for the next file made)."""
        path = path or self.path
        if fs.is_remote(path):
            return None
        try:
            with open(path, "rb") as f:
                st = os.fstat(f.fileno())
                return st.st_dev, st.st_ino, st.st_mtime_ns, f.read(METADATA_LOCK_LIMIT)
        except OSError:
            return None

    def _take_away(self, judged: tuple[int, int, int, bytes] | None) -> None:
        """Removes the lock file judged to be a dead job's (``judged``: its ``_file_id``). Another job may have
        removed it since and created its own, live one (two jobs judging one dead lock at once): locally the file is
        first renamed aside (atomic) and put back when it is not the one judged. On a remote filesystem (no
        atomic rename) the lock is advisory: ``check`` before committing catches a job that lost it."""
        if fs.is_remote(self.path):
            if fs.exists(self.path):
                fs.remove(self.path)
            return
        aside = f"{self.path}.{self.token['id']}"
        try:
            os.rename(self.path, aside)
        except FileNotFoundError:
            return  # another job took it away first
        if judged is None or judged != self._file_id(aside):  # a live job's fresh lock: back, unless one took it
            try:
                os.link(aside, self.path)
            except FileExistsError:
                pass
            except PermissionError:  # no hard link to another user's file (protected_hardlinks): move it back
                if not os.path.lexists(self.path):
                    os.rename(aside, self.path)
                    return
        os.remove(aside)

    def _create(self) -> bool:
        data = json.dumps(self.token)
        if fs.is_remote(self.path):
            if fs.exists(self.path):
                return False
            with fs.open(self.path, "w") as f:
                f.write(data)
            return self.held()
        try:
            fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            return False
        try:
            with os.fdopen(fd, "w") as f:
                f.write(data)
        except OSError as e:  # a full disk names no file: name the lock (its empty file turns stale, see _stale)
            raise OSError(e.errno, e.strerror, self.path) from None
        return True

    def _holder(self, refuse_junk: bool = False) -> dict[str, Any] | None:
        """The lock's content, or None when it is gone or still empty (its creator is writing it, or died between
        creating and writing it: ``_stale``). A lock this job cannot read as tfpipe's (another user's unreadable
        file, a link, not JSON, a key twice, no host or pid) is nobody's to take over or ignore: with
        ``refuse_junk`` a ``TfpipeError`` naming the file, else None."""
        try:
            if not fs.is_remote(self.path) and os.path.islink(self.path):
                raise TfpipeError("a symbolic link, not a file")
            data = fs.read_bytes(self.path, METADATA_LOCK_LIMIT)
            if not data:
                return None
            holder = fs.parse_json(data, self.path, "lock file")
            problem = None if isinstance(holder, dict) else "not a JSON object"
        except FileNotFoundError:
            return None
        except OSError as e:  # another user's lock of mode 0600: its job may well be alive
            holder, problem = {}, f"it cannot be read: {e.strerror or e}"
        except BadFile as e:  # not JSON, a key twice, a folder or a large file where the lock should be
            holder, problem = {}, e.detail if e.joined == ": " else str(e)
        except TfpipeError as e:  # a link
            holder, problem = {}, str(e)
        except Exception as e:  # tf.errors.NotFoundError from a remote filesystem
            if type(e).__module__.startswith("tensorflow"):
                return None
            raise
        if problem is None and not (isinstance(holder.get("host"), str) and type(holder.get("pid")) is int):
            problem = "no host and pid of the job that holds it"
        if problem is None:
            return holder
        if refuse_junk:
            raise TfpipeError(
                f"{self.path} is not a lock this job can read as tfpipe's ({problem}), so whether a job still writes "
                f"{posixpath.dirname(self.path)} is unknown; if none does, delete it"
            )
        return None

    def _stale(self) -> bool:
        """An empty lock file (its creator died between creating and writing it) older than ``STALE_SECONDS``:
        nobody holds it."""
        try:
            size, modified = fs.identity(self.path, follow_links=False)
        except (OSError, ValueError):
            return False
        return size == 0 and time.time() - modified / 1e9 > STALE_SECONDS

    def _dead(self, holder: Mapping[str, Any]) -> bool:
        """True for a lock whose job ran on this host and no longer runs."""
        if holder.get("host") != self.token["host"]:
            return False
        try:
            os.kill(int(holder.get("pid", 0)), 0)
        except ProcessLookupError:
            return True
        except (PermissionError, ValueError, OverflowError):
            return False
        # Our own pid: a live job of this process (another thread) if it holds that token now, else one that ended.
        return holder.get("pid") == os.getpid() and holder.get("id") not in HELD_HERE

    def _busy(self, holder: Mapping[str, Any]) -> str:
        folder = posixpath.dirname(self.path)
        if not holder:  # an empty lock younger than STALE_SECONDS: another job is taking the folder just now
            return (
                f"{folder} is being taken by another job just now ({self.path} was created and is still empty); "
                f"wait for it, or if no job writes there delete {self.path}"
            )
        here = holder.get("host") == self.token["host"] and holder.get("pid") == os.getpid()
        who = "this process (another thread)" if here else f"host {holder['host']}, pid {holder['pid']}"
        return (
            f"{folder} is being written by another {self.job} ({who}, started {holder.get('started', '?')}); "
            f"wait for it, or if that job is gone delete {self.path}"
        )

    def held(self) -> bool:
        """Whether the lock file is still ours (a remote lock can be lost to a writer that raced us)."""
        holder = self._holder()
        return holder is not None and holder.get("id") == self.token["id"]

    def check(self) -> None:
        """Before committing: refuse if another writer took the folder meanwhile (remote filesystems)."""
        if not self.held():
            raise TfpipeError(self._busy(self._holder() or {}) + "; this job's output was not committed")

    def __exit__(self, *exc: object) -> Literal[False]:
        try:
            if self.held():
                fs.remove(self.path)
        finally:
            HELD_HERE.discard(self.token["id"])
        return False
