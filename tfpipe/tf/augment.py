"""Training augmentations: per-image ops before batching, one XLA-compiled op per batch after it.

Per-image ops (random resized crop, random erasing) take one uint8 ``[H, W, 3]``
image and a stateless ``[2]`` seed. The pad crop, the flip and the colour jitter
run on whole uint8 batches in one ``tf.function(jit_compile=True)``: XLA fuses
the shift, the mirror, the colour arithmetic and the rounding into one pass over
the pixels. The same flip + pad crop + brightness per image in tf.data runs at
well under half that op's rate (each float colour op is a separate pass over the
image's floats), while a cached pipeline without per-image maps moves images at
about ten times the op's rate. Every op gives the same result eagerly and inside
``Dataset.map`` (tested); seeded pipelines are reproducible. MixUp and CutMix
work on whole batches and mix the multi-hot targets by the same weights as the
pixels.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, TypeAlias

from tfpipe.runtime.deps import lazy_module
from tfpipe.runtime.errors import TfpipeError, check_at_least, check_at_most, check_count, option

if TYPE_CHECKING:
    import tensorflow as tf
else:
    tf = lazy_module("tensorflow")  # imported when first used: Augment (a configuration) needs no TensorFlow

# fn(image [H, W, 3] or batch [B, H, W, 3], seed [2]) -> the same shape and dtype
ImageOp: TypeAlias = "Callable[[tf.Tensor, tf.Tensor], tf.Tensor]"
# fn(images [B, H, W, 3], targets [B, C], seed [2]) -> (mixed images, mixed targets)
MixOp: TypeAlias = "Callable[[tf.Tensor, tf.Tensor, tf.Tensor], tuple[tf.Tensor, tf.Tensor]]"


@dataclasses.dataclass(frozen=True)
class Augment:
    """Which augmentations to apply in training (each can be switched off).

    Attributes:
      flip: random horizontal flip.
      crop: "pad" (zero-pad by ``pad`` pixels, then crop back: the CIFAR
        recipe), "resized" (random resized crop of area ``crop_scale``; JPEGs
        that are not cached are then decoded with ``decode_and_crop_jpeg`` so
        only the window is decoded) or None.
      pad: padding of the "pad" crop; None means an eighth of the image side.
      crop_scale: area range of the "resized" crop. Multi-label data wants a high
        lower bound: a small crop can cut a labelled object out of view.
      crop_ratio: aspect ratio range of the "resized" crop.
      brightness, contrast, saturation: colour jitter strengths (0 = off).
      erasing: how many random-erasing rectangles to try per image (0 = off).
      erasing_prob: probability of each erasing.
      mixup, cutmix: Beta(alpha, alpha) parameters of MixUp / CutMix (0 = off);
        when both are on, each batch uses one of them at random.
      jit: XLA-compile the batch op (pad crop, flip, colour); False runs the
        same ops without XLA (~5x slower) for hosts where XLA is unavailable.
    """

    flip: bool = True
    crop: str | None = "pad"
    pad: int | None = None
    crop_scale: tuple[float, float] = (0.5, 1.0)
    crop_ratio: tuple[float, float] = (3 / 4, 4 / 3)
    brightness: float = 0.1
    contrast: float = 0.1
    saturation: float = 0.1
    erasing: int = 0
    erasing_prob: float = 0.5
    mixup: float = 0.0
    cutmix: float = 0.0
    jit: bool = True

    def __post_init__(self) -> None:
        """Every value in its range, refused in one line here (the command line's flags and Python alike): a
        negative MixUp alpha made the targets NaN, a negative pad failed inside the input pipeline."""
        check_augment(self)


# The largest value of each open-ended field: a jitter beyond 1 turns the image's contrast or colours inside out,
# an alpha of 1000 already draws 0.5 every time, a pad or erasing count beyond these is a typo.
AUGMENT_LIMITS = {
    "pad": 4096,
    "erasing": 64,
    "brightness": 1.0,
    "contrast": 1.0,
    "saturation": 1.0,
    "mixup": 1000.0,
    "cutmix": 1000.0,
}


def check_augment(aug: Augment) -> None:
    """``Augment``'s ranges: strengths and alphas finite and >= 0, ``erasing_prob`` a probability, the crop's
    ranges ``0 < low <= high`` (the scale at most 1), a known crop."""
    if aug.crop not in (None, "pad", "resized"):
        raise TfpipeError(f"crop must be 'pad', 'resized' or None (got {aug.crop!r})")
    check_count(0, pad=aug.pad, erasing=aug.erasing)
    check_at_least(0, **{k: getattr(aug, k) for k in ("brightness", "contrast", "saturation", "mixup", "cutmix")})
    for name, high in AUGMENT_LIMITS.items():
        check_at_most(high, **{name: getattr(aug, name)})
    if not (isinstance(aug.erasing_prob, (int, float)) and 0 <= aug.erasing_prob <= 1):
        raise TfpipeError(f"{option('erasing_prob')} must be a probability, 0..1 (got {aug.erasing_prob!r})")
    for name, top in (("crop_scale", 1.0), ("crop_ratio", math.inf)):
        pair = getattr(aug, name)
        ok = len(pair) == 2 and all(isinstance(x, (int, float)) and math.isfinite(x) for x in pair)
        if not (ok and 0 < pair[0] <= pair[1] <= top):
            most = " <= 1" if top == 1.0 else ""
            raise TfpipeError(f"{option(name)} must be two numbers 0 < low <= high{most} (got {pair!r})")


NO_AUGMENT = Augment(flip=False, crop=None, brightness=0.0, contrast=0.0, saturation=0.0)


RNG = "philox"  # named: "auto_select" may pick another generator under XLA than without it


def _uniform(shape: Sequence[int | tf.Tensor], seed: tf.Tensor, low: float = 0.0, high: float = 1.0) -> tf.Tensor:
    """Uniform floats in [low, high) from integer draws, which XLA and plain TensorFlow generate alike
    (their float draws differ even for the same generator)."""
    bits = tf.random.stateless_uniform(shape, seed, 0, 2**24, dtype=tf.int32, alg=RNG)
    return low + (high - low) * tf.cast(bits, tf.float32) * (1.0 / 2**24)


def _split(seed: tf.Tensor, n: int) -> tf.Tensor:
    return tf.random.experimental.stateless_split(seed, n, alg=RNG)


def make_shift_flip(pad: int, flip: bool) -> ImageOp:
    """Pad crop (zero-pad by ``pad``, crop back at a random offset: the CIFAR recipe) and a random
    left-right mirror of every image of a uint8 batch ``[B, H, W, 3]``.

    Both are a choice of source row and column for each output pixel, so they are
    done as one gather per axis (no padded copy) and a mask for the zero border.
    """

    def shift_flip(images: tf.Tensor, seed: tf.Tensor) -> tf.Tensor:
        seeds = _split(seed, 2)
        shape = tf.shape(images)
        b, h, w = shape[0], shape[1], shape[2]
        rows = tf.broadcast_to(tf.range(h)[None, :], [b, h])  # source row of each output row, per image
        cols = tf.broadcast_to(tf.range(w)[None, :], [b, w])
        if flip:
            mirror = _uniform([b, 1], seeds[1]) < 0.5
            cols = tf.where(mirror, w - 1 - cols, cols)
        if pad:
            shift = tf.random.stateless_uniform([b, 2], seeds[0], -pad, pad + 1, dtype=tf.int32, alg=RNG)
            rows, cols = rows + shift[:, :1], cols + shift[:, 1:]
        if pad:  # (a flip alone keeps the rows)
            images = tf.gather(images, tf.clip_by_value(rows, 0, h - 1), axis=1, batch_dims=1)
        images = tf.gather(images, tf.clip_by_value(cols, 0, w - 1), axis=2, batch_dims=1)
        if pad:
            inside = ((rows >= 0) & (rows < h))[:, :, None, None] & ((cols >= 0) & (cols < w))[:, None, :, None]
            images = tf.where(inside, images, tf.zeros_like(images))
        return images

    return shift_flip


def crop_window(
    image_shape: tf.Tensor, scale: tuple[float, float], ratio: tuple[float, float], seed: tf.Tensor
) -> tuple[tf.Tensor, tf.Tensor]:
    """A random resized-crop window (offset [y, x, 0], size [h, w, -1]) inside ``image_shape``.

    Used both on decoded images and, through ``decode_and_crop_jpeg``, on encoded JPEGs.
    """
    begin, size, _ = tf.image.stateless_sample_distorted_bounding_box(
        image_shape,
        bounding_boxes=tf.constant([[[0.0, 0.0, 1.0, 1.0]]]),
        seed=seed,
        min_object_covered=0.0,
        aspect_ratio_range=ratio,
        area_range=scale,
        max_attempts=10,
        use_image_if_no_bounding_boxes=True,
    )
    return begin, size


def make_resized_crop(out_size: int, scale: tuple[float, float], ratio: tuple[float, float]) -> ImageOp:
    """Random resized crop of a decoded image, back to ``out_size`` square."""

    def resized_crop(image: tf.Tensor, seed: tf.Tensor) -> tf.Tensor:
        begin, size = crop_window(tf.shape(image), scale, ratio, seed)
        return resize(tf.slice(image, begin, size), out_size, image.dtype)

    return resized_crop


GREY_WEIGHTS = (0.2989, 0.5870, 0.1140)  # ITU-R 601 luma, as tf.image.rgb_to_grayscale
MEAN_STRIDE = 4  # the contrast pivot (mean grey) is taken on every 4th pixel in each direction


def make_colour_jitter(brightness: float, contrast: float, saturation: float) -> ImageOp:
    """Brightness, contrast and saturation jitter of a float batch ``[B, H, W, 3]`` in [0, 255].

    Each image draws its own factors. Contrast pivots on the image's mean grey
    level (as PIL and torchvision do; the mean is taken on a strided subsample,
    16x cheaper and as good); brightness and contrast fold into one
    ``x * gain + offset``; saturation blends with the grey image (torchvision's
    way, several times cheaper than an HSV round trip). The result is not
    clipped: the final ``saturate_cast`` to uint8 does it.
    """
    w = tf.constant(GREY_WEIGHTS, tf.float32)

    def grey(images: tf.Tensor) -> tf.Tensor:
        return images[..., 0:1] * w[0] + images[..., 1:2] * w[1] + images[..., 2:3] * w[2]

    def colour_jitter(images: tf.Tensor, seed: tf.Tensor) -> tf.Tensor:
        u = _uniform([tf.shape(images)[0], 1, 1, 3], seed, -1.0, 1.0)
        if saturation:
            sat = 1.0 + u[..., 2:3] * saturation
            images = images * sat + grey(images) * (1.0 - sat)
        if brightness or contrast:
            gain = 1.0 + u[..., 1:2] * contrast
            pivot = tf.reduce_sum(
                tf.reduce_mean(images[:, ::MEAN_STRIDE, ::MEAN_STRIDE], axis=[1, 2], keepdims=True) * w,
                axis=-1,
                keepdims=True,
            )
            images = images * gain + ((1.0 - gain) * pivot + u[..., 0:1] * brightness * 255.0)
        return images

    return colour_jitter


def make_batch_augment(aug: Augment, size: int) -> ImageOp | None:
    """The pad crop, flip and colour jitter of an ``Augment`` for size x size images, as one op on uint8
    batches, or None when all three are off.

    Returns ``fn(images uint8 [B, size, size, 3], seed [2]) -> uint8``. Unless ``aug.jit`` is False, the
    geometry and the colour are two XLA-compiled functions: compiled together, XLA fuses the gathers into
    the colour arithmetic and the pair runs at about half the speed.
    """
    pad = 0
    if aug.crop == "pad":
        pad = aug.pad if aug.pad is not None else max(1, size // 8)
    colour = aug.brightness or aug.contrast or aug.saturation
    if not (pad or aug.flip or colour):
        return None
    compile_ = (lambda fn: tf.function(fn, jit_compile=True)) if aug.jit else (lambda fn: fn)
    geometry = compile_(make_shift_flip(pad, aug.flip)) if pad or aug.flip else None
    jitter = make_colour_jitter(aug.brightness, aug.contrast, aug.saturation)

    @compile_
    def colour_jitter(images: tf.Tensor, seed: tf.Tensor) -> tf.Tensor:
        x = jitter(tf.cast(images, tf.float32), seed)
        return tf.cast(tf.clip_by_value(x + 0.5, 0.0, 255.0), tf.uint8)  # rounds and clamps (saturate_cast is
        # the same, but XLA compiles it ~5x slower)

    def batch_augment(images: tf.Tensor, seed: tf.Tensor) -> tf.Tensor:
        seeds = _split(seed, 2)
        if geometry is not None:
            images = geometry(images, seeds[0])
        if colour:
            images = colour_jitter(images, seeds[1])
        return images

    return batch_augment


def box_mask(
    h: tf.Tensor, w: tf.Tensor, top: tf.Tensor, left: tf.Tensor, box_h: tf.Tensor, box_w: tf.Tensor
) -> tf.Tensor:
    """Boolean [h, w, 1] mask, True inside the box."""
    rows = tf.range(h)[:, None]
    cols = tf.range(w)[None, :]
    inside = (rows >= top) & (rows < top + box_h) & (cols >= left) & (cols < left + box_w)
    return inside[..., None]


def make_random_erasing(
    prob: float, scale: tuple[float, float] = (0.02, 0.25), ratio: tuple[float, float] = (0.3, 3.3)
) -> ImageOp:
    """Random erasing (Zhong et al. 2017): with probability ``prob``, fill a random
    rectangle with uniform noise in 0..255 (uint8 or float images)."""

    def random_erasing(image: tf.Tensor, seed: tf.Tensor) -> tf.Tensor:
        seeds = _split(seed, 3)
        shape = tf.shape(image)
        begin, size = crop_window(shape, scale, ratio, seeds[0])
        mask = box_mask(shape[0], shape[1], begin[0], begin[1], size[0], size[1])
        noise = tf.cast(tf.random.stateless_uniform(shape, seeds[1], 0, 256, dtype=tf.int32), image.dtype)
        apply = tf.random.stateless_uniform([], seeds[2]) < prob
        return tf.cond(apply, lambda: tf.where(mask, noise, image), lambda: image)

    return random_erasing


def resize(image: tf.Tensor, size: int, dtype: tf.DType) -> tf.Tensor:
    """Resizes to size x size with antialiasing, back to ``dtype`` (uint8 is rounded and saturated)."""
    out = tf.image.resize(image, [size, size], antialias=True)
    return tf.saturate_cast(tf.round(out), dtype) if dtype == tf.uint8 else tf.cast(out, dtype)


def sample_beta(alpha: float, seed: tf.Tensor) -> tf.Tensor:
    """Beta(alpha, alpha) from two stateless gamma draws."""
    seeds = _split(seed, 2)
    a = tf.random.stateless_gamma([], seeds[0], alpha)
    b = tf.random.stateless_gamma([], seeds[1], alpha)
    return a / (a + b)


def make_mixup(alpha: float) -> MixOp:
    """MixUp (Zhang et al. 2018) of a batch with a shuffled copy of itself; targets mix by the same weight."""

    def mixup(images: tf.Tensor, targets: tf.Tensor, seed: tf.Tensor) -> tuple[tf.Tensor, tf.Tensor]:
        seeds = _split(seed, 2)
        lam = sample_beta(alpha, seeds[0])
        perm = tf.random.experimental.stateless_shuffle(tf.range(tf.shape(images)[0]), seeds[1])
        x = tf.cast(images, tf.float32)
        mixed = lam * x + (1.0 - lam) * tf.gather(x, perm)
        return tf.saturate_cast(tf.round(mixed), images.dtype), lam * targets + (1.0 - lam) * tf.gather(targets, perm)

    return mixup


def make_cutmix(alpha: float) -> MixOp:
    """CutMix (Yun et al. 2019): paste a box from a shuffled copy; targets mix by the pasted area."""

    def cutmix(images: tf.Tensor, targets: tf.Tensor, seed: tf.Tensor) -> tuple[tf.Tensor, tf.Tensor]:
        seeds = _split(seed, 3)
        lam = sample_beta(alpha, seeds[0])
        perm = tf.random.experimental.stateless_shuffle(tf.range(tf.shape(images)[0]), seeds[1])
        h, w = tf.shape(images)[1], tf.shape(images)[2]
        cut = tf.sqrt(1.0 - lam)
        box_h, box_w = tf.cast(cut * tf.cast(h, tf.float32), tf.int32), tf.cast(cut * tf.cast(w, tf.float32), tf.int32)
        u = tf.random.stateless_uniform([2], seeds[2])
        cy, cx = tf.cast(u[0] * tf.cast(h, tf.float32), tf.int32), tf.cast(u[1] * tf.cast(w, tf.float32), tf.int32)
        top, bottom = tf.maximum(cy - box_h // 2, 0), tf.minimum(cy + box_h // 2, h)
        left, right = tf.maximum(cx - box_w // 2, 0), tf.minimum(cx + box_w // 2, w)
        mask = box_mask(h, w, top, left, bottom - top, right - left)[None]
        pasted = tf.cast((bottom - top) * (right - left), tf.float32) / tf.cast(h * w, tf.float32)
        mixed = tf.where(mask, tf.gather(images, perm), images)
        return mixed, (1.0 - pasted) * targets + pasted * tf.gather(targets, perm)

    return cutmix


def image_ops(aug: Augment, size: int, crop_done: bool = False) -> list[ImageOp]:
    """The per-image ops of an ``Augment`` (before batching), in order, each ``fn(image uint8, seed) -> uint8``.

    Args:
      aug: an ``Augment``.
      size: image side.
      crop_done: the resized crop already happened while decoding.
    """
    if aug.crop not in (None, "pad", "resized"):
        raise ValueError(f"unknown crop {aug.crop!r}: use 'pad', 'resized' or None")
    ops: list[ImageOp] = []
    if aug.crop == "resized" and not crop_done:
        ops.append(make_resized_crop(size, aug.crop_scale, aug.crop_ratio))
    return ops + [make_random_erasing(aug.erasing_prob)] * aug.erasing


def augment_image(image: tf.Tensor, seed: tf.Tensor, ops: Sequence[ImageOp]) -> tf.Tensor:
    """Applies per-image ops with independent seeds split from ``seed``."""
    seeds = _split(seed, max(1, len(ops)))
    for i, op in enumerate(ops):
        image = op(image, seeds[i])
    return image


def batch_mix(aug: Augment) -> MixOp | None:
    """The batch mixing op (MixUp, CutMix, or a random choice of the two), or None."""
    ops = [make(alpha) for make, alpha in ((make_mixup, aug.mixup), (make_cutmix, aug.cutmix)) if alpha]
    if not ops:
        return None
    if len(ops) == 1:
        return ops[0]

    def mixup_or_cutmix(images: tf.Tensor, targets: tf.Tensor, seed: tf.Tensor) -> tuple[tf.Tensor, tf.Tensor]:
        seeds = _split(seed, 2)
        pick = tf.random.stateless_uniform([], seeds[0]) < 0.5
        return tf.cond(pick, lambda: ops[0](images, targets, seeds[1]), lambda: ops[1](images, targets, seeds[1]))

    return mixup_or_cutmix
