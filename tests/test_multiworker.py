"""Multi-worker Keras (issue #35): ``train.fit --strategy multiworker`` on two workers at 127.0.0.1 (TF_CONFIG),
the chief alone writing the run, a killed worker stopping the other in one line, ``--resume`` finishing the run;
and the cluster settings refused before anything connects."""

import json
import math
import os
import signal
import subprocess
import time

import pytest

from tests.conftest import dies_with_this_process
from tfpipe.runtime.net import free_port
from train.runs import run as run_files

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EPOCHS = 20


def tf_config(addresses, index):
    return json.dumps({"cluster": {"worker": addresses}, "task": {"type": "worker", "index": index}})


def start_workers(started, records, run, tmp, *extra, own=((), ())):
    """``python -m train.fit --strategy multiworker`` twice, one a task of a two-worker cluster on 127.0.0.1 at
    free ports, each dying with this process; output to files (a full pipe would stall a worker). ``own``: each
    worker's own further arguments."""
    addresses = [f"127.0.0.1:{free_port()}", f"127.0.0.1:{free_port()}"]
    args = [
        "--records", records, "--run", str(run), "--strategy", "multiworker", "--model", "small-cnn",
        "--batch-size", "8", "--epochs", str(EPOCHS), "--lr", "1.5e-3", "--steps-per-execution", "4", "--swa-epochs", "2",
        "--seed", "0", "--verbose", "2", *extra,
    ]  # fmt: skip
    workers = []
    for index in range(2):
        out = open(tmp / f"worker{index}-{'resumed' if '--resume' in extra else 'first'}.log", "w+")
        env = {**os.environ, "PYTHONPATH": ROOT, "TF_CONFIG": tf_config(addresses, index), "TMPDIR": str(tmp)}
        proc = subprocess.Popen(
            dies_with_this_process("train.fit", *args, *own[index]),
            cwd=ROOT,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
        )
        proc.log = out
        workers.append(proc)
        started.append(proc)
    return workers


def output(proc):
    proc.log.seek(0)
    return proc.log.read()


def epochs_saved(run):
    path = run / run_files.HISTORY
    return len(path.read_text().splitlines()) - 1 if path.exists() else 0


@pytest.mark.slow
@pytest.mark.serial  # TensorFlow's coordination heartbeats: beside the other slow tests a resumed job lost one once
def test_two_workers_train_stop_together_when_one_dies_and_resume(demo_shards, tmp_path, started):
    """Two workers train the demo; worker 1 killed once the chief has saved 2 epochs ends the chief in one line
    within seconds, nothing of worker 1 left in the run folder; ``--resume`` on both finishes: every epoch once
    in the chief's history, a validation AUC >= 0.85, the run folder holding what a one-machine run's holds."""
    from tests.test_train_contracts import small
    from train.fit import fit

    run, tmp = tmp_path / "run", tmp_path / "tmp"
    tmp.mkdir()
    chief, worker = start_workers(started, demo_shards, run, tmp)
    deadline = time.monotonic() + 300
    while epochs_saved(run) < 2 and chief.poll() is None and time.monotonic() < deadline:
        time.sleep(0.5)
    assert epochs_saved(run) >= 2, output(chief)
    worker.send_signal(signal.SIGKILL)  # dies without a word (the out-of-memory killer); SIGTERM: the test below
    killed = time.monotonic()
    assert chief.wait(timeout=120) == 2, output(chief)
    waited = time.monotonic() - killed  # the chief's next step fails at once: the killed worker's sockets close
    said = output(chief).strip().splitlines()
    assert said[-1].startswith("train.fit: error: worker 0: worker 1 (127.0.0.1:") and "--resume" in said[-1], said[-3:]
    assert "Traceback" not in output(chief) and waited < 60
    assert [line for line in said if "train.fit: " not in line and "Epoch " not in line and " - " not in line] == []
    assert not (run / run_files.MODEL).exists() and (run / run_files.BACKUP).exists()
    saved = epochs_saved(run)

    chief, worker = start_workers(started, demo_shards, run, tmp, "--resume")
    assert chief.wait(timeout=600) == 0, output(chief)
    assert worker.wait(timeout=120) == 0, output(worker)
    assert output(worker).strip().splitlines()[-1] == "train.fit: worker 1 done; worker 0, the chief, writes the run"
    # issue #54: the worker is not silent while it trains (18 epochs or more: well over the heartbeat's 15 s), and
    # the chief traces its step for its one device, not "about 2x as long" for the job's two replicas
    assert "train.fit: worker 1: still training (worker 0, the chief, prints the epochs)" in output(worker)
    assert "traced once per replica" not in output(chief) and "compiling the training step for 2" in output(chief)
    # TensorFlow's reports of the workers gone (worker 1 ends before the chief's report) are held back
    assert not [line for line in output(chief).splitlines() if line.startswith(("E0000", "W0000", "/job:", "The "))]
    history = (run / run_files.HISTORY).read_text().splitlines()[1:]
    assert [int(row.split(",")[0]) for row in history] == list(range(EPOCHS)) and saved < EPOCHS
    metrics = json.loads((run / run_files.METRICS).read_text())
    assert metrics["replicas"] == 2 and metrics["global_batch_size"] == 16
    assert metrics["strategy_class"] in ("MultiWorkerMirroredStrategy", "CollectiveAllReduceStrategy")  # its alias
    # chance is 0.5; the exact AUC of the saved model, scored by the chief alone (0.92 here, 2026-11-27)
    assert metrics["report"]["roc_auc_macro"] >= 0.85, metrics["report"]
    assert "swa" in metrics and (run / run_files.MODEL_SWA).exists()
    assert not [n for _, dirs, files in os.walk(run) for n in dirs + files if "workertemp" in n]
    # worker 1's private folders: the resumed job's removed; the killed job's left (nothing could remove it)
    assert len([n for n in os.listdir(tmp) if n.startswith("tfpipe-worker-")]) <= 1

    alone = fit(small((demo_shards,), tmp_path / "alone", swa_epochs=1, epochs=1, report=True)).metrics
    assert alone["epochs"] == 1
    assert sorted(os.listdir(run)) == sorted(os.listdir(tmp_path / "alone"))


