"""tfpipe as users install it: the built wheel in a fresh venv that already holds *their* TensorFlow.

Each case makes a venv with a user's TensorFlow (+ tf-keras, or Keras 3 and JAX) + torch already installed (as a
Kaggle, Colab or TPU-VM image has them), installs the wheel with the ``[train]`` extra (``[train,jax]`` but in the
oldest case), checks that none of
those packages (nor numpy) was replaced, and runs demo data -> write -> fit on 8 CPU replicas with
``steps_per_execution`` -> predict through the installed commands, from a folder outside the repository with
no ``PYTHONPATH``. The Kaggle TPU case is that image as Kaggle builds it (tensorflow-cpu 2.20, Keras 3, jax 0.7.2,
no tf-keras): its run is Keras 3 on JAX, and it also executes the notebook cells of docs/guides/notebook.md. The
newest case adds the newest jax for this Python ([jax]) and starts it under Keras 3 (training on it is the JAX pass
of make test-slow, in the lock's venv: the same versions), and installs the package the way Beam's
``--setup_file`` stages it for Dataflow workers and runs the multi-process DirectRunner.

Slow (a few minutes per case; installs from the package registry): ``make test-install``, run by CI.
"""

import json
import os
import re
import shutil
import subprocess
import sys

import pytest

import tfpipe
from tests.readme_cells import TEST_PARAMETERS, notebook_cells

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
pytestmark = pytest.mark.install


def _lock(name):
    """The version requirements.txt pins for ``name``."""
    with open(os.path.join(ROOT, "requirements.txt")) as f:
        return re.search(rf"^{re.escape(name)}==(\S+)$", f.read(), re.M).group(1)


# What the user's image already has: the oldest TensorFlow + tf-keras we support; Kaggle's TPU v5e image (its
# docker-python tpu/requirements.in: tensorflow-cpu 2.20, keras>3, the jax its libtpu pin holds, no tf-keras; Keras
# 3.10, the oldest that TensorFlow 2.20 and tfpipe's [jax] take); the newest pinned.
CASES = {
    "oldest": ("tensorflow==2.18.1", "tf-keras==2.18.0"),
    "kaggle-tpu": ("tensorflow-cpu==2.20.0", "keras==3.10.0", "jax==0.7.2", "jaxlib==0.7.2"),
    "newest": (f"tensorflow=={_lock('tensorflow')}", f"tf-keras=={_lock('tf-keras')}"),
}
BACKEND = {"oldest": "tf", "kaggle-tpu": "jax", "newest": "tf"}  # what --backend auto trains with there
TORCH = _lock("torch")  # a CPU build is on this machine's disk; the user's image has its own torch
PACKAGE_FILES = ("pyproject.toml", "setup.py", "README.md", "tfpipe", "train")
KEPT = ("tensorflow", "tensorflow-cpu", "tf-keras", "keras", "jax", "jaxlib", "torch", "numpy")  # never replaced
START_UP_WORDS = ("cuInit", "cudart", "cuFFT", "cuDNN", "cuBLAS", "oneDNN", "InitializeLog")  # whatever the format


def run(cmd, cwd, env, timeout=900, quiet=False):
    """Runs ``cmd`` and returns its stdout; a failure shows the command's own output. ``quiet``: one of our
    commands, which shows none of TensorFlow's start-up lines, in this TensorFlow release's format either."""
    from tfpipe.runtime.console import NOISE

    done = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, (
        f"{' '.join(map(str, cmd))} -> {done.returncode}\n{done.stdout[-3000:]}\n{done.stderr[-5000:]}"
    )
    noise = [
        line
        for line in done.stderr.splitlines()
        if NOISE.match(line.encode()) or any(word in line for word in START_UP_WORDS)
    ]
    assert not (quiet and noise), f"{' '.join(map(str, cmd))} showed TensorFlow's start-up lines: {noise[:3]}"
    return done.stdout


