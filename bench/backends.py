"""The two backends side by side: the TPU dry run's cost on each, and the feed of Keras 3's tf.data adapter.

    python -m bench.backends --work bench/out

(a) The dry run: the wall time of ``python -m train.fit --strategy cpu --replicas 8`` over ``--replicas 1``, the
    same shards and the same global batch (8 x B/8 against 1 x B), for ``--backend jax`` (8 XLA host devices,
    one program) and ``--backend tf`` (8 virtual replicas under MirroredStrategy, the step traced once each; 2 in
    the smoke run). Each contender is a fresh process (whole-process time, imports included); the four take
    turns, best of ``rounds`` each.
(b) The feed: training images/s reaching 8 JAX devices through Keras 3's tf.data adapter (its JAX iterator and
    the sharded ``device_put`` of ``DataParallel``: what ``model.fit`` does with each batch), over
    ``make_dataset``'s own images/s on the same shards (its batches pulled to the host as NumPy). Next to them,
    ``model.fit`` of a model that does almost nothing: on a CPU its step over 8 host devices is what limits it, a
    cost a TPU does not have. One process, taking turns, best of ``reps``. Goal >= 0.9: the adapter must not
    become a TPU's bottleneck.
"""

import argparse
import json
import os
import subprocess
import sys
import time

from bench.common import dump
from bench.dry_run import shards  # the demo's first images as shards, one folder a size
from tfpipe.runtime.lifecycle import child_of_this_process

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FULL = {
    "images": 1024,
    "size": 64,
    "batch": 64,
    "epochs": 2,
    "spe": 4,
    "rounds": 2,
    "feed_steps": 48,
    "reps": 3,
    "devices": 8,
}
# The smoke run's dry run on 2 devices: the same code as 8 (as bench/dry_run.py's smoke run), and tf-keras traces
# 8 replicas one by one, about a third of the run; the feed keeps its 8 JAX devices.
SMOKE = {
    "images": 64,
    "size": 16,
    "batch": 16,
    "epochs": 1,
    "spe": 2,
    "rounds": 1,
    "feed_steps": 3,
    "reps": 1,
    "devices": 2,
}
HOST_DEVICES = "--xla_force_host_platform_device_count=8"


def fit_seconds(records, run, backend, replicas, cfg):
    """Whole-process seconds of one ``train.fit`` run (a fresh process: nothing compiled is reused)."""
    import shutil

    shutil.rmtree(run, ignore_errors=True)
    cmd = [
        sys.executable, "-m", "train.fit", "--records", records, "--run", run, "--backend", backend,
        "--strategy", "cpu", "--replicas", str(replicas), "--model", "small-cnn",
        "--batch-size", str(cfg["batch"] // replicas), "--epochs", str(cfg["epochs"]),
        "--steps-per-execution", str(cfg["spe"]), "--no-augment", "--no-report", "--verbose", "0", "--seed", "0",
    ]  # fmt: skip
    env = {k: v for k, v in os.environ.items() if k not in ("KERAS_BACKEND", "XLA_FLAGS")}
    started = time.perf_counter()
    done = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, preexec_fn=child_of_this_process(),
                          env=dict(env, PYTHONPATH=ROOT, TF_CPP_MIN_LOG_LEVEL="2"))  # fmt: skip
    if done.returncode:
        raise RuntimeError(f"train.fit --backend {backend} --replicas {replicas} failed:\n{done.stderr[-3000:]}")
    return time.perf_counter() - started


def dry_run(records, work, cfg):
    """(a): the best whole-process seconds of each (backend, replicas), the four taking turns."""
    best = {}
    for _ in range(cfg["rounds"]):
        for backend in ("jax", "tf"):
            for replicas in (1, cfg["devices"]):
                run = os.path.join(work, f"backends-run-{backend}-{replicas}")
                seconds = fit_seconds(records, run, backend, replicas, cfg)
                key = f"{backend}/{replicas}"
                best[key] = min(best.get(key, seconds), seconds)
    return best


