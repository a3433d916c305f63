"""Training figures: is the input pipeline ever the bottleneck, and what does steps_per_execution buy?

    python -m bench.training --corpus bench/out/corpus

1. Input-bound check: the same small model trained from ``make_dataset`` (with
   augmentation) and from one batch held in memory (``from_tensors().repeat()``),
   same shapes, same steps; the ratio of images/s is the share of training speed
   the pipeline keeps (goal >= 0.95).
2. steps_per_execution K = 1, 8, 32 on 8 virtual CPU replicas (``--replicas``; the smoke run takes 2, the same
   MirroredStrategy code) and, for comparison, on one replica, a tiny model
   (8 px, one conv, a dense head) on in-memory data: steps/s as a ratio to K = 1.
   The model does almost no work, so the ratio is the host's per-step overhead
   (Python, dispatch, callbacks) that K removes; a heavier model on a 2-core CPU
   hides it behind compute. On a TPU the per-call overhead is much larger.
"""

import argparse
import os
import time

from bench.common import dump, replicate_corpus

SIZE = 64
BATCH = 32
SPE_VALUES = (1, 8, 32)
SPE_SIZE = 8  # px: the steps_per_execution model's input


def build_shards(corpus, work, times):
    from tfpipe import Source, write_shards
    from tfpipe.writer.images import ImageSpec

    out = os.path.join(work, f"records{SIZE}")
    if not os.path.exists(os.path.join(out, "manifest.json")):
        csv_path, images = replicate_corpus(
            os.path.join(corpus, "train.csv"), os.path.join(corpus, "images"), os.path.join(work, "replicated"), times
        )
        write_shards(
            Source(images, csv=csv_path),
            out,
            spec=ImageSpec(image_size=SIZE),
            num_shards=8,
            overwrite=True,
            progress=False,
        )
    return out


def small_model(num_classes, size, spe):
    from train.keras.models import build_model

    model, _ = build_model("small-cnn", num_classes, size)
    model.compile(optimizer="adam", loss="binary_crossentropy", steps_per_execution=spe)
    return model


def tiny_model(num_classes, size, spe):
    """A few thousand weights: compute per step is ~nothing, so what is left is the per-step host overhead."""
    import tf_keras as keras

    inputs = keras.Input((size, size, 3), dtype="uint8")
    x = keras.layers.Rescaling(1 / 255)(inputs)
    x = keras.layers.Conv2D(8, 3, activation="relu")(x)
    x = keras.layers.GlobalAveragePooling2D()(x)
    model = keras.Model(inputs, keras.layers.Dense(num_classes, activation="sigmoid")(x))
    model.compile(optimizer="adam", loss="binary_crossentropy", steps_per_execution=spe)
    return model


def images_per_second(model, ds, steps, batch):
    """Trains ``steps`` steps after one warm-up epoch (tracing); returns images/s of the timed part."""
    model.fit(ds, epochs=1, steps_per_epoch=steps, verbose=0)
    start = time.perf_counter()
    model.fit(ds, epochs=1, steps_per_epoch=steps, verbose=0)
    return steps * batch / (time.perf_counter() - start)


def input_bound(records, steps, reps):
    import tensorflow as tf

    import tfpipe
    from tfpipe.format.shards import open_shards

    ds = tfpipe.make_dataset(records, BATCH, training=True)
    num_classes = open_shards(records).num_classes
    memory = tf.data.Dataset.from_tensors(next(iter(ds))).repeat()
    rates = {"make_dataset (augmented)": [], "one batch in memory": []}
    for _ in range(reps):  # alternate, so drifts of a shared machine hit both alike
        for name, data in (("make_dataset (augmented)", ds), ("one batch in memory", memory)):
            rates[name].append(images_per_second(small_model(num_classes, SIZE, 8), data, steps, BATCH))
    return rates


def steps_per_execution(steps, reps, replicas=8):
    import tensorflow as tf

    from train.accel.strategy import resolve_strategy

    strategy, _ = resolve_strategy("cpu", replicas)
    per_replica = 4
    global_batch = per_replica * strategy.num_replicas_in_sync
    images = tf.cast(tf.random.uniform([global_batch, SPE_SIZE, SPE_SIZE, 3], 0, 255, seed=0), tf.uint8)
    targets = tf.cast(tf.random.uniform([global_batch, 5], 0, 2, tf.int32, seed=1), tf.float32)
    ds = tf.data.Dataset.from_tensors((images, targets)).repeat()
    rates = {k: [] for k in SPE_VALUES}
    for _ in range(reps):
        for k in SPE_VALUES:
            with strategy.scope():
                model = tiny_model(5, SPE_SIZE, k)
            rates[k].append(images_per_second(model, ds, 4 * steps, global_batch) / global_batch)  # steps/s
    return [[k, r] for k, r in rates.items()]  # a list: JSON keeps it as it is


def run(corpus, work="bench/out", times=4, steps=64, reps=3, replicas=8):
    from train.accel.strategy import ensure_virtual_cpus

    ensure_virtual_cpus(8)  # before TensorFlow initialises its devices
    records = build_shards(corpus, work, times)
    return {
        "input": input_bound(records, steps, reps),
        "spe": steps_per_execution(steps, reps, replicas),
        "replicas": replicas,
        "spe_one_replica": steps_per_execution(steps, reps, replicas=1),
        "steps": steps,
    }


def report(result):
    inp, spe = result["input"], result["spe"]
    fed, memory = max(inp["make_dataset (augmented)"]), max(inp["one batch in memory"])
    lines = [
        f"Training input, small-cnn at {SIZE} px, batch {BATCH}, {result['steps']} steps, best of runs:",
        "",
        "| fed by | img/s best | img/s median |",
        "|---|---|---|",
    ]
    for name, rates in inp.items():
        lines.append(f"| {name} | {max(rates):.0f} | {sorted(rates)[len(rates) // 2]:.0f} |")
    lines += [
        "",
        f"make_dataset / in memory = {fed / memory:.2f} (goal >= 0.95; on 2 CPU cores the pipeline "
        "and the model share the cores, on an accelerator they do not)",
        "",
        "| steps_per_execution, tiny model | steps/s best | ratio to K=1 |",
        "|---|---|---|",
    ]
    many = f"{result.get('replicas', 8)} virtual CPU replicas"
    for label, runs in ((many, spe), ("1 replica", result.get("spe_one_replica", []))):
        for k, rates in runs:
            lines.append(f"| {label}, K = {k} | {max(rates):.1f} | {max(rates) / max(runs[0][1]):.2f} |")
    lines += [
        "",
        f"Tiny model ({SPE_SIZE} px, one conv, dense head) so the ratio shows the per-step host "
        "overhead that K removes; on CPU a real model's compute hides it. A TPU's per-call overhead is "
        "much larger (the TPU guide reports ~1.5x from this setting).",
    ]
    return "\n".join(lines)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--corpus", required=True)
    p.add_argument("--work", default="bench/out")
    p.add_argument("--steps", type=int, default=64)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--replicas", type=int, default=8, help="virtual CPU replicas of the steps_per_execution figures")
    p.add_argument("--json", help="also write the raw figures here")
    args = p.parse_args(argv)
    result = run(args.corpus, args.work, steps=args.steps, reps=args.reps, replicas=args.replicas)
    dump(result, args.json)
    print(report(result))


if __name__ == "__main__":
    main()
