"""The TPU dry run on 8 virtual CPU replicas against one replica: total time, where it goes, and prediction.

    python -m bench.dry_run --work bench/out

The workload: EfficientNet-B0 at 64 px, 2 epochs over 300 images, ``steps_per_execution`` 4, batch 4 per
replica; then ``train.predict`` of the same 300 images with each run. Every contender runs in a fresh process
(virtual devices must exist before TensorFlow starts, and nothing is cached between runs: TensorFlow keeps no
compiled functions across processes), the two replica counts take turns, and each keeps its best round.
Reported: whole-process wall time (start-up and imports included), the time to the first training step, the
steady-state training images/s (epoch 2), and the breakdown of the step's compilation measured in-process
(Python tracing of the step vs its first call: graph optimisation, placement, executor creation). ``--smoke``
compares 1 replica with 2 on a handful of images: it checks that the benchmark runs.
"""

import argparse
import json
import os
import subprocess
import sys
import time

from bench.common import dump
from tfpipe.runtime.lifecycle import child_of_this_process

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FULL = {
    "model": "efficientnet-b0",
    "size": 64,
    "images": 300,
    "epochs": 2,
    "spe": 4,
    "batch": 4,
    "rounds": 2,
    "replicas": 8,
}
# The smoke run checks that the benchmark runs: 2 replicas go through the same MirroredStrategy code as 8 in a
# third of the time (tracing runs the step's Python once per replica).
SMOKE = {"model": "small-cnn", "size": 16, "images": 24, "epochs": 2, "spe": 2, "batch": 1, "rounds": 1, "replicas": 2}


def shards(work, cfg):
    """The demo dataset's first ``images`` images written at ``size`` px with 5 folds (reused between runs)."""
    from tfpipe import Source, write_shards
    from tfpipe.demo import make_demo
    from tfpipe.writer.images import ImageSpec

    out = os.path.join(work, f"dry-run-{cfg['images']}-{cfg['size']}")
    if not os.path.exists(os.path.join(out, "manifest.json")):
        data = os.path.join(work, f"dry-run-demo-{cfg['images']}")
        make_demo(data, cfg["images"], 0, 0)
        write_shards(
            Source(os.path.join(data, "images"), csv=os.path.join(data, "train.csv")),
            out,
            spec=ImageSpec(image_size=cfg["size"]),
            num_folds=5,
            overwrite=True,
            progress=False,
        )
    return out


def one_fit(records, out, replicas, cfg, started):
    """Runs train.fit in this process; returns its timings (seconds from process start)."""
    import tf_keras as keras

    from tfpipe.tf.augment import NO_AUGMENT
    from train.fit import FitConfig, fit

    class FirstStep(keras.callbacks.Callback):
        first = None

        def on_train_batch_end(self, batch, logs=None):
            FirstStep.first = FirstStep.first or time.perf_counter() - started

    m = fit(
        FitConfig(
            records=records,
            run=out,
            strategy="cpu",
            replicas=replicas,
            model=cfg["model"],
            batch_size=cfg["batch"],
            epochs=cfg["epochs"],
            steps_per_execution=cfg["spe"],
            augment=NO_AUGMENT,
            verbose=0,
            report=False,
            callbacks=(FirstStep(),),
        )
    )
    return {
        "total": time.perf_counter() - started,
        "first_step": FirstStep.first,
        "images_per_sec": m.images_per_sec,
    }


def one_predict(records, run, replicas, started):
    from train.predict import predict

    predict(
        run,
        records,
        os.path.join(run, "submission.csv"),
        strategy="cpu",
        replicas=replicas,
        batch_size=8,
        progress=False,
    )
    return {"total": time.perf_counter() - started}


def one_trace(records, replicas, cfg, started):
    """The step's compilation taken apart: Python tracing of the train function, then its first call."""
    from tfpipe import make_dataset, open_shards
    from train.accel.strategy import resolve_strategy
    from train.keras.compiling import compile_model
    from train.keras.models import build_model
    from train.keras.plan import ModelPlan, OptimizerPlan

    strategy, _ = resolve_strategy("cpu", replicas)
    shards_ = open_shards(records)
    global_batch = cfg["batch"] * replicas
    ds = strategy.distribute_datasets_from_function(
        lambda ctx: make_dataset(
            records, ctx.get_per_replica_batch_size(global_batch), training=True, input_context=ctx
        )
    )
    with strategy.scope():
        model, _ = build_model(cfg["model"], shards_.num_classes, cfg["size"])
        head = ModelPlan(cfg["model"], shards_.num_classes, cfg["size"], bool(shards_.single_label))
        compile_model(model, head, OptimizerPlan(), 1e-3, cfg["spe"])
    iterator = iter(ds)
    function = model.make_train_function()
    t = time.perf_counter()
    concrete = function.get_concrete_function(iterator)
    traced = time.perf_counter()
    function(iterator)
    first = time.perf_counter()
    function(iterator)
    second = time.perf_counter()
    return {
        "trace": traced - t,
        "first_call": first - traced,
        "next_call": second - first,
        "graph_nodes": len(concrete.graph.as_graph_def().node),
    }


