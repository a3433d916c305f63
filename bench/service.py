"""The tf.data service against the in-process pipeline: training input, same shards, one run.

    python -m bench.service --records records/demo/train [--image-size 224] [--epochs 3] [--reps 3]

A dispatcher and ``--workers`` workers (``python -m tfpipe.service``) on 127.0.0.1 in processes of their own,
then round-robin: ``make_dataset(training=True, cache=False)`` in this process, and the same call with
``service=``. Figures: images/s of each epoch (the best over ``--reps`` runs) and their ratio; and the trainer's
CPU time per image (this process, every thread: ``resource.getrusage``; the workers and the dispatcher are other
processes), the fewest over the runs, and its ratio -- what the service leaves of the host's work. On one machine
the workers share its cores with the trainer, so the images/s ratio is the service's cost, not its gain: the gain is
the cores of other machines (docs/project/benchmarks.md works out how many a TPU needs).
"""

import argparse
import gc
import os
import resource
import subprocess
import sys
import tempfile

from bench.common import dump
from bench.reader import BATCH, epoch_rates
from tfpipe.runtime.lifecycle import child_of_this_process
from tfpipe.runtime.net import free_port

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


def cpu_seconds():
    """CPU time of this process so far, all its threads, user + system."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def servers_cpu_seconds(procs):
    """CPU time so far of the dispatcher and workers (Linux: /proc/PID/stat's utime + stime)."""
    total = 0
    for proc in procs:
        with open(f"/proc/{proc.pid}/stat") as f:
            fields = f.read().rpartition(")")[2].split()  # after the command's name, which may hold spaces
        total += int(fields[11]) + int(fields[12])
    return total / os.sysconf("SC_CLK_TCK")


def measured(make, steps, epochs, procs):
    """(images/s of each epoch, this process's CPU seconds per image over the epochs, the servers' CPU seconds per
    image over the same time: the workers may have begun the next epoch's job, so slightly more than theirs)."""
    start, servers = cpu_seconds(), servers_cpu_seconds(procs)
    rates = epoch_rates(make, steps, epochs)
    used, servers = cpu_seconds() - start, servers_cpu_seconds(procs) - servers
    gc.collect()  # the iterator's threads end before the next contender starts
    images = steps * BATCH * epochs
    return rates, used / images, servers / images


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
        cpu = {name: [] for name in contenders}
        for _ in range(reps):  # round-robin: a drift of the machine hits both alike
            for name, make in contenders.items():
                rates, here, there = measured(make, steps, epochs, procs)
                runs[name].append(rates)
                cpu[name].append((here, there))
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()
    best = {name: [max(r[e] for r in rs) for e in range(epochs)] for name, rs in runs.items()}
    return {
        "records": records, "image_size": image_size, "workers": workers, "epochs": best,
        "cpu_per_image": {name: min(c) for name, c in cpu.items()},  # (trainer, servers) of the leanest run
    }  # fmt: skip


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
        "",
        *cpu_report(result["cpu_per_image"]),
    ]
    return "\n".join(lines)


def ratios(result):
    """(name, measured ratio, goal) rows for ``python -m bench``'s summary."""
    (_, (mine, _)), (_, (theirs, _)) = result["cpu_per_image"].items()
    return [("service: trainer CPU per image / in process", theirs / mine, 0.1)]


def cpu_report(cpu):
    """The trainer's CPU per image, each contender, and the ratio; the servers' and the cores each needs for
    1,000 images/s (CPU seconds per image x 1,000)."""
    (here, (mine, _)), (there, (theirs, servers)) = cpu.items()
    return [
        "| input | trainer CPU per image (this process, every thread) | dispatcher + workers CPU per image |",
        "|---|---|---|",
        f"| {here} | {mine * 1000:.3f} ms | |",
        f"| {there} | {theirs * 1000:.3f} ms | {servers * 1000:.3f} ms |",
        "",
        f"trainer CPU per image, service / in process = {theirs / mine:.3f} (goal <= 0.1)",
        "",
        f"cores per 1,000 images/s: in process {mine * 1000:.2f} on the trainer's host; through the service "
        f"{theirs * 1000:.2f} on the trainer's host and {servers * 1000:.2f} on the workers' machines",
    ]


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
