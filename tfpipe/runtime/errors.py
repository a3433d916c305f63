"""One exception type for problems the user can fix, and the CLI edge that prints it."""

from __future__ import annotations

import argparse
import contextlib
import contextvars
import errno
import math
import numbers
import os
import sys
import warnings
from collections.abc import Callable, Iterator
from typing import Any, NoReturn, TextIO

from tfpipe.runtime.lifecycle import (
    BAD_INPUT,
    dead_worker_line,
    ending,
    quiet_for_a_gone_reader,
    stdout_reader_gone,
    stop_behind,
    stopping_on_signals,
)
from tfpipe.runtime.lifecycle import Terminated as Terminated  # importable from here too

_COMMAND: contextvars.ContextVar[str | None] = contextvars.ContextVar(
    "tfpipe_command", default=None
)  # the running command's name, under run_cli


class TfpipeError(Exception):
    """Bad input or configuration: shown to the user as one line, no traceback. Its kinds (below) let a notebook
    catch one apart from the others; every kind is still one line and exit code 2 at a command."""


class BadSetting(TfpipeError):
    """A setting or argument out of range, of the wrong type, or naming nothing known (``--lr -1``,
    ``--strategy tpuu``, ``batch_size=2.5``)."""


class ShardsChanged(TfpipeError):
    """The shards a job opened were rewritten, replaced or resized while it ran: what it made from them would
    be of other data."""


class RunMismatch(TfpipeError):
    """A run or CV folder that is not what it is taken for: another run's, another fold's, edited, damaged or
    unfinished."""


class MissingDependency(TfpipeError, ImportError):
    """An optional package the call needs is not installed (the message names the pip install)."""


class BadFile(TfpipeError):
    """A file tfpipe reads -- a manifest, a run or lock file -- that is not what it should be: its ``path``, what
    is wrong (``problem``) and what to do (``remedy``, may be empty), as fields; the message is
    ``PATH: PROBLEM; REMEDY`` (``joined`` between path and problem)."""

    def __init__(self, path: str, problem: str = "", remedy: str = "", joined: str = ": ") -> None:
        # one argument: the whole message (as torch rebuilds an error raised in a DataLoader worker)
        self.path, self.problem, self.remedy, self.joined = path, problem, remedy, joined
        super().__init__(f"{path}{joined}{self.detail}" if problem else path)

    @property
    def detail(self) -> str:
        """The message without the path: the problem and the remedy."""
        return self.problem + (f"; {self.remedy}" if self.remedy else "")

    def __reduce__(self) -> tuple[type, tuple[str, str, str, str]]:  # pickled across processes whole
        return BadFile, (self.path, self.problem, self.remedy, self.joined)


class NoAccelerator(TfpipeError):
    """The hardware asked for (``--strategy tpu`` or ``gpu``) is not in this environment."""


def option(name: str, value: object = None, python: str | None = None) -> str:
    """A setting as the user wrote it: ``--skip-bad`` / ``--num-folds 4`` / ``--tta`` / ``--no-report`` (False)
    under a command,
    ``skip_bad=True`` / ``num_folds=4`` / ``tta`` from Python, so an error names what the user can change where
    they are. ``python`` is the Python spelling when it is not the flag's name (``--unlabeled``:
    ``Source(..., labeled=False)``)."""
    if _COMMAND.get():
        flag = name.replace("_", "-")
        if value is False:  # a switch turned off: its --no- form (argparse's BooleanOptionalAction)
            return f"--no-{flag}"
        return f"--{flag}" + ("" if value is None or value is True else f" {_shell_word(value)}")
    if python is not None:
        return python
    return name if value is None else f"{name}={value!r}"


def in_command() -> bool:
    """Whether the code runs under a command (``run_cli``) rather than from Python: what an error may name."""
    return bool(_COMMAND.get())


def command() -> str | None:
    """The command the code runs under (``train.fit``), None from Python: for a line said by a thread it starts,
    which does not see the command's context."""
    return _COMMAND.get()


def _shell_word(value: object) -> str:
    """A value as typed in a shell: ``,`` stays ``,``; a space is ``' '``, a tab ``$'\\t'``."""
    import shlex

    text = str(value)
    if not text.isprintable():
        return "$'" + text.encode("unicode_escape").decode("ascii").replace("'", "\\'") + "'"
    return shlex.quote(text)


def check_at_least(low: float, **values: float | None) -> None:
    """Refuses settings below ``low`` and infinite ones (``None`` means "not set" and passes), naming the setting as
    the user wrote it: ``--epochs must be at least 1 (got 0)``. Every numeric setting with a floor goes through
    here, so the command line and the Python API refuse the same values."""
    for name, value in values.items():
        if value is not None:
            check_finite(name, value)
            if not value >= low:  # "not >=" also refuses NaN
                raise BadSetting(f"{option(name)} must be at least {low} (got {value})")


