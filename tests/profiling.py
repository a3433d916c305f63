"""Where the test minutes go: ``pytest -p tests.profiling`` writes one row per test to ``$TFPIPE_PROFILE``
(default ``test-profile.tsv``): its wall time (setup + call + teardown), the processes it started (and how many of
them were Python, which start TensorFlow when they run one of our commands) and the distribution strategies it built
in-process (with their replica count). ``python -m tests.profiling FILE`` sums a profile by file and by kind.

Used to write docs/project/tests.md; counts only, it changes nothing a test does.
"""

import collections
import csv
import os
import subprocess
import sys
import time

import pytest

_ROWS: dict = {}
_CURRENT = {"test": None}


def _profile_path():
    return os.environ.get("TFPIPE_PROFILE", "test-profile.tsv")


def _argv(args):
    """A command as Popen and run take it (a list, or one string), as a list of strings."""
    return [str(a) for a in (args if isinstance(args, (list, tuple)) else [args])]


def _count(kind, detail=""):
    test = _CURRENT["test"]
    if test is not None:
        row = _ROWS.setdefault(test, collections.Counter())
        row[kind] += 1
        if detail:
            row[f"{kind}:{detail}"] += 1


def _wrap_popen():
    original = subprocess.Popen.__init__

    def init(self, args, *rest, **kwargs):
        argv = _argv(args)
        _count("processes")
        if argv and (
            "python" in os.path.basename(argv[0]) or argv[0] == sys.executable or argv[0].startswith("tfpipe")
        ):
            module = (
                argv[argv.index("-m") + 1]
                if "-m" in argv[:3]
                else os.path.basename(argv[1] if len(argv) > 1 else argv[0])
            )
            _count("python", module)
        original(self, args, *rest, **kwargs)

    subprocess.Popen.__init__ = init


def _wrap_strategies():
    import tensorflow as tf

    for cls in (tf.distribute.MirroredStrategy, tf.distribute.OneDeviceStrategy):
        original = cls.__init__

        def init(self, *args, _original=original, _name=cls.__name__, **kwargs):
            _original(self, *args, **kwargs)
            _count("strategies", f"{_name}x{self.num_replicas_in_sync}")

        cls.__init__ = init


def _wrap_run():
    """Times each ``subprocess.run`` (the install tests' pip and venv steps), written to ``$TFPIPE_PROFILE.steps``."""
    original = subprocess.run

    def run(args, *rest, **kwargs):
        start = time.perf_counter()
        try:
            return original(args, *rest, **kwargs)
        finally:
            with open(_profile_path() + ".steps", "a") as f:
                f.write(f"{_CURRENT['test']}\t{time.perf_counter() - start:.1f}\t{' '.join(_argv(args))[:160]}\n")

    subprocess.run = run


def pytest_configure(config):
    _wrap_popen()
    _wrap_run()
    _wrap_strategies()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    _CURRENT["test"] = item.nodeid
    start = time.perf_counter()
    yield
    _ROWS.setdefault(item.nodeid, collections.Counter())["seconds"] = round(time.perf_counter() - start, 2)
    _CURRENT["test"] = None


def pytest_sessionfinish(session):
    with open(_profile_path(), "a", newline="") as f:
        out = csv.writer(f, delimiter="\t")
        for test, row in _ROWS.items():
            details = " ".join(f"{k}={v}" for k, v in sorted(row.items()) if ":" in k)
            out.writerow([test, row["seconds"], row["processes"], row["python"], row["strategies"], details])


def summary(path):
    by_file = collections.defaultdict(lambda: [0, 0.0, 0, 0])
    rows = list(csv.reader(open(path), delimiter="\t"))
    for test, seconds, processes, _python, strategies, _ in rows:
        entry = by_file[test.split("::")[0]]
        entry[0] += 1
        entry[1] += float(seconds)
        entry[2] += int(processes)
        entry[3] += int(strategies)
    print(f"{'file':40} {'tests':>5} {'seconds':>8} {'processes':>9} {'strategies':>10}")
    for name, (n, s, p, st) in sorted(by_file.items(), key=lambda kv: -kv[1][1]):
        print(f"{name:40} {n:5} {s:8.1f} {p:9} {st:10}")
    total = sum(float(r[1]) for r in rows)
    starting = sum(1 for r in rows if int(r[2]))
    print(f"{len(rows)} tests, {total:.0f} s; {starting} start processes ({sum(int(r[3]) for r in rows)} Python)")
    print("\nslowest 20:")
    for test, seconds, processes, _python, strategies, details in sorted(rows, key=lambda r: -float(r[1]))[:20]:
        print(f"{float(seconds):7.1f} s  {test}  ({processes} processes, {strategies} strategies) {details}")


if __name__ == "__main__":
    summary(sys.argv[1])
