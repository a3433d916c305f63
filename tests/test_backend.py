"""Which Keras trains (``train.backends.choice``): auto takes the framework that can use the machine and says why; a
TPU that this TensorFlow cannot drive never trains on the host CPU; a run is predicted by the backend it trained
with. The runs themselves are the ``backends`` tests, run on both backends by ``make test``."""

import os
import subprocess
import sys

import pytest

from tfpipe.runtime.errors import BadSetting, NoAccelerator
from train.backends import choice as backend
from train.backends.choice import Choice

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture
def machine(monkeypatch):
    """A machine described by hand: whether it looks like a TPU VM, the TensorFlow build, what is installed."""

    def describe(tpu=False, tensorflow="tensorflow 2.21.0", tf_keras=True, jax=True, keras_backend=None):
        monkeypatch.setattr(backend, "tpu_present", lambda: tpu)
        monkeypatch.setattr(backend, "tensorflow_build", lambda: tensorflow)
        monkeypatch.setattr(backend, "keras_3_installed", lambda: jax)
        monkeypatch.setattr(backend, "installed", lambda m: {"tf_keras": tf_keras, "jax": jax}.get(m, True))
        monkeypatch.setattr(backend, "keras_backend_set", lambda: keras_backend or "")

    return describe


def test_auto_takes_jax_where_tensorflow_cannot_use_the_tpu_or_tf_keras_is_missing(machine):
    """Kaggle's TPU v5e image: tensorflow-cpu, Keras 3, jax[tpu], no tf-keras -> jax, saying why; a TPU VM with
    tensorflow-tpu, or a GPU machine with tf-keras, keeps today's tf."""
    machine(tpu=True, tensorflow="tensorflow-cpu 2.20.0", tf_keras=False)
    kaggle = backend.choose("auto")
    assert kaggle == Choice("jax", "a TPU machine whose TensorFlow (tensorflow-cpu 2.20.0) has no TPU support")
    assert kaggle.words == "Keras 3 on JAX"
    machine(tpu=True, tensorflow="tensorflow-tpu 2.18.0")
    assert backend.choose("auto") == Choice("tf")
    machine(tf_keras=False)
    assert backend.choose("auto") == Choice("jax", "tf-keras is not installed; Keras 3 and JAX are")
    machine(keras_backend="jax")
    assert backend.choose("auto") == Choice("jax", "KERAS_BACKEND is jax")
    machine(keras_backend="jax")
    assert backend.choose("auto", strategy=object()) == Choice("tf", "a tf.distribute strategy was given")
    machine(tpu=True, tensorflow="tensorflow-cpu 2.20.0", jax=False)
    assert backend.choose("auto") == Choice("tf")  # and use_backend says what works (below)
    assert backend.choose("jax") == Choice("jax") and backend.choose("tf") == Choice("tf")
    with pytest.raises(BadSetting, match="^unknown backend 'torch': use one of auto, tf, jax$"):
        backend.choose("torch")


def test_the_tf_path_on_a_tpu_its_tensorflow_cannot_drive_is_one_line_naming_what_works(machine):
    machine(tpu=True, tensorflow="tensorflow-cpu 2.20.0")
    for strategy in ("tpu", "auto"):
        with pytest.raises(NoAccelerator) as e:
            backend.use_backend(Choice("tf"), strategy)
        assert str(e.value) == (  # said in Python's words outside a command (the command's: the next test)
            "this TensorFlow build (tensorflow-cpu 2.20.0) has no TPU support, so the TPU here cannot train with "
            "backend='tf': use backend='jax' (Keras 3 on JAX), or install the matching tensorflow-tpu and libtpu "
            "pair (or strategy='cpu' for the host CPU)"
        )
    backend.use_backend(Choice("tf"), "cpu")  # the host CPU, asked for: allowed


def test_a_run_is_predicted_with_its_own_backend():
    assert backend.for_run("auto", "jax", "runs/b0") == Choice("jax", "the run's own backend", "runs/b0")
    assert backend.for_run("tf", "tf", "runs/b0") == Choice("tf", "", "runs/b0")
    with pytest.raises(BadSetting) as e:
        backend.for_run("tf", "jax", "runs/b0")
    assert str(e.value) == (
        "runs/b0 was trained with backend='jax' (Keras 3 on JAX), whose model file tf-keras on TensorFlow does not "
        "load: predict it with backend='jax' (or auto)"
    )


def test_a_tf_run_on_a_tpu_its_tensorflow_cannot_drive_is_sent_to_the_cpu_not_to_jax(machine):
    """Predicting (or continuing) a tf-keras run where TensorFlow cannot drive the TPU: --backend jax would refuse
    its model file, so the way out named is the host CPU or a TensorFlow that drives the TPU."""
    machine(tpu=True, tensorflow="tensorflow-cpu 2.20.0")
    with pytest.raises(NoAccelerator) as e:
        backend.use_backend(backend.for_run("auto", "tf", "runs/b0"), "auto")
    assert str(e.value) == (
        "runs/b0 was trained with backend='tf' (tf-keras on TensorFlow), whose model file only tf-keras loads, and "
        "this TensorFlow build (tensorflow-cpu 2.20.0) has no TPU support: use strategy='cpu' (the host CPU), or "
        "install the matching tensorflow-tpu and libtpu pair"
    )
    assert "jax" not in str(e.value)


