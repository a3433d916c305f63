"""Deprecated: moved to ``train.keras.models`` in tfpipe 1.1 (``tfpipe.deprecations.MOVED_MODULES``)."""

from tfpipe.deprecations import warn_moved

warn_moved(__name__)

from train.keras.models import *  # noqa: E402, F403
