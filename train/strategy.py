"""Deprecated: moved to ``train.accel.strategy`` in tfpipe 1.1 (``tfpipe.deprecations.MOVED_MODULES``)."""

from tfpipe.deprecations import warn_moved

warn_moved(__name__)

from train.accel.strategy import *  # noqa: E402, F403
