"""The memory of one TPU core that a training step needs, for ``train.preflight.check``: measured from the buffers XLA
assigns the compiled step on the CPU, against a core of the TPU named, and the largest per-core batch that fits.

Measured, not modelled: XLA's buffer assignment is every buffer the step's program holds (its inputs -- weights,
optimizer slots, metric variables, the batch --, gradients, activations and scratch, one buffer shared between
values never live together). It is the CPU backend's program: a TPU's layouts (tiles of 8x128), its bfloat16
(the CPU computes some bfloat16 ops in float32) and its rematerialisation differ, so the figure is a guide.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import tensorflow as tf

from train.accel.tpus import Tpu
from train.preflight.xla_step import buffer_bytes, compile_step

HEADROOM = 0.9  # of a core's memory counted as usable: XLA's program, the runtime and infeed take the rest (a guess)
SUBLANES = 8  # a TPU core lays its batch out in groups of 8: batches suggested in multiples of 8
TRIES = 5  # compiles spent looking for a batch that fits, after a step that does not


class Memory(NamedTuple):
    """The figures of the memory line: bytes of the measured step and its parts, a core's usable bytes, and the
    largest per-core batch that fits, with how it is known."""

    measured: int
    weights: int
    optimizer: int
    batch: int
    core: int
    usable: int
    largest_batch: int
    largest_batch_is: str  # "estimated" (from two measured batch sizes) or "measured" (compiled at it, fits)


def nbytes(tensors: Any) -> int:
    """Bytes of the tensors or variables in a nested structure."""
    return sum(int(t.shape.num_elements()) * t.dtype.size for t in tf.nest.flatten(tensors))


def step_bytes(step: Callable[..., Any], batch: Any, size: int) -> int:
    """The measured bytes of ``step`` compiled for a batch like ``batch`` holding ``size`` images."""
    resized = tf.nest.map_structure(lambda t: tf.zeros([size, *t.shape[1:]], t.dtype), batch)
    return buffer_bytes(compile_step(step, resized).proto)[0]


def largest_batch(measured: int, size: int, other: int, other_size: int, usable: float) -> int:
    """The largest batch whose step fits ``usable`` bytes, from steps measured at two batch sizes: the bytes that
    grow with the batch (the difference, per image) and those that do not (the rest); a multiple of
    ``SUBLANES`` when there is room for one, 0 when not even one image fits."""
    per_image = max(1.0, (other - measured) / (other_size - size))
    fixed = measured - per_image * size
    largest = int((usable - fixed) // per_image)
    return largest // SUBLANES * SUBLANES if largest >= SUBLANES else max(0, largest)


def core_memory(model: Any, batch: Any, measured: int, tpu: Tpu) -> Memory:
    """The memory of the step compiled at ``batch`` (``measured`` bytes) on a ``tpu`` core. The largest batch that
    fits is estimated from a second compile at ``SUBLANES`` more images -- what one more costs near the batch
    asked for (XLA shares buffers differently at other sizes: small batches reuse the gradients' buffers, large
    ones change its choices) -- and, when the step does not fit, checked by compiling at it (``batch_that_fits``)."""
    size = int(tf.nest.flatten(batch)[0].shape[0])
    other_size = size + SUBLANES
    other = step_bytes(model.train_step, batch, other_size)
    usable = int(tpu.memory * HEADROOM)
    largest, known = largest_batch(measured, size, other, other_size, usable), "estimated"
    if measured > usable:
        largest, known = batch_that_fits(model, batch, min(largest, size - 1), usable)
    return Memory(
        measured,
        nbytes(model.weights),
        nbytes(model.optimizer.variables),
        nbytes(batch),
        tpu.memory,
        usable,
        largest,
        known,
    )


def batch_that_fits(model: Any, batch: Any, estimate: int, usable: int) -> tuple[int, str]:
    """A batch whose step fits, checked: compiled at the estimate, then at smaller batches (about 3/4 each time)
    while it does not, at most ``TRIES`` compiles. (0, "measured") when not even one image fits; the last
    size left untried, "estimated", when the tries run out."""
    size = estimate
    for _ in range(TRIES):
        if size < 1:
            return 0, "measured"
        if step_bytes(model.train_step, batch, size) <= usable:
            return size, "measured"
        smaller = size * 3 // 4
        size = smaller // SUBLANES * SUBLANES if smaller >= 2 * SUBLANES else min(smaller, size - 1)
    return size, "estimated"


def gigabytes(n: float) -> str:
    return f"{n / 1e9:.2f} GB" if n >= 1e8 else f"{n / 1e6:.1f} MB" if n >= 1e5 else f"{n / 1e3:.0f} kB"


def gibibytes(n: int) -> str:
    """A TPU's memory as its documents give it: 16 GiB (v3), 15 GiB (16 GB, v5e)."""
    return f"{n / 2**30:.0f} GiB" if n >= 2**30 else gigabytes(n)
