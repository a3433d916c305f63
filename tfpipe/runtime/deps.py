"""Optional dependencies, imported where they are used, with one line saying what to install when missing.

tfpipe's core (pyproject.toml ``dependencies``) needs neither TensorFlow nor torch: users bring their own builds
(a TPU image's TensorFlow, a CUDA torch), so each feature imports what it needs through ``require``, and
``train`` checks that tf-keras matches TensorFlow's release through ``require_keras``.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import importlib.util
import sys
from types import ModuleType
from typing import Any

from tfpipe.runtime.errors import MissingDependency as MissingDependency

# top-level module -> (what to install, what it is needed for)
OPTIONAL = {
    "tensorflow": ("'tfpipe[tensorflow]' (or your platform's own TensorFlow build)", "tf.data and gs:// paths"),
    "torch": ("'tfpipe[write]' (or any torch build)", "the writer's DataLoader workers"),
    "apache_beam": ("'tfpipe[beam]'", "--runner beam"),
    "grpc": ("'tfpipe[tensorflow]' (TensorFlow brings grpcio)", "a tf.data service"),
    "tensorflow_datasets": ("'tfpipe[tfds]'", "a TFDS source"),
    "efficientnet": ("'tfpipe[train]'", "the EfficientNet models"),
    "matplotlib": ("'tfpipe[train]'", "the run's pictures"),
    "pytorch_lightning": ("'tfpipe[lightning]'", "tfpipe.torch.lightning"),
    "timm": ("timm (it needs a torchvision built for your torch)", "a model other than small-cnn in PyTorch"),
    "torch_xla": ("the torch_xla of your torch's release (e.g. torch==2.9.0 torch-xla==2.9.0)", "--xla"),
}


# Modules whose first import writes C++ log lines to fd 2 (absl's preamble, oneDNN, cudart): imported through
# ``require`` while tfpipe.runtime.console holds those lines back, in a notebook as under a command (TFPIPE_VERBOSE=1
# shows them). A user's own earlier ``import tensorflow`` is theirs, and shows them.
LOUD_IMPORTS = ("tensorflow", "tf_keras")


def require(module: str) -> ModuleType:
    """Imports ``module`` (e.g. "torch.utils.data"), or raises ``MissingDependency`` naming what to install.

    A package that is installed but fails to import keeps its own error: that is a broken install, not a
    missing one, and its traceback is what helps.
    """
    top = module.split(".")[0]
    try:
        if top in LOUD_IMPORTS and top not in sys.modules:  # the first import: its C++ start-up lines held back
            from tfpipe.runtime.console import quiet_tensorflow

            with quiet_tensorflow(environment=False):
                return importlib.import_module(module)
        return importlib.import_module(module)
    except ImportError as e:
        if e.name is None or e.name.split(".")[0] != top:
            raise
        raise _missing(top) from None


def check_installed(module: str) -> None:
    """Raises ``MissingDependency`` when ``module`` is not installed, without importing it: for what a command
    needs only at its end (train.fit's pictures, after minutes of training), checked before it starts."""
    top = module.split(".")[0]
    if importlib.util.find_spec(top) is None:
        raise _missing(top)


def _missing(top: str) -> MissingDependency:
    install, needed_for = OPTIONAL.get(top, (top, "this feature"))
    return MissingDependency(f"{top} is not installed, and is needed for {needed_for}: pip install {install}")


def _distribution_version(name: str, module: str) -> str | None:
    """The installed version of distribution ``name``, else of whichever distribution provides ``module`` (a
    nightly or a fork under another name), else None. The direct look-up comes first: scanning every installed
    distribution's file list (``packages_distributions``) takes seconds in a large environment."""
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        dists = importlib.metadata.packages_distributions().get(module, [])
        return importlib.metadata.version(dists[0]) if dists else None


def keras_problem(tf_version: str) -> str | None:
    """None when tf-keras of TensorFlow's release (``tf_version``, e.g. "2.19.1") is installed, else what to do."""
    release = ".".join(tf_version.split(".")[:2])
    hint = f"pip install 'tf-keras~={release}.0'"
    if importlib.util.find_spec("tf_keras") is None:
        return f"training needs tf-keras of TensorFlow's release {release}, which is not installed: {hint}"
    found = _distribution_version("tf-keras", "tf_keras")
    if found is not None and found.split(".")[:2] != release.split("."):
        return f"tf-keras {found} does not match TensorFlow {tf_version} (they must be the same release): {hint}"
    return None


def require_keras() -> ModuleType:
    """Returns the ``tf_keras`` module for the ``train`` engine; TensorFlow and tf-keras must be the same release.

    Keras 3 cannot train with ``steps_per_execution > 1`` under MirroredStrategy (keras-team/keras#19246),
    so training uses tf-keras. When it is missing or of another release: ``MissingDependency`` saying what to
    install (a ``TfpipeError``: one line and exit code 2 under a command).
    """
    try:
        tf = require("tensorflow")
        problem = keras_problem(tf.__version__)
    except MissingDependency as e:
        problem = str(e)
    if problem is not None:
        raise MissingDependency(problem)
    return importlib.import_module("tf_keras")


def lazy_module(name: str) -> Any:
    """A stand-in for module ``name`` that imports it (through ``require``) when an attribute is first used:
    modules whose functions use TensorFlow can be imported by TensorFlow-free code (configuration classes,
    ``--help``) without starting it."""

    class Lazy:
        def __getattr__(self, attr: str) -> Any:
            return getattr(require(name), attr)

        def __repr__(self) -> str:
            return f"<lazy module {name!r}>"

    return Lazy()
