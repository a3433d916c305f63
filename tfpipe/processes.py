"""Child processes that end with their parent (principle 4 of docs/project/reliability.md)."""

from __future__ import annotations

import functools
import multiprocessing
import os
import re
import socket
import sys
import threading
import time
from collections.abc import Callable
from types import TracebackType
from typing import NoReturn

PR_SET_PDEATHSIG = 1  # linux/prctl.h
MAX_PORT = 65535


def die_with_parent(parent_pid: int, poll_seconds: float = 1.0, thread_bound: bool = True) -> None:
    """Ends the calling (child) process when ``parent_pid`` ends, however it ends (``kill -9``, SIGTERM).

    Call it first thing in a child: a DataLoader ``worker_init_fn``, a pool ``initializer``, a ``preexec_fn``
    (the setting survives ``exec``). On Linux the kernel sends SIGKILL at the parent's death
    (``PR_SET_PDEATHSIG``) -- also to a child blocked writing into a pipe nobody reads, where torch's own
    parent check never runs; elsewhere a daemon thread watches the parent id. The kernel's signal comes when
    the parent *thread* that started the child ends: a child started from another thread than the parent's main
    thread (a DataLoader first iterated in a thread that then ended) passes ``thread_bound=False`` and is watched
    by the thread instead.
    """
    if not (thread_bound and _killed_by_the_kernel_at_parent_death()):  # not Linux, or not the main thread: poll

        def watch() -> NoReturn:
            while os.getppid() == parent_pid:
                time.sleep(poll_seconds)
            os._exit(1)

        threading.Thread(target=watch, daemon=True, name="tfpipe-parent-watch").start()
    if os.getppid() != parent_pid:  # the parent died before the line above took effect
        os._exit(1)


def _killed_by_the_kernel_at_parent_death() -> bool:
    """Asks Linux for SIGKILL when the parent (thread) ends (``PR_SET_PDEATHSIG``); False where that is not there."""
    import ctypes
    import signal

    try:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    except (AttributeError, OSError):
        return False
    return True


def child_of_this_process() -> Callable[[], None]:
    """A ``preexec_fn`` for ``subprocess``: the child dies with this process."""
    parent = os.getpid()
    return lambda: die_with_parent(parent)


def loader_dies_with_this_process(start_method: str | None = None) -> Callable[[int], None]:
    """The ``worker_init_fn`` of a DataLoader this process iterates: every worker ends with this process, whichever
    thread starts the workers (``persistent_workers`` started in a thread that ends live on) and however late (a
    worker whose parent died while it started exits at once). ``start_method``: the loader's
    ``multiprocessing_context`` (default: multiprocessing's). A worker's ``sys.excepthook`` holds back the
    resource sharer's traceback of a reader stopped mid-connection (``quiet_resource_sharer``)."""
    method = start_method or multiprocessing.get_start_method()
    return functools.partial(
        worker_dies_with_parent, os.getpid(), main_thread=threading.main_thread().ident, method=method
    )


def worker_dies_with_parent(
    parent_pid: int, worker_id: int, main_thread: int | None = None, method: str | None = None
) -> None:
    """A DataLoader ``worker_init_fn`` (made by ``loader_dies_with_this_process``): the worker ends with the process
    that made the loader. Under ``forkserver`` a worker's parent is the server, not that process: torch's own check
    of the loader's process is left to cover it. A forked or spawned worker whose parent is already gone (it died
    while the worker started) exits; one started from another thread than the parent's ``main_thread``, or
    spawned, is watched by a thread (``die_with_parent``). ``method``: the loader's start method (None: unknown).
    The worker's resource sharer stays quiet when the loader's process stops (``quiet_resource_sharer``)."""
    quiet_resource_sharer()
    if os.getppid() != parent_pid:
        if method in ("fork", "spawn"):
            os._exit(1)  # the parent died between starting this worker and now
        return
    forked_from_main = method in (None, "fork") and (main_thread is None or threading.get_ident() == main_thread)
    die_with_parent(parent_pid, thread_bound=forked_from_main)


def quiet_resource_sharer() -> None:
    """This process's ``sys.excepthook`` passes on everything but the traceback multiprocessing's resource sharer
    thread prints when a consumer's connection to it breaks. A DataLoader worker serves its batches' shared memory
    through that thread, and a process that reads them and is stopped (Ctrl-C, a rank ended by its launcher)
    breaks the connection: the worker, which is about to end with it, would print 20 lines of traceback first."""
    sys.excepthook = functools.partial(_without_a_broken_sharer, sys.excepthook)  # the sharer calls it directly


def _without_a_broken_sharer(
    previous: Callable[..., object], kind: type[BaseException], error: BaseException, tb: TracebackType | None
) -> None:
    frames, step = [], tb
    while step is not None:
        frames.append(step.tb_frame.f_code.co_filename)
        step = step.tb_next
    broken = issubclass(kind, (ConnectionResetError, BrokenPipeError))
    if not (broken and any(f.endswith("resource_sharer.py") for f in frames)):
        previous(kind, error, tb)


def host_and_port(address: object) -> tuple[str, int] | None:
    """``HOST:PORT`` as (host, port), the port any number (the caller says which it dials); None when ``address``
    is not of that form (no host, no port, a port that is not 1-5 ASCII digits, not a string)."""
    if not isinstance(address, str):
        return None
    host, _, port = address.rpartition(":")
    return (host, int(port)) if host and re.fullmatch("[0-9]{1,5}", port) else None  # "²".isdigit()


def free_port() -> int:
    """A port free on 127.0.0.1 now, for a server or process group this job starts on this machine."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])
