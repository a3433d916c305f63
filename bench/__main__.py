"""Every benchmark in one run: corpus -> writer -> reader -> service -> training -> TPU dry run -> the two backends;
results and a chart.

    python -m bench               # make bench: the full set (most of an hour on a small machine)
    python -m bench --smoke       # a handful of images, to check the benchmarks still run

Each benchmark runs in its own process (the training one needs 8 virtual CPU
devices set before TensorFlow starts) and hands its raw figures back as JSON.
"""

import argparse
import datetime
import json
import os
import platform
import subprocess
import sys

from tfpipe.runtime.lifecycle import child_of_this_process

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FULL = {"n": 300, "writer_reps": 3, "times": 8, "reps": 3, "epochs": 3, "steps": 64}
SMOKE = {"n": 4, "writer_reps": 1, "times": 1, "reps": 1, "epochs": 2, "steps": 4}


def machine():
    import importlib.metadata as md

    versions = ", ".join(
        f"{p} {md.version(p)}" for p in ("tensorflow", "tf-keras", "torch", "opencv-python-headless", "numpy")
    )
    return (
        f"{datetime.date.today().isoformat()} · {platform.machine()} {platform.processor() or ''} · "
        f"{os.cpu_count()} CPUs · Python {platform.python_version()} · {versions}"
    )


def check_sizes(work, cfg):
    """A work folder holds the corpus, shards and figures of one set of sizes: reusing a smoke run's 16-photo
    corpus or its figures in a full report would publish numbers that mean nothing."""
    stamp = os.path.join(work, "sizes.json")
    if os.path.exists(stamp):
        with open(stamp) as f:
            held = json.load(f)
        if held != cfg:
            print(
                f"bench: error: {work} holds a run of other sizes ({held}); remove it or choose another --work",
                file=sys.stderr,
            )
            sys.exit(2)
    os.makedirs(work, exist_ok=True)
    with open(stamp, "w") as f:
        json.dump(cfg, f)


def bench(module, args, work, only=None):
    """Runs ``bench.<module>`` in a fresh process and returns its figures (or, with ``only`` naming another
    benchmark, the figures of its last run)."""
    out = os.path.join(work, f"{module}.json")
    if only and only != module and os.path.exists(out):
        with open(out) as f:
            return json.load(f)
    subprocess.run(
        [sys.executable, "-m", f"bench.{module}", *args, "--json", out],
        check=True,
        cwd=ROOT,
        preexec_fn=child_of_this_process(),  # a killed benchmark leaves no process behind
        env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", PYTHONPATH=ROOT),
    )
    with open(out) as f:
        return json.load(f)


def ratios(writer, reader, training):
    """(name, measured ratio, goal) for the chart."""
    n, res = writer["n"], writer["results"]

    def marginal(name):
        return 2 * n / (res[name]["3N"] - res[name]["N"])

    sp, tr = reader["single_pass"], reader["training"]
    inp = training["input"]
    return [
        ("writer / seed (marginal)", marginal("tfpipe.write") / marginal("seed writer"), 2.5),
        ("writer / codec limit", marginal("tfpipe.write") / marginal("codec limit (bare pool)"), 0.9),
        (
            "pass-through / seed q100",
            marginal("tfpipe.write pass-through") / marginal("seed writer, no resize, q100"),
            10,
        ),
        (
            "pass-through / seed q100, whole process 3N",
            res["seed writer, no resize, q100"]["3N"] / res["tfpipe.write pass-through"]["3N"],
            None,
        ),
        (
            "reader / decode limit",
            sp["make_dataset(training=False)"][0] / sp["decode limit (bytes in memory, parallel decode)"][0],
            0.93,
        ),
        (
            "reader / seed parser",
            sp["make_dataset(training=False)"][0] / sp["seed parser (parse_single_example + decode_jpeg)"][0],
            1.0,
        ),
        (
            "training input / seed, epoch>=2",
            min(tr["make_dataset(training=True), cache"][1:]) / min(tr["seed training input"][1:]),
            3.0,
        ),
        (
            "fed by make_dataset / in memory",
            max(inp["make_dataset (augmented)"]) / max(inp["one batch in memory"]),
            0.95,
        ),
        ("writer RSS 4N / N", writer["rss_4n"] / res["tfpipe.write"]["rss"][0], 1.25),
    ] + [(f"steps_per_execution {k} / 1", max(r) / max(training["spe"][0][1]), None) for k, r in training["spe"][1:]]


def at_most(name):
    """Whether a figure's goal is a ceiling (memory, CPU) rather than a floor (speed)."""
    return "RSS" in name or "CPU" in name


