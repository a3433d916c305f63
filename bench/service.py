"""The tf.data service against the in-process pipeline: training input, same shards, one run.

    python -m bench.service --records records/demo/train [--image-size 224] [--epochs 3] [--reps 3]

A dispatcher and ``--workers`` workers (``python -m tfpipe.service``) on 127.0.0.1 in processes of their own,
then round-robin: ``make_dataset(training=True, cache=False)`` in this process, and the same call with
``service=``. Figures: images/s of each epoch (the best over ``--reps`` runs) and their ratio. On one machine the
workers share its cores with the trainer, so the ratio is the service's cost, not its gain: the gain is the cores
of other machines (docs/project/benchmarks.md works out how many a TPU needs).
"""

import argparse
import os
import subprocess
import sys
import tempfile

from bench.common import dump
from bench.reader import BATCH, epoch_rates
from tfpipe.lifecycle import child_of_this_process
from tfpipe.net import free_port

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def start_service(workers, procs):
    """A dispatcher and ``workers`` workers on 127.0.0.1, appended to ``procs`` as they start (the caller stops
    them, also when one fails to start); returns the dispatcher's address."""
    port = free_port()
    env = dict(os.environ, PYTHONPATH=ROOT)
    roles = [["dispatcher", "--port", str(port)]] + [
        ["worker", "--dispatcher", f"127.0.0.1:{port}", "--address", "127.0.0.1"] for _ in range(workers)
    ]
    for role in roles:
        log = tempfile.TemporaryFile("w+")  # noqa: SIM115 -- the server's stderr, for its life
        proc = subprocess.Popen(
            [sys.executable, "-m", "tfpipe.service", *role],
            cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=log, text=True,
            preexec_fn=child_of_this_process(),  # no TensorFlow in this process yet: a fork is safe
        )  # fmt: skip
        procs.append(proc)
        if not proc.stdout.readline():
            log.seek(0)
            raise SystemExit(f"bench.service: the {role[0]} did not start: {log.read().strip()[-500:]}")
    return f"grpc://127.0.0.1:{port}"


def run(records, image_size, workers, reps, epochs):
    procs = []
    try:
        address = start_service(workers, procs)
        import tfpipe

        steps = max(1, tfpipe.count_examples(records) // BATCH)
        common = {"training": True, "cache": False, "image_size": image_size}
        contenders = {
            "in process": lambda: tfpipe.make_dataset(records, BATCH, **common),
            f"tf.data service, {workers} local workers": lambda: tfpipe.make_dataset(
                records, BATCH, service=address, **common
            ),
        }
        runs = {name: [] for name in contenders}
        for _ in range(reps):  # round-robin: a drift of the machine hits both alike
            for name, make in contenders.items():
                runs[name].append(epoch_rates(make, steps, epochs))
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()
    best = {name: [max(r[e] for r in rs) for e in range(epochs)] for name, rs in runs.items()}
    return {"records": records, "image_size": image_size, "workers": workers, "epochs": best}


def report(result):
    (here, here_rates), (there, there_rates) = result["epochs"].items()
    ratio = min(there_rates[1:] or there_rates) / min(here_rates[1:] or here_rates)
    lines = [
        f"Training input, batch {BATCH}, {result['image_size'] or 'stored'} px, best of each epoch:",
        "",
        "| input | " + " | ".join(f"epoch {e + 1} img/s" for e in range(len(here_rates))) + " |",
        "|---" * (1 + len(here_rates)) + "|",
        f"| {here} | " + " | ".join(f"{r:.0f}" for r in here_rates) + " |",
        f"| {there} | " + " | ".join(f"{r:.0f}" for r in there_rates) + " |",
        "",
        f"service / in process (epochs >= 2) = {ratio:.2f}",
    ]
    return "\n".join(lines)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--records", required=True)
    p.add_argument("--image-size", type=int)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--json", help="also write the raw figures here")
    args = p.parse_args(argv)
    result = run(args.records, args.image_size, args.workers, args.reps, args.epochs)
    dump(result, args.json)
    print(report(result))


if __name__ == "__main__":
    main()
