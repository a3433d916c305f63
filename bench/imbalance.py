"""Imbalanced classes: the same single-label data trained as it is, with ``--class-weight balanced`` and with
``--sampling balanced``, side by side, each scored on a held-out test set drawn like the training images.

    python -m bench.imbalance bench/out/imbalance

One shape of the demo's kinds per image (``tfpipe.demo``'s background and shapes, small and faint, so the task
is not trivial), its kind the image's one label, in the shares of ``SHARES`` (the rarest classes 6% and 4%, as in
a Kaggle competition's tail). The same small-cnn trains on fold 0 of 5 three times (``--metric
balanced_accuracy``); each run predicts the held-out images. Prints a markdown table (the training guide's):
accuracy, balanced accuracy, macro F1 and the two rarest classes' F1 and recall on the held-out test.
"""

from __future__ import annotations

import argparse
import csv
import os
import sys

import cv2
import numpy as np

from bench.common import check_work_folder

SHARES = {"circle": 0.50, "square": 0.25, "triangle": 0.15, "star": 0.06, "cross": 0.04}
RARE = ("star", "cross")
SIZE = 32
MARK = ".bench-imbalance"
WAYS = (  # (the table's words, --class-weight, --sampling)
    ("as it is", None, None),
    ("`--class-weight balanced`", "balanced", None),
    ("`--sampling balanced`", None, "balanced"),
)


def write_images(folder: str, name: str, count: int, seed: int) -> str:
    """``count`` images of one shape each, their kinds in ``SHARES``' proportions, and their CSV (image,
    label). Returns the CSV's path."""
    from tfpipe.demo import background, polygon

    rng = np.random.default_rng(seed)
    kinds = rng.choice(list(SHARES), size=count, p=list(SHARES.values()))
    os.makedirs(os.path.join(folder, "images"), exist_ok=True)
    rows = []
    for i, kind in enumerate(kinds):
        img = background(rng, 96, 96)
        r, cx, cy = rng.uniform(14, 22), rng.uniform(28, 68), rng.uniform(28, 68)
        colour = tuple(int(c) for c in rng.integers(90, 200, 3))  # faint: near the background's own range
        if kind == "circle":
            cv2.circle(img, (int(cx), int(cy)), int(r), colour, -1, cv2.LINE_AA)
        else:
            cv2.fillPoly(img, [polygon(kind, cx, cy, r, rng.uniform(0, 2 * np.pi))], colour, cv2.LINE_AA)
        image_id = f"{name}_{i:05d}"
        cv2.imwrite(os.path.join(folder, "images", f"{image_id}.png"), img)
        rows.append((image_id, kind))
    path = os.path.join(folder, f"{name}.csv")
    with open(path, "w", newline="") as f:
        csv.writer(f).writerows([("image", "label"), *rows])
    return path


def shards(work: str, csv_path: str, name: str, folds: int | None) -> str:
    import tfpipe

    out = os.path.join(work, "records", name)
    source = tfpipe.Source(
        os.path.join(work, "images"), csv=csv_path, label_format=tfpipe.LabelFormat(class_col="label")
    )
    tfpipe.write_shards(source, out, spec=tfpipe.ImageSpec(image_size=SIZE), num_folds=folds, workers=0,
                        classes=sorted(SHARES), progress=False, overwrite=True)  # fmt: skip
    return out


def trained_and_scored(
    work: str, records: str, test: str, class_weight: str | None, sampling: str | None, epochs: int
) -> dict:
    """The held-out test scores of one run trained with ``class_weight`` and ``sampling``."""
    from train.fit import FitConfig, fit
    from train.predict import predict

    run = os.path.join(work, "runs", f"{class_weight or 'none'}-{sampling or 'none'}")
    cfg = FitConfig(records=records, run=run, strategy="cpu", model="small-cnn", batch_size=32, epochs=epochs,
                    lr=2e-3, seed=0, verbose=0, overwrite=os.path.exists(run), metric="balanced_accuracy",
                    class_weight=class_weight, sampling=sampling)  # fmt: skip
    fit(cfg)
    return predict(run, test, out="", strategy="cpu", progress=False).attrs["evaluation"]["all"]


def run(args: argparse.Namespace) -> None:
    from tfpipe.runtime.errors import check_count

    check_count(1, epochs=args.epochs)
    check_count(50, images=args.images)
    check_work_folder(args.work, MARK)
    records = shards(args.work, write_images(args.work, "train", args.images, seed=0), "train", 5)
    test = shards(args.work, write_images(args.work, "test", args.images // 2, seed=1), "test", None)
    rare = " / ".join(RARE)
    print(f"| training | accuracy | balanced accuracy | F1 macro | F1 of {rare} | recall of {rare} |")
    print("|---|---|---|---|---|---|")
    for what, class_weight, sampling in WAYS:
        s = trained_and_scored(args.work, records, test, class_weight, sampling, args.epochs)
        table = s["per_class"]
        f1 = " / ".join(f"{table[c]['f1'] or 0:.3f}" for c in RARE)
        recall = " / ".join(f"{table[c]['recall'] or 0:.3f}" for c in RARE)
        print(
            f"| {what} | {s['exact_match']:.3f} | {s['balanced_accuracy']:.3f} | {s['f1_macro']:.3f} | {f1} | "
            f"{recall} |",
            flush=True,
        )


def main() -> int:
    from tfpipe.runtime.errors import ArgumentParser, run_cli

    p = ArgumentParser(prog="python -m bench.imbalance", description=(__doc__ or "").splitlines()[0])
    p.add_argument("work", help="a new or empty folder for the images, shards and runs (or one this made before)")
    p.add_argument("--images", type=int, default=2000, help="training images (half as many, new: the test set)")
    p.add_argument("--epochs", type=int, default=12)
    return run_cli("bench.imbalance", run, p.parse_args())


if __name__ == "__main__":
    sys.exit(main())