def chart(rows, path):
    from matplotlib.figure import Figure  # headless without pyplot: no backend to select

    fig = Figure(figsize=(8, 0.45 * len(rows) + 1))
    ax = fig.subplots()
    names = [r[0] for r in rows][::-1]
    values = [r[1] for r in rows][::-1]
    goals = [r[2] for r in rows][::-1]
    met = [
        "tab:blue" if g is None or (v <= g if at_most(n) else v >= g) else "tab:red"
        for n, v, g in zip(names, values, goals)
    ]
    ax.barh(names, values, color=met)
    for i, g in enumerate(goals):
        if g is not None:
            ax.plot([g, g], [i - 0.4, i + 0.4], "k-", lw=2)
    ax.set_xscale("log")
    ax.set_xlabel("ratio (log scale); black tick = goal; red = goal not met")
    ax.set_title("tfpipe benchmarks: ratios measured side by side in one run")
    fig.savefig(path, dpi=100, bbox_inches="tight")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--smoke", action="store_true", help="tiny sizes: checks that every benchmark runs")
    p.add_argument(
        "--work",
        help="corpus, shards and figures, reused by later runs of the same sizes "
        "(default: bench/out, or bench/out-smoke with --smoke)",
    )
    p.add_argument("--results", default=os.path.join(ROOT, "bench", "results.md"))
    p.add_argument(
        "--only",
        choices=("writer", "reader", "service", "training", "dry_run", "backends", "none"),
        help="rerun one benchmark (none: just rewrite the report); the others' figures come from "
        "their last run in --work",
    )
    args = p.parse_args(argv)
    cfg = SMOKE if args.smoke else FULL
    args.work = args.work or os.path.join(ROOT, "bench", "out-smoke" if args.smoke else "out")
    check_sizes(args.work, cfg)
    corpus = os.path.join(args.work, "corpus")
    if not os.path.exists(os.path.join(corpus, "train.csv")):
        from bench.corpus import make_corpus

        make_corpus(corpus, min(4 * cfg["n"], 400))  # the writer repeats photos beyond 400 (hard links)
    common = ["--corpus", corpus, "--work", args.work]
    writer = bench("writer", [*common, "--n", str(cfg["n"]), "--reps", str(cfg["writer_reps"])], args.work, args.only)
    reader = bench(
        "reader",
        [*common, "--times", str(cfg["times"]), "--reps", str(cfg["reps"]), "--epochs", str(cfg["epochs"])],
        args.work,
        args.only,
    )
    service = bench(
        "service",
        [
            "--records", os.path.join(args.work, "records256"), "--image-size", "224",
            "--workers", "1" if args.smoke else "2", "--reps", str(cfg["reps"]), "--epochs", str(cfg["epochs"]),
        ],
        args.work,
        args.only,
    )  # fmt: skip
    # The smoke run's steps_per_execution figures on 2 replicas: the same MirroredStrategy code as 8, each of the six
    # models traced for a quarter of the replicas (as the smoke dry run, bench/dry_run.py).
    smoke_replicas = ["--replicas", "2"] if args.smoke else []
    training = bench(
        "training",
        [*common, "--steps", str(cfg["steps"]), "--reps", str(cfg["reps"]), *smoke_replicas],
        args.work,
        args.only,
    )

    dry_run = bench("dry_run", ["--work", args.work, *(["--smoke"] if args.smoke else [])], args.work, args.only)
    backends = bench("backends", ["--work", args.work, *(["--smoke"] if args.smoke else [])], args.work, args.only)

    from bench import backends as backends_lib
    from bench import dry_run as dry_run_lib
    from bench import reader as reader_lib
    from bench import service as service_lib
    from bench import training as training_lib
    from bench import writer as writer_lib

    many = dry_run_lib.replicas(dry_run)
    rows = (
        ratios(writer, reader, training)
        + service_lib.ratios(service)
        + [
            (f"TPU dry run: 1 / {many} replicas, train.fit", 1 / dry_run_lib.ratios(dry_run)["fit"], 0.5),
            (f"TPU dry run: 1 / {many} replicas, train.predict", 1 / dry_run_lib.ratios(dry_run)["predict"], 1 / 1.5),
        ]
        + backends_lib.ratios(backends)
    )
    summary = ["| figure | measured | goal |", "|---|---|---|"] + [
        f"| {name} | {value:.2f} | {'' if goal is None else ('<= ' if at_most(name) else '>= ') + f'{goal:.3g}'} |"
        for name, value, goal in rows
    ]
    text = (
        "\n\n".join(
            [
                f"# Benchmark results{' (smoke run: sizes too small to mean anything)' if args.smoke else ''}",
                machine(),
                "\n".join(summary),
                writer_lib.report(writer),
                reader_lib.report(reader),
                service_lib.report(service),
                training_lib.report(training),
                dry_run_lib.report(dry_run),
                backends_lib.report(backends),
                "Reproduce: `make bench` (or `python -m bench`). Each figure is a ratio of two things measured "
                "in this run on the same data.",
            ]
        )
        + "\n"
    )
    with open(args.results, "w") as f:
        f.write(text)
    chart(rows, os.path.splitext(args.results)[0] + ".png")
    print(text)


if __name__ == "__main__":
    main()