@pytest.fixture(scope="module")
def wheel(tmp_path_factory):
    """The package built as a wheel (what ``pip install .`` or an index installs), from a copy of the files a
    build reads, so the build leaves nothing (build/, *.egg-info) in the checkout."""
    src, out = tmp_path_factory.mktemp("src"), tmp_path_factory.mktemp("wheel")
    for name in PACKAGE_FILES:
        copy = shutil.copytree if os.path.isdir(os.path.join(ROOT, name)) else shutil.copy
        copy(os.path.join(ROOT, name), src / name)
    run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--quiet", "-w", str(out), str(src)], ROOT, os.environ)
    (path,) = out.glob("tfpipe-*.whl")
    return str(path)


def test_the_wheel_carries_its_type_hints(wheel):
    """PEP 561: ``py.typed`` in both packages, so a user's mypy or pyright checks calls into tfpipe and train."""
    import zipfile

    names = set(zipfile.ZipFile(wheel).namelist())
    assert {"tfpipe/py.typed", "train/py.typed"} <= names
    assert {"tfpipe/format/schema.py", "tfpipe/tf/read.py", "tfpipe/torch/__init__.py"} <= names and any(
        n.endswith(f"{tfpipe.__version__}.dist-info/METADATA") for n in names
    )


def user_env(venv):
    """The environment of a user's shell in ``venv``: its bin first, nothing of this repository on the path."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env["PATH"] = f"{venv}/bin:{env['PATH']}"
    env["TF_CPP_MIN_LOG_LEVEL"] = "2"
    # A user's image holds the bytecode of its packages; these venvs are installed with --no-compile, so let Python
    # write it on first import (a shell with PYTHONDONTWRITEBYTECODE would recompile TensorFlow in every process).
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    return env


def make_user_venv(path, packages):
    """A fresh venv holding what the user's image already had: ``packages`` (TensorFlow and its Keras), torch, and
    a current pip (as a notebook image has; Python 3.11's bundled pip is 23.2)."""
    run([sys.executable, "-m", "venv", str(path)], ROOT, os.environ)
    env = user_env(path)
    run(["python", "-m", "pip", "install", "--quiet", "--upgrade", "pip"], str(path), env)
    # --no-compile: the image's own packages need no bytecode written ahead (Python writes it for what is imported,
    # user_env allows it); it saves compiling TensorFlow's and torch's ~20,000 modules per venv. tfpipe itself is
    # installed as users do.
    image = [*packages, f"torch=={TORCH}"]
    run(["pip", "install", "--quiet", "--no-compile", *image], str(path), env)
    return env


def versions(env, cwd):
    listed = json.loads(run(["pip", "list", "--format", "json"], cwd, env))
    return {p["name"].lower().replace("_", "-"): p["version"] for p in listed}  # tensorflow_cpu: tensorflow-cpu


def write_fit_predict(work, env):
    """Demo data -> shards -> 8-replica training with steps_per_execution 2 -> submission, via the installed commands
    (``--backend auto``: the one the image's packages make)."""
    write_shards(work, env)
    run = "run-auto"
    train(
        [
            "python",
            "-m",
            "train.fit",
            "--records",
            "records/train",
            "--run",
            run,
            "--backend",
            "auto",
            "--strategy",
            "cpu",
            "--replicas",
            "8",
            "--steps-per-execution",
            "2",
            "--model",
            "small-cnn",
            "--batch-size",
            "2",
            "--epochs",
            "1",
            "--verbose",
            "0",
        ],
        work,
        env,
    )
    # A fresh process on 8 replicas: nothing may start TensorFlow's (or JAX's) devices before the strategy is made.
    train(
        ["tfpipe-predict", "--run", run, "--records", "records/test", "--out", f"{run}.csv", "--strategy", "cpu",
         "--replicas", "8"],
        work,
        env,
    )  # fmt: skip
    with open(os.path.join(work, run, "metrics.json")) as f:
        metrics = json.load(f)
    with open(os.path.join(work, f"{run}.csv")) as f:
        rows = f.read().splitlines()
    with open(os.path.join(work, "data", "test.csv")) as f:
        test_ids = [line.split(",")[0] for line in f.read().splitlines()[1:]]
    return metrics, rows, test_ids


# The newest case's [jax] under Keras 3: the backend, the versions pip resolved, and the 8 host devices of a dry run.
JAX_STARTS = "import jax, keras; print(keras.backend.backend(), jax.__version__, keras.__version__, len(jax.devices()))"


def train(cmd, work, env):
    run(cmd, work, env, quiet=True)


def write_shards(work, env):
    """The demo data and its shards, through the installed commands."""
    run(["tfpipe-demo", "data", "--train", "96", "--test", "16"], work, env, quiet=True)
    run(
        [
            "python",
            "-m",
            "tfpipe.write",
            "--csv",
            "data/train.csv",
            "--images",
            "data/images",
            "--out",
            "records/train",
            "--image-size",
            "32",
            "--num-folds",
            "3",
            "--no-progress",
        ],
        work,
        env,
        quiet=True,
    )
    run(
        [
            "tfpipe-write",
            "--csv",
            "data/test.csv",
            "--images",
            "data/images",
            "--out",
            "records/test",
            "--split",
            "test",
            "--unlabeled",
            "--image-size",
            "32",
            "--no-progress",
        ],
        work,
        env,
        quiet=True,
    )


@pytest.mark.parametrize("case", list(CASES))
def test_wheel_next_to_users_tensorflow(case, wheel, tmp_path):
    venv, work = tmp_path / "venv", tmp_path / "work"
    work.mkdir()
    env = make_user_venv(venv, CASES[case])
    before = versions(env, str(work))
    extras = "train" if case == "oldest" else "train,jax"  # the newest: the newest jax for this Python, added
    run(["pip", "install", "--quiet", f"{wheel}[{extras}]"], str(work), env)
    after = versions(env, str(work))
    assert {k: after.get(k) for k in KEPT if k in before} == {k: before[k] for k in KEPT if k in before}
    assert all(after[p.split("==")[0]] == p.split("==")[1] for p in CASES[case])  # the image's own, kept
    assert ("tf-keras" in after) == (case != "kaggle-tpu")

    # The installed package answers, from outside the repository; a train.py in the folder does not shadow it.
    where = run(
        ["python", "-c", "import tfpipe, train.fit; print(tfpipe.__file__); print(train.fit.__file__)"], str(work), env
    )
    assert all(str(venv) in line for line in where.split()), where
    shadowed = work / "project"
    shadowed.mkdir()
    (shadowed / "train.py").write_text("print('a user script')\n")
    assert "--replicas" in run(["tfpipe-fit", "--help"], str(shadowed), env)

    metrics, rows, test_ids = write_fit_predict(str(work), env)
    assert metrics["backend"] == BACKEND[case]
    assert (metrics["replicas"], metrics["steps_per_execution"]) == (8, 2)
    assert metrics["optimizer_steps"] == metrics["steps_per_epoch"] >= 2  # every step ran: 2 per execution
    assert rows[0] == "image,labels" and [r.split(",")[0] for r in rows[1:]] == test_ids

    if case == "kaggle-tpu":
        notebook_cells_in_a_notebook(venv, env, work)
    if case == "newest":
        jax_env = dict(env, KERAS_BACKEND="jax", XLA_FLAGS="--xla_force_host_platform_device_count=8")
        started = run(["python", "-c", JAX_STARTS], str(work), jax_env)
        assert started.split() == ["jax", after["jax"], after["keras"], "8"], started
        beam_workers_from_setup_file(env, work)


# The notebook cells (docs/guides/notebook.md) ----------------------------------------------------------------
# The install cell's TFPIPE becomes a folder holding a copy of the repository's package files (what a Kaggle dataset
# of the repository holds); the parameters cell is followed by TEST_PARAMETERS, which point it at a tiny demo dataset.
TFPIPE_SETTING = re.compile(r"^TFPIPE = .*$", re.M)
DEVICES_FIRST = "import jax\nprint(jax.devices())"  # JAX's devices made first (the case's backend: jax)


def notebook(cells, tfpipe_folder):
    import nbformat

    sources = [TFPIPE_SETTING.sub(lambda _: f"TFPIPE = {str(tfpipe_folder)!r}", c) for c in cells]
    assert sum(a != b for a, b in zip(sources, cells)) == 1, "the install cell names no TFPIPE folder"
    return nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(s) for s in sources])


