"""Writer figures: tfpipe.write vs the seed notebook's writer and vs the codec limit, side by side.

    python -m bench.writer --corpus bench/out/corpus

Same photos, same output (256 px, JPEG q95) for every contender. The seed
writer is one process, one image at a time: cv2.imread -> cv2.resize ->
cv2.imencode -> tf.train.Example -> TFRecordWriter. The codec limit is the same
decode -> resize -> encode work in a bare multiprocessing pool over all cores,
with no serialization and no TFRecord I/O. Each contender runs on N and 3N
images as a separate process; (t(3N) - t(N)) / 2N is the per-image (marginal)
cost, t(N) minus N times that is the start-up.
"""

import argparse
import csv
import os
import subprocess
import sys
import tempfile
import time

from bench.common import dump, replicate_corpus
from tfpipe.runtime.lifecycle import child_of_this_process

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SIZE = 256
QUALITY = 95
SEED_REENCODE_QUALITY = 100  # the seed notebook's pass-through-less "no resize" writer


def seed_writer(csv_path, images, out, size, quality):
    """The seed notebook cell, faithfully: one image at a time in one process."""
    import cv2
    import tensorflow as tf

    with open(csv_path) as f:
        rows = list(csv.DictReader(f))
    with tf.io.TFRecordWriter(os.path.join(out, "seed.tfrec")) as writer:
        for row in rows:
            img = cv2.imread(os.path.join(images, row["image"] + ".jpg"))
            if size:
                img = cv2.resize(img, (size, size))
            data = cv2.imencode(".jpg", img, (cv2.IMWRITE_JPEG_QUALITY, quality))[1].tobytes()
            feature = {
                "image": tf.train.Feature(bytes_list=tf.train.BytesList(value=[data])),
                "image_name": tf.train.Feature(bytes_list=tf.train.BytesList(value=[row["image"].encode()])),
            }
            writer.write(tf.train.Example(features=tf.train.Features(feature=feature)).SerializeToString())


def _codec_work(path):
    import cv2

    cv2.setNumThreads(1)
    img = cv2.imread(path, cv2.IMREAD_REDUCED_COLOR_4)  # the same reduced decoding tfpipe uses
    img = cv2.resize(img, (SIZE, SIZE), interpolation=cv2.INTER_AREA)
    return len(cv2.imencode(".jpg", img, (cv2.IMWRITE_JPEG_QUALITY, QUALITY))[1])


def codec_limit(csv_path, images):
    """decode -> resize -> encode over all cores, results thrown away: the ceiling for any writer."""
    import multiprocessing

    with open(csv_path) as f:
        paths = [os.path.join(images, row["image"] + ".jpg") for row in csv.DictReader(f)]
    from tfpipe.runtime.lifecycle import die_with_parent

    with multiprocessing.get_context("fork").Pool(os.cpu_count(), die_with_parent, (os.getpid(),)) as pool:
        sum(pool.map(_codec_work, paths, chunksize=8))


def ours(csv_path, images, out, size):
    from tfpipe import Source, write_shards
    from tfpipe.writer.images import ImageSpec

    write_shards(Source(images, csv=csv_path), out, spec=ImageSpec(image_size=size, quality=QUALITY), progress=False)


CONTENDERS = {
    "tfpipe.write": lambda a: ours(a.csv, a.images, a.out, SIZE),
    "seed writer": lambda a: seed_writer(a.csv, a.images, a.out, SIZE, QUALITY),
    "codec limit (bare pool)": lambda a: codec_limit(a.csv, a.images),
    "tfpipe.write pass-through": lambda a: ours(a.csv, a.images, a.out, None),
    "seed writer, no resize, q100": lambda a: seed_writer(a.csv, a.images, a.out, None, SEED_REENCODE_QUALITY),
}


def subset_csv(csv_path, n, out):
    with open(csv_path) as f:
        rows = list(csv.reader(f))
    with open(out, "w", newline="") as f:
        csv.writer(f).writerows(rows[: n + 1])
    return out


def time_process(name, csv_path, images):
    """Wall time of one contender in a fresh process (start-up included), and its peak RSS in KB."""
    with tempfile.TemporaryDirectory() as out:
        start = time.perf_counter()
        proc = subprocess.run(
            [sys.executable, "-m", "bench.writer", "--one", name, "--csv", csv_path, "--images", images, "--out", out],
            capture_output=True,
            text=True,
            cwd=ROOT,
            preexec_fn=child_of_this_process(),
            env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", PYTHONPATH=ROOT),
        )
        seconds = time.perf_counter() - start
    if proc.returncode:
        raise RuntimeError(f"{name} failed: {proc.stderr[-2000:]}")
    return seconds, int(proc.stdout.strip().splitlines()[-1])


