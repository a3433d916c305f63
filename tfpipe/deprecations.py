"""Old spellings of tfpipe 1.0's renamed arguments and flags: each keeps working until ``REMOVED_IN`` and warns.

The renames (``RENAMES``) are the one list: the Python wrappers, the command lines' deprecated flags, the
CHANGELOG (a test checks every entry is listed there) and the glossary (docs/glossary.md) all follow it.
Python callers get a ``DeprecationWarning`` pointing at their own line; a command line prints one line on
stderr and carries on.
"""

from __future__ import annotations

import argparse
import functools
import sys
import warnings
from collections.abc import Callable, Mapping, Sequence
from typing import Any, TypeVar, cast

from tfpipe.errors import TfpipeError

REMOVED_IN = "1.1"
F = TypeVar("F", bound=Callable[..., Any])

# (where, old spelling, new spelling): Python keyword arguments as "name=", command-line flags as "--name".
RENAMES: tuple[tuple[str, str, str], ...] = (
    ("tfpipe.write_shards", "shards=", "num_shards="),
    ("tfpipe.write_shards", "folds=", "num_folds="),
    ("tfpipe.inspect_shards", "out=", "stream="),
    ("tfpipe.Shards", ".folds", ".num_folds"),
    ("tfpipe.Manifest", ".folds", ".num_folds"),
    ("train.fit.FitConfig", "out=", "run="),
    ("train.predict.predict_probabilities", "source=", "records="),
    ("python -m tfpipe.write", "--shards", "--num-shards"),
    ("python -m tfpipe.write", "--folds", "--num-folds"),
    ("python -m train.fit", "--out", "--run"),
)


# Modules of the 1.x API that moved into train/'s sub-packages in 1.1 (old -> new): each old module still imports
# (``train/<old>.py``, one line of aliasing) and warns at the importer's line; they go in ``MOVED_REMOVED_IN``.
MOVED_REMOVED_IN = "1.2"
MOVED_MODULES: dict[str, str] = {
    "train.strategy": "train.accel.strategy",
    "train.tpus": "train.accel.tpus",
    "train.cv_folder": "train.runs.cv_folder",
    "train.models": "train.keras.models",
    "train.torch_models": "train.torch.models",
    "train.run": "train.runs.run",  # RunConfig, named by the 1.0 guides
    "train.evaluation": "train.decide.evaluation",  # the scores, named by the 1.0 predicting guide
}


def warn_moved(old: str) -> None:
    """Warns, at the line that imports ``old`` (importlib's own frames are skipped by ``warnings``), that the
    module is now ``MOVED_MODULES[old]``."""
    warnings.warn(
        f"{old} is deprecated, import {MOVED_MODULES[old]} (the old module is removed in tfpipe {MOVED_REMOVED_IN})",
        DeprecationWarning,
        stacklevel=3,
    )


def warn_renamed(old: str, new: str, stacklevel: int = 3) -> None:
    """Warns that ``old`` is now ``new`` (``stacklevel`` 3: the warning points at the caller of the caller)."""
    warnings.warn(
        f"{old} is deprecated, use {new} (the old spelling is removed in tfpipe {REMOVED_IN})",
        DeprecationWarning,
        stacklevel=stacklevel,
    )


def changed_arguments(
    where: str | None = None, *, renamed: Mapping[str, str] | None = None, removed: Mapping[str, str] | None = None
) -> Callable[[F], F]:
    """Decorator for a callable whose keyword arguments changed: ``renamed`` old -> new name (accepted with a
    warning at the caller's line; both spellings at once are an error, which one would win is a guess),
    ``removed`` old name -> what replaced it (a ``TypeError`` saying so, not Python's bare "unexpected keyword
    argument"). One wrapper, so the warning's stack level is right whatever else changed. ``where`` names the
    callable (default: the function's name; a dataclass's ``__init__`` wants its class name)."""

    def decorate(func: F) -> F:
        name = where or func.__name__

        @functools.wraps(func)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            for old, instead in (removed or {}).items():
                if old in kwargs:
                    raise TypeError(f"{name}({old}=...) was removed in tfpipe 1.0: use {instead}")
            for old, new in (renamed or {}).items():
                if old in kwargs:
                    if new in kwargs:
                        raise TfpipeError(f"{name}() got both {old}= and {new}=; pass only {new}=")
                    warn_renamed(f"{name}({old}=...)", f"{name}({new}=...)")
                    kwargs[new] = kwargs.pop(old)
            return func(*args, **kwargs)

        return cast(F, wrapper)  # functools.wraps keeps the signature

    return decorate


def renamed_arguments(where: str | None = None, **renames: str) -> Callable[[F], F]:
    """``@renamed_arguments(shards="num_shards")``: ``changed_arguments`` with renames only."""
    return changed_arguments(where, renamed=renames)


def removed_arguments(where: str | None = None, **replacements: str) -> Callable[[F], F]:
    """``@removed_arguments(size="image_size=")``: ``changed_arguments`` with removals only."""
    return changed_arguments(where, removed=replacements)


class DeprecatedFlag(argparse.Action):
    """A command line's old flag: stores into the new flag's destination and says so in one line on stderr."""

    def __init__(self, option_strings: Sequence[str], dest: str, *, new: str, **kwargs: Any) -> None:
        kwargs.setdefault("help", argparse.SUPPRESS)  # --help shows only the new spelling
        super().__init__(option_strings, dest, **kwargs)
        self.new = new

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: Any,
        option_string: str | None = None,
    ) -> None:
        command = parser.prog.removeprefix("python -m ")  # as the command's errors say it: "tfpipe.write: ..."
        print(
            f"{command}: warning: {option_string} is deprecated, use {self.new} "
            f"(the old spelling is removed in tfpipe {REMOVED_IN})",
            file=sys.stderr,
        )
        setattr(namespace, self.dest, values)


def add_deprecated_flag(parser: argparse._ActionsContainer, old: str, new: str, **kwargs: Any) -> None:
    """Adds ``old`` as a hidden, warning spelling of the already added flag ``new`` (same type, same dest).

    ``parser`` is a parser or one of its argument groups (both see every flag of the parser)."""
    target = next(a for a in parser._actions if new in a.option_strings)  # argparse has no public lookup
    if target.type is not None:  # None is argparse's default (the string as given)
        kwargs["type"] = target.type
    parser.add_argument(old, action=DeprecatedFlag, new=new, dest=target.dest, **kwargs)
