"""A single-label, imbalanced, grouped competition, end to end, against a scikit-learn MLP on raw pixels.

    python -m bench.competition bench/out/competition

The training guide's recipe ("A single-label, imbalanced competition, end to end": its commands as written, on
the documented CPU settings: small-cnn, 64 px, 8 virtual replicas, ``--metric balanced_accuracy --sampling
balanced --tta 4``) on synthetic data drawn like a competition's: one of five shapes an image (28% of the images down
to 4%), photos grouped by region, each region with its own background cast, shape colours and sizes, a few
byte-identical copies in other regions, and a test set of regions that no fold holds (a shift no validation can
show). Prints the held-back test's accuracy and balanced accuracy of the submission beside the CV's OOF figure
(the model and the views it submits with) and beside an ``MLPClassifier`` on the same 64 px pixels, trained on
every training image. The submission follows a ``sample_submission.csv`` in a shuffled order; the test labels
stay in a file the commands never read.
"""

from __future__ import annotations

import csv
import os
import shutil
import subprocess
import sys

import cv2
import numpy as np

from bench.common import check_work_folder

SHARES = {"circle": 0.28, "square": 0.26, "triangle": 0.24, "star": 0.18, "cross": 0.04}
TRAIN_REGIONS, TEST_REGIONS = range(10), range(10, 12)
COPIES = 12  # training images copied byte for byte into another region
MARK = ".bench-competition"
# The largest allocation: the MLP's pixels (``pixels``), each training image a float64 row of 64 x 64 x 3, then all
# of them as one float32 array -- bytes an image at the peak
MLP_IMAGE_BYTES = 64 * 64 * 3 * (8 + 4)


def draw(rng: np.random.Generator, kind: str, region: int) -> np.ndarray:
    """One 96 px image of ``kind`` as ``region`` photographs it: its background cast, colours and sizes."""
    from tfpipe.demo import background, polygon

    look = np.random.default_rng(1000 + region)  # the region's own, the same for each of its images
    cast, hue, size = look.integers(-35, 36, 3), look.integers(70, 150, 3), look.uniform(12, 18)
    img = np.clip(background(rng, 96, 96).astype(np.int16) + cast, 0, 255).astype(np.uint8)
    r, cx, cy = size + rng.uniform(0, 6), rng.uniform(28, 68), rng.uniform(28, 68)
    colour = tuple(int(c) for c in np.clip(hue + rng.integers(0, 60, 3), 0, 255))
    if kind == "circle":
        cv2.circle(img, (int(cx), int(cy)), int(r), colour, -1, cv2.LINE_AA)
    else:
        cv2.fillPoly(img, [polygon(kind, cx, cy, r, rng.uniform(0, 2 * np.pi))], colour, cv2.LINE_AA)
    return img


