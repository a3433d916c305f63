"""Keras 3 on JAX over several processes (``--backend jax --strategy multiworker``, ``train.accel.hosts``): two
processes of 4 XLA host devices each at 127.0.0.1, the cluster in Keras' own variables. Process 0 alone writes
the run; a killed process ends the other in one line; SIGTERM to both saves at one step and ``--resume`` on both
finishes; processes started unlike refuse before training. And the cluster's variables checked in one line."""

import json
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest

from tests.conftest import dies_with_this_process
from tests.test_multiworker import epochs_saved, output
from tfpipe.runtime.net import free_port
from train.runs import run as run_files

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EPOCHS = 10
ARGS = [
    "--backend", "jax", "--strategy", "multiworker", "--replicas", "4", "--model", "small-cnn", "--batch-size", "8",
    "--lr", "1.5e-3", "--steps-per-execution", "4", "--swa-epochs", "2", "--seed", "0", "--verbose", "2",
]  # fmt: skip


def start_processes(started, records, run, tmp, *extra, own=((), ()), command="train.fit", epochs=EPOCHS):
    """``python -m train.fit --backend jax --strategy multiworker`` (or ``command``) twice, processes 0 and 1 of a
    cluster whose coordinator listens at a free port of 127.0.0.1, each dying with this process; output to
    files."""
    address = f"127.0.0.1:{free_port()}"
    procs = []
    for index in range(2):
        out = open(tmp / f"process{index}-{len(started)}.log", "w+")
        env = {
            **os.environ, "PYTHONPATH": ROOT, "TMPDIR": str(tmp), "KERAS_DISTRIBUTION_JOB_ADDRESSES": address,
            "KERAS_DISTRIBUTION_NUM_PROCESSES": "2", "KERAS_DISTRIBUTION_PROCESS_ID": str(index),
        }  # fmt: skip
        env.pop("KERAS_BACKEND", None)
        env.pop("XLA_FLAGS", None)  # --replicas 4 asks for each process's devices
        args = ["--records", records, "--run", str(run), *ARGS, "--epochs", str(epochs), *extra, *own[index]]
        proc = subprocess.Popen(
            dies_with_this_process(command, *args), cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT
        )
        proc.log = out
        procs.append(proc)
        started.append(proc)
    return procs


def one_process_env():
    """This process's environment without a backend or XLA's device count (``--replicas`` asks for them)."""
    return {k: v for k, v in os.environ.items() if k not in ("KERAS_BACKEND", "XLA_FLAGS")}


def wait_for_epochs(run, n, procs, seconds=300):
    deadline = time.monotonic() + seconds
    while epochs_saved(run) < n and all(p.poll() is None for p in procs) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert epochs_saved(run) >= n, output(procs[0])