def feed(records, cfg):
    """(b), in a process started with 8 XLA host devices and ``KERAS_BACKEND=jax`` (``--one feed``): the augmented
    training batches decoded anew each epoch (``cache=False``), pulled (1) as ``make_dataset``'s own NumPy
    batches, (2) through Keras 3's tf.data adapter onto the 8 devices as ``DataParallel`` shards them (the
    adapter's JAX iterator and ``jax.device_put`` with the distribution's data layout: what Keras' JAX trainer
    does with every batch), (3) through ``model.fit`` of a model of one pooling and one dense layer -- on a CPU
    that row is the step's cost over 8 host devices on 2 cores, not the feed's (a TPU's step is microseconds)."""
    import jax
    import keras
    import numpy as np
    from keras.src.trainers.data_adapters import get_data_adapter  # the adapter model.fit uses

    import tfpipe
    from train.backends.jax import jax_devices

    devices = jax_devices("cpu", 8)
    shards_ = tfpipe.open_shards(records)
    steps, batch = cfg["feed_steps"], cfg["batch"]
    ds = tfpipe.make_dataset(records, batch, training=True, image_size=cfg["size"], seed=0, cache=False).repeat()
    layout = devices.distribution.get_data_layout

    def own():
        it = iter(ds)
        next(it)  # the pipeline's threads started
        started = time.perf_counter()
        for _ in range(steps):
            [np.asarray(t) for t in next(it)]
        return steps * batch / (time.perf_counter() - started)

    def adapter():
        it = get_data_adapter(ds, steps_per_epoch=10**9).get_jax_iterator()
        next(it)
        started = time.perf_counter()
        for _ in range(steps):
            placed = [jax.device_put(t, layout(t.shape).backend_layout) for t in next(it)]
        jax.block_until_ready(placed)
        return steps * batch / (time.perf_counter() - started)

    with devices.scope():
        inputs = keras.Input((cfg["size"], cfg["size"], 3), dtype="uint8")
        pooled = keras.layers.GlobalAveragePooling2D()(keras.layers.Rescaling(1 / 255)(inputs))
        outputs = keras.layers.Dense(shards_.num_classes, activation="sigmoid")(pooled)
        model = keras.Model(inputs, outputs)
        model.compile("sgd", "binary_crossentropy", steps_per_execution=cfg["spe"])

    class EpochTimes(keras.callbacks.Callback):
        last = 0.0

        def on_epoch_begin(self, epoch, logs=None):
            self.began = time.perf_counter()

        def on_epoch_end(self, epoch, logs=None):
            EpochTimes.last = time.perf_counter() - self.began

    def fitted():
        with devices.scope():
            model.fit(ds, epochs=2, steps_per_epoch=steps, verbose=0, callbacks=[EpochTimes()], shuffle=False)
        return steps * batch / EpochTimes.last  # the second epoch: the first compiles

    rates = {"make_dataset": [], "keras 3 adapter onto 8 JAX devices": [], "model.fit, a near-no-op model": []}
    for _ in range(cfg["reps"]):  # taking turns
        for name, measure in zip(rates, (own, adapter, fitted)):
            rates[name].append(measure())
    return rates


def ratios(result):
    """(name, measured, goal) rows for the summary, each a floor: the dry runs as 1 over 8 (the cost of 8 devices
    is at most 1.5x one's: >= 1/1.5) and the feed."""
    d, f, n = result["dry_run"], result["feed"], result["config"]["devices"]
    return [
        (f"TPU dry run, Keras 3 on JAX: 1 / {n} devices, train.fit", d["jax/1"] / d[f"jax/{n}"], 1 / 1.5),
        (f"TPU dry run, tf-keras: 1 / {n} replicas, same global batch", d["tf/1"] / d[f"tf/{n}"], None),
        (
            "JAX feed (Keras 3's adapter) / make_dataset",
            max(f["keras 3 adapter onto 8 JAX devices"]) / max(f["make_dataset"]),
            0.9,
        ),
    ]


