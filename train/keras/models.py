"""The model table: name -> backbone builder, registered where each builder is defined, plus the shared head.

``@register_model("efficientnet-{}", ("b0", ...))`` adds one name per variant, so the names the command line
offers (``train.fit --model``) are the table's keys and cannot drift from the builders. Importing this module
starts no TensorFlow (``--help`` answers at once); the builders import the backend's Keras when they build.

Models take uint8 images: the cast and the backbone's own normalisation run
inside the model (on the accelerator), so the input pipeline moves 4x fewer bytes.
"""

from __future__ import annotations

import string
from collections.abc import Callable, Iterable
from typing import Any, NamedTuple

from tfpipe.runtime.errors import TfpipeError, option
from train.backends import complete, current, keras_module

IMAGENET_MEAN = (0.485, 0.456, 0.406)  # the efficientnet package's 'torch' preprocessing
IMAGENET_STD = (0.229, 0.224, 0.225)
DROPOUT = 0.2
BN_MOMENTUM = 0.9  # small-cnn: short runs need moving statistics that catch up within an epoch or two

# builder(variant, input_shape, weights) -> (backbone model, preprocessing layers run before it)
Builder = Callable[[str, tuple[int, int, int], "str | None"], tuple[Any, list[Any]]]


class Registered(NamedTuple):
    """One entry of the model table: the builder, the variant it is called with, and the smallest input side the
    model takes (EfficientNets downsample 32x; a small ConvNet takes less)."""

    builder: Builder
    variant: str
    min_image_size: int


MODELS: dict[str, Registered] = {}  # name -> (builder, variant, min_image_size)


def register_model(
    pattern: str, variants: Iterable[str] = ("",), min_image_size: int = 32
) -> Callable[[Builder], Builder]:
    """Registers ``builder`` under ``pattern.format(variant)`` for each variant; a name twice is a bug.

    ``pattern`` holds one ``{}`` for the variant when there are several (``"efficientnet-b{}", ("0", "1")``) and
    none for one model (``"small-cnn"``); ``min_image_size`` is the smallest input side the model takes (checked
    before training starts). A pattern and variants that do not make one distinct name per variant are a
    ``ValueError`` (``"bad-{}"`` without variants would register ``"bad-"``).
    """
    names = _names(pattern, variants)
    if type(min_image_size) is not int or min_image_size < 1:
        raise ValueError(f"min_image_size of {pattern!r} must be a whole number of pixels (got {min_image_size!r})")

    def add(builder: Builder) -> Builder:
        twice = [name for name in names if name in MODELS]
        if twice:
            raise ValueError(f"model {twice[0]!r} registered twice")
        for name, variant in names.items():
            MODELS[name] = Registered(builder, variant, min_image_size)
        return builder

    return add


def _names(pattern: str, variants: Iterable[str]) -> dict[str, str]:
    """name -> variant for ``register_model``, or a ``ValueError`` saying why the pattern and the variants do not
    make one distinct, non-empty name per variant."""
    if isinstance(variants, str):
        raise ValueError(f"variants of {pattern!r} must be a list of strings, not the string {variants!r}")
    listed = tuple(variants)
    if not listed or not all(isinstance(v, str) for v in listed):
        raise ValueError(f"variants of {pattern!r} must be one or more strings (got {listed!r})")
    fields = [field for _, field, _, _ in string.Formatter().parse(pattern) if field is not None]
    if fields not in ([], [""]):
        raise ValueError(f"pattern {pattern!r} must hold one {{}} (where the variant goes) or none")
    if not fields and len(listed) > 1:
        raise ValueError(f"pattern {pattern!r} has no {{}}, so its {len(listed)} variants would share one name")
    if fields and listed == ("",):
        raise ValueError(
            f"pattern {pattern!r} has a {{}} but no variants to put there (it would register "
            f"{pattern.format('')!r}); pass variants=(...), or drop the {{}} for a single model"
        )
    names = {pattern.format(v) if fields else pattern: v for v in listed}
    if len(names) < len(listed) or not all(name.strip() for name in names):
        raise ValueError(f"pattern {pattern!r} with variants {listed!r} does not make distinct, non-empty names")
    return names


def registered(name: str) -> Registered:
    """The table's entry for ``name``; an unknown name is an error listing the known ones."""
    if name not in MODELS:
        raise TfpipeError(f"unknown model {name!r}; choose one of {', '.join(MODELS)}")
    return MODELS[name]


def model_names() -> tuple[str, ...]:
    """Every registered model name, in registration order."""
    return tuple(MODELS)


@register_model("efficientnet-b{}", [str(i) for i in range(8)])
def _efficientnet(variant: str, input_shape: tuple[int, int, int], weights: str | None) -> tuple[Any, list[Any]]:
    """EfficientNet-B0..B7, the backend's (``Backend.efficientnet``: tf-keras' from the ``efficientnet`` package,
    Keras 3's own); one that does not normalise its [0, 255] input gets ImageNet's normalisation before it."""
    keras = keras_module()
    backbone, normalises = current().efficientnet(variant, input_shape, weights)
    if normalises:
        return backbone, []
    return backbone, [
        keras.layers.Rescaling(1.0 / 255),
        keras.layers.Normalization(mean=IMAGENET_MEAN, variance=[s * s for s in IMAGENET_STD]),
    ]