def execute(nb_path, cwd, env):
    """Executes a notebook in a kernel of the venv (nbclient runs there); returns the executed cells."""
    script = (
        "import nbformat, nbclient, sys\n"
        "nb = nbformat.read(sys.argv[1], as_version=4)\n"
        "nbclient.NotebookClient(nb, timeout=900, allow_errors=True, kernel_name='python3').execute()\n"
        "nbformat.write(nb, sys.argv[1])\n"
    )
    run(["python", "-c", script, str(nb_path)], cwd, env, timeout=1800)
    import nbformat

    return nbformat.read(str(nb_path), as_version=4).cells


def errors(cell):
    return [f"{o['ename']}: {o['evalue']}" for o in cell.get("outputs", []) if o["output_type"] == "error"]


def notebook_cells_in_a_notebook(venv, env, work):
    import nbformat

    work = work / "notebook"  # its own folder: the submission.csv of the command-line run is of other records
    work.mkdir()
    run(["pip", "install", "--quiet", "nbclient", "ipykernel"], str(work), env)
    run(["pip", "uninstall", "--yes", "--quiet", "tfpipe"], str(work), env)  # the install cell must bring it back
    install, parameters, strategy, *rest = notebook_cells()
    folder = work / "kaggle-input" / "tfpipe"  # the repository as a Kaggle dataset holds it
    folder.mkdir(parents=True)
    for name in PACKAGE_FILES:
        copy = shutil.copytree if os.path.isdir(os.path.join(ROOT, name)) else shutil.copy
        copy(os.path.join(ROOT, name), folder / name)
    # A fresh kernel: every notebook cell runs without an error.
    nb = notebook([install, parameters, TEST_PARAMETERS, strategy, *rest], folder)
    nbformat.write(nb, str(work / "readme.ipynb"))
    executed = execute(work / "readme.ipynb", str(work), env)
    assert [errors(c) for c in executed] == [[]] * len(executed)
    assert "ERROR" not in "".join(o.get("text", "") for o in executed[0].outputs)  # %pip prints, never raises
    origin = run(
        [
            "python",
            "-c",
            "import importlib.metadata as m; print(m.distribution('tfpipe').read_text('direct_url.json'))",
        ],
        str(work),
        env,
    )
    origin = json.loads(origin)  # installed by the cell, from its copy of the folder, not editable
    assert origin["url"].startswith("file://") and origin["url"].endswith("/tfpipe"), origin
    assert "dir_info" in origin and not origin["dir_info"].get("editable"), origin
    with open(work / "submission.csv") as f:
        rows = f.read().splitlines()
    with open(work / "submission-cv.csv") as f:  # cell 8: the fold ensemble of two folds' runs
        ensemble = f.read().splitlines()
    assert len(rows) == 1 + 8 and [r.split(",")[0] for r in ensemble] == [r.split(",")[0] for r in rows]
    assert "OOF AUC" in "".join(o.get("text", "") for o in executed[-1].outputs)
    # A kernel where JAX already made its devices: the devices cell says what to do instead of silently training
    # on one device.
    nb = notebook([DEVICES_FIRST, install, parameters, TEST_PARAMETERS, strategy], folder)
    nbformat.write(nb, str(work / "dirty.ipynb"))
    executed = execute(work / "dirty.ipynb", str(work), env)
    assert [errors(c) for c in executed[:-1]] == [[]] * (len(executed) - 1)
    (message,) = errors(executed[-1])
    assert message.startswith("TfpipeError") and "restart the kernel" in message, message


