"""tfpipe behaves like a library: importing it changes nothing in the host process, optional dependencies are
imported where used, and a missing one is one line naming the pip install (each case in a fresh process)."""

import argparse
import importlib
import json
import os
import subprocess
import sys

import pytest

from tests.conftest import save
from tests.readme_cells import notebook_cells
from tfpipe.runtime.deps import MissingDependency, keras_problem, require

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENV = dict(os.environ, PYTHONPATH=ROOT, TF_CPP_MIN_LOG_LEVEL="2")


def python(code, *args):
    return subprocess.run(
        [sys.executable, "-c", code, *args], capture_output=True, text=True, env=ENV, cwd=ROOT, timeout=300
    )


HOST_STATE = """
import os, sys
import matplotlib
import tensorflow as tf, tf_keras  # the user's own imports come first
from PIL import Image
matplotlib.use("pdf")  # the notebook's choices
Image.MAX_IMAGE_PIXELS = 1234
env = dict(os.environ)

import numpy as np
import tfpipe, tfpipe.write, tfpipe.tf.read, tfpipe.inspect, tfpipe.torch.dataset, tfpipe.writer.images
import train.fit, train.predict, train.keras.plots, train.keras.report
# ... and using it: a header read (the image is above the user's Pillow limit) and a picture
tfpipe.writer.images.read_header(open(sys.argv[1], "rb").read(), "x.jpg")
train.keras.plots.roc_curves(np.array([[0], [1]]), np.array([[0.2], [0.7]]), ["a"], sys.argv[2])
changed = sorted(k for k in set(env) | set(os.environ) if env.get(k) != os.environ.get(k))
print(matplotlib.get_backend(), Image.MAX_IMAGE_PIXELS, changed)
try:
    Image.open(sys.argv[1])
except Image.DecompressionBombError:
    print("user limit enforced")
"""


def test_import_and_use_change_no_host_state(tmp_path):
    image = save(tmp_path / "big.jpg", size=(64, 64))  # 4096 px, more than twice the user's 1234-pixel limit
    done = python(HOST_STATE, str(image), str(tmp_path / "roc.png"))
    assert done.returncode == 0, done.stderr
    assert done.stdout.split("\n")[:2] == ["pdf 1234 []", "user limit enforced"]
    assert (tmp_path / "roc.png").read_bytes()[:4] == b"\x89PNG"


