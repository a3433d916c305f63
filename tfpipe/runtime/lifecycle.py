"""How every tfpipe process ends: one policy for the signals that stop a command, and for the processes it starts.

- **The table** (``STOPS``): Ctrl-C (SIGINT) ends a command with exit code 130 and the line ``PROG: interrupted``,
  SIGTERM (a preempted VM, a notebook's time limit, a scheduler) with 143 and ``PROG: terminated (SIGTERM)`` --
  the codes a shell gives. ``run_cli`` installs it for every command (``stopping_on_signals``): SIGTERM raises
  ``Terminated`` (a ``KeyboardInterrupt``), so what a command wrote is kept and its temporaries removed, as for
  Ctrl-C.
- **Stops at a safe point** (``deferred_stops``): where stopping mid-way would lose work (a training step), the
  signal is noted and the code stops at its next safe point (``train.fit`` saves the step first).
- **A command whose main thread waits in C++** (a server): ``signals_held`` + ``wait_for_a_stop`` (``sigwait``).
- **Ending at once** (``exit_now``) with what was written passed on, from any thread.
- **Children that die with their parent** (principle 4 of docs/project/reliability.md): a DataLoader worker, a
  pool worker, a subprocess (``die_with_parent`` and its makers), and the launcher side, ranks stopped when their
  launcher leaves (``stop_processes``); a DataLoader worker that died is one line in the process it served
  (``dead_worker_line``), not the traceback of the error its death caused there.

No TensorFlow here: every command, the PyTorch ones too, uses it.
"""

from __future__ import annotations

import contextlib
import functools
import multiprocessing
import os
import re
import select
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from types import TracebackType
from typing import Any, NoReturn

from tfpipe.runtime.console import FORWARD_SECONDS, FORWARDER

PR_SET_PDEATHSIG = 1  # linux/prctl.h


# How every process of tfpipe ends -- a command, a rank of a recipe, a server -- by exit code (0: done):
PARENT_GONE = 1  # a child (a DataLoader or pool worker, a rank) whose parent died: ended, nobody to tell
BAD_INPUT = 2  # after its one line: a TfpipeError, an OSError naming its file, a DataLoader worker that died
LOST_A_RANK = 3  # a spawned rank that only lost another rank: its launcher names the one that went first
INTERRUPTED = 130  # Ctrl-C (SIGINT): the code a shell gives
TERMINATED = 143  # SIGTERM: the code a shell gives
# stdout's reader closed it (``| head`` had what it wanted): 128 + SIGPIPE, the code a shell gives a Unix tool that
# SIGPIPE ends (Python ignores SIGPIPE, so the write raises instead); nothing said -- there is no one to read it
READER_GONE = 141
EXITS: dict[int, str] = {
    PARENT_GONE: "a child ended because its parent died",
    BAD_INPUT: "one line said why (bad input, a full disk, a worker that died)",
    LOST_A_RANK: "a rank lost another rank; its launcher says which",
    INTERRUPTED: "interrupted (SIGINT)",
    READER_GONE: "its output's reader closed the pipe (| head): ended quietly",
    TERMINATED: "terminated (SIGTERM)",
}

# signal -> (exit code, the words of the command's last line)
STOPS: dict[int, tuple[int, str]] = {
    signal.SIGINT: (INTERRUPTED, "interrupted"),
    signal.SIGTERM: (TERMINATED, "terminated (SIGTERM)"),
}


class Terminated(KeyboardInterrupt):
    """A command told to stop (SIGTERM; SIGINT where it was deferred to a safe point): ended as Ctrl-C is (what
    it wrote is kept, its own temporaries removed), with its message as the line and the table's exit code for
    ``signum``; ``at``: where it stopped, when at a safe point ("epoch 2, step 5")."""

    def __init__(self, line: str | None = None, signum: int = signal.SIGTERM, at: str = "") -> None:
        super().__init__(STOPS[signum][1] if line is None else line)
        self.code, self.signum, self.at = STOPS[signum][0], signum, at


def ending(stop: KeyboardInterrupt) -> tuple[int, str]:
    """(exit code, words after ``PROG: ``) of a command ended by ``stop``: a ``Terminated`` says its own line,
    Ctrl-C is ``interrupted`` (with what the code added)."""
    if isinstance(stop, Terminated):
        return stop.code, str(stop)
    code, words = STOPS[signal.SIGINT]
    return code, words + (f": {stop}" if str(stop) else "")


def with_detail(stop: KeyboardInterrupt, detail: str) -> KeyboardInterrupt:
    """The same stop (Ctrl-C or SIGTERM: the same exit code) with ``detail`` added to its line: what was kept and
    how to go on (``PROG: terminated (SIGTERM): 3 of 8 shards were finished ...``)."""
    if isinstance(stop, Terminated):
        return Terminated(f"{stop}: {detail}", stop.signum, stop.at)
    return KeyboardInterrupt(detail)


def _terminate(signum: int, frame: Any) -> None:
    raise Terminated()