def write_data(work: str, images: int) -> None:
    """images/, train.csv (image, label, region), test.csv (image), sample_submission.csv (image, label; shuffled)
    and answers.csv (the test's labels, for scoring only)."""
    rng = np.random.default_rng(0)
    os.makedirs(os.path.join(work, "images"), exist_ok=True)
    rows: dict[str, list[tuple[str, str, int]]] = {"train": [], "test": []}
    for split, regions, count in (("train", TRAIN_REGIONS, images), ("test", TEST_REGIONS, images // 3)):
        kinds = rng.choice(list(SHARES), size=count, p=list(SHARES.values()))
        for i, kind in enumerate(kinds):
            region = int(rng.choice(list(regions)))
            name = f"{split}_{i:05d}"
            cv2.imwrite(os.path.join(work, "images", f"{name}.png"), draw(rng, str(kind), region))
            rows[split].append((name, str(kind), region))
    for j, (name, kind, region) in enumerate(rows["train"][:COPIES]):  # the same photo filed twice
        copy = f"copy_{j:03d}"
        shutil.copy(os.path.join(work, "images", f"{name}.png"), os.path.join(work, "images", f"{copy}.png"))
        rows["train"].append((copy, kind, (region + 5) % len(TRAIN_REGIONS)))
    table(work, "train.csv", ["image", "label", "region"], rows["train"])
    table(work, "test.csv", ["image"], [(name,) for name, _, _ in rows["test"]])
    table(work, "answers.csv", ["image", "label"], [(name, kind) for name, kind, _ in rows["test"]])
    shuffled = [rows["test"][i] for i in rng.permutation(len(rows["test"]))]
    table(work, "sample_submission.csv", ["image", "label"], [(name, "circle") for name, _, _ in shuffled])


def table(work: str, name: str, header: list[str], rows: list[tuple]) -> None:
    with open(os.path.join(work, name), "w", newline="") as f:
        csv.writer(f).writerows([header, *rows])


def commands(work: str) -> list[list[str]]:
    """The training guide's commands, as written there, in ``work``."""
    write = [sys.executable, "-m", "tfpipe.write"]
    return [
        [*write, "--csv", "train.csv", "--images", "images", "--out", "records/train", "--class-col", "label",
         "--group-col", "region", "--num-folds", "5", "--image-size", "64", "--no-progress"],
        [*write, "--csv", "test.csv", "--images", "images", "--out", "records/test", "--split", "test",
         "--unlabeled", "--image-size", "64", "--no-progress"],
        [sys.executable, "-m", "train.cv", "--records", "records/train", "--run", "runs/cv", "--strategy", "cpu",
         "--replicas", "8", "--steps-per-execution", "5", "--model", "small-cnn", "--batch-size", "8",
         "--epochs", "12", "--lr", "5e-4", "--swa-epochs", "3", "--seed", "0", "--metric", "balanced_accuracy",
         "--sampling", "balanced", "--tta", "4", "--verbose", "0"],
        [sys.executable, "-m", "train.predict", "--run", "runs/cv", "--records", "records/test", "--out",
         "submission.csv", "--strategy", "cpu", "--replicas", "8", "--tta", "4", "--sample-submission",
         "sample_submission.csv", "--save-probabilities", "runs/cv/test-probs.csv"],
    ]  # fmt: skip


def pixels(work: str, names: list[str]) -> np.ndarray:
    """The images at 64 px (INTER_AREA, as the writer resizes), as flat [0, 1] rows."""
    rows = []
    for name in names:
        img = cv2.imread(os.path.join(work, "images", f"{name}.png"))[:, :, ::-1]
        rows.append(cv2.resize(img, (64, 64), interpolation=cv2.INTER_AREA).reshape(-1) / 255.0)
    return np.array(rows, dtype=np.float32)


def read(work: str, name: str) -> list[dict[str, str]]:
    with open(os.path.join(work, name), newline="") as f:
        return list(csv.DictReader(f))


def mlp_scores(work: str) -> tuple[float, float]:
    """Held-back accuracy and balanced accuracy of an MLP on raw pixels trained on every training image."""
    from sklearn.metrics import accuracy_score, balanced_accuracy_score
    from sklearn.neural_network import MLPClassifier
    from sklearn.pipeline import make_pipeline
    from sklearn.preprocessing import StandardScaler

    train, answers = read(work, "train.csv"), read(work, "answers.csv")
    mlp = make_pipeline(StandardScaler(), MLPClassifier((256,), early_stopping=True, max_iter=300, random_state=0)).fit(
        pixels(work, [r["image"] for r in train]), [r["label"] for r in train]
    )
    predicted = mlp.predict(pixels(work, [r["image"] for r in answers]))
    truth = [r["label"] for r in answers]
    return accuracy_score(truth, predicted), balanced_accuracy_score(truth, predicted)


def check_fits_in_memory(images: int) -> None:
    """``images`` training images fit this machine's memory where the bench holds them all at once (the MLP's
    pixels: ``MLP_IMAGE_BYTES`` each), else one line naming ``--images`` and the most that fit -- before any file
    is written, not NumPy's out-of-memory traceback after."""
    from tfpipe.runtime.errors import TfpipeError, option

    needs = (images + COPIES) * MLP_IMAGE_BYTES
    has = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    if needs > has:
        most = has // MLP_IMAGE_BYTES - COPIES
        raise TfpipeError(
            f"{option('images', images)}: the MLP baseline holds every training image's 64 px pixels in memory at "
            f"once, {needs / 1e9:,.1f} GB, more than this machine's {has / 1e9:,.1f} GB; use "
            f"{option('images')} {most} or fewer"
        )


def run(work: str, images: int) -> None:
    from sklearn.metrics import accuracy_score, balanced_accuracy_score

    from tfpipe.runtime.errors import check_count
    from train.runs.cv_folder import CVResult

    check_count(100, images=images)  # fewer would leave the rarest class (4%) a handful of images
    check_fits_in_memory(images)
    check_work_folder(work, MARK)
    for made in ("images", "records", "runs"):  # this benchmark's own, from an earlier run (the mark says so)
        shutil.rmtree(os.path.join(work, made), ignore_errors=True)
    write_data(work, images)
    for argv in commands(work):
        print("$", " ".join(a.replace(sys.executable, "python") for a in argv), flush=True)
        subprocess.run(argv, cwd=work, check=True)
    sample = read(work, "sample_submission.csv")
    submitted = read(work, "submission.csv")
    assert [r["image"] for r in submitted] == [r["image"] for r in sample], "the submission left the sample's order"
    truth = {r["image"]: r["label"] for r in read(work, "answers.csv")}
    y, p = [truth[r["image"]] for r in submitted], [r["label"] for r in submitted]
    cv = CVResult.load(os.path.join(work, "runs", "cv"))
    model = cv.scores_of(swa=cv.submits == "model-swa.keras")
    assert model is not None
    oof, one = model.scores["balanced_accuracy"], (model.one_view or {}).get("balanced_accuracy")
    mlp_acc, mlp_bal = mlp_scores(work)
    print(f"\nSingle-label, imbalanced, grouped: {images} training images in {len(TRAIN_REGIONS)} regions (+{COPIES}"
          f" copies), {len(truth)} test images of {len(TEST_REGIONS)} regions no fold holds\n")  # fmt: skip
    print("| | test accuracy | test balanced accuracy | OOF balanced accuracy |")
    print("|---|---|---|---|")
    print(f"| train.cv, the 5 fold models' {model.model}, {model.views} views (submitted) | "
          f"{accuracy_score(y, p):.3f} | {balanced_accuracy_score(y, p):.3f} | {oof:.3f} (1 view: "
          f"{'n/a' if one is None else f'{one:.3f}'}) |")  # fmt: skip
    print(f"| MLPClassifier(256) on raw 64 px pixels, every training image | {mlp_acc:.3f} | {mlp_bal:.3f} | |")
    print(f"\nOOF - test, balanced accuracy: {oof - balanced_accuracy_score(y, p):+.3f}")


def main() -> int:
    from tfpipe.runtime.errors import ArgumentParser, run_cli

    p = ArgumentParser(prog="python -m bench.competition", description=(__doc__ or "").splitlines()[0])
    p.add_argument("work", help="a new or empty folder for the images, shards and runs (or one this made before)")
    p.add_argument("--images", type=int, default=1200, help="training images (a third as many: the test set)")
    args = p.parse_args()
    return run_cli("bench.competition", lambda a: run(a.work, a.images), args)


if __name__ == "__main__":
    sys.exit(main())