@pytest.mark.slow
@pytest.mark.serial  # two processes of 4 devices each on 2 cores: beside other tests, each step waits longer
def test_two_processes_train_end_together_when_one_dies_stop_together_and_resume(demo_shards, tmp_path, started):
    """Process 1 killed once 2 epochs are saved ends process 0 in one line within seconds; ``--resume`` on both,
    SIGTERM to both: each saves at the same step and exits 143 saying so; ``--resume`` on both again finishes:
    every epoch once in history.csv, the exact validation AUC well above chance, process 1's last line naming
    process 0, and the run folder holding what a one-process run's holds."""
    run, tmp = tmp_path / "run", tmp_path / "tmp"
    tmp.mkdir()
    chief, other = start_processes(started, demo_shards, run, tmp)
    wait_for_epochs(run, 2, [chief, other])
    other.send_signal(signal.SIGKILL)  # dies without a word (the out-of-memory killer)
    killed = time.monotonic()
    assert chief.wait(timeout=120) == 2, output(chief)
    waited = time.monotonic() - killed  # its connection to process 0 closed at once (JAX's heartbeat: 100 s)
    said = output(chief).strip().splitlines()
    assert said[-1].startswith("train.fit: error: process 0: process 1 ended before the job did"), said[-3:]
    assert "--resume on every process" in said[-1] and "Traceback" not in output(chief) and waited < 30
    assert not (run / run_files.MODEL).exists() and (run / run_files.BACKUP).exists()
    first = next(line for line in said if line.startswith("train.fit: "))
    assert first == "train.fit: Keras 3 on JAX, process 0 of 2, 8 CPU devices in all (4 on this one, XLA host devices)"
    assert not [line for line in said if line.startswith(("E0000", "W0000", "F0000"))]  # absl's noise

    one = [*ARGS[:2], "--strategy", "cpu", "--replicas", "8", *ARGS[6:], "--epochs", str(EPOCHS), "--resume"]
    alone = subprocess.run(dies_with_this_process("train.fit", "--records", demo_shards, "--run", str(run), *one),
                           cwd=ROOT, env=one_process_env(), capture_output=True, text=True, timeout=300)  # fmt: skip
    assert alone.returncode == 2 and "was started with processes=2, not 1" in alone.stderr, alone.stderr[-2000:]

    chief, other = start_processes(started, demo_shards, run, tmp, "--resume")
    wait_for_epochs(run, 4, [chief, other])
    for proc in (chief, other):
        proc.send_signal(signal.SIGTERM)  # a TPU VM's maintenance event reaches every host
    for proc in (chief, other):
        assert proc.wait(timeout=120) == 143, output(proc)
    lines = [output(p).strip().splitlines()[-1] for p in (chief, other)]
    assert lines[0] == lines[1] and lines[0].startswith("train.fit: terminated (SIGTERM) at epoch "), lines
    assert lines[0].endswith("saved: --resume continues there")  # both at the step they agreed on

    chief, other = start_processes(started, demo_shards, run, tmp, "--resume")
    assert chief.wait(timeout=600) == 0, output(chief)
    assert other.wait(timeout=120) == 0, output(other)
    assert output(other).strip().splitlines()[-1] == "train.fit: process 1 done; process 0, the chief, writes the run"
    history = (run / run_files.HISTORY).read_text().splitlines()[1:]
    assert [int(row.split(",")[0]) for row in history] == list(range(EPOCHS))
    metrics = json.loads((run / run_files.METRICS).read_text())
    assert metrics["backend"] == "jax" and metrics["replicas"] == 8 and metrics["global_batch_size"] == 64
    assert metrics["report"]["roc_auc_macro"] >= 0.7, metrics["report"]  # chance is 0.5
    assert "swa" in metrics and (run / run_files.MODEL_SWA).exists()
    assert len([n for n in os.listdir(tmp) if n.startswith("tfpipe-worker-")]) <= 1  # the killed job's left

    alone = tmp_path / "alone"
    one = [*ARGS[:2], "--strategy", "cpu", "--replicas", "8", *ARGS[6:], "--epochs", "3", "--records", demo_shards]
    done = subprocess.run(dies_with_this_process("train.fit", *one, "--run", str(alone)), cwd=ROOT,
                          env=one_process_env(), capture_output=True, text=True, timeout=600)  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    assert sorted(os.listdir(run)) == sorted(os.listdir(alone))


