"""Timing helpers shared by the benchmarks: every figure is a ratio measured in one run."""

import os
import statistics
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")


def timed(fn, reps=3):
    """Runs ``fn`` ``reps`` times; returns (min seconds, median seconds, last result)."""
    times, result = [], None
    for _ in range(reps):
        start = time.perf_counter()
        result = fn()
        times.append(time.perf_counter() - start)
    return min(times), statistics.median(times), result


def replicate_corpus(csv_path, images, out, times):
    """A folder of hard links repeating the corpus ``times`` times (more records, no more disk)."""
    import csv

    os.makedirs(os.path.join(out, "images"), exist_ok=True)
    with open(csv_path) as f:
        rows = list(csv.DictReader(f))
    new_rows = []
    for r in range(times):
        for row in rows:
            name = f"{row['image']}_{r}"
            link = os.path.join(out, "images", name + ".jpg")
            if not os.path.exists(link):
                os.link(os.path.join(images, row["image"] + ".jpg"), link)
            new_rows.append((name, row["labels"]))
    path = os.path.join(out, "train.csv")
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["image", "labels"])
        w.writerows(new_rows)
    return path, os.path.join(out, "images")


def dump(result, path):
    """Writes a benchmark's raw figures as JSON (for ``python -m bench``), if ``path`` is given."""
    if path:
        import json

        with open(path, "w") as f:
            json.dump(result, f, indent=1)


def check_work_folder(work, mark):
    """The work folder is new or empty, or one this benchmark made (its ``mark`` file): its images, shards and
    runs are then replaced; nobody else's folder is written into."""
    from tfpipe.runtime.errors import TfpipeError

    if os.path.isdir(work) and os.listdir(work) and not os.path.isfile(os.path.join(work, mark)):
        raise TfpipeError(f"{work} holds files this benchmark did not write; choose a new or empty folder")
    if os.path.exists(work) and not os.path.isdir(work):
        raise TfpipeError(f"{work} is a file; name a folder")
    os.makedirs(work, exist_ok=True)
    open(os.path.join(work, mark), "w").close()
