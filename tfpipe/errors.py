"""One exception type for problems the user can fix, and the CLI edge that prints it."""
import sys
import warnings


class TfpipeError(Exception):
    """Bad input or configuration: shown to the user as one line, no traceback."""


def renamed(old, new, stacklevel=3):
    """Warns that ``old`` (a name from tfpipe 0.1) is now ``new``; the old name keeps working for this release."""
    warnings.warn(f"{old} is renamed {new} (tfpipe 0.2); the old name will be removed in 0.3", FutureWarning,
                  stacklevel=stacklevel)


def run_cli(prog, fn, *args):
    """Runs ``fn(*args)`` for an entry point and returns its exit code.

    A ``TfpipeError`` becomes ``prog: error: message`` on stderr and exit code 2;
    Ctrl-C becomes exit code 130. Anything else is a bug and keeps its traceback.
    """
    try:
        fn(*args)
    except TfpipeError as e:
        print(f"{prog}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt as e:
        print(f"{prog}: interrupted" + (f": {e}" if str(e) else ""), file=sys.stderr)
        return 130
    return 0