def contender(kind, replicas, records, run, cfg):
    """One measurement in a fresh process (the replica count must be set before TensorFlow starts)."""
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "bench.dry_run",
            "--one",
            kind,
            "--replicas",
            str(replicas),
            "--records",
            records,
            "--run",
            run,
            "--config",
            json.dumps(cfg),
        ],
        capture_output=True,
        text=True,
        cwd=ROOT,
        preexec_fn=child_of_this_process(),
        env=dict(os.environ, PYTHONPATH=ROOT),
    )
    if out.returncode:
        raise RuntimeError(f"{kind} on {replicas} replicas failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def run(work, cfg):
    import shutil

    records = shards(work, cfg)
    best = {}
    for _ in range(cfg["rounds"]):  # the replica counts take turns; each keeps its best round
        for replicas in (1, cfg["replicas"]):
            run_dir = os.path.join(work, f"dry-run-run-{replicas}")
            shutil.rmtree(run_dir, ignore_errors=True)
            for kind, key in (("fit", "fit"), ("predict", "predict"), ("trace", "trace")):
                if kind == "trace" and (key, replicas) in best:
                    continue  # the breakdown once: it explains the totals, which are what the rounds compare
                got = contender(kind, replicas, records, run_dir, cfg)
                keep = best.setdefault((key, replicas), got)
                if got.get("total", got.get("trace")) < keep.get("total", keep.get("trace")):
                    best[(key, replicas)] = got
    return {"config": cfg, "results": {f"{k}/{r}": v for (k, r), v in best.items()}}


def replicas(result):
    """The many-replica count of a result (8 in full runs, and in results that lack the count)."""
    return result["config"].get("replicas", 8)


def ratios(result):
    r, n = result["results"], replicas(result)
    return {
        "fit": r[f"fit/{n}"]["total"] / r["fit/1"]["total"],
        "predict": r[f"predict/{n}"]["total"] / r["predict/1"]["total"],
    }


def report(result):
    cfg, r, n = result["config"], result["results"], replicas(result)
    q = ratios(result)
    one, many = (lambda kind, key: r[f"{kind}/1"][key]), (lambda kind, key: r[f"{kind}/{n}"][key])
    rows = [
        f"| | 1 replica | {n} replicas | {n} / 1 | goal |",
        "|---|---|---|---|---|",
        f"| train.fit, whole process (s) | {one('fit', 'total'):.0f} | {many('fit', 'total'):.0f} | "
        f"{q['fit']:.2f} | <= 2 |",
        f"| time to the first step (s) | {one('fit', 'first_step'):.0f} | {many('fit', 'first_step'):.0f} | "
        f"{many('fit', 'first_step') / one('fit', 'first_step'):.2f} | |",
        f"| steady state, epoch 2 (images/s) | {one('fit', 'images_per_sec')} | {many('fit', 'images_per_sec')}"
        f" | {many('fit', 'images_per_sec') / one('fit', 'images_per_sec'):.2f} | |",
        f"| step compilation: Python tracing (s) | {one('trace', 'trace'):.1f} | {many('trace', 'trace'):.1f} | "
        f"{many('trace', 'trace') / one('trace', 'trace'):.1f} | |",
        f"| step compilation: first call (s) | {one('trace', 'first_call'):.1f} | "
        f"{many('trace', 'first_call'):.1f} | {many('trace', 'first_call') / one('trace', 'first_call'):.1f} | |",
        f"| next call, {cfg['spe']} steps (s) | {one('trace', 'next_call'):.2f} | {many('trace', 'next_call'):.2f}"
        f" | {many('trace', 'next_call') / one('trace', 'next_call'):.1f} | {n} ({n}x the images) |",
        f"| graph nodes of the step | {one('trace', 'graph_nodes')} | {many('trace', 'graph_nodes')} | "
        f"{many('trace', 'graph_nodes') / one('trace', 'graph_nodes'):.1f} | |",
        f"| train.predict, whole process (s) | {one('predict', 'total'):.0f} | {many('predict', 'total'):.0f} | "
        f"{q['predict']:.2f} | <= 1.5 |",
    ]
    return (
        f"## TPU dry run: {n} virtual CPU replicas vs 1\n\n{cfg['model']}, {cfg['size']} px, {cfg['images']} "
        f"images, {cfg['epochs']} epochs, steps_per_execution {cfg['spe']}, batch {cfg['batch']} per replica; "
        f"best of {cfg['rounds']} alternating rounds, each in a fresh process.\n\n" + "\n".join(rows)
    )


def main(argv=None):
    started = time.perf_counter()
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--work", default=os.path.join(ROOT, "bench", "out"))
    p.add_argument("--smoke", action="store_true")
    p.add_argument("--json", help="also write the raw figures here")
    p.add_argument("--one", choices=("fit", "predict", "trace"), help=argparse.SUPPRESS)
    p.add_argument("--replicas", type=int, help=argparse.SUPPRESS)
    p.add_argument("--records", help=argparse.SUPPRESS)
    p.add_argument("--run", help=argparse.SUPPRESS)
    p.add_argument("--config", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.one:
        from train.accel.strategy import resolve_strategy

        cfg = json.loads(args.config)
        resolve_strategy("cpu", args.replicas)  # the virtual devices, before anything starts TensorFlow's
        if args.one == "fit":
            got = one_fit(args.records, args.run, args.replicas, cfg, started)
        elif args.one == "predict":
            got = one_predict(args.records, args.run, args.replicas, started)
        else:
            got = one_trace(args.records, args.replicas, cfg, started)
        print(json.dumps(got))
        return
    result = run(args.work, SMOKE if args.smoke else FULL)
    dump(result, args.json)
    print(report(result))


if __name__ == "__main__":
    main()