def test_resume_with_auto_continues_a_run_on_the_backend_it_started_with(trained_run, tmp_path, machine):
    """--resume with --backend auto takes the run's own backend (config.json's), not what auto would choose for a
    new run; a new folder, a backend asked for, or a notebook's devices keep today's choice."""
    import json
    import shutil

    machine(tf_keras=False)  # auto would choose jax for a new run
    run = tmp_path / "run"
    shutil.copytree(trained_run[0], run)
    assert backend.resumed("auto", "cpu", str(run)) == Choice("tf", "the run's own backend", str(run))
    config = json.loads((run / "config.json").read_text())
    config["backend"] = "jax"  # config.json keeps the settings at its top level
    (run / "config.json").write_text(json.dumps(config))
    assert backend.resumed("auto", "cpu", str(run)) == Choice("jax", "the run's own backend", str(run))
    assert backend.resumed("auto", "cpu", str(tmp_path / "new")) is None
    assert backend.resumed("tf", "cpu", str(run)) is None and backend.resumed("auto", object(), str(run)) is None


def test_host_devices_are_asked_of_xla_once_and_kept_with_the_users_flags(monkeypatch):
    monkeypatch.setattr(backend, "jax_started", lambda: False)
    monkeypatch.setenv("XLA_FLAGS", "--xla_dump_to=/tmp/x --xla_force_host_platform_device_count=2")
    backend.ask_host_devices(8)
    assert os.environ["XLA_FLAGS"] == "--xla_dump_to=/tmp/x --xla_force_host_platform_device_count=8"
    backend.ask_host_devices(4)  # 8 are enough for 4
    assert os.environ["XLA_FLAGS"].endswith("=8")


def run_fit(*flags, env):
    own = {k: v for k, v in os.environ.items() if k not in ("KERAS_BACKEND", "XLA_FLAGS")}  # this test's backend's
    return subprocess.run(
        [sys.executable, "-m", "train.fit", *flags],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env={**own, "PYTHONPATH": ROOT, **env},
        timeout=300,
    )


def test_a_tpu_machine_whose_tensorflow_has_no_tpu_support_never_trains_on_its_cpu(shard_dir, tmp_path):
    """A process that looks like a TPU VM (the environment Kaggle's TPU image sets) with this machine's
    TensorFlow (no TPU support) and no TPU JAX can see: --backend tf is one line naming --backend jax, and auto
    (jax) one line saying nothing trains on the host CPU unless --strategy cpu asks -- exit 2, no traceback."""
    env = {"TPU_ACCELERATOR_TYPE": "v5litepod-8"}
    flags = ("--records", shard_dir[0], "--run", str(tmp_path / "run"), "--model", "small-cnn")
    r = run_fit(*flags, "--backend", "tf", env=env)
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr[-2000:]
    assert (
        r.stderr.strip()
        .splitlines()[-1]
        .startswith(
            "train.fit: error: this TensorFlow build (tensorflow 2.21.0) has no TPU support, so the TPU here cannot "
            "train with --backend tf: use --backend jax"
        )
    )
    r = run_fit(*flags, env=env)
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr[-2000:]
    assert r.stderr.strip().splitlines()[-1] == (
        "train.fit: error: a TPU machine, but JAX sees no TPU (install jax[tpu], whose libtpu drives it); nothing "
        "trains on the host CPU unless --strategy cpu asks for it"
    )
    assert not (tmp_path / "run").exists()


@pytest.mark.backends
def test_complete_makes_a_mixin_a_class_of_the_processs_keras_whose_super_reaches_keras(tmp_path):
    """``train.backends.complete``: the mixin first, then its Keras class; made once, under the mixin's module and
    name (what a model file says), registered as before; a mixin's ``super()`` reaches the Keras class (the
    history log writes its row through Keras' CSVLogger)."""
    from types import SimpleNamespace

    from tests.conftest import backend_keras
    from train.backends import complete
    from train.keras.backup import StepGroups
    from train.keras.callbacks import HistoryLog, Throughput
    from train.keras.compiling import F1Score
    from train.keras.schedules import OneCycle

    keras = backend_keras()
    throughput = complete(Throughput)(8)
    assert all(isinstance(throughput, c) for c in (Throughput, StepGroups, keras.callbacks.Callback))
    assert complete(Throughput) is type(throughput) is complete(type(throughput))
    assert (type(throughput).__module__, type(throughput).__qualname__) == ("train.keras.callbacks", "Throughput")
    assert keras.utils.get_registered_name(complete(F1Score)) == "tfpipe>F1Score"
    assert keras.utils.get_registered_name(complete(OneCycle)) == "OneCycle"  # not registered: custom_objects holds it
    log = complete(HistoryLog)(str(tmp_path / "history.csv"), append=True)
    log.set_model(SimpleNamespace(stop_training=False))
    log.on_train_begin()
    assert not (tmp_path / "history.csv").exists()  # opened at the first epoch's end
    log.on_epoch_end(0, {"loss": 0.5})
    log.on_train_end()
    header, row = (tmp_path / "history.csv").read_text().splitlines()
    assert header.startswith("epoch,loss") and row.startswith("0,0.5")  # tf-keras adds val_loss (NA)
