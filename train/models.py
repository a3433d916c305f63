"""The model table: name -> backbone builder, plus the head every model shares.

Models take uint8 images: the cast and the backbone's own normalisation run
inside the model (on the accelerator), so the input pipeline moves 4x fewer bytes.
"""

import tensorflow as tf

from tfpipe.deps import require, require_keras
from tfpipe.errors import TfpipeError

keras = require_keras()

IMAGENET_MEAN = (0.485, 0.456, 0.406)  # the efficientnet package's 'torch' preprocessing
IMAGENET_STD = (0.229, 0.224, 0.225)
DROPOUT = 0.2
BN_MOMENTUM = 0.9  # small-cnn: short runs need moving statistics that catch up within an epoch or two


def _efficientnet(variant):
    """EfficientNet-B0..B7 from the ``efficientnet`` package, built with tf-keras modules."""

    def build(input_shape, weights):
        efn = require("efficientnet.model")
        fn = getattr(efn, f"EfficientNet{variant}")
        backbone = fn(
            include_top=False,
            weights=weights,
            input_shape=input_shape,
            backend=keras.backend,
            layers=keras.layers,
            models=keras.models,
            utils=keras.utils,
        )
        return backbone, [
            keras.layers.Rescaling(1.0 / 255),
            keras.layers.Normalization(mean=IMAGENET_MEAN, variance=[s * s for s in IMAGENET_STD]),
        ]

    return build


def _efficientnet_v2(variant):
    """EfficientNetV2 from Keras applications (includes its own [0, 255] -> [-1, 1] rescaling)."""

    def build(input_shape, weights):
        fn = getattr(keras.applications, f"EfficientNetV2{variant}")
        return fn(include_top=False, weights=weights, input_shape=input_shape, include_preprocessing=True), []

    return build


def custom_objects():
    """What ``load_model`` needs for the efficientnet package's layers (its swish and FixedDropout)."""
    efn = require("efficientnet.model")
    kw = {"backend": keras.backend, "layers": keras.layers, "models": keras.models, "utils": keras.utils}
    return {"swish": efn.get_swish(**kw), "FixedDropout": efn.get_dropout(**kw)}


def _small_cnn(widths=(32, 64, 128, 256)):
    """A small ConvNet (pairs of conv-BN-ReLU, then pooling) for CPU dry runs, tests and the demo.

    EfficientNets from scratch need far more epochs than a laptop CPU gives a demo;
    this one learns the demo shapes in a couple of minutes. No pretrained weights.
    """

    def build(input_shape, weights):
        if weights is not None:
            raise ValueError("small-cnn has no pretrained weights; use --weights none")
        inputs = keras.Input(input_shape)
        x = inputs
        for i, width in enumerate(widths):
            for j in range(2):
                x = keras.layers.Conv2D(width, 3, padding="same", use_bias=False, name=f"conv{i}_{j}")(x)
                x = keras.layers.BatchNormalization(momentum=BN_MOMENTUM, name=f"bn{i}_{j}")(x)
                x = keras.layers.ReLU(name=f"relu{i}_{j}")(x)
            if i < len(widths) - 1:
                x = keras.layers.MaxPooling2D(name=f"pool{i}")(x)
        return keras.Model(inputs, x, name="small_cnn"), [keras.layers.Rescaling(1.0 / 255)]

    return build


MODELS = {"small-cnn": _small_cnn()}
MODELS.update({f"efficientnet-b{i}": _efficientnet(f"B{i}") for i in range(8)})
MODELS.update({f"efficientnetv2-{v.lower()}": _efficientnet_v2(v) for v in ("S", "M", "L", "B0", "B1", "B2", "B3")})


def min_image_size(name):
    """The smallest input side a model takes: EfficientNets downsample 32x (Keras refuses below 32);
    small-cnn's three poolings need 8."""
    return 8 if name == "small-cnn" else 32


def build_model(name, num_classes, image_size, *, weights=None, multi_label=True, dropout=DROPOUT):
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
    if name not in MODELS:
        raise TfpipeError(f"unknown model {name!r}; choose one of {', '.join(MODELS)}")
    try:
        backbone, preprocess = MODELS[name]((image_size, image_size, 3), weights)
    except (OSError, ValueError) as e:  # no internet for "imagenet", or a bad weights file
        raise TfpipeError(f"cannot load weights {weights!r} for {name}: {str(e).splitlines()[0][:200]}") from None
    except Exception as e:  # urllib/HTTP errors from the download
        if weights == "imagenet":
            raise TfpipeError(
                f"cannot download ImageNet weights for {name} (no internet?): {type(e).__name__}: {str(e)[:160]}"
            ) from None
        raise
    inputs = keras.Input((image_size, image_size, 3), dtype=tf.uint8, name="image")
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