@register_model("efficientnetv2-{}", ("s", "m", "l", "b0", "b1", "b2", "b3"))
def _efficientnet_v2(variant: str, input_shape: tuple[int, int, int], weights: str | None) -> tuple[Any, list[Any]]:
    """EfficientNetV2 from Keras applications (includes its own [0, 255] -> [-1, 1] rescaling)."""
    keras = keras_module()
    fn = getattr(keras.applications, f"EfficientNetV2{variant.upper()}")
    return fn(include_top=False, weights=weights, input_shape=input_shape, include_preprocessing=True), []


def custom_objects() -> dict[str, Any]:
    """What loading a model file needs, the backend says (``Backend.custom_objects``): tfpipe's metric and
    schedules, completed on this process's Keras, under the class names a compiled model file gives them; the
    efficientnet package's layers tf-keras' EfficientNets use."""
    from train.keras.compiling import F1Score
    from train.keras.schedules import KaggleRamp, OneCycle

    return current().custom_objects({c.__name__: complete(c) for c in (F1Score, OneCycle, KaggleRamp)})


# Narrow for CPUs: half of (32, 64, 128, 256) is a quarter of the multiply-adds and about half the demo's epoch
# time on 2 cores, and the demo (at --lr 5e-4) still reaches an AUC around 0.95 (docs/project/tests.md).
SMALL_CNN_WIDTHS = (16, 32, 64, 128)


@register_model("small-cnn", min_image_size=8)
def _small_cnn(variant: str, input_shape: tuple[int, int, int], weights: str | None) -> tuple[Any, list[Any]]:
    """A small ConvNet (pairs of conv-BN-ReLU, then pooling) for CPU dry runs, tests and the demo.

    EfficientNets from scratch need far more epochs than a laptop CPU gives a demo;
    this one learns the demo shapes in a couple of minutes. No pretrained weights.
    """
    keras = keras_module()
    if weights is not None:
        raise ValueError(f"small-cnn has no pretrained weights; use {option('weights', 'none', python='weights=None')}")
    inputs = keras.Input(input_shape)
    x = inputs
    for i, width in enumerate(SMALL_CNN_WIDTHS):
        for j in range(2):
            x = keras.layers.Conv2D(width, 3, padding="same", use_bias=False, name=f"conv{i}_{j}")(x)
            x = keras.layers.BatchNormalization(momentum=BN_MOMENTUM, name=f"bn{i}_{j}")(x)
            x = keras.layers.ReLU(name=f"relu{i}_{j}")(x)
        if i < len(SMALL_CNN_WIDTHS) - 1:
            x = keras.layers.MaxPooling2D(name=f"pool{i}")(x)
    return keras.Model(inputs, x, name="small_cnn"), [keras.layers.Rescaling(1.0 / 255)]


def min_image_size(name: str) -> int:
    """The smallest input side model ``name`` takes, as it was registered (``register_model(min_image_size=...)``):
    32 for the EfficientNets (they downsample 32x; Keras refuses less), 8 for small-cnn's three poolings."""
    return registered(name).min_image_size


def _backbone(
    name: str, builder: Builder, variant: str, input_shape: tuple[int, int, int], weights: str | None
) -> tuple[Any, list[Any]]:
    """Calls the builder. With ``weights`` given, its failure is reported as a weights problem (no internet for
    "imagenet", a bad weights file); without, the builder's own error goes through unchanged (a bug in a user's
    registered builder is not a weights problem)."""
    try:
        return builder(variant, input_shape, weights)
    except (OSError, ValueError) as e:
        if weights is None:
            raise
        raise TfpipeError(f"cannot load weights {weights!r} for {name}: {str(e).splitlines()[0][:200]}") from None
    except Exception as e:  # urllib/HTTP errors from the download
        if weights == "imagenet":
            raise TfpipeError(
                f"cannot download ImageNet weights for {name} (no internet?): {type(e).__name__}: {str(e)[:160]}"
            ) from None
        raise


def build_model(
    name: str,
    num_classes: int,
    image_size: int,
    *,
    weights: str | None = None,
    multi_label: bool = True,
    dropout: float = DROPOUT,
) -> tuple[Any, Any]:
    """Builds ``uint8 image -> cast -> normalise -> backbone -> pool -> dropout -> dense``.

    Call inside ``strategy.scope()``. The output layer is float32 even under a
    mixed-precision policy (numerically safe losses).

    Args:
      name: a key of ``MODELS``.
      num_classes: outputs.
      image_size: side of the square input.
      weights: None, "imagenet" (downloads), or a path to backbone weights.
      multi_label: sigmoid outputs (independent labels) if True, softmax otherwise.
      dropout: dropout rate before the classifier.

    Returns:
      (model, backbone): the backbone is returned so it can be frozen.
    """
    builder, variant, _ = registered(name)
    keras = keras_module()
    backbone, preprocess = _backbone(name, builder, variant, (image_size, image_size, 3), weights)
    inputs = keras.Input((image_size, image_size, 3), dtype="uint8", name="image")
    x = keras.layers.Rescaling(1.0, name="cast")(inputs)  # uint8 -> compute dtype
    for layer in preprocess:
        x = layer(x)
    x = backbone(x)
    x = keras.layers.GlobalAveragePooling2D(name="pool")(x)
    x = keras.layers.Dropout(dropout, name="dropout")(x)
    outputs = keras.layers.Dense(
        num_classes, activation="sigmoid" if multi_label else "softmax", dtype="float32", name="classifier"
    )(x)
    return keras.Model(inputs, outputs, name=name), backbone
