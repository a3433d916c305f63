"""Reader figures: make_dataset vs the decode limit and vs the seed notebook's parser, and against the reader of
the commit before the per-shard checks (``BEFORE_CHECKS``).

    python -m bench.reader --corpus bench/out/corpus

All pipelines read the same 256 px q95 shards in one run, taking turns
(round-robin); figures are images/s (best and median of ``--reps`` single
passes; for training, the best of each epoch over ``--reps - 1`` runs) and their
ratios. A single pass is a new iterator over a dataset built once, as Keras
reads its validation data every epoch; ``make_dataset`` built anew for each pass
is a row of its own (its tracing, about 50 ms, is paid once a job). The A/B runs
each version's reader in processes of its own, taking turns, each against the
decode limit measured in the same process.
"""

import argparse
import glob
import json
import os
import shutil
import statistics
import subprocess
import sys

from bench.common import dump, replicate_corpus, timed

BATCH = 64
SIZE = 256
BEFORE_CHECKS = "c092a63"  # a commit without shard_reader's per-shard checks (the identity and the count checks)
LIMIT = "decode limit (bytes in memory, parallel decode)"
SEED = "seed parser (parse_single_example + decode_jpeg)"
OURS = "make_dataset(training=False)"
REBUILT = f"{OURS}, built for each pass"
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def build_shards(corpus, work, times):
    """Writes the (replicated) corpus as 256 px shards with tfpipe.write; returns the folder."""
    from tfpipe import Source, write_shards
    from tfpipe.writer.images import ImageSpec

    out = os.path.join(work, "records256")
    if not os.path.exists(os.path.join(out, "manifest.json")):
        csv_path, images = replicate_corpus(
            os.path.join(corpus, "train.csv"), os.path.join(corpus, "images"), os.path.join(work, "replicated"), times
        )
        write_shards(
            Source(images, csv=csv_path),
            out,
            spec=ImageSpec(image_size=SIZE, quality=95),
            num_shards=16,
            overwrite=True,
            progress=False,
        )
    return out


def count(ds):
    return sum(int((batch[0] if isinstance(batch, tuple) else batch).shape[0]) for batch in ds)


def seed_parser(files):
    """The seed notebook's reader: parse_single_example + decode_jpeg in one map, no parallelism asked for."""
    import tensorflow as tf

    spec = {
        "image": tf.io.FixedLenFeature([], tf.string),
        "target": tf.io.FixedLenSequenceFeature([], tf.int64, allow_missing=True),
    }

    def parse(record):
        ex = tf.io.parse_single_example(record, spec)
        image = tf.reshape(tf.io.decode_jpeg(ex["image"], channels=3), [SIZE, SIZE, 3])
        return image, tf.reduce_max(tf.one_hot(ex["target"], 5), axis=0)

    return tf.data.TFRecordDataset(files).map(parse)


def seed_training(files):
    """The seed's training input: its parser + the same augmentation, shuffle, repeat, batch."""
    import tensorflow as tf

    def augment(image, target):
        image = tf.image.random_flip_left_right(image)
        image = tf.image.random_crop(tf.image.resize_with_crop_or_pad(image, SIZE + 64, SIZE + 64), [SIZE, SIZE, 3])
        image = tf.image.random_brightness(tf.cast(image, tf.float32), 25.5)
        return tf.saturate_cast(image, tf.uint8), target

    return seed_parser(files).map(augment).shuffle(2048).repeat().batch(BATCH, drop_remainder=True)


def bare_decode(files):
    """The decode limit: the same JPEG bytes already in memory, decoded with AUTOTUNE parallelism."""
    import tensorflow as tf

    spec = {"image": tf.io.FixedLenFeature([], tf.string)}
    blobs = list(tf.data.TFRecordDataset(files).batch(1024).map(lambda s: tf.io.parse_example(s, spec)["image"]))
    memory = tf.data.Dataset.from_tensor_slices(tf.concat(blobs, 0))
    return lambda: (
        memory.map(lambda b: tf.io.decode_jpeg(b, channels=3), num_parallel_calls=tf.data.AUTOTUNE)
        .batch(BATCH)
        .prefetch(tf.data.AUTOTUNE)
    )