def test_core_imports_without_tensorflow_or_torch():
    done = python(
        "import sys, tfpipe, tfpipe.write, tfpipe.writer.images, tfpipe.sources.source, tfpipe.format.shards\n"
        "print(sorted(m for m in ('tensorflow', 'torch', 'matplotlib') if m in sys.modules))"
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"


# A package hidden from the process (None in sys.modules is what Python does for a module that cannot be imported).
HIDE = "import sys\nfor m in sys.argv[1].split(','): sys.modules[m] = None\n"


def test_writer_without_torch_is_one_line(labeled_folder):
    done = python(
        HIDE + "from tfpipe.write import main\nsys.exit(main(sys.argv[2:]))",
        "torch",
        "--csv",
        labeled_folder["csv"],
        "--images",
        labeled_folder["images"],
        "--out",
        str(labeled_folder["root"] / "out"),
        "--image-size",
        "16",
        "--no-progress",
    )
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [
        "tfpipe.write: error: torch is not installed, and is needed for the writer's DataLoader workers: "
        "pip install 'tfpipe[write]' (or any torch build)"
    ]
    assert not (labeled_folder["root"] / "out").exists() or not os.listdir(labeled_folder["root"] / "out")


# the console script is the same entry point by another door: make test-slow (make test keeps python -m)
@pytest.mark.parametrize("how", ["python -m", pytest.param("console script", marks=pytest.mark.slow)])
def test_fit_without_tf_keras_is_one_line(how, shard_dir, tmp_path):
    """--backend tf without tf-keras: one line saying what to install (auto would take Keras 3 on JAX:
    tests/test_backend.py)."""
    import tensorflow as tf

    args = f"'--records', {shard_dir[0]!r}, '--run', {str(tmp_path / 'run')!r}, '--backend', 'tf'"
    if how == "python -m":
        code = (
            HIDE
            + f"import runpy\nsys.argv = ['train.fit', {args}]\nrunpy.run_module('train.fit', run_name='__main__', alter_sys=True)"
        )
    else:
        code = HIDE + f"sys.argv = ['/venv/bin/tfpipe-fit', {args}]\nfrom train.fit import main\nsys.exit(main())"
    done = python(code, "tf_keras")
    release = ".".join(tf.__version__.split(".")[:2])
    assert done.returncode == 2, done.stderr
    assert "Traceback" not in done.stderr  # TensorFlow's own start-up lines (issue #17) may stand before the error
    assert done.stderr.strip().splitlines()[-1:] == [
        f"train.fit: error: training needs tf-keras of TensorFlow's release {release}, which is not installed: "
        f"pip install 'tf-keras~={release}.0'"
    ]


def test_the_trainer_imports_without_tf_keras_and_what_first_needs_it_raises_import_error():
    """Keras is bound late (``train.backends``): importing the trainer needs no tf-keras; the first thing that
    needs it on the tf backend (here building a model) raises ``MissingDependency`` saying what to install."""
    done = python(
        HIDE + "import train.fit\nfrom train.keras import trainer\nfrom train.keras.models import build_model\n"
        "try:\n    build_model('small-cnn', 2, 32)\nexcept ImportError as e:\n    print(type(e).__name__, '|', e)",
        "tf_keras",
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("MissingDependency | training needs tf-keras"), done.stdout


def test_keras_of_another_release_is_named():
    import tf_keras

    installed = tf_keras.__version__
    assert keras_problem(installed) is None
    other = "2.10.1" if not installed.startswith("2.10.") else "2.11.0"
    assert keras_problem(other) == (
        f"tf-keras {installed} does not match TensorFlow {other} (they must be the same "
        f"release): pip install 'tf-keras~={other.rsplit('.', 1)[0]}.0'"
    )


def test_require_names_the_extra_and_keeps_real_import_errors(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "apache_beam", None)
    with pytest.raises(MissingDependency, match=r"apache_beam is not installed.*pip install 'tfpipe\[beam\]'"):
        require("apache_beam")
    # A package that is there but broken keeps its own error (and traceback): that is not a missing install.
    (tmp_path / "broken_pkg").mkdir()
    (tmp_path / "broken_pkg" / "__init__.py").write_text("import no_such_module_inside\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ModuleNotFoundError, match="no_such_module_inside"):
        require("broken_pkg")


def test_notebook_cells_are_there_and_compile():
    """The notebook cells of docs/guides/notebook.md (executed for real by test_install.py) parse as IPython cells,
    in order; the install cell installs from a folder the user names, not from a placeholder URL."""
    from IPython.core.inputtransformer2 import TransformerManager

    cells = notebook_cells()
    assert len(cells) == 8
    install = cells[0].strip().splitlines()
    assert install[-1] == '%pip install -q "{SOURCE}[train]"'
    assert sum(line.startswith("TFPIPE = ") for line in install) == 1  # the line tests/test_install.py replaces
    for cell in cells:
        compile(TransformerManager().transform_cell(cell), "<notebook cell>", "exec")


COMMANDS = ("tfpipe.write", "tfpipe.inspect", "tfpipe.demo", "train.fit", "train.predict", "train.cv", "train.blend")


@pytest.mark.parametrize("command", COMMANDS)
def test_help_answers_at_once_without_tensorflow_and_shows_defaults(command):
    code = (
        "import sys, time, runpy, contextlib, io\nt = time.process_time()\nout = io.StringIO()\n"
        f"sys.argv = [{command!r}, '--help']\n"
        "with contextlib.redirect_stdout(out):\n"
        "    try:\n"
        f"        runpy.run_module({command!r}, run_name='__main__', alter_sys=True)\n"
        "    except SystemExit:\n        pass\n"
        "print(time.process_time() - t, 'tensorflow' in sys.modules, 'torch' in sys.modules)\n"
        "print(out.getvalue())"
    )
    # The process's CPU time, not the wall clock: beside other tests on a loaded 2-core CI machine the same --help
    # took 3.02 and 3.57 s of wall time. On a second run: `make setup` installs with --no-compile, so in a fresh
    # venv the first run also compiles the bytecode of what it imports, once.
    assert python(code).returncode == 0
    done = python(code)
    assert done.returncode == 0, done.stderr
    first, text = done.stdout.split("\n", 1)
    seconds, tensorflow, torch = first.split()
    assert (tensorflow, torch) == ("False", "False") and float(seconds) < 3.0, first
    assert "usage: python -m " + command in text
    flat = " ".join(text.split())
    for action in importlib.import_module(command).build_parser()._actions:  # every value default is shown
        if action.option_strings and action.default not in (None, False, argparse.SUPPRESS):
            assert f"default: {action.default}" in flat or "default" in (action.help or ""), action.option_strings


def test_tensorflow_start_up_lines_are_held_back_unless_asked_for(shard_dir, tmp_path):
    """A command that starts TensorFlow and then fails (no TPU to connect to): exactly its one error line;
    TFPIPE_VERBOSE=1 shows TensorFlow's own lines again. (A mistyped --run or --records is answered before
    TensorFlow starts: test_a_missing_run_or_shard_folder_is_answered_before_tensorflow_starts.)"""
    env = {k: v for k, v in os.environ.items() if k not in ("TF_CPP_MIN_LOG_LEVEL", "TFPIPE_VERBOSE")}
    cmd = [sys.executable, "-m", "train.fit", "--records", shard_dir[0], "--run", str(tmp_path / "run")]
    cmd += ["--strategy", "tpu"]
    quiet = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT)
    assert quiet.returncode == 2
    [line] = quiet.stderr.strip().splitlines()
    assert line.startswith("train.fit: error: ") and "no TPU found" in line
    loud = subprocess.run(cmd, capture_output=True, text=True, env=dict(env, TFPIPE_VERBOSE="1"), cwd=ROOT)
    assert "absl::InitializeLog()" in loud.stderr and len(loud.stderr.strip().splitlines()) > 1


def test_the_notebook_strategy_cell_says_nothing_of_tensorflows_start_up(tmp_path):
    """Through the Python API as in a notebook (no TF_CPP_MIN_LOG_LEVEL): importing through tfpipe and finding
    the devices print none of TensorFlow's lines (absl's preamble, oneDNN, cuInit, "Using MirroredStrategy"),
    the user's own logging passes, and the environment is left as it was."""
    env = {k: v for k, v in os.environ.items() if k not in ("TF_CPP_MIN_LOG_LEVEL", "TFPIPE_VERBOSE")}
    code = (
        "import logging, os\n"
        "from train.accel.strategy import resolve_strategy\n"
        "strategy, kind = resolve_strategy('auto', replicas=2)\n"
        "print(kind, strategy.num_replicas_in_sync)\n"
        "logging.getLogger('tensorflow').warning('the user says this')\n"
        "import importlib.util\n"  # JAX's own import (TensorFlow's tf.lite makes it) sets a default of 1
        "assert os.environ.get('TF_CPP_MIN_LOG_LEVEL') == ('1' if importlib.util.find_spec('jax') else None)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=dict(env, PYTHONPATH=ROOT),
                          cwd=ROOT, timeout=300)  # fmt: skip
    assert done.returncode == 0 and done.stdout == "cpu 2\n", done.stderr
    assert done.stderr.strip().splitlines() == ["WARNING:tensorflow:the user says this"], done.stderr


@pytest.mark.parametrize(
    "command, args, error",
    [
        (
            "train.predict",
            ["--run", "{tmp}/no-run", "--records", "{shards}"],
            "{tmp}/no-run: no config.json; is this a run folder written by train.fit?",
        ),
        (
            "train.predict",
            ["--run", "{run}", "--records", "{shards}"],
            "{run}/config.json: field 'classes' must list the class names (non-empty strings) (got None); "
            "the run folder was edited or damaged",
        ),
        ("train.fit", ["--records", "{tmp}/none", "--run", "{tmp}/run"], "{tmp}/none: no shard files found"),
    ],
)
def test_a_missing_run_or_shard_folder_is_answered_before_tensorflow_starts(command, args, error, shard_dir, tmp_path):
    """A typo in --run or --records: the one-line error at once, with TensorFlow not importable at all."""
    run = tmp_path / "run-folder"
    run.mkdir()
    (run / "config.json").write_text("{}")  # a damaged run folder is answered as early
    fill = {"tmp": str(tmp_path), "shards": shard_dir[0], "run": str(run)}
    argv = [a.format(**fill) for a in args]
    done = python(HIDE + f"from {command} import main\nsys.exit(main(sys.argv[2:]))", "tensorflow,tf_keras", *argv)
    assert done.returncode == 2, done.stderr
    assert done.stderr.strip().splitlines() == [f"{command}: error: " + error.format(**fill)]


def test_a_python_warning_under_a_command_is_one_line_and_pythons_own_way_after(capsys):
    import warnings

    from tfpipe.runtime.errors import run_cli

    before = warnings.showwarning
    assert run_cli("tfpipe.x", lambda: warnings.warn("the seed fixes nothing of this input", stacklevel=1)) == 0
    assert capsys.readouterr().err == "tfpipe.x: warning: the seed fixes nothing of this input\n"
    assert warnings.showwarning is before


def test_the_stderr_filter_passes_progress_bars_and_drops_whole_noise_lines():
    import threading

    from tfpipe.runtime.console import _forward

    src_r, src_w = os.pipe()
    dst_r, dst_w = os.pipe()
    thread = threading.Thread(target=_forward, args=(src_r, dst_w))
    thread.start()
    for part in (
        b"write train:  50%|##   | 6/12\r",
        b"write train: 100%|#####| 12/12\n",
        b"I0000 00:00:1795412900.936833   27851 port.cc:153] oneDNN custom operations are on.\n",
        b"E0000 00:00:17",
        b"95412900.9 1 cuda_executor.cc:1] failed call to cuInit\n",
        b"2026-11-23 07:13:30.538873: E external/local_xla/xla/stream_executor/cuda/cuda_fft.cc:467] "
        b"Unable to register cuFFT factory\n",  # TensorFlow 2.18 / 2.19
        b"Epoch 1/2\n",
        b"2026-11-24 11:40:01.1: W tensorflow/core/framework/local_rendezvous.cc:404] Local rendezvous is aborting "
        b"with status: OUT_OF_RANGE: End of sequence\n\t [[{{node MultiDeviceIteratorGetNextFromShard}}]]\n",
        b"\t [[{{node MultiDevice",  # the continuation of a noise line, in pieces
        b"IteratorGetNextFromShard}}]]\n",
        b"I0000 00:00:1.0 22996 cudart_stub.cc:31] Could not find cuda drivers\n",
        b"\rwrite test:   0%|     | 0/2",  # a bar right after a held-back line: \r is not an indent
        b"\rwrite test: 100%|#####| 2/2\n",
        b"2026-11-23 07:13:30.531: W tensorf",  # TensorFlow <= 2.19's format, split over two reads
        b"low/core/x.cc:4] a warning\n",
        b"*** Begin stack trace ***\n\ttsl::CurrentStackTrace[abi:cxx11]()\n\t\n\txla::ShapeVerifier::Handle(x)\n",
        b"\t\n*** End stack trace ***\n",  # XLA's trace of a failed compile (train.fit --preflight), blank frames
        b"E0000 00:00:1.0 7 coordination_service_agent.cc:1] Polled an error: UNAVAILABLE: The following tasks are "
        b"unhealthy (stopped sending heartbeats):\n/job:worker/replica:0/task:1\nThe tasks have crashed. Check the "
        b"task logs.\nThe error could be from a previous operation. Restart your program to reset.\n",  # multi-worker
        b'Traceback (most recent call last):\n  File "x.py", line 1\n',  # indented, but after a line we keep
        b"[Gloo] Rank ",  # JAX's CPU collectives as a group connects, written in pieces
        b"3 is connected to 7 peer ranks. Expected number of connected peer ranks is : 7\n",
        b"[Gloo] Rank 3[Gloo] Rank 2 is connected to 7 peer ranks. Expected number of connected peer ranks is : 7\n",
        b" is connected to 7 peer ranks. Expected number of connected peer ranks is : 7\n",  # two threads' lines
        b"tfpipe.write: error: x\n",
    ):
        os.write(src_w, part)
    os.close(src_w)
    thread.join(5)
    os.close(dst_w)
    with os.fdopen(dst_r, "rb") as f:
        got = f.read()
    assert got == (
        b"write train:  50%|##   | 6/12\rwrite train: 100%|#####| 12/12\nEpoch 1/2\n"
        b"\rwrite test:   0%|     | 0/2\rwrite test: 100%|#####| 2/2\n"
        b'Traceback (most recent call last):\n  File "x.py", line 1\ntfpipe.write: error: x\n'
    )


def test_a_quiet_call_holds_back_cpp_log_lines_and_changes_nothing_after(capfd, monkeypatch):
    """fit / predict from Python (a notebook): TensorFlow's C++ lines written to fd 2 while they run are held
    back, everything else passes; the environment and fd 2 are as before afterwards; TFPIPE_VERBOSE=1 shows all."""
    import os

    from tfpipe.runtime.console import quiet_call

    monkeypatch.delenv("TF_CPP_MIN_LOG_LEVEL", raising=False)
    monkeypatch.delenv("TFPIPE_VERBOSE", raising=False)

    @quiet_call
    def work():
        os.write(2, b"I0000 00:00:17.912 123 local_rendezvous.cc:405] Local rendezvous is aborting with status\n")
        os.write(2, b"a line of ours\n")
        return 7

    assert work() == 7
    err = capfd.readouterr().err
    assert "a line of ours" in err and "rendezvous" not in err
    assert "TF_CPP_MIN_LOG_LEVEL" not in os.environ
    os.write(2, b"I0000 00:00:18.000 1 f.cc:1] after the call\n")  # fd 2 is the real one again
    assert "after the call" in capfd.readouterr().err
    monkeypatch.setenv("TFPIPE_VERBOSE", "1")
    work()
    assert "rendezvous" in capfd.readouterr().err


def test_a_thread_that_ends_the_process_under_the_filter_keeps_its_last_line():
    """lifecycle.exit_now from a thread while the main thread is stuck: the line it printed reaches stderr (with
    os._exit alone the filter's thread died first and the line was lost, as rank 0's watch in the Lightning recipe
    found)."""
    code = (
        "import sys, threading, time\n"
        "from tfpipe.runtime import console, lifecycle\n"
        "def end():\n"
        "    print('the last line', file=sys.stderr, flush=True)\n"
        "    lifecycle.exit_now(3)\n"
        "with console.quiet_tensorflow(environment=False):\n"
        "    print('the first line', file=sys.stderr, flush=True)\n"
        "    threading.Timer(0.2, end).start()\n"
        "    time.sleep(30)\n"
    )
    for _ in range(5):  # the loss was a race: several tries
        done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, env=ENV)
        assert (done.returncode, done.stderr.splitlines()) == (3, ["the first line", "the last line"])


def test_each_kind_of_error_a_notebook_can_catch_is_raised_where_it_happens_and_is_one_line(
    shard_dir, tmp_path, capsys
):
    """Issue #62: a handful of ``TfpipeError`` kinds, each from a real cause; every one is still a ``TfpipeError``
    (one line, exit 2 under a command), so nothing that caught ``TfpipeError`` before misses one."""
    import shutil

    from tfpipe.format.manifest import Manifest
    from tfpipe.format.shards import open_shards
    from tfpipe.runtime import errors
    from tfpipe.runtime.deps import require
    from train.accel.strategy import resolve_strategy
    from train.runs.run import RunConfig

    folder = tmp_path / "shards"
    shutil.copytree(shard_dir[0], folder)
    shards = open_shards(str(folder))
    manifest = json.loads((folder / "manifest.json").read_text())
    (folder / "manifest.json").write_text(json.dumps(dict(manifest, dataset_id="0" * len(manifest["dataset_id"]))))
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "config.json").write_text('{"classes": 3}')
    causes = {
        errors.BadSetting: lambda: resolve_strategy("tpuu", 1),
        errors.ShardsChanged: shards.check_unchanged,
        errors.BadFile: lambda: Manifest.load(str(folder)),  # its dataset id edited: the file names its problem
        errors.RunMismatch: lambda: RunConfig.load(str(tmp_path / "run")),
        errors.MissingDependency: lambda: require("tfpipe_no_such_package"),
        errors.NoAccelerator: lambda: resolve_strategy("gpu", 1),
    }
    for kind, cause in causes.items():
        with pytest.raises(kind) as caught:
            cause()
        assert isinstance(caught.value, errors.TfpipeError)
        others = [k for k in causes if k is not kind and isinstance(caught.value, k)]
        assert others == [], (kind, others)

        def command(raise_it=caught.value):
            raise raise_it

        capsys.readouterr()
        assert errors.run_cli("prog", command) == 2
        assert capsys.readouterr().err == f"prog: error: {caught.value}\n", kind
    with pytest.raises(errors.BadFile) as caught:  # the fields, as the writer and the locks read them
        Manifest.load(str(folder))
    bad = caught.value
    assert (bad.path, bad.remedy) == (str(folder / "manifest.json"), "write the shards again")
    assert str(bad) == f"{bad.path}: {bad.problem}; {bad.remedy}" and "no longer matches its dataset_id" in bad.problem
    (folder / "manifest.json").write_text(json.dumps(dict(manifest, split="a; b")))  # "; " inside the problem
    from tfpipe.writer.staging import existing_manifest

    with pytest.raises(errors.BadFile) as caught:
        existing_manifest(str(folder))
    assert str(caught.value) == (
        f"{folder}/manifest.json: field 'split' is not a shard-name prefix (got 'a; b'); tfpipe.write deletes "
        f"nothing a damaged manifest lists -- restore it, or remove {folder} yourself and write again"
    )
