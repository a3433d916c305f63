"""One exception type for problems the user can fix, and the CLI edge that prints it."""
import contextvars
import sys
import warnings

_COMMAND = contextvars.ContextVar("tfpipe_command", default=None)  # the running command's name, under run_cli


class TfpipeError(Exception):
    """Bad input or configuration: shown to the user as one line, no traceback."""


def option(name, value=None):
    """A setting as the user wrote it: ``--skip-bad`` / ``--folds 4`` / ``--tta`` under a command,
    ``skip_bad=True`` / ``folds=4`` / ``tta`` from Python, so an error names what the user can change where
    they are."""
    if _COMMAND.get():
        return f"--{name.replace('_', '-')}" + ("" if value is None or value is True else f" {value}")
    return name if value is None else f"{name}={value!r}"


def renamed(old, new, stacklevel=3):
    """Warns that ``old`` (a name from tfpipe 0.1) is now ``new``; the old name keeps working for this release."""
    warnings.warn(f"{old} is renamed {new} (tfpipe 0.2); the old name will be removed in 0.3", FutureWarning,
                  stacklevel=stacklevel)


def run_cli(prog, fn, *args):
    """Runs ``fn(*args)`` for an entry point and returns its exit code.

    A ``TfpipeError`` becomes ``prog: error: message`` on stderr and exit code 2;
    Ctrl-C becomes exit code 130. Anything else is a bug and keeps its traceback.
    """
    token = _COMMAND.set(prog)
    try:
        fn(*args)
    except TfpipeError as e:
        print(f"{prog}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt as e:
        print(f"{prog}: interrupted" + (f": {e}" if str(e) else ""), file=sys.stderr)
        return 130
    finally:
        _COMMAND.reset(token)
    return 0
