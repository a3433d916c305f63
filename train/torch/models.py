"""The PyTorch side of the recipes (``examples/torch_ddp.py``, ``examples/lightning_swa.py``): the model table,
the input step and the validation score. No TensorFlow here.

    from train.torch.models import build_model, model_inputs
    model = build_model("small-cnn", num_classes=5)  # or a timm name: build_model("resnet18", 5)
    logits = model(model_inputs(images, training=True))  # images: RecordDataset's uint8 [B, 3, S, S]

The same small ConvNet design as ``train.keras.models``' small-cnn (pairs of conv-BN-ReLU, then pooling), at twice its
widths (``SMALL_CNN_WIDTHS``); any other name is looked up in timm (``timm.list_models()``),
built from scratch unless ``pretrained`` (a download: never in tests or the demo).
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

import numpy as np

from tfpipe.format.sampling import SAMPLINGS
from tfpipe.runtime.deps import require
from tfpipe.runtime.errors import TfpipeError

require("torch")
import torch
from torch import nn

from tfpipe.torch.dataset import RecordDataset
from train.decide.evaluation import Array, score
from train.keras.imbalance import LossWeights, weights_of
from train.keras.models import DROPOUT, IMAGENET_MEAN, IMAGENET_STD
from train.keras.names import CLASS_WEIGHT_HELP, CLASS_WEIGHTS, SAMPLING_HELP

# Twice the widths of train.keras.models' small-cnn: the recipes' defaults (lr, epochs) are tuned to them. At Keras'
# half widths these defaults score lower on the demo: the Lightning recipe's AUC by several hundredths, and one
# process for 10 epochs (what the torch_xla test trains) by about two (docs/project/tests.md).
SMALL_CNN_WIDTHS = (32, 64, 128, 256)
FLIP = 0.5  # chance of a horizontal flip of a training image: the demo's shapes and most photos allow it


def small_cnn(num_classes: int) -> nn.Module:
    """``train.keras.models``' small-cnn design in PyTorch: pairs of conv-BN-ReLU per width, max-pooling between
    widths."""
    layers: list[nn.Module] = []
    channels = 3
    for i, width in enumerate(SMALL_CNN_WIDTHS):
        for _ in range(2):
            layers += [nn.Conv2d(channels, width, 3, padding=1, bias=False), nn.BatchNorm2d(width), nn.ReLU()]
            channels = width
        if i < len(SMALL_CNN_WIDTHS) - 1:
            layers.append(nn.MaxPool2d(2))
    head = [nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Dropout(DROPOUT), nn.Linear(channels, num_classes)]
    return nn.Sequential(*layers, *head)


TORCH_MODELS: dict[str, Callable[[int], nn.Module]] = {"small-cnn": small_cnn}  # name -> builder(num_classes)


def check_model(name: str, pretrained: bool = False) -> None:
    """Raises ``TfpipeError`` unless ``name`` is in the table or timm's (which must then be installed)."""
    if name in TORCH_MODELS:
        if pretrained:
            raise TfpipeError(f"{name} has no pretrained weights")
        return
    timm = require("timm")
    if name not in timm.list_models():
        raise TfpipeError(f"unknown model {name!r}: use small-cnn or a timm model name (timm.list_models())")


def build_model(name: str, num_classes: int, pretrained: bool = False) -> nn.Module:
    """A model of the table, else timm's model ``name`` with a ``num_classes`` head (logits out)."""
    check_model(name, pretrained)
    if name in TORCH_MODELS:
        return TORCH_MODELS[name](num_classes)
    return require("timm").create_model(name, pretrained=pretrained, num_classes=num_classes)


def model_inputs(images: torch.Tensor, training: bool) -> torch.Tensor:
    """uint8 [B, 3, H, W] -> float32 normalised as ImageNet models expect; training flips some horizontally."""
    x = images.float().div_(255)
    mean = torch.tensor(IMAGENET_MEAN, device=x.device).view(1, 3, 1, 1)
    std = torch.tensor(IMAGENET_STD, device=x.device).view(1, 3, 1, 1)
    x = (x - mean) / std
    if training:
        flip = torch.rand(len(x), device=x.device) < FLIP
        x = torch.where(flip.view(-1, 1, 1, 1), x.flip(3), x)
    return x


def validation_auc(probs: Array, targets: Array) -> float:
    """Exact macro ROC AUC over the classes with positives and negatives: the figure ``train.fit`` reports."""
    classes = [str(c) for c in range(targets.shape[1])]
    auc = score(np.asarray(probs), np.asarray(targets), classes, [0.5] * len(classes), False)["roc_auc_macro"]
    if auc is None:
        raise TfpipeError("the validation images have no class with both positive and negative images: no AUC")
    return float(auc)


def add_recipe_arguments(parser: argparse.ArgumentParser, per: str) -> None:
    """The flags both recipes take, in one vocabulary; ``per`` names a rank (``process``, ``device``)."""
    parser.add_argument("--records", help="shard folder written with --num-folds (to train on)")
    parser.add_argument("--fold", type=int, default=0, help="the fold validated on; the others are trained on")
    parser.add_argument("--model", default="small-cnn", help="small-cnn, or a timm model name (timm installed)")
    ranks = f"{per}es" if per.endswith("s") else f"{per}s"  # processes, devices
    parser.add_argument("--batch-size", type=int, default=8, help=f"per {per}")
    parser.add_argument(
        "--lr",
        type=float,
        default=1e-3,
        help=f"per {per}: the optimizer gets lr x the number of {ranks}",
    )
    parser.add_argument("--workers", type=int, default=0, help=f"DataLoader workers per {per}")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--class-weight", choices=CLASS_WEIGHTS, help=f"{CLASS_WEIGHT_HELP} (each class a yes/no)")
    parser.add_argument("--sampling", choices=SAMPLINGS, help=SAMPLING_HELP)


class WeightedBCE(nn.Module):
    """Binary cross-entropy on logits with each class's positives and negatives weighed (``LossWeights``): the
    recipes' loss under ``--class-weight balanced``, as train.fit weighs a multi-label run's."""

    positive: torch.Tensor  # [C] buffers: they move with .to(device)
    negative: torch.Tensor

    def __init__(self, weights: LossWeights) -> None:
        super().__init__()
        self.register_buffer("positive", torch.tensor(weights.positive, dtype=torch.float32))
        self.register_buffer("negative", torch.tensor(weights.negative, dtype=torch.float32))

    def forward(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        bce = nn.functional.binary_cross_entropy_with_logits(logits, targets, reduction="none")
        return (bce * (targets * self.positive + (1 - targets) * self.negative)).mean()


def recipe_loss(class_weight: str | None, training: RecordDataset) -> nn.Module:
    """The recipes' loss: every class its own yes/no question (BCE on logits, single-label shards too), with
    ``--class-weight balanced`` weighed by the ``training`` images' class counts (their labels read, no image
    decoded) by scikit-learn's binary rule, the rule of train.fit's multi-label runs."""
    if class_weight is None:
        return nn.BCEWithLogitsLoss()
    targets = training.targets()
    return WeightedBCE(weights_of(targets.sum(axis=0), len(targets), single_label=False))
