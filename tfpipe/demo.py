"""Generate the built-in demo dataset: coloured shapes on textured backgrounds.

    python -m tfpipe.demo data/demo --train 2000 --test 400

Writes a Kaggle-style folder: ``images/*.jpg``, ``train.csv`` (``image,labels``;
labels are the kinds of shapes present, space-separated, empty when there
are none) and an unlabeled ``test.csv``. Shapes sit in distinct cells of a
2x2 grid, so none hides another and every label is visible. Deterministic
for a given seed.
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import json
import os
import sys
from collections.abc import Iterator, Sequence

import cv2
import numpy as np

from tfpipe.runtime import fs
from tfpipe.runtime.errors import ArgumentParser, TfpipeError, check_count, check_seed, run_cli

SHAPES = ("circle", "cross", "square", "star", "triangle")
MARK = ".tfpipe-demo.json"  # written first into a demo folder: what a later demo may write over
MAX_SHAPES = 4  # one per cell of a 2x2 grid
SIDE_RANGE = (144, 224)  # width and height in pixels, drawn independently: photos are rarely square
RADIUS_RANGE = (0.22, 0.42)  # outer radius over the cell's shorter side (at most 0.5: the shape stays in its cell)
JPEG_QUALITY = 92


def background(rng: np.random.Generator, height: int, width: int) -> np.ndarray:
    """Low-frequency colour noise plus fine grain: texture for the model to ignore."""
    coarse = rng.integers(40, 150, (rng.integers(2, 6), rng.integers(2, 6), 3)).astype(np.float32)
    img = cv2.resize(coarse, (width, height), interpolation=cv2.INTER_CUBIC)
    img += rng.normal(0, 12, (height, width, 3)).astype(np.float32)
    return np.clip(img, 0, 255).astype(np.uint8)


def polygon(kind: str, cx: float, cy: float, r: float, angle: float) -> np.ndarray:
    """Vertices of a shape centred at (cx, cy) with outer radius r, rotated by angle."""
    if kind == "square":
        t = angle + np.pi / 4 + np.arange(4) * np.pi / 2
        radii = np.full(4, r)
    elif kind == "triangle":
        t = angle + np.arange(3) * 2 * np.pi / 3
        radii = np.full(3, r)
    elif kind == "star":
        t = angle + np.arange(10) * np.pi / 5
        radii = np.where(np.arange(10) % 2 == 0, r, r * 0.45)
    else:  # cross: a plus sign of two bars
        w = r * 0.35
        pts = np.array(
            [(-w, -r), (w, -r), (w, -w), (r, -w), (r, w), (w, w), (w, r), (-w, r), (-w, w), (-r, w), (-r, -w), (-w, -w)]
        )
        c, s = np.cos(angle), np.sin(angle)
        return (pts @ np.array([[c, s], [-s, c]]) + (cx, cy)).astype(np.int32)
    return np.stack([cx + radii * np.cos(t), cy + radii * np.sin(t)], axis=1).astype(np.int32)


def draw_image(rng: np.random.Generator) -> tuple[np.ndarray, list[str]]:
    """Returns (BGR image, sorted list of shape kinds present)."""
    height, width = rng.integers(*SIDE_RANGE, size=2)
    img = background(rng, height, width)
    n = rng.integers(0, MAX_SHAPES + 1)
    cells = rng.permutation(4)[:n]
    kinds = [SHAPES[k] for k in rng.integers(0, len(SHAPES), n)]
    for cell, kind in zip(cells, kinds):
        cw, ch = width / 2, height / 2
        r = rng.uniform(*RADIUS_RANGE) * min(cw, ch)
        cx = (cell % 2) * cw + cw / 2 + rng.uniform(-1, 1) * (cw / 2 - r)
        cy = (cell // 2) * ch + ch / 2 + rng.uniform(-1, 1) * (ch / 2 - r)
        hsv = np.array([[[rng.integers(0, 180), rng.integers(150, 256), rng.integers(170, 256)]]], np.uint8)
        colour = tuple(int(c) for c in cv2.cvtColor(hsv, cv2.COLOR_HSV2BGR)[0, 0])
        if kind == "circle":
            cv2.circle(img, (int(cx), int(cy)), int(r), colour, -1, cv2.LINE_AA)
        else:
            cv2.fillPoly(img, [polygon(kind, cx, cy, r, rng.uniform(0, 2 * np.pi))], colour, cv2.LINE_AA)
    return img, sorted(set(kinds))


@contextlib.contextmanager
def opencv_without_threads() -> Iterator[None]:
    """OpenCV's own thread pool off while the demo draws, and the caller's setting back after: a process whose
    OpenCV pool is running cannot fork safely, and ``write_shards`` forks its workers (``make_demo`` then
    ``write_shards`` in one notebook would hang its workers for good). Small images gain nothing from the pool."""
    saved = cv2.getNumThreads()
    cv2.setNumThreads(0)
    try:
        yield
    finally:
        cv2.setNumThreads(saved)


def make_demo(out: str, train: int = 2000, test: int = 400, seed: int = 0) -> dict[str, str]:
    """Writes the demo dataset into ``out`` and returns the paths of the two CSVs.

    ``out`` must be new, empty or an earlier demo folder: the demo never writes over a user's ``train.csv``."""
    check_count(1, train=train)
    check_count(0, test=test)
    check_seed(seed=seed)
    check_demo_folder(out)
    rng = np.random.default_rng(seed)
    images = os.path.join(out, "images")
    fs.makedirs(images)  # a file where a folder must be is named
    with open(os.path.join(out, MARK), "w") as f:  # first: a re-run may replace an interrupted demo
        json.dump({"train": train, "test": test, "seed": seed}, f)
    paths: dict[str, str] = {}
    for split, count in (("train", train), ("test", test)):
        rows = []
        with opencv_without_threads():
            for i in range(count):
                name = f"{split}_{i:05d}"
                img, labels = draw_image(rng)
                cv2.imwrite(os.path.join(images, name + ".jpg"), img, [cv2.IMWRITE_JPEG_QUALITY, JPEG_QUALITY])
                rows.append((name, " ".join(labels)))
        paths[split] = os.path.join(out, f"{split}.csv")
        with open(paths[split], "w", newline="") as f:
            w = csv.writer(f)
            w.writerow(["image", "labels"] if split == "train" else ["image"])
            w.writerows(rows if split == "train" else [(name,) for name, _ in rows])
    return paths