@pytest.mark.parametrize(
    "tf_config, says",
    [
        (None, "reads the cluster from TF_CONFIG, which is not set"),
        ("{cluster", "TF_CONFIG is not JSON"),
        ('{"cluster": {"worker": ["127.0.0.1:1"], "ps": ["127.0.0.1:2"]}, "task": {"type": "worker"}}', "'ps' tasks"),
        ('{"cluster": {"worker": ["127.0.0.1:1"]}, "task": {"type": "worker", "index": 1}}', "task index is 1"),
        ('{"cluster": {"worker": ["127.0.0.1:1"]}, "task": {"type": "worker"}}', "task index is None"),
        ('{"cluster": {"worker": ["127.0.0.1:1", "127.0.0.1:1"]}, "task": {"type": "worker"}}', "twice"),
        ('{"cluster": {"worker": ["127.0.0.1"]}, "task": {"type": "worker"}}', "not HOST:PORT"),
        ('{"cluster": {"worker": ["127.0.0.1:1"]}, "task": {"type": "chief"}}', "task type is 'chief'"),
        ('{"cluster": {"worker": ["127.0.0.1:\u00b2"]}, "task": {"type": "worker"}}', "not HOST:PORT"),  # ² isdigit
        ('{"cluster": {"worker": ["127.0.0.1:\u0662\u0663"]}, "task": {"type": "worker"}}', "not HOST:PORT"),
        ('{"cluster": {"chief": [], "worker": ["127.0.0.1:1"]}, "task": {"type": "worker"}}', "'chief': a list"),
        ('{"cluster": {"worker": ["127.0.0.1:1"]}, "task": {"type": "worker"}, "rpc_layer": "x"}', '"rpc_layer"'),
    ],
)
def test_a_cluster_tensorflow_would_wait_for_is_one_line(shard_dir, tmp_path, monkeypatch, capsys, tf_config, says):
    """A missing or mistyped TF_CONFIG is refused before TensorFlow connects (it would wait for the cluster
    forever); nothing is written."""
    from train.fit import main

    if tf_config is None:
        monkeypatch.delenv("TF_CONFIG", raising=False)
    else:
        monkeypatch.setenv("TF_CONFIG", tf_config)
    run = tmp_path / "run"
    assert main(["--records", shard_dir[0], "--run", str(run), "--strategy", "multiworker"]) == 2
    err = capsys.readouterr().err.strip()
    assert says in err and len(err.splitlines()) == 1, err
    assert not run.exists()


