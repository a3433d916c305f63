"""Deprecated: moved to ``train.runs.run`` in tfpipe 1.1 (``tfpipe.deprecations.MOVED_MODULES``)."""

from tfpipe.deprecations import warn_moved

warn_moved(__name__)

from train.runs.run import *  # noqa: E402, F403