# Beam's --setup_file, as Dataflow stages it for its workers ---------------------------------------------------
def beam_workers_from_setup_file(env, work):
    """Builds the package with Beam's own stager from the README's ``--setup_file``, installs that (what a Dataflow
    worker does) with Beam, and writes with the multi-process DirectRunner: the workers import the installed
    tfpipe (no repository on their path) and write the same bytes as the default runner."""
    staged = work / "staged"
    stage = (
        "import sys\n"
        "from apache_beam.options.pipeline_options import PipelineOptions\n"
        "from apache_beam.runners.portability.stager import Stager\n"
        "Stager.create_job_resources(PipelineOptions(['--setup_file', sys.argv[1]]), sys.argv[2])\n"
    )
    staged.mkdir()
    run([sys.executable, "-c", stage, os.path.join(ROOT, "setup.py"), str(staged)], ROOT, os.environ)
    (sdist,) = staged.glob("tfpipe-*.tar.gz")  # staged for the workers as workflow.tar.gz
    run(["pip", "install", "--quiet", str(sdist), f"apache-beam=={_lock('apache-beam')}"], str(work), env)
    run(
        [
            "python",
            "-m",
            "tfpipe.write",
            "--csv",
            "data/train.csv",
            "--images",
            "data/images",
            "--out",
            "beam",
            "--image-size",
            "32",
            "--num-folds",
            "3",
            "--no-progress",
            "--runner",
            "beam",
            "--",
            "--direct_running_mode=multi_processing",
            "--direct_num_workers=2",
        ],
        str(work),
        env,
    )
    names = sorted(os.listdir(work / "records" / "train"))
    assert sorted(os.listdir(work / "beam")) == names
    for name in names:
        assert (work / "beam" / name).read_bytes() == (work / "records" / "train" / name).read_bytes(), name


