"""Never silent: write -> fit on 8 virtual replicas -> predict on the demo data, as a user runs them, with no gap
longer than ``MAX_GAP`` seconds between two pieces of output (a line, or a progress bar's update).

The chain is the demo's, made smaller (fewer images and epochs) but with the phases that used to go quiet:
compiling for 8 replicas, validation, the report and SWA after training, and prediction until the CSV is
written. ``python -m tests.test_silence`` prints every gap over 10 s with the line that ended it (what
the numbers in the README were measured with).
"""

from __future__ import annotations

import itertools
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
MAX_GAP = 30.0  # seconds, on a 2-core CPU
# small-cnn compiles for 8 replicas in about a minute here: every phase that used to go quiet (compiling, the
# report, SWA, loading, predicting) still takes long enough to need its heartbeat. With
# TFPIPE_SILENCE_MODEL=efficientnet-b0 the chain trains a real EfficientNet (about 15 minutes).
MODEL = os.environ.get("TFPIPE_SILENCE_MODEL", "small-cnn")


def timed_output(argv: list[str], cwd: Path) -> tuple[int, list[tuple[float, str]]]:
    """Runs ``argv`` with stdout and stderr merged into a pipe (not a terminal: what a log or CI sees); returns
    (exit code, [(seconds since start, text)]), one entry per chunk of output as it arrived: a line, or a
    progress bar's update (Keras' bar, not on a terminal, adds to its line without ending it)."""
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    start = time.monotonic()
    proc = subprocess.Popen(argv, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    assert proc.stdout is not None
    pieces: list[tuple[float, str]] = [(0.0, "(start) " + " ".join(argv[1:3]))]
    while chunk := os.read(proc.stdout.fileno(), 65536):
        text = chunk.decode("utf-8", "replace").strip()
        if text:
            pieces.append((time.monotonic() - start, text))
    pieces.append((time.monotonic() - start, "(exit)"))
    return proc.wait(), pieces


def gaps(pieces: list[tuple[float, str]]) -> list[tuple[float, str, str]]:
    """(seconds of silence, the output before, the output that ended it), longest first."""
    found = [(t - s, before, after) for (s, before), (t, after) in itertools.pairwise(pieces)]
    return sorted(found, reverse=True)


def chain(work: Path) -> Iterator[tuple[list[str], list[tuple[float, str]]]]:
    """The demo chain, smaller: each command and its timed output, as each ends (a failing command fails)."""
    py = sys.executable
    data, records, run = work / "data", work / "records", work / "run"
    commands = [
        [py, "-m", "tfpipe.demo", str(data), "--train", "400", "--test", "80"],
        [py, "-m", "tfpipe.write", "--csv", f"{data}/train.csv", "--images", f"{data}/images"]
        + ["--out", f"{records}/train", "--image-size", "32", "--num-folds", "5"],
        [py, "-m", "tfpipe.write", "--csv", f"{data}/test.csv", "--images", f"{data}/images"]
        + ["--out", f"{records}/test", "--split", "test", "--unlabeled", "--image-size", "32"],
        [py, "-m", "train.fit", "--records", f"{records}/train", "--run", str(run), "--strategy", "cpu"]
        + ["--replicas", "8", "--steps-per-execution", "5", "--model", MODEL, "--batch-size", "4"]
        + ["--epochs", "2", "--swa-epochs", "1"],
        [py, "-m", "train.predict", "--run", str(run), "--records", f"{records}/test"]
        + ["--out", f"{run}/submission.csv", "--strategy", "cpu", "--replicas", "8", "--tta", "2"],
        [py, "-m", "train.predict", "--run", str(run), "--records", f"{records}/train", "--out", f"{run}/own.csv"]
        + ["--strategy", "cpu", "--replicas", "8"],
    ]
    for argv in commands:
        code, pieces = timed_output(argv, ROOT)
        text = "\n".join(p for _, p in pieces)
        assert code == 0, f"{' '.join(argv[1:3])} failed (exit {code}):\n{text[-3000:]}"
        yield argv, pieces


@pytest.mark.slow
@pytest.mark.serial  # a gap is timed on 2 cores: another test beside it would stretch it
def test_write_fit_predict_never_silent_for_more_than_30_s(tmp_path):
    results = list(chain(tmp_path))
    worst = max((gap + (" ".join(argv[1:3]),) for argv, pieces in results for gap in gaps(pieces)[:1]))
    seconds, before, after, command = worst
    assert seconds <= MAX_GAP, (
        f"{command}: {seconds:.0f} s without output (longest gap; at most {MAX_GAP:.0f} s) between\n  {before!r}\n"
        f"and\n  {after!r}"
    )
    fit_out = "\n".join(p for _, p in results[3][1])
    assert "validation AUC" in fit_out and "exact-match" in fit_out and "positives" in fit_out  # the class table
    assert "per class, model.keras, 1 view, at the thresholds of thresholds.json:" in fit_out  # names its model
    assert "is slow compared to the batch time" not in fit_out  # tf-keras' callback timing on 8 replicas (#54)
    own = "\n".join(p for _, p in results[5][1])
    assert "are the shards this run trained on" in own and "held out (fold 0)" in own


def test_the_callback_timing_warning_is_held_back_while_tensorflow_runs_and_only_then(caplog):
    """tf-keras warns "Callback method `on_train_batch_end` is slow compared to the batch time" on 8 replicas
    with steps_per_execution (the hook waits for the step's results): held back while fit runs (issue #54), like
    TensorFlow's other start-up lines; the user's own logging of the logger is untouched before and after."""
    import logging

    from tfpipe.runtime.console import quiet_tensorflow

    timing = "Callback method `on_train_batch_end` is slow compared to the batch time (batch time: 0.1s)"
    logger = logging.getLogger("tensorflow")
    with caplog.at_level(logging.WARNING, logger="tensorflow"):
        with quiet_tensorflow(environment=False):
            logger.warning(timing)
            logger.warning("another warning")
        logger.warning(timing)
    assert [r.getMessage() for r in caplog.records] == ["another warning", timing]
    assert logger.filters == []


if __name__ == "__main__":
    import tempfile

    with tempfile.TemporaryDirectory() as work:
        for argv, pieces in chain(Path(work)):
            long = [g for g in gaps(pieces) if g[0] > 10]
            total = pieces[-1][0]
            print(f"{' '.join(argv[1:3])}: {total:.0f} s, longest gap {gaps(pieces)[0][0]:.1f} s", flush=True)
            for seconds, before, after in long:
                print(f"    {seconds:5.1f} s  before: {before[:110]!r}\n           after:  {after[:110]!r}")
