"""Every command ends the same way (``tfpipe.runtime.lifecycle``): Ctrl-C (SIGINT) exit 130, SIGTERM 143, one last line
naming the stop, no process of ours left behind, and nothing half-written -- a write's folder resumable and said
so, a training run's step saved and said so. One table: command x signal."""

import os
import shutil
import signal
import subprocess
import sys
import time
import uuid

import pytest

from tests.conftest import sigint_as_a_terminal_sends_it
from tests.test_reliability import finished_shards
from tests.test_whole_job import processes_marked

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY_FIT = ["--model", "small-cnn", "--batch-size", "1", "--epochs", "50", "--steps-per-execution", "1",
            "--verbose", "2"]  # fmt: skip
COMPILED = "compiled; the first"  # train.fit's line once its steps run


def at_work(proc, out, marker, tmp_path):
    """Reads the command's output until ``marker`` (a line's start or part; a callable: a check of the folder
    ``tmp_path``) says it is at work."""
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline:
        if callable(marker):
            if marker(tmp_path):
                return
            time.sleep(0.01)
            continue
        line = proc.stdout.readline()
        out.append(line)
        if marker in line:
            return
        assert line or proc.poll() is None, "".join(out)[-3000:]
    raise AssertionError("never at work: " + "".join(out)[-3000:])


def fit_left_a_step(tmp_path, line):
    assert "saved: --resume continues there" in line and (tmp_path / "run" / "backup").is_dir()


def cv_left_a_step(tmp_path, line):
    assert "saved: --resume continues there" in line and (tmp_path / "cv" / "fold-0" / "backup").is_dir()


def write_is_resumable(tmp_path, line):
    out = tmp_path / "out"
    assert "--resume" in line and not list(out.glob("*.tfrec")) and not (out / "manifest.json").exists()
    assert finished_shards(str(out)) >= 2


# command: (argv after python, what says it is at work, what the last line starts with after the stop's words,
# what it left)
COMMANDS = {
    "tfpipe.write": (
        lambda d, tmp: [
            "-m",
            "tfpipe.write",
            *d["slow"][0],
            "--out",
            str(tmp / "out"),
            "--workers",
            "1",
            "--no-progress",
        ],
        lambda tmp: finished_shards(str(tmp / "out")) >= 2,
        ": ",
        write_is_resumable,
    ),
    "train.fit": (
        lambda d, tmp: [
            "-m",
            "train.fit",
            "--records",
            d["shards"],
            "--run",
            str(tmp / "run"),
            "--strategy",
            "cpu",
            "--no-report",
            *TINY_FIT,
        ],
        COMPILED,
        " at epoch 1, step ",
        fit_left_a_step,
    ),
    "train.cv": (
        lambda d, tmp: [
            "-m",
            "train.cv",
            "--records",
            d["shards"],
            "--run",
            str(tmp / "cv"),
            "--fold",
            "0",
            "--strategy",
            "cpu",
            *TINY_FIT,
        ],
        COMPILED,
        " at epoch 1, step ",
        cv_left_a_step,
    ),
    "tfpipe.service": (
        lambda d, tmp: ["-m", "tfpipe.service", "dispatcher", "--port", "0"],
        "tf.data service dispatcher at",
        "",
        None,
    ),
    "torch_ddp": (
        lambda d, tmp: ["examples/torch_ddp.py", "--records", d["shards"], "--processes", "2", "--epochs", "50"],
        "epoch 1/50",
        "",
        None,
    ),
    "lightning_swa": (
        lambda d, tmp: ["examples/lightning_swa.py", "--records", d["shards"], "--devices", "2", "--epochs", "50"],
        "epoch 1/50",
        "",
        None,
    ),
}


def test_sigterm_to_a_running_command_is_exit_143_and_its_one_line(tmp_path):
    """Issue #62: a real SIGTERM to a real command under ``run_cli`` in the default suite (the server: at work as
    soon as it listens, a few seconds); the table's code and words, written here, not read from the table."""
    argv = ["-m", "tfpipe.service", "dispatcher", "--port", "0"]
    last = stopped("tfpipe.service", argv, "tf.data service dispatcher at", "", signal.SIGTERM, tmp_path,
                   expected=(143, "terminated (SIGTERM)"))  # fmt: skip
    assert last == "tfpipe.service: terminated (SIGTERM)"


