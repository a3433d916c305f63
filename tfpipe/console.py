"""What a command shows on the terminal: TensorFlow's start-up lines are held back unless asked for.

TensorFlow 2.21 and absl log through C++ straight to file descriptor 2 (``All log messages before
absl::InitializeLog() are written to STDERR``, oneDNN, cudart/cuInit on machines without a GPU, XLA service
lines), and several of those ignore ``TF_CPP_MIN_LOG_LEVEL``. Under a command (``run_cli``) a thread reads fd 2
through a pipe and forwards everything except absl-formatted info/warning/error lines (``I0000 12:00:00.0 ...``),
the same lines in older TensorFlow's format (``2026-11-23 07:13:30.53: E ...``) and the one absl preamble;
Python's own output, tqdm's bars and our errors pass untouched. Set
``TFPIPE_VERBOSE=1`` to see everything. Nothing happens on import, and nothing when tfpipe is used from Python.
"""

from __future__ import annotations

import contextlib
import os
import re
import sys
import threading
from collections.abc import Iterator

VERBOSE_ENV = "TFPIPE_VERBOSE"
PREAMBLE = b"WARNING: All log messages before absl::InitializeLog()"
NOISE = re.compile(
    rb"^(?:[IWE]\d{4} [\d:.]+ +\d+ [\w./-]+:\d+\]"  # absl's line prefix: I0000 00:00:17.9 123 f.cc:1]
    rb"|\d{4}-\d\d-\d\d [\d:.]+: [IWE] [\w./-]+:\d+\]"  # TensorFlow <= 2.19's: 2026-11-23 07:13:30.5: E f.cc:4]
    rb"|" + re.escape(PREAMBLE) + rb"|To enable the following instructions: .* rebuild TensorFlow)"
)  # cpu_feature_guard's 2nd line
PYTHON_LOGGERS = ("tensorflow", "absl")  # INFO:tensorflow:Using MirroredStrategy ... (Python logging)


def verbose() -> bool:
    return os.environ.get(VERBOSE_ENV, "") not in ("", "0")


@contextlib.contextmanager
def quiet_tensorflow() -> Iterator[None]:
    """Holds back TensorFlow's and absl's start-up lines for the duration (see the module docstring)."""
    if verbose():
        yield
        return
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")  # before TensorFlow is imported: what it does honour
    with _python_loggers_quiet(), _fd2_filtered():
        yield


@contextlib.contextmanager
def _python_loggers_quiet() -> Iterator[None]:
    import logging

    saved = {name: logging.getLogger(name).level for name in PYTHON_LOGGERS}
    for name in PYTHON_LOGGERS:
        logging.getLogger(name).setLevel(logging.WARNING)
    try:
        yield
    finally:
        for name, level in saved.items():
            logging.getLogger(name).setLevel(level)


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
    thread = threading.Thread(target=_forward, args=(read_end, real), daemon=True, name="tfpipe-stderr")
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


def _forward(read_end: int, real: int) -> None:
    """Copies the pipe to the real stderr, dropping whole noise lines; text that is not yet a whole line (a
    progress bar's ``\\r`` update) is passed on at once unless it could still become a noise line."""
    pending = b""
    with os.fdopen(read_end, "rb", buffering=0) as pipe:
        while True:
            chunk = pipe.read(65536)
            if not chunk:
                break
            pending += chunk
            *lines, pending = pending.split(b"\n")
            out = b"".join(line + b"\n" for line in lines if not NOISE.match(line))
            if pending and not _could_be_noise(pending):
                out, pending = out + pending, b""
            if out:
                os.write(real, out)
    if pending and not NOISE.match(pending):
        os.write(real, pending)


def _could_be_noise(start: bytes) -> bool:
    """Whether an unfinished line may still turn out to be a noise line (so it waits for its end)."""
    head = start[: len(PREAMBLE)]
    return (
        bool(re.match(rb"[IWE]\d{0,4}(?: |$)", start))
        or PREAMBLE.startswith(head)
        or b"To enable the following".startswith(start[:23])
    )