def check_demo_folder(out: str) -> None:
    """Refuses a folder holding anything the demo did not write (its mark file, or a demo folder without the
    mark: only ``images/``, ``train.csv`` starting with ``train_00000`` and ``test.csv``)."""
    if not str(out).strip():
        raise TfpipeError("the demo folder is empty (an unset variable?); give a path")
    if os.path.exists(out) and not os.path.isdir(out):
        raise TfpipeError(f"{out} is a file; the demo writes a folder")
    held = sorted(os.listdir(out)) if os.path.isdir(out) else []
    if not held or MARK in held or _earlier_demo(out, held):
        return
    raise TfpipeError(
        f"{out} holds files the demo did not write ({', '.join(held[:3])}{', ...' * (len(held) > 3)}); "
        "it writes only into a new or empty folder or over an earlier demo -- choose another folder"
    )


def _earlier_demo(out: str, held: list[str]) -> bool:
    if not set(held) <= {"images", "train.csv", "test.csv"}:
        return False
    try:
        with open(os.path.join(out, "train.csv")) as f:
            return f.readline().strip() == "image,labels" and f.readline().startswith("train_00000,")
    except (OSError, UnicodeDecodeError):
        return False


def run_command(args: argparse.Namespace) -> None:
    make_demo(args.out, args.train, args.test, args.seed)
    print(f"demo dataset: {args.train} train + {args.test} test images, classes {' '.join(SHAPES)} -> {args.out}")


def build_parser() -> ArgumentParser:
    p = ArgumentParser(prog="python -m tfpipe.demo", description=(__doc__ or "").split("\n\n")[0])
    p.add_argument("out", help="output folder")
    p.add_argument("--train", type=int, default=2000, help="labeled images")
    p.add_argument("--test", type=int, default=400, help="unlabeled images")
    p.add_argument("--seed", type=int, default=0, help="seed of the drawing")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    return run_cli("tfpipe.demo", run_command, build_parser().parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