@contextlib.contextmanager
def stopping_on_signals() -> Iterator[None]:
    """Within the block SIGTERM raises ``Terminated`` as Ctrl-C raises ``KeyboardInterrupt`` (``run_cli`` wraps
    every command in it); the handler before is put back after. Python sets handlers from the main thread only:
    elsewhere (a command run in a thread) nothing changes."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    with sigterm_restored():
        on_sigterm(_terminate)
        yield


def on_sigterm(handler: Callable[[int, Any], None]) -> None:
    """Installs ``handler`` for SIGTERM (main thread only): for a launcher whose own handler fails (Lightning's;
    ``train.torch.lightning_ranks.StopOnSigterm``). Every signal handler of tfpipe is installed in this module."""
    signal.signal(signal.SIGTERM, handler)


@contextlib.contextmanager
def sigterm_restored() -> Iterator[None]:
    """SIGTERM does after the block what it did before: what the block installs (TensorFlow's coordination
    service its preemption notice, Lightning its own handler) is taken back. The handler Python knew is put
    back; from the main thread only, where Python's handlers are set."""
    main = threading.current_thread() is threading.main_thread()
    before = signal.getsignal(signal.SIGTERM) if main else None
    try:
        yield
    finally:
        if before is not None:  # None: a handler Python did not install, which it cannot put back
            signal.signal(signal.SIGTERM, before)


def stdout_reader_gone(error: BaseException) -> bool:
    """Whether ``error`` is a write to standard output whose reader closed it (``| head`` read what it wanted):
    the write end of a pipe whose read end is gone polls as an error. A broken pipe elsewhere (a socket, a child's
    stdin) is not, and stays an error."""
    if not isinstance(error, BrokenPipeError):
        return False
    try:
        fd = sys.stdout.fileno()
    except (AttributeError, OSError, ValueError):  # no descriptor (a notebook's stream, a test's capture)
        return False
    if not hasattr(select, "poll"):  # no poll (Windows): Python's own recipe, every broken pipe is stdout's
        return True
    poller = select.poll()
    poller.register(fd, select.POLLOUT)
    return any(events & (select.POLLERR | select.POLLHUP) for _, events in poller.poll(0))


