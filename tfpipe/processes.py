"""Child processes that end with their parent (principle 4 of docs/project/reliability.md)."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from typing import NoReturn

PR_SET_PDEATHSIG = 1  # linux/prctl.h


def die_with_parent(parent_pid: int, poll_seconds: float = 1.0) -> None:
    """Ends the calling (child) process when ``parent_pid`` ends, however it ends (``kill -9``, SIGTERM).

    Call it first thing in a child: a DataLoader ``worker_init_fn``, a pool ``initializer``, a ``preexec_fn``
    (the setting survives ``exec``). On Linux the kernel sends SIGKILL at the parent's death
    (``PR_SET_PDEATHSIG``) -- also to a child blocked writing into a pipe nobody reads, where torch's own
    parent check never runs; elsewhere a daemon thread watches the parent id.
    """
    import ctypes
    import signal

    try:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    except (AttributeError, OSError):  # not Linux: poll instead

        def watch() -> NoReturn:
            while os.getppid() == parent_pid:
                time.sleep(poll_seconds)
            os._exit(1)

        threading.Thread(target=watch, daemon=True, name="tfpipe-parent-watch").start()
    if os.getppid() != parent_pid:  # the parent died before the line above took effect
        os._exit(1)


def child_of_this_process() -> Callable[[], None]:
    """A ``preexec_fn`` for ``subprocess``: the child dies with this process."""
    parent = os.getpid()
    return lambda: die_with_parent(parent)


def worker_dies_with_parent(parent_pid: int, worker_id: int) -> None:
    """A DataLoader ``worker_init_fn``, as ``functools.partial(worker_dies_with_parent, os.getpid())``: the worker
    ends with the process that made the loader. Under ``forkserver`` a worker's parent is the server, not that
    process: torch's own check of the loader's process is left to cover it."""
    if os.getppid() == parent_pid:
        die_with_parent(parent_pid)
