"""Deprecated: moved to ``train.decide.evaluation`` in tfpipe 1.1 (``tfpipe.deprecations.MOVED_MODULES``)."""

from tfpipe.deprecations import warn_moved

warn_moved(__name__)

from train.decide.evaluation import *  # noqa: E402, F403