def epoch_rates(make_ds, steps_per_epoch, epochs):
    """images/s of each epoch of an infinite training dataset."""
    import time

    it = iter(make_ds())
    rates = []
    for _ in range(epochs):
        start = time.perf_counter()
        for _ in range(steps_per_epoch):
            next(it)
        rates.append(steps_per_epoch * BATCH / (time.perf_counter() - start))
    return rates


def single_passes(records, reps, full=True):
    """Best and median images/s of one pass (a new iterator) of each evaluation reader, round-robin (not
    ``full``: the seed parser left out, the A/B's figures)."""
    import tfpipe

    files = sorted(glob.glob(os.path.join(records, "*.tfrec")))
    n = tfpipe.count_examples(records)
    pipelines = {LIMIT: bare_decode(files)()}  # each built once: a pass is what every epoch's validation costs
    if full:
        pipelines[SEED] = seed_parser(files).batch(BATCH)
    pipelines[OURS] = tfpipe.make_dataset(records, BATCH, cache=False)
    passes = {name: (lambda ds=ds: count(ds)) for name, ds in pipelines.items()}
    passes[REBUILT] = lambda: count(tfpipe.make_dataset(records, BATCH, cache=False))
    times = {name: [] for name in passes}
    for _ in range(reps):  # round-robin, so drifts of a shared machine hit every contender alike
        for name, one_pass in passes.items():
            seconds, _, got = timed(one_pass, 1)
            assert got == n, (name, got, n)
            times[name].append(seconds)
    return n, {name: (n / min(t), n / statistics.median(t)) for name, t in times.items()}


def checks_ab(records, work, reps, against=BEFORE_CHECKS):
    """The evaluation reader of this checkout and of ``against`` (its ``tfpipe`` exported with ``git archive``),
    each in ``reps`` fresh processes taking turns, each pass against the decode limit of the same process.
    Returns {version: [(img/s, img/s / decode limit, built for each pass / decode limit) of each process]}, or
    None outside a git checkout."""
    old = os.path.join(work, f"tfpipe-{against}")
    if not os.path.exists(os.path.join(old, "tfpipe")):
        archive = subprocess.run(["git", "-C", ROOT, "archive", against, "tfpipe"], capture_output=True)
        if archive.returncode != 0:
            return None
        os.makedirs(old, exist_ok=True)
        subprocess.run(["tar", "-x", "-C", old], input=archive.stdout, check=True)
    os.makedirs(os.path.join(old, "bench"), exist_ok=True)
    for name in glob.glob(os.path.join(ROOT, "bench", "*.py")):  # this checkout's benchmark code (not bench/out)
        shutil.copy(name, os.path.join(old, "bench"))
    versions = {"this checkout": ROOT, against: old}
    records = os.path.abspath(records)  # each version runs in its own folder
    figures = {name: [] for name in versions}
    for _ in range(reps):
        for name, root in versions.items():  # cwd first on sys.path: that root's tfpipe is imported
            out = subprocess.run(
                [sys.executable, "-m", "bench.reader", "--passes-only", records, "--reps", str(reps)],
                cwd=root, env=dict(os.environ, PYTHONPATH=root), capture_output=True, text=True,
            )  # fmt: skip
            if out.returncode != 0:
                raise SystemExit(f"bench.reader: the {name} reader failed: {out.stderr.strip()[-1500:]}")
            sp = json.loads(out.stdout.strip().splitlines()[-1])
            figures[name].append((sp[OURS][0], sp[OURS][0] / sp[LIMIT][0], sp[REBUILT][0] / sp[LIMIT][0]))
    return figures