# PyTorch/XLA and timm (issue #25) ------------------------------------------------------------------------------
# torch_xla 2.9 needs torch 2.9 (no torch_xla matches the lock's torch 2.13), and timm needs a torchvision built for
# the torch beside it (none matches the lock's CPU torch): a venv as a TPU image has it, with no TensorFlow at all.
XLA_IMAGE = ("torch==2.9.0", "torch-xla==2.9.0", "torchvision==0.24.0", "timm")
AUC = re.compile(r"^validation AUC (\d\.\d+)$", re.M)


@pytest.mark.xla  # several GB of torch 2.9 + CUDA libraries: `make test-xla`, not in CI's time budget
def test_pytorch_xla_and_timm_next_to_a_tpu_images_torch(wheel, tmp_path):
    """The wheel with ``[lightning]`` next to torch 2.9 + torch_xla 2.9 + timm keeps them, writes shards without
    TensorFlow, and ``examples/torch_ddp.py --xla`` learns the demo on an XLA CPU device (``PJRT_DEVICE=CPU``: one
    device; several abort in torch_xla 2.9's CPU all-reduce, docs/guides/torch.md); ``--model resnet18`` trains
    a timm model on 2 processes."""
    venv, work = tmp_path / "venv", tmp_path / "work"
    work.mkdir()
    run([sys.executable, "-m", "venv", str(venv)], ROOT, os.environ)
    env = user_env(venv)
    run(["pip", "install", "--quiet", *XLA_IMAGE], str(work), env, timeout=1800)
    before = versions(env, str(work))
    run(["pip", "install", "--quiet", f"{wheel}[lightning]"], str(work), env)
    after = versions(env, str(work))
    assert {k: after[k] for k in ("torch", "torch-xla", "torchvision")} == {
        k: before[k] for k in ("torch", "torch-xla", "torchvision")
    }
    assert "tensorflow" not in after
    run(["tfpipe-demo", "data", "--train", "800", "--test", "0"], str(work), env)
    run(["tfpipe-write", "--csv", "data/train.csv", "--images", "data/images", "--out", "records", "--image-size",
         "48", "--num-folds", "4", "--no-progress"], str(work), env)  # fmt: skip
    example = os.path.join(ROOT, "examples", "torch_ddp.py")
    xla = run(["python", example, "--records", "records", "--xla", "--epochs", "10", "--batch-size", "16"], str(work),
              {**env, "PJRT_DEVICE": "CPU"}, timeout=1800)  # fmt: skip
    assert float(AUC.findall(xla)[-1]) >= 0.85, xla  # chance is 0.5; measured 0.87 on this machine
    timm = run(["python", example, "--records", "records", "--model", "resnet18", "--processes", "2", "--epochs",
                "1"], str(work), env, timeout=1800)  # fmt: skip
    assert 0 <= float(AUC.findall(timm)[-1]) <= 1, timm
