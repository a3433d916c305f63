"""What a command shows on the terminal: TensorFlow's start-up lines are held back unless asked for.

TensorFlow 2.21 and absl log through C++ straight to file descriptor 2 (``All log messages before
absl::InitializeLog() are written to STDERR``, oneDNN, cudart/cuInit on machines without a GPU, XLA service
lines), and several of those ignore ``TF_CPP_MIN_LOG_LEVEL``. Under a command (``run_cli``) a thread reads fd 2
through a pipe and forwards everything except absl-formatted info/warning/error lines (``I0000 12:00:00.0 ...``),
the same lines in older TensorFlow's format (``2026-11-23 07:13:30.53: E ...``) and the one absl preamble;
Python's own output, tqdm's bars and our errors pass untouched. The public calls that run TensorFlow for long
(``train.fit.fit``, ``train.predict.predict``) do the same while they run, in a notebook too (``quiet_call``),
without touching the environment. Set ``TFPIPE_VERBOSE=1`` to see everything. Nothing happens on import.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import io
import os
import re
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from typing import ParamSpec, TextIO, TypeVar

P = ParamSpec("P")
R = TypeVar("R")

VERBOSE_ENV = "TFPIPE_VERBOSE"
PREAMBLE = b"WARNING: All log messages before absl::InitializeLog()"
GLOO = b"[Gloo] Rank "  # on stdout: train.backends.jax.cluster_devices sends it to stderr while groups connect
NOISE = re.compile(
    rb"^(?:[IWE]\d{4} [\d:.]+ +\d+ [\w./-]+:\d+\]"  # absl's line prefix: I0000 00:00:17.9 123 f.cc:1]
    rb"|\d{4}-\d\d-\d\d [\d:.]+: [IWE] [\w./-]+:\d+\]"  # TensorFlow <= 2.19's: 2026-11-23 07:13:30.5: E f.cc:4]
    rb"|" + re.escape(PREAMBLE) + rb"|To enable the following instructions: .* rebuild TensorFlow"  # cpu_feature_guard
    rb"|\*\*\* (?:Begin|End) stack trace \*\*\*"  # XLA's C++ stack trace of a failed compile (its frames indented)
    # JAX's CPU collectives as each group connects, one line a device's thread: lines that interleave too
    rb"|" + re.escape(GLOO) + rb"|.*is connected to \d+ peer ranks\. Expected number of connected peer ranks is : \d+$)"
)
# An indented line: part of the log message above it (not a bar's \r); a stack trace's frames, blank ones too.
CONTINUATION = re.compile(
    rb"^(?:[ \t]+(?:\S|$)"  # indented: a node name, a stack frame
    # the unindented lines of the distributed runtime's messages (a task, gRPC's and the coordination service's
    # words) after an error line: a multi-worker job whose peer is gone
    rb"|/job:\w+(?:/replica:\d+)?/task:\d+\S*$|The tasks have crashed\.|The error could be from a previous operation"
    rb"|Additional GRPC error information|:\w+:Error received from peer)"
)
# The start of a TensorFlow <= 2.19 line, up to its file name (2026-11-23 07:13:30.5: W tensorflow/core/x.cc:4)
OLD_FORMAT_START = re.compile(
    rb"\d{1,4}(?:-\d{0,2}(?:-\d{0,2}"  # the date
    rb"(?: [\d:.]*(?::(?: (?:[IWE](?: [\w./-]*(?::\d*)?)?)?)?)?)?)?)?"  # the time, level, file and line
)
PYTHON_LOGGERS = ("tensorflow", "absl")  # INFO:tensorflow:Using MirroredStrategy ... (Python logging)
FORWARDER = "tfpipe-stderr"  # the thread that passes fd 2 on through the filter (quiet_tensorflow)
FORWARD_SECONDS = 2.0  # exit_now's wait for the filter to pass on what was written


def verbose() -> bool:
    return os.environ.get(VERBOSE_ENV, "") not in ("", "0")


_QUIET: contextvars.ContextVar[bool] = contextvars.ContextVar("tfpipe_quiet", default=False)


@contextlib.contextmanager
def quiet_tensorflow(environment: bool = True) -> Iterator[None]:
    """Holds back TensorFlow's and absl's log lines for the duration (see the module docstring).

    ``environment``: also set ``TF_CPP_MIN_LOG_LEVEL`` (what TensorFlow honours when it is imported later) --
    a command's ``main`` does; a library call does not, and changes nothing that outlives it. Nested uses are
    one (the outermost filters)."""
    if verbose() or _QUIET.get():
        yield
        return
    if environment:
        os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    token = _QUIET.set(True)
    try:
        with _python_loggers_quiet(), _fd2_filtered():
            yield
    finally:
        _QUIET.reset(token)


def quiet_call(fn: Callable[P, R]) -> Callable[P, R]:
    """Decorator of the public calls that run TensorFlow for long (``fit``, ``predict``): their C++ log lines
    (``Local rendezvous is aborting ... OUT_OF_RANGE``, a partially cached dataset, cuInit on a machine without a
    GPU) are held back while they run, also in a notebook cell; ``TFPIPE_VERBOSE=1`` shows them."""

    @functools.wraps(fn)
    def wrapper(*args: P.args, **kwargs: P.kwargs) -> R:
        with quiet_tensorflow(environment=False):
            return fn(*args, **kwargs)

    return wrapper


# tf-keras' "Callback method `on_train_batch_end` is slow compared to the batch time": with steps_per_execution
# and several replicas the hook's time includes waiting for the step's results (the logs it hands on), so the
# warning fires on 8 replicas with nothing slow in any callback; TFPIPE_VERBOSE=1 shows it
HELD_BACK = ("Callback method `",)


def _not_held_back(record: object) -> bool:
    return not str(getattr(record, "msg", "")).startswith(HELD_BACK)


@contextlib.contextmanager
def _python_loggers_quiet() -> Iterator[None]:
    import logging

    saved = {name: logging.getLogger(name).level for name in PYTHON_LOGGERS}
    for name in PYTHON_LOGGERS:
        logging.getLogger(name).setLevel(logging.WARNING)
        logging.getLogger(name).addFilter(_not_held_back)
    try:
        yield
    finally:
        for name, level in saved.items():
            logging.getLogger(name).setLevel(level)
            logging.getLogger(name).removeFilter(_not_held_back)


@contextlib.contextmanager
def _fd2_filtered() -> Iterator[None]:
    try:
        sys.stderr.flush()
        real = os.dup(2)
    except (OSError, ValueError):  # no usable fd 2 (e.g. a closed stderr): nothing to filter
        yield
        return
    read_end, write_end = os.pipe()
    os.dup2(write_end, 2)
    os.close(write_end)
    thread = threading.Thread(target=_forward, args=(read_end, real), daemon=True, name=FORWARDER)
    thread.start()
    try:
        yield
    finally:
        try:
            sys.stderr.flush()
        except (OSError, ValueError):
            pass
        os.dup2(real, 2)  # the pipe's last write end closes: the thread reads to the end and stops
        thread.join(timeout=5)
        os.close(real)


@contextlib.contextmanager
def stdout_on_stderr() -> Iterator[None]:
    """Within the block, what C++ libraries print on stdout (file descriptor 1) goes to stderr, where the noise
    filter reads it: gloo prints a ``[Gloo] Rank 0 is connected to ...`` line on stdout as each group of JAX's CPU
    collectives connects. Python's and C's buffers of stdout are flushed before and after (C++ writes through C's
    buffer: a line left there would reach the real stdout later)."""
    import ctypes

    flush_c = ctypes.CDLL(None).fflush
    sys.stdout.flush()
    flush_c(None)
    saved = os.dup(1)
    try:
        os.dup2(2, 1)
        yield
    finally:
        sys.stdout.flush()
        flush_c(None)
        os.dup2(saved, 1)
        os.close(saved)


def _forward(read_end: int, real: int) -> None:
    """Copies the pipe to the real stderr, dropping whole noise lines and the indented lines that continue one
    (``\\t [[{{node MultiDeviceIteratorGetNextFromShard}}]]`` after a rendezvous warning); text that is not yet a
    whole line (a progress bar's ``\\r`` update) is passed on at once unless it could still become one of those."""
    pending, after_noise = b"", False
    with os.fdopen(read_end, "rb", buffering=0) as pipe:
        while True:
            chunk = pipe.read(65536)
            if not chunk:
                break
            pending += chunk
            *lines, pending = pending.split(b"\n")
            kept = []
            for line in lines:
                after_noise = bool(NOISE.match(line) or (after_noise and CONTINUATION.match(line)))
                if not after_noise:
                    kept.append(line + b"\n")
            out = b"".join(kept)
            if pending and not _could_be_noise(pending) and not (after_noise and pending[:1] in (b" ", b"\t")):
                out, pending = out + pending, b""
            if out:
                os.write(real, out)
    if pending and not NOISE.match(pending) and not (after_noise and CONTINUATION.match(pending)):
        os.write(real, pending)


def _could_be_noise(start: bytes) -> bool:
    """Whether an unfinished line may still turn out to be a noise line (so it waits for its end)."""
    head = start[: len(PREAMBLE)]
    return (
        bool(re.match(rb"[IWE]\d{0,4}(?: |$)", start))
        or bool(OLD_FORMAT_START.fullmatch(start))
        or PREAMBLE.startswith(head)
        or b"To enable the following".startswith(start[:23])
        or GLOO.startswith(start[: len(GLOO)])  # gloo's C++ writes its line in pieces
    )


def on_terminal() -> bool:
    """Whether stdout is a terminal (a person watches: progress bars) rather than a log, a pipe or nothing."""
    try:
        return sys.stdout.isatty()
    except (AttributeError, ValueError):  # a closed or replaced stdout
        return False


HEARTBEAT_SECONDS = 15.0  # at most this long without a line while a command works (half the silence test's 30 s)


class Heartbeat:
    """A line every ``every`` seconds while something long runs that prints nothing of its own (compiling a
    step, scoring a validation set): ``PREFIX: DOING (40 s)``, the seconds since ``start``. ``start(doing)``
    begins a wait, ``update(doing)`` renames it (the clock runs on), ``stop()`` ends it; ``touch()`` says output
    was just shown (the next line comes ``every`` s later).
    One daemon thread, started on the first ``start``: it never outlives the process, and a stopped heartbeat
    costs nothing. ``with heartbeat(...)`` does it for one block.

    ``start_outside(doing)`` is for a wait inside TensorFlow's C++ code that holds Python's GIL, where no thread
    of ours can run: the lines come from a small child process instead (see ``OutsideBeat``)."""

    def __init__(self, prefix: str, every: float = HEARTBEAT_SECONDS, out: TextIO | None = None) -> None:
        self.prefix, self.every, self.out = prefix, every, out
        self._lock = threading.Lock()
        self._doing: str | None = None
        self._since = self._last = 0.0
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None
        self._outside: OutsideBeat | None = None

    def start(self, doing: str) -> None:
        self._end_outside()
        with self._lock:
            now = time.monotonic()
            self._doing, self._since, self._last = doing, now, now
        if self._thread is None:
            self._thread = threading.Thread(target=self._beat, daemon=True, name="tfpipe-heartbeat")
            self._thread.start()

    def update(self, doing: str) -> None:
        with self._lock:
            self._doing = doing

    def touch(self) -> None:
        with self._lock:
            self._last = time.monotonic()

    def start_outside(self, doing: str) -> None:
        """Like ``start``, for a wait that holds the GIL; the thread's lines resume with the next ``start``."""
        self.stop()  # ends an earlier outside wait too
        self._outside = OutsideBeat.begin(self.prefix, doing, self.every, self.out or sys.stdout)

    def stop(self) -> None:
        self._end_outside()
        with self._lock:
            self._doing = None

    def _end_outside(self) -> None:
        if self._outside is not None:
            self._outside.close()
            self._outside = None

    def close(self) -> None:
        self.stop()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout=5)

    def _beat(self) -> None:
        while not self._wake.wait(min(1.0, self.every)):
            with self._lock:
                now = time.monotonic()
                if self._doing is None or now - self._last < self.every:
                    continue
                self._last = now
                line = f"{self.prefix}: {self._doing} ({now - self._since:.0f} s)"
            print(line, file=self.out or sys.stdout, flush=True)