def check_at_most(high: float, **values: float | None) -> None:
    """Refuses settings above ``high`` (checked for being numbers by ``check_at_least``/``check_count`` first),
    naming the setting and the range: a value no pipeline can hold (``read_buffer=2**63``) is one line when the
    options are made, never TensorFlow's error at the first batch."""
    for name, value in values.items():
        if value is not None and value > high:
            raise BadSetting(f"{option(name)} must be at most {high:,} (got {value:,})")


def check_finite(name: str, value: object) -> None:
    """Refuses what is not a real number (a string, a bool) and infinity: ``--lr inf`` or ``--mixup inf`` would
    turn a whole run into NaN. NaN is left to the range checks, which name the range it misses."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise BadSetting(f"{option(name)} must be a number (got {value!r})")
    if value in (math.inf, -math.inf):
        raise BadSetting(f"{option(name)} must be finite (got {value})")


def check_count(low: int, **values: float | None) -> None:
    """Refuses counts (batch sizes, epochs, classes, pixels) that are not whole numbers of at least ``low``:
    ``batch_size=2.5`` or ``True`` is a mistake, not a batch of 2. ``None`` passes."""
    for name, value in values.items():
        if value is not None and (isinstance(value, bool) or not isinstance(value, numbers.Integral)):
            raise BadSetting(f"{option(name)} must be a whole number (got {value!r})")
    check_at_least(low, **values)


def check_seed(**values: float | None) -> None:
    """Refuses seeds NumPy and scikit-learn cannot take (whole numbers in 0..2**32-1): unchecked, ``--seed -1``
    would be their traceback after the job has started. ``None`` passes."""
    check_count(0, **values)
    for name, value in values.items():
        if value is not None and value >= 2**32:
            raise BadSetting(f"{option(name)} must be below 2**32 (got {value})")


def check_positive(**values: float | None) -> None:
    """Refuses settings that must be above 0 and finite (learning rates); ``None`` passes."""
    for name, value in values.items():
        if value is not None:
            check_finite(name, value)
            if not value > 0:
                raise BadSetting(f"{option(name)} must be above 0 (got {value})")


def check_fraction(**values: float | None) -> None:
    """Refuses settings that must lie strictly between 0 and 1 (thresholds, fractions); ``None`` passes."""
    for name, value in values.items():
        if value is not None and not 0 < value < 1:  # also refuses NaN
            raise BadSetting(f"{option(name)} must be between 0 and 1 (got {value})")


def check_path(**values: object) -> None:
    """Refuses empty paths (an unset shell variable: ``--out "$OUT"``), which would otherwise mean the working
    folder."""
    for name, value in values.items():
        if value is not None and not str(value).strip():
            raise BadSetting(f"{option(name)} is empty (an unset variable?); give a path")


class DefaultsFormatter(argparse.HelpFormatter):
    """``--help`` shows every option's default: ``(default: X)`` is added unless the help already says it or
    there is none to show (a flag's False, an unset None)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        flag = action.nargs == 0  # --skip-bad, --no-report: what it does is the help, not a True/False default
        hidden = action.default is None or action.default == argparse.SUPPRESS  # 0 is shown: 0 == False
        if "default" in text or flag or hidden or not action.option_strings:
            return text
        return f"{text} (default: {action.default})"


class ArgumentParser(argparse.ArgumentParser):
    """argparse with one-line errors: ``prog: error: argument --epochs: invalid int value: 'x' (see --help)``
    and exit code 2, instead of the full usage block before it; ``--help`` shows the defaults."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("formatter_class", DefaultsFormatter)
        # No abbreviations: a prefix such as "--fold" must not quietly stand for another flag.
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


def os_error_line(e: OSError, path: str | None = None) -> str:
    """An ``OSError`` as one line naming its file (``path`` where the error names none: a ``write`` into an open
    file that fills the disk) and, for a full disk or quota, the fix: ``out/train-00003.part: No space left on
    device (the disk or quota is full: free space)``."""
    where = f"{e.filename} -> {e.filename2}" if e.filename and e.filename2 else (e.filename or path)
    line = f"{where}: {e.strerror or e}" if where else str(e.strerror or e)
    if e.errno in (errno.ENOSPC, errno.EDQUOT):
        line += " (the disk or quota is full: free space)"
    elif e.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
        line += " (this user cannot write or read there: choose another place, or change its permissions)"
    elif e.errno == errno.ENAMETOOLONG:
        line += " (choose a shorter name)"
    return line


@contextlib.contextmanager
def as_command(prog: str) -> Iterator[None]:
    """Within the block, errors spell settings as the command ``prog``'s flags (``--out``, not ``out``): for
    the processes a command starts (its ranks), which do not run through ``run_cli``."""
    token = _COMMAND.set(prog)
    try:
        yield
    finally:
        _COMMAND.reset(token)


@contextlib.contextmanager
def warnings_as_lines(prog: str) -> Iterator[None]:
    """Within the block, a Python warning is one line, ``prog: warning: message``, as the command's own warnings
    are -- not Python's file, line number and source line, which speak to a programmer, not to the command's user.
    Python's own way is back after the block (a library call in a notebook is not a command)."""

    def one_line(
        message: Warning | str,
        category: type[Warning],
        filename: str,
        lineno: int,
        file: TextIO | None = None,
        line: str | None = None,
    ) -> None:
        print(f"{prog}: warning: {message}", file=sys.stderr, flush=True)

    with warnings.catch_warnings():  # puts ``showwarning`` back, and the filters a command may add
        warnings.showwarning = one_line
        yield


def renamed(e: TfpipeError, old: str, new: str) -> TfpipeError:
    """``e`` of the same kind, saying ``new`` where it said ``old`` (a worker's private folder: the run's);
    a ``BadFile`` keeps its fields."""
    if isinstance(e, BadFile):
        return BadFile(e.path.replace(old, new), e.problem.replace(old, new), e.remedy.replace(old, new), e.joined)
    text = str(e).replace(old, new)
    try:
        return type(e)(text)
    except Exception:  # a kind made from more than its message (the preflight's StepRefused, from its findings)
        return TfpipeError(text)


def error_line(e: BaseException, who: str = "") -> str | None:
    """The one line an exception ends a process with (exit code ``BAD_INPUT``), for every command and rank alike;
    None for a bug, which keeps its traceback. A ``TfpipeError``'s message (raised in a DataLoader worker, torch
    re-raises it with the worker's traceback before it: its last line), a DataLoader worker that died (``who``
    first: ``rank 3: ``), an ``OSError`` naming its file (a full disk, an unreadable file: the machine's problem)."""
    if isinstance(e, TfpipeError):
        last = (str(e).strip().splitlines() or [""])[-1]
        wrapped = "\n" in str(e).strip() and last.startswith(f"{type(e).__module__}.{type(e).__name__}: ")
        return last.split(": ", 1)[1] if wrapped else str(e)  # torch's "...\ntfpipe.errors.TfpipeError: message"
    worker = dead_worker_line(e)
    if worker:
        return who + worker
    return os_error_line(e) if isinstance(e, OSError) else None


def run_cli(prog: str, fn: Callable[..., object], *args: object) -> int:
    """Runs ``fn(*args)`` for an entry point and returns its exit code.

    TensorFlow's start-up lines are held back meanwhile (``tfpipe.runtime.console``), and a Python warning is one line
    (``warnings_as_lines``). A ``TfpipeError`` becomes
    ``prog: error: message`` on stderr and exit code 2; so do an ``OSError`` (a full disk, an unreadable file:
    the machine's problem, not a bug; ``os_error_line`` names the file) and the death of a DataLoader worker
    (the out-of-memory killer's, say: ``tfpipe.runtime.lifecycle.dead_worker_line``);
    Ctrl-C becomes exit code 130 and SIGTERM 143, each with its line (``tfpipe.runtime.lifecycle``'s table, installed
    here for every command; a command that stops at a safe point says where); standard output closed by its reader
    (``| head``) ends the command quietly with 141, as SIGPIPE ends a Unix tool. Anything else
    is a bug and keeps its traceback. ``fn`` may return the exit code of a report it printed
    (``train.fit --preflight``: 2 when a TPU would refuse the run); else 0.
    """
    from tfpipe.runtime.console import quiet_tensorflow

    for name in ("stdout", "stderr"):  # started with fd 1 or 2 closed (``>&-``, a daemon): Python made it None
        if getattr(sys, name) is None:
            setattr(sys, name, open(os.devnull, "w"))  # noqa: SIM115 -- the command's own stream, for its life
    try:
        # TensorFlow's start-up lines held back (TFPIPE_VERBOSE=1); SIGTERM ends the command as Ctrl-C does
        with as_command(prog), warnings_as_lines(prog), quiet_tensorflow(), stopping_on_signals():
            code = fn(*args)
            sys.stdout.flush()  # what is left reaches its reader here, where a reader gone is caught
    except TfpipeError as e:  # bad input: its line, even while a stop was on its way
        print(f"{prog}: error: {error_line(e)}", file=sys.stderr)
        return BAD_INPUT
    except KeyboardInterrupt as e:  # Ctrl-C, or a Terminated (SIGTERM)
        code, words = ending(e)
        print(f"{prog}: {words}", file=sys.stderr)
        return code
    except Exception as e:  # a DataLoader worker that died (out of memory, killed) or an OSError; else a bug
        if stdout_reader_gone(e):  # ``| head`` read what it wanted: a Unix tool ends quietly
            return quiet_for_a_gone_reader()
        stop = stop_behind(e)  # raised as the command stopped (a SIGTERM to the group also ends the workers)
        if stop is not None:
            code, words = ending(stop)
            print(f"{prog}: {words}", file=sys.stderr)
            return code
        line = error_line(e)
        if line is None:
            raise
        print(f"{prog}: error: {line}", file=sys.stderr)
        return BAD_INPUT
    return code if isinstance(code, int) else 0