@pytest.mark.slow
@pytest.mark.serial  # as above
def test_cross_validation_on_two_processes_resumes_after_one_dies_and_process_0_writes_it(
    demo_shards, tmp_path, started
):
    """``train.cv`` on the cluster, folds 0 and 1 one after another: process 1 killed in fold 1 ends process 0 in
    one line; ``--resume`` on both keeps fold 0 (on both: where each fold stands is process 0's reading, not each
    one's race with it), continues fold 1 and scores the OOF predictions of both folds once, written by process
    0; ``--resume`` of the finished CV is refused by both processes in one line each."""
    cv, tmp = tmp_path / "cv", tmp_path / "tmp"
    tmp.mkdir()
    cv_args = ("--fold", "0,1", "--swa-epochs", "0")
    chief, other = start_processes(started, demo_shards, cv, tmp, *cv_args, command="train.cv", epochs=3)
    wait_for_epochs(cv / "fold-1", 1, [chief, other])
    other.send_signal(signal.SIGKILL)
    assert chief.wait(timeout=120) == 2, output(chief)
    said = output(chief).strip().splitlines()
    assert said[-1].startswith("train.cv: error: process 0: process 1 ended before the job did"), said[-3:]
    assert (cv / "fold-0" / run_files.MODEL).exists() and not (cv / "fold-1" / run_files.MODEL).exists()
    kept = (cv / "fold-0" / run_files.MODEL).stat().st_mtime_ns

    chief, other = start_processes(started, demo_shards, cv, tmp, *cv_args, "--resume", command="train.cv", epochs=3)
    assert chief.wait(timeout=600) == 0, output(chief)
    assert other.wait(timeout=120) == 0, output(other)
    for proc in (chief, other):
        lines = output(proc).splitlines()
        assert "train.cv: fold 0 (1 of 2): trained earlier -> " + str(cv / "fold-0") in lines, lines[-5:]
        assert "train.cv: fold 1 (2 of 2): continuing -> " + str(cv / "fold-1") in lines, lines[-5:]
    assert output(other).strip().splitlines()[-1] == "train.cv: process 1 done; process 0, the chief, writes the CV"
    assert (cv / "fold-0" / run_files.MODEL).stat().st_mtime_ns == kept
    history = (cv / "fold-1" / run_files.HISTORY).read_text().splitlines()[1:]
    assert [int(row.split(",")[0]) for row in history] == [0, 1, 2]  # each epoch once
    result = json.loads((cv / "cv.json").read_text())
    assert result["folds"] == [0, 1] and result["replicas"] == 8
    oof = (cv / "oof.csv").read_text().splitlines()[1:]
    assert len(oof) == 400 and len(set(oof)) == 400  # folds 0 and 1 of 800 images in 4: each image once
    scores = result["models"][0]["scores"]
    assert scores["roc_auc_macro"] >= 0.65, scores  # chance is 0.5

    chief, other = start_processes(started, demo_shards, cv, tmp, *cv_args, "--resume", command="train.cv", epochs=3)
    for proc, says in ((chief, "holds a finished cross-validation"), (other, "process 0 refused the CV folder")):
        assert proc.wait(timeout=300) == 2, output(proc)
        last = output(proc).strip().splitlines()[-1]
        assert says in last and "Traceback" not in output(proc), last
    assert (cv / "fold-0" / run_files.MODEL).stat().st_mtime_ns == kept


@pytest.mark.slow
def test_processes_started_unlike_all_refuse_before_training(demo_shards, tmp_path, started):
    """Process 1 given another learning rate: every process refuses in one line before the first step (each
    would otherwise update its copy of the weights differently); nothing is trained or kept."""
    run, tmp = tmp_path / "run", tmp_path / "tmp"
    tmp.mkdir()
    procs = start_processes(started, demo_shards, run, tmp, own=((), ("--lr", "3e-3")))
    for proc in procs:
        assert proc.wait(timeout=300) == 2, output(proc)
        said = output(proc).strip().splitlines()[-1]
        assert "the processes do not start alike" in said and "Traceback" not in output(proc), said
    assert not (run / run_files.HISTORY).exists()