def report(result):
    cfg, d, f = result["config"], result["dry_run"], result["feed"]
    n = cfg["devices"]
    rows = [
        f"| | 1 | {n} | {n} / 1 | goal |",
        "|---|---|---|---|---|",
        f"| `--backend jax` (XLA host devices), whole process (s) | {d['jax/1']:.0f} | {d[f'jax/{n}']:.0f} | "
        f"{d[f'jax/{n}'] / d['jax/1']:.2f} | <= 1.5 |",
        f"| `--backend tf` (virtual replicas), whole process (s) | {d['tf/1']:.0f} | {d[f'tf/{n}']:.0f} | "
        f"{d[f'tf/{n}'] / d['tf/1']:.2f} | |",
    ]
    own, adapter = max(f["make_dataset"]), max(f["keras 3 adapter onto 8 JAX devices"])
    fitted = max(f["model.fit, a near-no-op model"])
    feed_rows = [
        "| | images/s (best of " + str(cfg["reps"]) + ") | / make_dataset |",
        "|---|---|---|",
        f"| `make_dataset(training=True, cache=False)`, batches to NumPy | {own:.0f} | 1 |",
        f"| the same through Keras 3's tf.data adapter onto 8 JAX devices (sharded `device_put`) | {adapter:.0f} | "
        f"{adapter / own:.2f} (goal >= 0.9) |",
        f"| `model.fit` of a near-no-op model on 8 host devices (the CPU's step, not the feed) | {fitted:.0f} | "
        f"{fitted / own:.2f} |",
    ]
    return (
        f"## The two backends: the dry run and the JAX feed\n\nsmall-cnn, {cfg['size']} px, {cfg['images']} images, "
        f"{cfg['epochs']} epochs, global batch {cfg['batch']}, steps_per_execution {cfg['spe']}; best of "
        f"{cfg['rounds']} alternating rounds, each a fresh process.\n\n" + "\n".join(rows) + "\n\n"
        f"The feed: {cfg['feed_steps']} steps of {cfg['batch']} augmented images decoded anew; `model.fit`'s second "
        f"epoch timed (a model of one pooling and one dense layer).\n\n" + "\n".join(feed_rows)
    )


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--work", default=os.path.join(ROOT, "bench", "out"))
    p.add_argument("--smoke", action="store_true")
    p.add_argument("--json", help="also write the raw figures here")
    p.add_argument("--one", choices=("feed",), help=argparse.SUPPRESS)
    p.add_argument("--records", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    cfg = SMOKE if args.smoke else FULL
    if args.one:
        print(json.dumps(feed(args.records, cfg)))
        return
    os.makedirs(args.work, exist_ok=True)
    records = shards(args.work, cfg)
    result = {"config": cfg, "dry_run": dry_run(records, args.work, cfg)}
    env = {k: v for k, v in os.environ.items() if k not in ("KERAS_BACKEND", "XLA_FLAGS")}
    done = subprocess.run(
        [sys.executable, "-m", "bench.backends", "--one", "feed", "--records", records, *(["--smoke"] * args.smoke)],
        capture_output=True, text=True, cwd=ROOT, preexec_fn=child_of_this_process(),
        env=dict(env, PYTHONPATH=ROOT, KERAS_BACKEND="jax", XLA_FLAGS=HOST_DEVICES, TF_CPP_MIN_LOG_LEVEL="2"),
    )  # fmt: skip
    if done.returncode:
        raise RuntimeError(f"the feed benchmark failed:\n{done.stderr[-3000:]}")
    result["feed"] = json.loads(done.stdout.strip().splitlines()[-1])
    if args.json:
        dump(result, args.json)
    print(report(result))


if __name__ == "__main__":
    main()