@pytest.mark.slow  # each a command started, stopped at work and watched until its processes are gone: 5-25 s
@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_a_stopped_command_exits_with_the_tables_code_one_line_no_process_and_nothing_half_written(
    command, signum, shard_dir, slow_source, tmp_path
):
    argv, marker, after, left = COMMANDS[command]
    last = stopped(command, argv({"shards": shard_dir[0], "slow": slow_source}, tmp_path), marker, after, signum,
                   tmp_path)  # fmt: skip
    if left:
        left(tmp_path, last)


@pytest.mark.slow  # a prediction on 8 replicas stopped at work, 10-20 s each
@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_a_stopped_prediction_leaves_no_submission_and_no_process(signum, trained_run, tmp_path):
    """The table's row for ``train.predict`` (apart: it needs the session's trained run): ``--out`` absent, not
    half-written, and of the run folder (a copy: the session's run stays as it is) every file kept; the one file
    it may gain is the 8-view validation predictions the TTA worth line measures (``--threshold``: nothing tuned)."""
    shared, _, test = trained_run
    run = str(tmp_path) + "-run"
    shutil.copytree(shared, run)
    before = set(os.listdir(run))
    out = tmp_path / "submission.csv"
    argv = ["-m", "train.predict", "--run", run, "--records", test, "--out", str(out), "--strategy", "cpu",
            "--replicas", "8", "--tta", "8", "--threshold", "0.5"]  # fmt: skip
    stopped("train.predict", argv, "train.predict: view 1/8", "", signum, tmp_path)
    after = set(os.listdir(run))
    assert sorted(os.listdir(tmp_path)) == [] and before <= after
    assert after - before <= {"val_predictions-tta8.csv", "val_predictions-swa-tta8.csv"}, after - before


def test_a_reader_that_closes_the_pipe_early_ends_the_command_quietly(trained_run):
    """``python -m train.inspect RUN | head`` ended in ``Broken pipe``: a command whose output's reader has closed
    the pipe now ends as a Unix tool does -- quietly, exit 141 (128 + SIGPIPE, the code a shell gives), nothing on
    stderr. (``--help | head`` was quiet already: argparse drops a failed write of its help, and exits 0.) The
    reader here closes the pipe before the command writes a byte."""
    run, _, _ = trained_run
    for argv, code in ((["train.inspect", run], 141), (["train.inspect", run, "--json"], 141),
                       (["train.fit", "--help"], 0)):  # fmt: skip
        read_end, write_end = os.pipe()
        proc = subprocess.Popen([sys.executable, "-m", *argv], cwd=ROOT, env={**os.environ, "PYTHONPATH": ROOT},
                                stdout=write_end, stderr=subprocess.PIPE)  # fmt: skip
        os.close(write_end)
        os.close(read_end)  # the reader is gone: the command's first write finds no one
        err = proc.communicate(timeout=120)[1].decode()
        assert (proc.returncode, err) == (code, ""), (argv, proc.returncode, err[-2000:])


# The codes and words a stopped command ends with, written here as the shell knows them (not read from
# tfpipe.runtime.lifecycle.STOPS: a test that reads the table it tests cannot fail when the table changes).
SHELL_CODES = {signal.SIGINT: (130, "interrupted"), signal.SIGTERM: (143, "terminated (SIGTERM)")}


def stopped(command, argv, marker, after, signum, tmp_path, expected=None):
    """Runs ``python ARGV``, sends ``signum`` once ``marker`` says it is at work, and checks the exit code and
    words (``SHELL_CODES``'s, or ``expected``), one last line (``COMMAND: WORDS`` then ``after``), no traceback and no process of ours left; returns
    that line."""
    mark = uuid.uuid4().hex
    env = {**os.environ, "PYTHONPATH": ROOT, "TFPIPE_TEST_MARK": mark}
    sigint_as_a_terminal_sends_it()
    proc = subprocess.Popen([sys.executable, *argv], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)  # fmt: skip
    out = []
    try:
        at_work(proc, out, marker, tmp_path)
        proc.send_signal(signum)
        rest, _ = proc.communicate(timeout=120)
    finally:
        proc.kill()
    said = "".join(out) + rest
    code, words = expected or SHELL_CODES[signum]
    last = said.strip().splitlines()[-1]
    assert proc.returncode == code and last.startswith(f"{command}: {words}{after}"), said[-3000:]
    assert said.count(f"{command}: {words}") == 1 and "Traceback" not in said, said[-3000:]
    deadline = time.monotonic() + 30  # ranks, DataLoader workers, Python's resource tracker
    while processes_marked(mark) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert processes_marked(mark) == []
    return last