def quiet_for_a_gone_reader() -> int:
    """After ``stdout_reader_gone``: standard output pointed at ``os.devnull`` (Python's documented recipe), so the
    flush at exit writes nowhere instead of raising again; returns ``READER_GONE``, the exit code."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    os.close(devnull)
    return READER_GONE


class Deferred:
    """The stop noted by ``deferred_stops``: ``received`` is the signal (None: none yet)."""

    def __init__(self) -> None:
        self.received: int | None = None

    def stop(self, where: str, at: str = "") -> NoReturn:
        """Ends the command now, its line the table's words and ``where`` (what was saved, how to go on); ``at``:
        the safe point, for the record ("epoch 2, step 5")."""
        assert self.received is not None
        raise Terminated(f"{STOPS[self.received][1]} {where}", self.received, at)


@contextlib.contextmanager
def deferred_stops() -> Iterator[Deferred]:
    """Within the block SIGINT and SIGTERM are noted in the ``Deferred`` it gives, not raised: the code looks at
    ``received`` where stopping keeps its work (a training step's end) and calls ``stop``. A second signal raises
    at once (a user who presses Ctrl-C twice does not want to wait). Main thread only, as every handler."""
    deferred = Deferred()
    if threading.current_thread() is not threading.main_thread():
        yield deferred
        return

    def note(signum: int, frame: Any) -> None:
        if deferred.received is not None:
            raise Terminated(None, signum)
        deferred.received = signum

    before = {signum: signal.signal(signum, note) for signum in STOPS}
    try:
        yield deferred
    finally:
        for signum, handler in before.items():
            signal.signal(signum, handler)


@contextlib.contextmanager
def signals_held() -> Iterator[None]:
    """The stop signals blocked in this thread and every thread it starts (TensorFlow's, gRPC's), for
    ``wait_for_a_stop``: call it before any thread starts. The caller's mask is put back after (a signal held
    meanwhile is dropped: the block's own end is the answer)."""
    held = signal.pthread_sigmask(signal.SIG_BLOCK, set(STOPS))
    try:
        yield
    finally:
        with contextlib.suppress(KeyboardInterrupt):
            signal.pthread_sigmask(signal.SIG_SETMASK, held)


def wait_for_a_stop(prog: str) -> NoReturn:
    """Waits for Ctrl-C or SIGTERM (held by ``signals_held``), says the table's line and ends the process at once.

    A Python handler runs only when the main thread does: a signal the kernel hands to another thread leaves a main
    thread asleep in C++ (a server's ``join``), and a Ctrl-C can be lost on a loaded machine; ``sigwait`` takes it
    whichever thread it came to. Ending at once: a TensorFlow server's own stop, as the process ends normally, can
    take over a minute on a loaded machine."""
    received = signal.sigwait(set(STOPS))
    code, words = STOPS[received]
    print(f"{prog}: {words}", file=sys.stderr)
    exit_now(code)  # the line passes TensorFlow's log filter first


def exit_now(code: int) -> NoReturn:
    """``os._exit(code)`` that keeps what was written to stderr: for a thread that must end the process while the
    main thread is stuck in C++ (where no Python exception reaches it). Under ``quiet_tensorflow`` fd 2 is a pipe
    whose lines a daemon thread passes on, and ``os._exit`` alone would end that thread before it had (the line
    saying why would be lost): this closes the pipe's end here and waits for the thread to pass the rest on. What was
    printed to stdout is written first."""
    with contextlib.suppress(OSError, ValueError):
        sys.stdout.flush()
    with contextlib.suppress(OSError, ValueError):
        sys.stderr.flush()
    forwarders = [thread for thread in threading.enumerate() if thread.name == FORWARDER]
    if forwarders:
        os.close(2)  # the thread reads to the end (a child still holding the pipe: its lines so far, then the wait)
        for thread in forwarders:
            thread.join(timeout=FORWARD_SECONDS)
    os._exit(code)


def stop_processes(processes: Sequence[Any], grace_seconds: float = 5.0) -> None:
    """The launcher side: every process of ``processes`` (``multiprocessing.Process`` objects) still running is
    sent SIGTERM, and SIGKILL after ``grace_seconds`` (a rank waiting in a collective ignores SIGTERM)."""
    for p in processes:
        if p.is_alive():
            p.terminate()
    deadline = time.monotonic() + grace_seconds
    for p in processes:
        p.join(max(0.0, deadline - time.monotonic()))
        if p.is_alive():
            p.kill()
            p.join()


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
            os._exit(PARENT_GONE)

        threading.Thread(target=watch, daemon=True, name="tfpipe-parent-watch").start()
    if os.getppid() != parent_pid:  # the parent died before the line above took effect
        os._exit(PARENT_GONE)


def _killed_by_the_kernel_at_parent_death() -> bool:
    """Asks Linux for SIGKILL when the parent (thread) ends (``PR_SET_PDEATHSIG``); False where that is not there."""
    import ctypes

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
            os._exit(PARENT_GONE)  # the parent died between starting this worker and now
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


WORKER_DIED = re.compile(r"DataLoader worker \(pids?(?:\(s\))? ([\d, ]+)\) (is killed by signal: [^.\n]+|[^\n]+)")


def dead_worker_line(error: BaseException) -> str | None:
    """What a DataLoader worker's death (the kernel's out-of-memory killer, a ``kill -9``) looks like in the error
    it caused in the process reading from it, in one line -- None when no worker died. torch's own
    ("DataLoader worker (pid N) is killed by signal: Killed") is in the error or one it was raised from; a worker
    killed while it handed over a batch's shared memory shows instead as the connection to it breaking (an
    ``EOFError``, a ``ConnectionResetError``), and the loader's iterator in the traceback names the worker."""
    chain = error_chain(error)
    said = [m for e in chain for m in WORKER_DIED.finditer(str(e))]
    if said:  # the most precise: a signal's name before "exited unexpectedly"
        best = min(said, key=lambda m: not m.group(2).startswith("is killed"))
        return f"DataLoader worker (pid {best.group(1)}) {best.group(2).strip()}"
    for e in chain:
        for worker in _loader_workers(e.__traceback__):
            code = _exit_code(worker)
            if code:
                how = f"is killed by signal: {signal.strsignal(-code)}" if code < 0 else f"exited with code {code}"
                return f"DataLoader worker (pid {worker.pid}) {how}"
    return None


def error_chain(error: BaseException) -> list[BaseException]:
    """``error``, then what it was raised from or while handling, and so on."""
    chain: list[BaseException] = []
    while error is not None and error not in chain:
        chain.append(error)
        error = error.__cause__ or error.__context__  # type: ignore[assignment]
    return chain


def stop_behind(error: BaseException) -> KeyboardInterrupt | None:
    """The stop (Ctrl-C, a ``Terminated``) that ``error`` was raised while handling, if any: a SIGTERM to the
    whole process group (``timeout``, ``kill -- -PGID``, a scheduler) also ends the DataLoader workers, and
    torch's SIGCHLD handler raises its "worker is killed" error while this process is already stopping."""
    return next((e for e in error_chain(error) if isinstance(e, KeyboardInterrupt)), None)


def _loader_workers(tb: TracebackType | None) -> list[Any]:
    """The worker processes of the DataLoader iterators (torch's ``_workers``) that frames of ``tb`` belong to."""
    workers: list[Any] = []
    while tb is not None:
        owner = tb.tb_frame.f_locals.get("self")
        found = getattr(owner, "_workers", None)
        if isinstance(found, list) and "torch" in type(owner).__module__:
            workers += [w for w in found if w not in workers and hasattr(w, "exitcode")]
        tb = tb.tb_next
    return workers


def _exit_code(worker: Any) -> int | None:
    """A worker process's exit code (negative: the signal's number), None while it runs or where it is unknown."""
    try:
        worker.join(timeout=0.2)  # a worker killed mid-handover closed its end a moment before it ended
        return worker.exitcode
    except (AssertionError, ValueError):  # not this process's child, or closed already
        return None
