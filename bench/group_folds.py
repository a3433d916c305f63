"""Flattering vs honest validation: the same grouped data, folds by image and folds by group, side by side.

    python -m bench.group_folds bench/out/group_folds

Each "photograph" of the demo's kind (``tfpipe.demo.draw_image``) gives ``--copies`` crops of itself, as one
patient gives several scans or one video many frames: near-copies with the photograph's labels, one group. The
same CSV is written twice, with stratified folds by image (crops of one photograph in several folds) and with
``--group-col photo`` (each photograph's crops in one fold); the same small-cnn is trained on fold 0 of each, and
both runs predict a held-out test set of new photographs. The validation score a run reports should be what the
test set says; with folds by image it says more (the crops of a validation photograph were trained on).
Prints a markdown table (the training guide's).
"""

from __future__ import annotations

import argparse
import csv
import os
import sys

import cv2
import numpy as np

from bench.common import check_work_folder

CROP = 0.8  # a crop keeps this share of each side, at a random place
SIZE = 32


def write_photos(folder: str, name: str, photos: int, copies: int, seed: int) -> str:
    """``photos`` drawn photographs, ``copies`` random crops (and flips) of each, and their CSV: image, labels,
    photo. Returns the CSV's path."""
    from tfpipe.demo import draw_image

    rng = np.random.default_rng(seed)
    os.makedirs(os.path.join(folder, "images"), exist_ok=True)
    rows = []
    for p in range(photos):
        image, labels = draw_image(rng)
        h, w = image.shape[:2]
        for c in range(copies):
            y, x = rng.integers(0, int(h * (1 - CROP)) + 1), rng.integers(0, int(w * (1 - CROP)) + 1)
            crop = image[y : y + int(h * CROP), x : x + int(w * CROP)]
            crop = crop[:, ::-1] if rng.random() < 0.5 else crop
            image_id = f"{name}_{p:04d}_{c}"
            cv2.imwrite(os.path.join(folder, "images", f"{image_id}.jpg"), np.ascontiguousarray(crop))
            rows.append((image_id, " ".join(labels), f"{name}_{p:04d}"))
    path = os.path.join(folder, f"{name}.csv")
    with open(path, "w", newline="") as f:
        csv.writer(f).writerows([("image", "labels", "photo"), *rows])
    return path


def fold_and_score(work: str, train_csv: str, test: str, group_col: str | None, epochs: int) -> tuple[float, float]:
    """(the run's validation AUC on fold 0, its AUC on the held-out test photographs)."""
    import tfpipe
    from tfpipe.demo import SHAPES
    from train.fit import FitConfig, fit
    from train.predict import predict

    name = "by_group" if group_col else "by_image"
    records = os.path.join(work, "records", name)
    source = tfpipe.Source(os.path.join(work, "images"), csv=train_csv, group_col=group_col)
    tfpipe.write_shards(source, records, spec=tfpipe.ImageSpec(image_size=SIZE), num_folds=5, workers=0,
                        classes=sorted(SHAPES), progress=False, overwrite=True)  # fmt: skip
    run = os.path.join(work, "runs", name)
    cfg = FitConfig(records=records, run=run, strategy="cpu", model="small-cnn", batch_size=16, epochs=epochs,
                    lr=2e-3, seed=0, verbose=0, overwrite=os.path.exists(run))  # fmt: skip
    metrics = fit(cfg)
    df = predict(run, test, out="", strategy="cpu", progress=False)
    return metrics.report["roc_auc_macro"], df.attrs["evaluation"]["all"]["roc_auc_macro"]


MARK = ".bench-group-folds"  # written first into the work folder: what a later run may write over


def run(args: argparse.Namespace) -> None:
    import tfpipe
    from tfpipe.demo import SHAPES  # every class in both writes, whatever the few photographs of a smoke run hold
    from tfpipe.runtime.errors import check_count

    check_count(1, copies=args.copies, epochs=args.epochs)
    check_count(3, photos=args.photos)  # a third of them, new, are the test set
    check_work_folder(args.work, MARK)
    train_csv = write_photos(args.work, "train", args.photos, args.copies, seed=0)
    test_csv = write_photos(args.work, "test", args.photos // 3, args.copies, seed=1)
    test = os.path.join(args.work, "records", "test")
    tfpipe.write_shards(tfpipe.Source(os.path.join(args.work, "images"), csv=test_csv), test, classes=sorted(SHAPES),
                        spec=tfpipe.ImageSpec(image_size=SIZE), workers=0, progress=False, overwrite=True)  # fmt: skip
    print("| folds | validation AUC (fold 0) | held-out test AUC | validation minus test |")
    print("|---|---|---|---|")
    for group_col, what in ((None, "by image (`--num-folds 5`)"), ("photo", "by group (`--group-col photo`)")):
        val, held_out = fold_and_score(args.work, train_csv, test, group_col, args.epochs)
        print(f"| {what} | {val:.3f} | {held_out:.3f} | {val - held_out:+.3f} |", flush=True)


def main() -> int:
    from tfpipe.runtime.errors import ArgumentParser, run_cli

    p = ArgumentParser(prog="python -m bench.group_folds", description=(__doc__ or "").splitlines()[0])
    p.add_argument("work", help="a new or empty folder for the images, shards and runs (or one this made before)")
    p.add_argument("--photos", type=int, default=150, help="photographs to train on (a third as many new ones: test)")
    p.add_argument("--copies", type=int, default=4, help="crops of each photograph")
    p.add_argument("--epochs", type=int, default=12)
    return run_cli("bench.group_folds", run, p.parse_args())


if __name__ == "__main__":
    sys.exit(main())