@pytest.mark.parametrize(
    "args, says",
    [
        (["--strategy", "multiworker", "--replicas", "2"], "--replicas sets virtual CPU replicas"),
        (["--strategy", "multiworker", "--data-service", "grpc://127.0.0.1:1"], "one trainer consumes a service"),
        (["--strategy", "multiworker", "--run", __file__], "is a file; --run names a folder"),  # a lone worker waited
    ],
)
def test_multiworker_settings_are_checked_before_connecting(shard_dir, tmp_path, monkeypatch, capsys, args, says):
    from train.fit import main

    monkeypatch.setattr("train.accel.cluster.connect", lambda: pytest.fail("connected: it would wait for worker 1"))
    monkeypatch.setenv("TF_CONFIG", tf_config([f"127.0.0.1:{free_port()}", f"127.0.0.1:{free_port()}"], 0))
    assert main(["--records", shard_dir[0], "--run", str(tmp_path / "run"), *args]) == 2  # a later --run wins
    err = capsys.readouterr().err.strip()
    assert says in err and len(err.splitlines()) == 1, err


def test_workers_of_uneven_shares_validate_the_same_steps_and_every_record_once(shard_dir):
    """Three input pipelines (workers) whose shares of the validation files differ (4 files: 2, 1 and 1): each
    yields the steps the largest share needs (padding weighted 0), so no worker stops before its last record or
    waits for batches that never come, and together they hold every record once. The steps from the total (what
    the trainer used before) are fewer."""
    import tensorflow as tf

    import tfpipe
    from tfpipe.tf.batches import evaluation_steps

    shards = tfpipe.open_shards(shard_dir[0], [0, 1])
    assert len(shards.files) == 4 and shards.num_examples == 20
    names, steps = [], []
    for pipeline in range(3):
        ctx = tf.distribute.InputContext(3, pipeline, 3)
        ds = tfpipe.make_dataset(shard_dir[0], 4, folds=[0, 1], pad_batches=True, input_context=ctx, with_ids=True)
        batches = list(ds)
        steps.append(len(batches))
        names += [n for b in batches for n, w in zip(b[3].numpy(), b[2].numpy()) if w == 1]
    most = evaluation_steps(shards, 4, tf.distribute.InputContext(3, 0, 3))
    assert steps == [most] * 3 and most == 3 > math.ceil(20 / (4 * 3))  # 10 records: 3 batches of 4
    assert sorted(names) == sorted(n for b in tfpipe.make_dataset(shard_dir[0], 4, folds=[0, 1], with_ids=True)
                                   for n in b[2].numpy())  # fmt: skip


def test_a_cluster_has_one_input_pipeline_a_worker():
    """The trainer's validation steps count a multi-worker strategy's workers (its class is TensorFlow's
    CollectiveAllReduceStrategy); one machine's strategy has one pipeline."""
    import tensorflow as tf

    from train.accel.strategy import input_pipelines

    class Resolver:
        def cluster_spec(self):
            return tf.train.ClusterSpec({"chief": ["127.0.0.1:1"], "worker": ["127.0.0.1:2", "127.0.0.1:3"]})

    cluster = type("CollectiveAllReduceStrategy", (), {"cluster_resolver": Resolver()})()
    assert input_pipelines(cluster) == 3 and input_pipelines(tf.distribute.get_strategy()) == 1


@pytest.mark.slow
def test_workers_started_unlike_all_refuse_before_training(demo_shards, tmp_path, started):
    """Worker 1 given other settings (more epochs): every worker refuses in one line before training, instead of
    the two training different epochs and waiting for each other's steps; nothing is trained or kept."""
    run, tmp = tmp_path / "run", tmp_path / "tmp"
    tmp.mkdir()
    workers = start_workers(started, demo_shards, run, tmp, own=((), ("--epochs", "3")))
    for proc in workers:
        assert proc.wait(timeout=300) == 2, output(proc)
        said = output(proc).strip().splitlines()[-1]
        assert "the workers do not start alike" in said and "Traceback" not in output(proc), said
    assert not (run / run_files.HISTORY).exists()


def test_predicting_refuses_a_cluster(tmp_path, capsys):
    """Predictions come back in written order from one machine; a multi-worker strategy would return them in
    the workers' order: refused from Python before anything is read, and not offered on the command line."""
    from tfpipe.runtime.errors import TfpipeError
    from train.predict import build_parser, predict

    with pytest.raises(TfpipeError, match="predicting runs on one machine"):
        predict(str(tmp_path / "run"), str(tmp_path / "records"), str(tmp_path / "s.csv"), strategy="multiworker")
    with pytest.raises(SystemExit) as e:
        build_parser().parse_args(["--run", "r", "--records", "x", "--out", "s.csv", "--strategy", "multiworker"])
    assert e.value.code == 2 and "--strategy: invalid choice: 'multiworker'" in capsys.readouterr().err


