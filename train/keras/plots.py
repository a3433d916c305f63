"""The pictures a run leaves in its folder: learning curves, per-class ROC curves, a prediction grid.

Each function takes plain arrays / a DataFrame and writes one PNG (through
``tfpipe.runtime.fs``, so a ``gs://`` run folder works too). Figures are drawn on
``matplotlib.figure.Figure`` objects, which render headless without pyplot:
the process's (a notebook's) matplotlib backend is never changed.
"""

from __future__ import annotations

import io
import textwrap
from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np

from tfpipe.runtime import fs
from tfpipe.runtime.deps import require

if TYPE_CHECKING:
    import pandas as pd
    from matplotlib.figure import Figure

RIGHT, WRONG = "tab:blue", "tab:red"
# Keras' AUC during training is a binned estimate; the exact figure of the saved model is in roc.png and
# metrics.json (report.roc_auc_macro), and the two are not the same number.
TITLES = {"auc": "AUC (Keras' binned estimate)"}
GRID_CHARS = 26  # characters of a caption line that fit a 2.2-inch grid cell at 8 pt


def subplots(rows: int, columns: int, figsize: tuple[float, float]) -> tuple[Figure, np.ndarray]:
    """A figure and its [rows, columns] axes, without pyplot (no backend is selected or changed)."""
    fig = require("matplotlib.figure").Figure(figsize=figsize)
    return fig, fig.subplots(rows, columns, squeeze=False)


def save(fig: Figure, path: str) -> None:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=100, bbox_inches="tight")
    fs.write_atomic(path, buf.getvalue())


def learning_curves(history: pd.DataFrame, path: str) -> None:
    """Loss, every validation score, and the learning rate per epoch (from ``history.csv``)."""
    metrics = [c for c in history.columns if not c.startswith("val_") and c not in ("epoch", "lr", "loss")]
    panels = ["loss", *metrics, *(["lr"] if "lr" in history else [])]
    fig, axes = subplots(1, len(panels), figsize=(4 * len(panels), 3.2))
    epochs = history["epoch"] + 1
    for ax, name in zip(axes[0], panels):
        ax.plot(epochs, history[name], marker=".", label="train" if name != "lr" else "learning rate")
        if f"val_{name}" in history:
            ax.plot(epochs, history[f"val_{name}"], marker=".", label="validation")
        ax.set_title(TITLES.get(name, name))
        ax.set_xlabel("epoch")
        ax.xaxis.set_major_locator(require("matplotlib.ticker").MaxNLocator(integer=True))  # whole epochs
        ax.grid(alpha=0.3)
        ax.legend()
    save(fig, path)


def roc_curves(targets: np.ndarray, probs: np.ndarray, classes: Sequence[str], path: str) -> None:
    """One validation ROC curve per class (classes without both positives and negatives are left out)."""
    from sklearn.metrics import roc_auc_score, roc_curve

    fig, axes = subplots(1, 1, figsize=(5, 5))
    ax = axes[0, 0]
    for c, name in enumerate(classes):
        if 0 < targets[:, c].sum() < len(targets):
            fpr, tpr, _ = roc_curve(targets[:, c], probs[:, c])
            ax.plot(fpr, tpr, label=f"{name} (AUC {roc_auc_score(targets[:, c], probs[:, c]):.3f})")
    ax.plot([0, 1], [0, 1], "k:", lw=1)
    ax.set(xlabel="false positive rate", ylabel="true positive rate", title="validation ROC per class")
    ax.legend(fontsize=8, loc="lower right")
    save(fig, path)


def wrapped(text: str, width: int = GRID_CHARS, most_lines: int = 3) -> str:
    """A caption wrapped to a grid cell's width, at most ``most_lines`` lines (the rest elided)."""
    lines = textwrap.wrap(text, width) or [""]
    return (
        "\n".join(lines[: most_lines - 1] + [" ".join(lines[most_lines - 1 :])[: width - 2] + ".."])
        if len(lines) > most_lines
        else "\n".join(lines)
    )


def prediction_grid(
    images: np.ndarray | Sequence[np.ndarray],
    true_labels: Sequence[str],
    predicted_labels: Sequence[str],
    path: str,
    columns: int = 6,
) -> None:
    """Images titled "true / predicted", blue when the label sets agree, red when they do not."""
    n = len(images)
    rows = max(1, -(-n // columns))
    titles = [
        f"{wrapped(true or 'no labels')}\n{wrapped(pred or 'no labels')}"
        for true, pred in zip(true_labels, predicted_labels)
    ]
    lines = max([t.count("\n") + 1 for t in titles] + [2])
    # Each row gets the height of its tallest title, so long label lists never run into the images above.
    fig, axes = subplots(rows, columns, figsize=(2.2 * columns, (2.2 + 0.16 * lines) * rows))
    for ax in axes.flat:
        ax.axis("off")
    for ax, image, title, true, pred in zip(axes.flat, images, titles, true_labels, predicted_labels):
        ax.imshow(np.asarray(image))
        ax.set_title(title, fontsize=8, color=RIGHT if set(true.split()) == set(pred.split()) else WRONG)
    fig.suptitle("validation: true (top) / predicted (bottom)", fontsize=10)
    save(fig, path)
