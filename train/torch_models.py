"""Deprecated: moved to ``train.torch.models`` in tfpipe 1.1 (``tfpipe.deprecations.MOVED_MODULES``)."""

from tfpipe.deprecations import warn_moved

warn_moved(__name__)

from train.torch.models import *  # noqa: E402, F403