# The child of ``OutsideBeat``: standard library only, started with -I -S (no site packages, ~20 ms).
_OUTSIDE_CHILD = """
import os, select, sys, time
prefix, doing, every = sys.argv[1], sys.argv[2], float(sys.argv[3])
start = time.monotonic()
while True:
    ready = select.select([0], [], [], every)[0]
    if ready and not os.read(0, 4096):
        break  # the parent closed the pipe, or died
    if not ready:
        os.write(1, f"{prefix}: {doing} ({time.monotonic() - start:.0f} s)\\n".encode())
"""


class OutsideBeat:
    """Heartbeat lines written by a child process to this process's stdout file descriptor, for a wait in
    TensorFlow's C++ code that holds the GIL. At the end of ``model.fit`` and ``model.predict`` on
    several replicas, destroying the input pipeline's iterators sometimes waits for a tf.data autotuning
    thread's timed sleep (up to 60 s, longer with several iterators) while holding the GIL, so a thread's
    heartbeat falls silent exactly then. (TensorFlow's CancellationManager wakes that thread before it marks
    itself cancelled; a thread that wakes in between goes back to sleep. See docs/project/reliability.md.)
    The child reads a pipe from this process: it ends at ``close()``, and also when this process dies (the pipe
    closes), so it never outlives its parent."""

    def __init__(self, proc: subprocess.Popen[bytes]) -> None:
        self.proc = proc

    @classmethod
    def begin(cls, prefix: str, doing: str, every: float, out: TextIO) -> OutsideBeat | None:
        """None where ``out`` is not a plain file with a descriptor (a test's StringIO; a notebook's stream, whose
        descriptor would lead to the server's console, not the cell)."""
        if not isinstance(out, io.TextIOWrapper):
            return None
        try:
            fd = out.fileno()
            out.flush()
        except (AttributeError, OSError, ValueError):
            return None
        argv = [sys.executable, "-I", "-S", "-c", _OUTSIDE_CHILD, prefix, doing, str(every)]
        return cls(subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=fd, stderr=subprocess.DEVNULL))

    def close(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.close()
        try:
            self.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


@contextlib.contextmanager
def heartbeat(
    prefix: str, doing: str, every: float = HEARTBEAT_SECONDS, out: TextIO | None = None
) -> Iterator[Heartbeat]:
    """``Heartbeat(prefix).start(doing)`` for the block (see ``Heartbeat``)."""
    beat = Heartbeat(prefix, every, out)
    beat.start(doing)
    try:
        yield beat
    finally:
        beat.close()


@contextlib.contextmanager
def saying(prefix: str, line: str | None, still: str, enabled: bool = True) -> Iterator[None]:
    """``PREFIX: LINE`` (unless ``line`` is None: said already), then a heartbeat (``PREFIX: still ... (40 s)``)
    while the block runs; nothing at all unless ``enabled`` (a command's quiet setting)."""
    if not enabled:
        yield
        return
    if line is not None:
        print(f"{prefix}: {line}", flush=True)
    with heartbeat(prefix, still):
        yield


def counted(n: int, noun: str) -> str:
    """``1 image`` / ``3 images``: a count and its noun, in the plural unless it is one."""
    return f"{n} {noun}{'s' * (n != 1)}"