def run(corpus, work, times=8, reps=3, epochs=3):
    import tfpipe
    from tfpipe.tf.augment import Augment

    records = build_shards(corpus, work, times)
    files = sorted(glob.glob(os.path.join(records, "*.tfrec")))
    n, rows = single_passes(records, reps)
    ab = checks_ab(records, work, reps)
    steps = max(1, n // BATCH)
    aug = Augment(flip=True, crop="pad", pad=32, brightness=0.1, contrast=0.0, saturation=0.0)
    training = {
        "seed training input": lambda: seed_training(files),
        "make_dataset(training=True), cache": lambda: tfpipe.make_dataset(
            records, BATCH, training=True, augment=aug, cache=True
        ),
        "make_dataset(training=True), no cache": lambda: tfpipe.make_dataset(
            records, BATCH, training=True, augment=aug, cache=False
        ),
    }
    rounds = {name: [] for name in training}
    for _ in range(max(1, reps - 1)):  # whole runs of `epochs` epochs, round-robin; the best of each epoch is kept
        for name, make in training.items():
            rounds[name].append(epoch_rates(make, steps, epochs))
    train_rates = {name: [max(r[e] for r in runs) for e in range(epochs)] for name, runs in rounds.items()}
    return {"records": n, "single_pass": rows, "training": train_rates, "checks_ab": ab}


def report(result):
    lines = [
        f"Reader, {result['records']} records of {SIZE} px, batch {BATCH}:",
        "",
        "| single pass | best img/s | median img/s |",
        "|---|---|---|",
    ]
    sp = result["single_pass"]
    for name, (best, median) in sp.items():
        lines.append(f"| {name} | {best:.0f} | {median:.0f} |")
    limit, ours, seed = sp[LIMIT][0], sp[OURS][0], sp[SEED][0]
    lines += [
        "",
        f"make_dataset / decode limit = {ours / limit:.2f} (goal >= 0.93, every check on); "
        f"make_dataset / seed = {ours / seed:.2f} (goal >= 1)",
        "",
        *ab_report(result.get("checks_ab")),
        "| training input | "
        + " | ".join(f"epoch {i + 1} img/s" for i in range(len(next(iter(result["training"].values())))))
        + " |",
        "|---" * (1 + len(next(iter(result["training"].values())))) + "|",
    ]
    tr = result["training"]
    for name, rates in tr.items():
        lines.append(f"| {name} | " + " | ".join(f"{r:.0f}" for r in rates) + " |")
    seed_later = min(tr["seed training input"][1:])
    ours_later = min(tr["make_dataset(training=True), cache"][1:])
    lines += ["", f"epoch >= 2, cached make_dataset / seed = {ours_later / seed_later:.2f} (goal >= 3)"]
    return "\n".join(lines)


def ab_report(ab):
    """The A/B's lines: each version's best and median figures over its processes."""
    if not ab:
        return ["(no A/B against the commit before the checks: not a git checkout holding it)", ""]
    runs = len(next(iter(ab.values())))
    lines = [
        "Evaluation reader, this checkout against the commit before the per-shard checks, each version in "
        f"{runs} process{'' if runs == 1 else 'es'} taking turns (best pass of each process):",
        "",
        "| version | best img/s | best / decode limit | median / decode limit | built for each pass: best / limit |",
        "|---|---|---|---|---|",
    ]
    for name, runs in ab.items():
        ratios = [r for _, r, _ in runs]
        lines.append(
            f"| {name} | {max(s for s, _, _ in runs):.0f} | {max(ratios):.3f} | {statistics.median(ratios):.3f} "
            f"| {max(b for _, _, b in runs):.3f} |"
        )
    return [*lines, ""]


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--corpus")
    p.add_argument("--passes-only", metavar="RECORDS", help="the A/B's child: single passes of RECORDS, as JSON")
    p.add_argument("--work", default="bench/out")
    p.add_argument("--times", type=int, default=8, help="repeat the corpus this many times (default: 8)")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--json", help="also write the raw figures here")
    args = p.parse_args(argv)
    if args.passes_only:
        from tfpipe.runtime.errors import TfpipeError

        try:
            print(json.dumps(single_passes(args.passes_only, args.reps, full=False)[1]))
        except TfpipeError as e:
            raise SystemExit(f"bench.reader: {e}") from None
        return
    if not args.corpus:
        p.error("--corpus is required")
    result = run(args.corpus, args.work, args.times, args.reps, args.epochs)
    dump(result, args.json)
    print(report(result))


if __name__ == "__main__":
    main()