@pytest.mark.parametrize(
    "environ, says",
    [
        ({}, "reads the cluster from KERAS_DISTRIBUTION_JOB_ADDRESSES"),
        ({"KERAS_DISTRIBUTION_NUM_PROCESSES": "2"}, "KERAS_DISTRIBUTION_JOB_ADDRESSES is not set"),
        ({"KERAS_DISTRIBUTION_NUM_PROCESSES": "two"}, "KERAS_DISTRIBUTION_NUM_PROCESSES is 'two'"),
        ({"KERAS_DISTRIBUTION_PROCESS_ID": "2"}, "KERAS_DISTRIBUTION_PROCESS_ID is '2': a whole number, 0..1"),
        ({"KERAS_DISTRIBUTION_JOB_ADDRESSES": "127.0.0.1"}, "not HOST:PORT"),
        ({"KERAS_DISTRIBUTION_JOB_ADDRESSES": "127.0.0.1:1,127.0.0.1:2,127.0.0.1:3"}, "3 addresses for 2 processes"),
        ({"KERAS_DISTRIBUTION_JOB_ADDRESSES": "127.0.0.1:1,127.0.0.1:1"}, "an address twice"),
        ({"KERAS_DISTRIBUTION_JOB_ADDRESSES": "127.0.0.1:\u00b2"}, "not HOST:PORT"),
    ],
)
def test_a_cluster_jax_would_wait_for_is_one_line(monkeypatch, environ, says):
    """Keras' variables checked before JAX starts: a mistyped cluster would have JAX wait five minutes, then
    fail in C++. (Unset: on a machine that is not a TPU pod slice's host.)"""
    from tfpipe.runtime.errors import TfpipeError
    from train.accel.hosts import Cluster, cluster_from_environment

    monkeypatch.setattr("train.accel.hosts.tpu_present", lambda: False)
    full = {
        "KERAS_DISTRIBUTION_JOB_ADDRESSES": "127.0.0.1:1234",
        "KERAS_DISTRIBUTION_NUM_PROCESSES": "2",
        "KERAS_DISTRIBUTION_PROCESS_ID": "1",
    }
    assert cluster_from_environment(full) == Cluster("127.0.0.1:1234", 2, 1)
    given = {} if not environ else {**full, **environ}
    if "KERAS_DISTRIBUTION_JOB_ADDRESSES is not set" in says:
        given.pop("KERAS_DISTRIBUTION_JOB_ADDRESSES")
    with pytest.raises(TfpipeError) as e:
        cluster_from_environment(given)
    assert says in str(e.value) and "\n" not in str(e.value)


# After the guide's recipe: what each process trained to, and make_dataset's line for a batch that does not divide
# over this host's devices, and for an evaluation's last batch that does not (no pad_batches).
RECIPE_CHECKS = """
import numpy as np

weights = float(sum(np.asarray(w, np.float64).sum() for w in model.get_weights()))
print(f"TRAINED {host} {len(history.history['loss'])} {history.history['val_loss'][-1]:.6f} {weights:.6f}")
for wrong in (dict(batch_size=batch + 1, training=True), dict(batch_size=batch, folds=[4]),
              dict(batch_size=batch, folds=[4], drop_remainder=True)):
    try:
        tfpipe.make_dataset(RECORDS, image_size=32, input_context=context, **{"folds": [0, 1, 2, 3], **wrong})
        print("ACCEPTED", wrong)
    except tfpipe.TfpipeError as e:
        print("REFUSED", e)
"""


