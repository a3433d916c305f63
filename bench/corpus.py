"""A corpus of realistic photos for benchmarks, built offline from scikit-image's sample photographs.

    python -m bench.corpus bench/out/corpus --count 300

Random crops, scales (1,400-2,200 px wide, like Kaggle competition photos),
flips, colour shifts and a little sensor noise (upscaled photos are otherwise
smoother than real ones, and JPEG cost depends on detail). Writes
``images/*.jpg`` (quality 92) and ``train.csv`` with random multi-labels.
"""

import argparse
import csv
import os

import cv2
import numpy as np

PHOTOS = (
    "astronaut",
    "coffee",
    "chelsea",
    "rocket",
    "retina",
    "stereo_motorcycle",
    "immunohistochemistry",
    "hubble_deep_field",
    "colorwheel",
)
WIDTH_RANGE = (1400, 2200)
LABELS = ("a", "b", "c", "d", "e")


def source_photos():
    """The photographs scikit-image ships (no download), as BGR uint8."""
    import skimage.data

    out = []
    for name in PHOTOS:
        img = getattr(skimage.data, name)()
        img = img[0] if isinstance(img, tuple) else img
        out.append(cv2.cvtColor(img[:, :, :3], cv2.COLOR_RGB2BGR))
    return out


def make_photo(rng, photos):
    src = photos[rng.integers(len(photos))]
    h, w = src.shape[:2]
    ch, cw = int(h * rng.uniform(0.6, 1.0)), int(w * rng.uniform(0.6, 1.0))
    y, x = rng.integers(0, h - ch + 1), rng.integers(0, w - cw + 1)
    crop = src[y : y + ch, x : x + cw]
    width = int(rng.integers(*WIDTH_RANGE))
    height = int(width * rng.uniform(0.6, 0.9))
    img = cv2.resize(crop, (width, height), interpolation=cv2.INTER_CUBIC).astype(np.float32)
    if rng.random() < 0.5:
        img = img[:, ::-1]
    img = img * rng.uniform(0.8, 1.2, 3) + rng.uniform(-20, 20, 3)
    img += rng.standard_normal(img.shape, dtype=np.float32) * 4
    return np.clip(img, 0, 255).astype(np.uint8)


def make_corpus(out, count=300, seed=0):
    """Writes ``count`` photos and a CSV; returns (csv path, images folder)."""
    rng = np.random.default_rng(seed)
    photos = source_photos()
    images = os.path.join(out, "images")
    os.makedirs(images, exist_ok=True)
    rows = []
    for i in range(count):
        name = f"photo_{i:05d}"
        cv2.imwrite(os.path.join(images, name + ".jpg"), make_photo(rng, photos), [cv2.IMWRITE_JPEG_QUALITY, 92])
        labels = [lab for lab in LABELS if rng.random() < 0.3]
        rows.append((name, " ".join(labels)))
    path = os.path.join(out, "train.csv")
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["image", "labels"])
        w.writerows(rows)
    return path, images


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("out")
    p.add_argument("--count", type=int, default=300)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    make_corpus(args.out, args.count, args.seed)
    print(f"{args.count} photos -> {args.out}")


if __name__ == "__main__":
    main()