def test_a_worker_that_cannot_listen_at_its_address_is_one_line(shard_dir, tmp_path):
    """This task's port taken (by a socket on 127.0.0.1 here): TensorFlow's server cannot start, and its
    traceback becomes one line naming the address; nothing is written. A process of its own: the strategy
    would otherwise configure this one's cluster."""
    import socket
    import sys

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        address = f"127.0.0.1:{taken.getsockname()[1]}"
        env = {**os.environ, "PYTHONPATH": ROOT, "TF_CONFIG": tf_config([address], 0)}
        args = ["--records", shard_dir[0], "--run", str(tmp_path / "run"), "--strategy", "multiworker"]
        done = subprocess.run(
            [sys.executable, "-m", "train.fit", *args], env=env, cwd=ROOT, capture_output=True, text=True, timeout=300
        )
    assert done.returncode == 2, done.stderr[-3000:]
    said = f"worker 0 cannot listen at {address} (TF_CONFIG): the port is taken, or the address is not this machine's"
    assert done.stderr.strip() == f"train.fit: error: {said}"
    assert not (tmp_path / "run").exists()


SIGTERM_KEPT = """
import json, os, signal, sys
from tfpipe.runtime.net import free_port
from train.accel.cluster import connect
os.environ["TF_CONFIG"] = json.dumps({"cluster": {"worker": [f"127.0.0.1:{free_port()}"]}, "task": {"type": "worker", "index": 0}})
signal.signal(signal.SIGTERM, lambda *_: print("the user's handler"))
connect()
os.kill(os.getpid(), signal.SIGTERM)
"""

# train.fit's command line, with a callback that sends the process SIGTERM after epoch 2's first step
STOPPED_IN_EPOCH_2 = """
import dataclasses, sys
from tests.test_preemption import SignalInEpoch
from tfpipe.runtime.errors import run_cli
from tfpipe.runtime.lifecycle import exit_now
from train.fit import build_parser, config_from_args, fit
cfg = config_from_args(build_parser().parse_args(sys.argv[1:]))
exit_now(run_cli("train.fit", fit, dataclasses.replace(cfg, callbacks=(SignalInEpoch(1),))))
"""


@pytest.mark.slow  # three processes that join a cluster (two train), about 45 s
def test_sigterm_mid_epoch_on_a_worker_ends_in_a_line_resume_continues_and_a_user_keeps_their_handler(
    shard_dir, tmp_path
):
    """TensorFlow's coordination service takes SIGTERM (a preemption notice) and swallows it: a worker told to
    stop by its job scheduler trained on to its last epoch. ``train.fit`` stops at the step it was at in epoch 2
    of 3 (``--save-every 2``: a backup there), in one line, exit 143; ``--resume`` says ``epoch 2, step 2`` and
    records each epoch once. A Python user's own SIGTERM handler is theirs again once the strategy is made."""
    import sys

    env = {**os.environ, "PYTHONPATH": ROOT, "TF_CONFIG": tf_config([f"127.0.0.1:{free_port()}"], 0)}
    run = tmp_path / "run"
    args = ["--records", shard_dir[0], "--run", str(run), "--strategy", "multiworker", "--model", "small-cnn",
            "--image-size", "32", "--batch-size", "4", "--epochs", "3", "--steps-per-execution", "1",
            "--save-every", "2", "--no-report", "--verbose", "2"]  # fmt: skip
    done = subprocess.run([sys.executable, "-c", STOPPED_IN_EPOCH_2, *args], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=300)  # fmt: skip
    assert done.returncode == 143, done.stderr[-2000:]
    assert done.stderr.strip().splitlines()[-1] == (
        "train.fit: terminated (SIGTERM) at epoch 2, step 2; saved: --resume continues there"
    ), done.stderr[-2000:]
    assert "Traceback" not in done.stderr and epochs_saved(run) == 1
    done = subprocess.run([sys.executable, "-m", "train.fit", *args, "--resume"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    assert "train.fit: resuming at epoch 2, step 2\n" in done.stdout, done.stdout[-2000:]
    assert [line.split(",")[0] for line in (run / "history.csv").read_text().splitlines()[1:]] == ["0", "1", "2"]
    assert json.loads((run / "metrics.json").read_text())["interrupted"] == 1

    env.pop("TF_CONFIG")
    done = subprocess.run([sys.executable, "-c", SIGTERM_KEPT], env=env, cwd=ROOT, capture_output=True, text=True,
                          timeout=120)  # fmt: skip
    assert done.returncode == 0 and done.stdout.strip() == "the user's handler", done.stderr[-2000:]