def run_recipe(tmp_path, example_data, processes):
    """The reading guide's Keras 3 recipe (its ``jax`` block, read from the Markdown), then ``RECIPE_CHECKS``, in
    ``processes`` processes of 8 / ``processes`` XLA host devices each (a cluster at 127.0.0.1 when several),
    in a working folder holding the demo shards; the output of each."""
    from tests.readme_cells import fenced_blocks

    (recipe,) = fenced_blocks(os.path.join(ROOT, "docs", "guides", "reading.md"), "jax")
    shutil.copytree(example_data["shards"], tmp_path, dirs_exist_ok=True)
    script = tmp_path / "recipe.py"
    script.write_text(recipe + RECIPE_CHECKS, encoding="utf-8")
    address = f"127.0.0.1:{free_port()}"
    procs = []
    for index in range(processes):
        env = {k: v for k, v in os.environ.items() if not k.startswith(("KERAS_", "XLA_FLAGS"))}
        env.update(PYTHONPATH=ROOT, XLA_FLAGS=f"--xla_force_host_platform_device_count={8 // processes}")
        if processes > 1:
            env.update(KERAS_DISTRIBUTION_JOB_ADDRESSES=address, KERAS_DISTRIBUTION_NUM_PROCESSES=str(processes),
                       KERAS_DISTRIBUTION_PROCESS_ID=str(index))  # fmt: skip
        procs.append(subprocess.Popen([sys.executable, str(script)], cwd=tmp_path, env=env, text=True,
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT))  # fmt: skip
    outputs = [p.communicate(timeout=600)[0] for p in procs]
    for p, out in zip(procs, outputs):
        assert p.returncode == 0, out[-3000:]
    return outputs


def said(output, word):
    return [line.split(" ", 1)[1] for line in output.splitlines() if line.startswith(word + " ")]


@pytest.mark.slow
def test_own_keras_3_model_recipe_trains_on_8_devices_and_a_wrong_batch_is_one_line(tmp_path, example_data):
    """The guide's recipe on one process of 8 devices: two epochs with a validation of every image (padded), and
    make_dataset's one line for a batch of 33 (not a multiple of 8) and for the validation's last batch of 13
    images without pad_batches (JAX's error in fit otherwise), and that batch taken with drop_remainder=True."""
    (out,) = run_recipe(tmp_path, example_data, 1)
    (trained,) = said(out, "TRAINED")
    assert trained.split()[:2] == ["0", "2"] and "nan" not in trained, out[-2000:]
    refused = said(out, "REFUSED")
    assert len(refused) == 2 and "batch_size 33 does not divide over the 8 devices" in refused[0], out[-2000:]
    assert "does not divide over the 8 devices" in refused[1] and "pad_batches=True" in refused[1], refused
    assert [line for line in said(out, "ACCEPTED") if "'drop_remainder': True" in line], out[-2000:]  # the remedy
    assert "Your input ran out of data" not in out


@pytest.mark.slow
def test_own_keras_3_model_recipe_trains_across_two_processes_alike(tmp_path, example_data):
    """The same recipe in two processes of 4 devices each (Keras' variables, gloo): one JAX program, each
    process its share of the shards; both end with the same weights and validation loss, and each refuses a
    batch that does not divide over its own 4 devices."""
    outputs = run_recipe(tmp_path, example_data, 2)
    trained = [said(out, "TRAINED") for out in outputs]
    assert [t[0].split()[:2] for t in trained] == [["0", "2"], ["1", "2"]], outputs[0][-2000:]
    assert trained[0][0].split()[2:] == trained[1][0].split()[2:]  # one program: the same numbers on both
    for out in outputs:
        assert "batch_size 17 does not divide over the 4 devices" in said(out, "REFUSED")[0], out[-2000:]


def test_process_0_that_cannot_listen_at_the_address_is_one_line():
    """Process 0 hosts JAX's coordination service: at a port already taken (or an address not this machine's),
    JAX's service ends the process with a segmentation fault and no word; checked first, in one line. Another
    process does not listen, and a free port passes."""
    import socket

    from tfpipe.runtime.errors import TfpipeError
    from train.accel.hosts import Cluster, check_listens

    with socket.create_server(("127.0.0.1", 0)) as taken:
        address = f"127.0.0.1:{taken.getsockname()[1]}"
        with pytest.raises(TfpipeError) as e:
            check_listens(Cluster(address, 2, 0))
        assert str(e.value).startswith(f"process 0 cannot listen at {address}") and "port is taken" in str(e.value)
        check_listens(Cluster(address, 2, 1))  # process 1 dials it
    check_listens(Cluster(f"127.0.0.1:{free_port()}", 2, 0))
