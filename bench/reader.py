"""Reader figures: make_dataset vs the decode limit and vs the seed notebook's parser.

    python -m bench.reader --corpus bench/out/corpus

All pipelines read the same 256 px q95 shards in one run, taking turns
(round-robin); figures are images/s (best and median of ``--reps`` single
passes; for training, the best of each epoch over ``--reps - 1`` runs) and their
ratios.
"""

import argparse
import glob
import os
import statistics

from bench.common import dump, replicate_corpus, timed

BATCH = 64
SIZE = 256


def build_shards(corpus, work, times):
    """Writes the (replicated) corpus as 256 px shards with tfpipe.write; returns the folder."""
    from tfpipe import Source, write_shards
    from tfpipe.images import ImageSpec

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


def run(corpus, work, times=8, reps=3, epochs=3):
    import tfpipe
    from tfpipe.augment import Augment

    records = build_shards(corpus, work, times)
    files = sorted(glob.glob(os.path.join(records, "*.tfrec")))
    n = tfpipe.count_examples(records)
    rows = {}
    pipelines = {
        "decode limit (bytes in memory, parallel decode)": bare_decode(files),
        "seed parser (parse_single_example + decode_jpeg)": lambda: seed_parser(files).batch(BATCH),
        "make_dataset(training=False)": lambda: tfpipe.make_dataset(records, BATCH, cache=False),
    }
    times = {name: [] for name in pipelines}
    for _ in range(reps):  # round-robin, so drifts of a shared machine hit every contender alike
        for name, make in pipelines.items():
            seconds, _, got = timed(lambda make=make: count(make()), 1)
            assert got == n, (name, got, n)
            times[name].append(seconds)
    rows = {name: (n / min(t), n / statistics.median(t)) for name, t in times.items()}
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
    return {"records": n, "single_pass": rows, "training": train_rates}


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
    limit = sp["decode limit (bytes in memory, parallel decode)"][0]
    ours = sp["make_dataset(training=False)"][0]
    seed = sp["seed parser (parse_single_example + decode_jpeg)"][0]
    lines += [
        "",
        f"make_dataset / decode limit = {ours / limit:.2f} (goal >= 0.9); "
        f"make_dataset / seed = {ours / seed:.2f} (goal >= 1)",
        "",
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


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--corpus", required=True)
    p.add_argument("--work", default="bench/out")
    p.add_argument("--times", type=int, default=8, help="repeat the corpus this many times (default: 8)")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--json", help="also write the raw figures here")
    args = p.parse_args(argv)
    result = run(args.corpus, args.work, args.times, args.reps, args.epochs)
    dump(result, args.json)
    print(report(result))


if __name__ == "__main__":
    main()
