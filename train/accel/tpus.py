"""The TPUs ``train.fit --preflight --tpu NAME`` checks a step against: devices a host and memory a device.

A TensorFlow device on a TPU is a TensorCore (v2, v3: two a chip, each with half the chip's memory) or a whole
chip (v4: its two TensorCores act as one "megacore" device; v5e: one TensorCore a chip). Figures from Google's
Cloud TPU system architecture pages (cloud.google.com/tpu/docs/v2, /v3, /v4, /v5e). No TensorFlow here; also the
cheap look for a TPU that both backends make (``tpu_present``).
"""

from __future__ import annotations

import glob
import os
from typing import NamedTuple

GIB = 2**30
TPU_HINTS = ("TPU_NAME", "COLAB_TPU_ADDR", "TPU_ACCELERATOR_TYPE", "KAGGLE_TPU")  # env vars set next to a TPU


def tpu_present() -> bool:
    """A cheap look for a TPU (environment or TPU VM device files) that starts nothing."""
    return any(os.environ.get(k) for k in TPU_HINTS) or bool(glob.glob("/dev/accel*") or glob.glob("/dev/vfio/[0-9]*"))


class Tpu(NamedTuple):
    """One kind of TPU host: ``devices`` replicas (``strategy.num_replicas_in_sync`` on one host, as in ``v3-8``),
    ``memory`` bytes of high-bandwidth memory a device, and where the figures come from."""

    name: str
    devices: int
    memory: int
    source: str


TPUS: dict[str, Tpu] = {
    t.name: t
    for t in (
        Tpu("v2", 8, 8 * GIB, "v2-8: 4 chips of 16 GiB HBM, 2 TensorCores each (cloud.google.com/tpu/docs/v2)"),
        Tpu("v3", 8, 16 * GIB, "v3-8: 4 chips of 32 GiB HBM, 2 TensorCores each (cloud.google.com/tpu/docs/v3)"),
        Tpu("v4", 4, 32 * GIB, "v4-8: 4 chips of 32 GiB HBM, one megacore device each (cloud.google.com/tpu/docs/v4)"),
        Tpu("v5e", 8, 16 * GIB, "v5e-8: 8 chips of 16 GB HBM, 1 TensorCore each (cloud.google.com/tpu/docs/v5e)"),
    )
}
DEFAULT_TPU = "v3"  # Kaggle's TPU v3-8, the TPU most of our users start on