def run(csv_path, images, n, reps=2, work="bench/out"):
    """{contender: {"N": best seconds, "3N": best seconds, "rss": (KB at N, KB at 3N)}}, plus
    tfpipe.write's peak RSS on N and 4N images (the corpus needs 4N photos)."""
    os.makedirs(work, exist_ok=True)
    with open(csv_path) as f:
        photos = sum(1 for _ in f) - 1
    if photos < 4 * n:  # repeat the corpus through hard links (the same bytes, no more disk)
        csv_path, images = replicate_corpus(csv_path, images, os.path.join(work, "writer_corpus"), -(-4 * n // photos))
    small, large = subset_csv(csv_path, n, f"{work}/writer_n.csv"), subset_csv(csv_path, 3 * n, f"{work}/writer_3n.csv")
    runs = {name: {"N": [], "3N": []} for name in CONTENDERS}
    for _ in range(reps):  # round robin: a slow spell of a shared machine hits every contender alike
        for name in CONTENDERS:
            runs[name]["N"].append(time_process(name, small, images))
            runs[name]["3N"].append(time_process(name, large, images))
    results = {}
    for name, r in runs.items():
        t_small, t_large = min(r["N"]), min(r["3N"])
        results[name] = {"N": t_small[0], "3N": t_large[0], "rss": (t_small[1], t_large[1])}
    four = time_process("tfpipe.write", subset_csv(csv_path, 4 * n, f"{work}/writer_4n.csv"), images)
    return {"n": n, "results": results, "rss_4n": four[1]}


def report(result):
    n, res = result["n"], result["results"]

    def marginal(name):
        return 2 * n / (res[name]["3N"] - res[name]["N"])

    lines = [
        f"Writer, {n} and {3 * n} photos (1,400-2,200 px) -> {SIZE} px q{QUALITY}, best of runs:",
        "",
        "| contender | wall N (s) | wall 3N (s) | marginal img/s | start-up (s) | peak RSS N / 3N (MB) |",
        "|---|---|---|---|---|---|",
    ]
    for name, r in res.items():
        startup = r["N"] - n / marginal(name)
        lines.append(
            f"| {name} | {r['N']:.1f} | {r['3N']:.1f} | {marginal(name):.0f} | {startup:.1f} | "
            f"{r['rss'][0] / 1024:.0f} / {r['rss'][1] / 1024:.0f} |"
        )
    lines += [
        "",
        f"marginal: tfpipe.write / seed = {marginal('tfpipe.write') / marginal('seed writer'):.2f} (goal >= 2.5); "
        f"tfpipe.write / codec limit = {marginal('tfpipe.write') / marginal('codec limit (bare pool)'):.2f} "
        f"(goal >= 0.9); pass-through / seed q100 = "
        f"{marginal('tfpipe.write pass-through') / marginal('seed writer, no resize, q100'):.1f} (goal >= 10)",
        f"whole process on 3N: tfpipe.write / seed = {res['seed writer']['3N'] / res['tfpipe.write']['3N']:.2f}x",
        f"memory: tfpipe.write peak RSS {res['tfpipe.write']['rss'][0] / 1024:.0f} MB on {n} photos, "
        f"{result['rss_4n'] / 1024:.0f} MB on {4 * n} (ratio {result['rss_4n'] / res['tfpipe.write']['rss'][0]:.2f}, "
        "goal: flat)",
    ]
    return "\n".join(lines)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--corpus", help="folder made by bench.corpus")
    p.add_argument("--n", type=int, default=300, help="N images; fewer than 4N photos are repeated (default: 300)")
    p.add_argument("--reps", type=int, default=2)
    p.add_argument("--work", default="bench/out")
    p.add_argument("--json", help="also write the raw figures here")
    p.add_argument("--one", choices=sorted(CONTENDERS), help=argparse.SUPPRESS)  # child process: run one contender
    p.add_argument("--csv", help=argparse.SUPPRESS)
    p.add_argument("--images", help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.one:
        import resource

        CONTENDERS[args.one](args)
        children = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
        print(max(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss, children))
        return
    result = run(
        os.path.join(args.corpus, "train.csv"), os.path.join(args.corpus, "images"), args.n, args.reps, args.work
    )
    dump(result, args.json)
    print(report(result))


if __name__ == "__main__":
    main()
