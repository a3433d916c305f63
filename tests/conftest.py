"""Shared helpers: synthetic images and CSVs made on the fly."""

import io
import os
import sys
import warnings

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
# The backend the session's trainer runs on: tf (tf-keras on TensorFlow's strategies), or jax (Keras 3 on JAX, 8
# XLA host devices). `make test` runs the tests marked `backends` a second time with TFPIPE_TEST_BACKEND=jax: the
# second backend is a parametrisation of the tests that matter, one process each (a process has one Keras).
BACKEND = os.environ.get("TFPIPE_TEST_BACKEND", "tf")
if BACKEND == "jax":
    os.environ["KERAS_BACKEND"] = "jax"
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()
# TensorFlow's caching allocator for CPU tensors (as the Makefile sets for make test and make demo, and for the
# processes the tests start): CPU training otherwise spends much of its time mapping fresh pages for each step.
os.environ.setdefault("TF_CPU_ALLOCATOR_USE_BFC", "true")

import tensorflow as tf

# Eight virtual CPU devices for the whole session (a dry run of a TPU v3-8's cores); this must
# happen before TensorFlow initialises its devices, hence here.
tf.config.set_logical_device_configuration(
    tf.config.list_physical_devices("CPU")[0], [tf.config.LogicalDeviceConfiguration()] * 8
)


def backend_keras():
    """The Keras the session's trainer runs on (``BACKEND``): tf-keras, or Keras 3 on JAX."""
    from train.backends import keras_module

    return keras_module()


def backend_devices(strategy="cpu", replicas=8):
    """The session backend's strategy (tf) or devices (jax) for ``strategy`` and ``replicas``."""
    from train.backends import Choice, resolve

    return resolve(Choice(BACKEND), strategy, replicas)[0]


import cv2
import numpy as np
import pytest
from PIL import Image

# Session fixtures that take tens of seconds to build. `make test` runs on two pytest-xdist workers with
# `--dist loadgroup`: every test that uses one of these runs on the same worker, so each is built once per run, as
# in a plain one-process run.
SHARED_FIXTURES = ("trained_run", "slow_source", "cv_run")


# The tests that take minutes, longest first (their call times in CI's parallel stage, where two run at once:
# docs/project/tests.md, "Issue #65"), handed out before the rest: pytest-xdist deals tests in collection order and
# knows nothing of their length, and a 3-minute test dealt last runs alone after the other worker has finished. A
# name here that no test has any more puts nothing first (two renamed tests were dealt 64th and 68th of 99):
# tests/test_layout.py checks each name against the tests' sources.
LONGEST_FIRST = (
    "test_every_benchmark_runs_and_writes_results_and_chart",  # 298 s
    "test_torch_ddp_example_learns_the_demo_on_8_processes_and_submits",  # 183 s
    "test_wheel_next_to_users_tensorflow[newest]",  # 178 s, make test-slow-install's install cases
    "test_wheel_next_to_users_tensorflow[kaggle-tpu]",  # 177 s
    "test_notebook_runs_end_to_end",  # 155 s
    "test_wheel_next_to_users_tensorflow",  # 110 s, the oldest
    "test_a_step_too_big_for_a_core_is_refused_and_the_suggested_batch_fits",  # 81 s
    "test_lightning_swa_example_learns_the_demo_on_2_devices_and_submits",
    "test_oof_holds_every_image_once_scored_by_the_model_that_never_trained_on_it",  # the JAX pass: its CV, 108 s
    "test_a_ddp_epoch_on_8_ranks_with_2_workers_ends_and_reads_every_record",  # 53 s
    "test_torch_ddp_under_torchrun_on_two_nodes_trains_on_4_ranks_and_submits",  # 50 s
    "test_a_worker_killed_mid_epoch_and_started_again_costs_that_epoch_only_what_it_held",  # 48 s
    "test_a_model_learns_the_demo_shapes",  # 44 s; 73 s on JAX
    "test_resume_continues_where_it_stopped",  # 44 s
    "test_the_examples_of_a_page_run",
    "test_training_killed_mid_epoch_resumes_to_the_same_epochs_and_steps",
    "test_eight_virtual_replicas_with_steps_per_execution",
)


def pytest_collection_modifyitems(config, items):
    if BACKEND == "jax":  # only the tests that run on either backend (the rest are the TF path's or backend-free)
        kept = [item for item in items if item.get_closest_marker("backends")]
        config.hook.pytest_deselected(items=[item for item in items if item not in kept])
        items[:] = kept

    def later(item):  # the minutes-long tests, then the ones sharing the trained run, then the rest in their order
        names, fixtures = (item.name, getattr(item, "originalname", item.name)), getattr(item, "fixturenames", ())
        rank = min((LONGEST_FIRST.index(n) for n in names if n in LONGEST_FIRST), default=len(LONGEST_FIRST))
        return rank, "trained_run" not in fixtures

    items.sort(key=later)  # stable


def pytest_itemcollected(item):
    backends = item.get_closest_marker("backends")
    if BACKEND == "jax" and backends is not None and backends.kwargs.get("jax") == "slow":
        item.add_marker(pytest.mark.slow)  # over ~20 s on JAX (a CV compiles each fold's steps): make test-slow
    shared = [name for name in SHARED_FIXTURES if name in getattr(item, "fixturenames", ())]
    if shared:
        item.add_marker(pytest.mark.xdist_group(shared[0]))


def pytest_collection_finish(session):
    """On an xdist worker with ``--dist loadgroup``, the groups must have reached the test ids (pytest-xdist appends
    ``@group``); pytest-xdist 3.8 on pytest 9.2 silently drops them (pytest-xdist#1386), which builds each shared
    fixture on every worker: said once, so that the lost minutes have a name."""
    if getattr(session.config.option, "loadgroup", False):
        lost = [i.nodeid for i in session.items if i.get_closest_marker("xdist_group") and "@" not in i.nodeid]
        if lost:
            warnings.warn(
                f"pytest-xdist ignored the xdist_group of {len(lost)} tests (pytest-xdist#1386 on pytest 9.2): "
                "shared session fixtures are built on every worker; use the lock's pytest (requirements.txt)",
                stacklevel=1,
            )


# A test whose own run (its call, not the session fixtures it shares) takes longer than this belongs to the `slow`
# group; the default run names any that do not, in its summary (docs/project/tests.md, "Keeping it fast").
SLOW_TEST_SECONDS = 20.0
_UNMARKED_SECONDS: dict[str, float] = {}


def pytest_runtest_logreport(report):
    if report.when == "call" and not {"slow", "install", "xla"} & set(report.keywords):
        _UNMARKED_SECONDS[report.nodeid] = report.duration


def pytest_terminal_summary(terminalreporter):
    over = sorted(((s, n) for n, s in _UNMARKED_SECONDS.items() if s > SLOW_TEST_SECONDS), reverse=True)
    for seconds, name in over:
        terminalreporter.write_line(
            f"over {SLOW_TEST_SECONDS:.0f} s without @pytest.mark.slow: {name} ({seconds:.0f} s)", yellow=True
        )


@pytest.fixture(autouse=True, scope="session")
def state_folder(tmp_path_factory):
    """The records of the files train.predict wrote (``train.prediction.written``: ``$XDG_STATE_HOME``) in the
    session's temporary folder, not the user's home; the processes the tests start inherit it."""
    os.environ["XDG_STATE_HOME"] = str(tmp_path_factory.mktemp("state"))


@pytest.fixture(autouse=True)
def short_lived_iterators(request):
    """Every test runs inside ``train.accel.strategy.quick_teardown()``, as ``train.fit`` and ``train.predict`` do, and
    a test that ran for over a second has its garbage collected when it ends.

    Why: a tf.data iterator that a test drops without closing (a distributed dataset iterated outside ``fit``, a
    ``next(iter(ds))``) keeps its autotuning thread, whose sleep doubles up to 60 s while the iterator waits in
    the garbage. Python's collector then frees it at a random later moment, in whatever test runs, and the free
    waits for that sleep with the GIL held: `py-spy dump --native` caught a test stalled 104 s in a previous
    test's ``MultiDeviceIterator`` destructor, freed by a collection during tracing (docs/project/tests.md, seventh
    round). Inside the block per-replica prefetches have no such thread, and a prompt collection frees the others
    while their sleep is still short. ``@pytest.mark.tuned_prefetches`` keeps TensorFlow's own prefetches (the test
    of quick_teardown itself).
    """
    import gc
    import time

    from train.accel.strategy import quick_teardown

    start = time.monotonic()
    if request.node.get_closest_marker("tuned_prefetches"):
        yield
    else:
        with quick_teardown():
            yield
    if time.monotonic() - start > 1.0:
        gc.collect()


def gradient_image(height, width, seed=0):
    """An RGB uint8 image with structure (so JPEG and resizing do real work)."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:height, 0:width]
    img = np.stack(
        [x * 255 // max(width - 1, 1), y * 255 // max(height - 1, 1), np.full_like(x, rng.integers(0, 256))], axis=-1
    )
    return img.astype(np.uint8)


def save(path, kind="jpeg", size=(48, 64), seed=0, orientation=None):
    """Writes a test image of a given kind; ``size`` is (height, width) of the stored pixels."""
    rgb = gradient_image(*size, seed=seed)
    pil = Image.fromarray(rgb)
    if kind == "jpeg":
        exif = Image.Exif()
        if orientation:
            exif[0x0112] = orientation
        pil.save(path, "JPEG", quality=95, exif=exif)
    elif kind == "gray":
        pil.convert("L").save(path, "JPEG", quality=95)
    elif kind == "cmyk":
        pil.convert("CMYK").save(path, "JPEG", quality=95)
    elif kind == "png":
        pil.save(path, "PNG")
    elif kind == "rgba":
        rgba = np.dstack([rgb, np.full(size, 128, np.uint8)])
        Image.fromarray(rgba, "RGBA").save(path, "PNG")
    elif kind == "palette":
        pil.convert("P", palette=Image.Palette.ADAPTIVE, colors=16).save(path, "PNG")
    elif kind == "png16":
        cv2.imwrite(str(path), (rgb[:, :, ::-1].astype(np.uint16) * 257))
    else:
        raise ValueError(kind)
    return path


def sigint_as_a_terminal_sends_it():
    """Lets the subprocesses started next get SIGINT as a terminal's Ctrl-C delivers it. A test process with SIGINT
    ignored (pytest started in the background by a non-interactive shell: `(cmd &)` ignores SIGINT, as a clean
    clone's CI run here was) passes that on, and the child then runs on instead of stopping (CI saw it)."""
    import signal

    if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)


def write_csv(path, header, rows):
    import csv

    with open(path, "w", newline="", encoding="utf-8") as f:
        w = csv.writer(f)
        w.writerow(header)
        w.writerows(rows)
    return path


@pytest.fixture
def labeled_folder(tmp_path):
    """A small multi-label dataset: 12 JPEGs, ids without extension, some empty label lists."""
    images = tmp_path / "images"
    images.mkdir()
    labels = ["cat dog", "", "dog", "bird", "cat", "", "bird cat dog", "dog", "cat", "bird", "", "dog cat"]
    rows = []
    for i, lab in enumerate(labels):
        save(images / f"img{i:02d}.jpg", size=(40 + i, 56), seed=i)
        rows.append((f"img{i:02d}", lab))
    csv_path = write_csv(tmp_path / "train.csv", ["image", "labels"], rows)
    return {"images": str(images), "csv": str(csv_path), "rows": rows, "root": tmp_path}


def jpeg_bytes(rgb, quality=95):
    buf = io.BytesIO()
    Image.fromarray(rgb).save(buf, "JPEG", quality=quality)
    return buf.getvalue()


# A command in a child process that dies with this one (PR_SET_PDEATHSIG), however it ends: no preexec_fn, which
# is unsafe in a process whose TensorFlow threads run.
_DIES_WITH_PARENT = (
    "import runpy, sys; from tfpipe.runtime.lifecycle import die_with_parent; die_with_parent(int(sys.argv[1])); "
    "sys.argv = sys.argv[2:]; runpy.run_module(sys.argv[0], run_name='__main__')"
)


def dies_with_this_process(module, *args):
    """The argv of ``python -m module ARGS`` in a child that dies with this (the test) process."""
    return [sys.executable, "-c", _DIES_WITH_PARENT, str(os.getpid()), module, *args]


def validation_auc(model_path, records, folds):
    """Keras' macro AUC (what fit reports) of a saved model on ``folds``, computed here from scratch."""
    import tfpipe
    from train.keras.compiling import make_auc
    from train.keras.run_model import load_model

    model = load_model(model_path)
    auc = make_auc(model.output_shape[-1])
    for images, targets in tfpipe.make_dataset(records, 8, folds=folds):
        auc.update_state(targets, model(images, training=False))
    return float(auc.result())


@pytest.fixture
def registry():
    """The model table (``train.keras.models.MODELS``) as it was, restored after the test."""
    from train.keras.models import MODELS

    saved = dict(MODELS)
    yield
    MODELS.clear()
    MODELS.update(saved)


@pytest.fixture(scope="session")
def shard_dir(tmp_path_factory):
    """40 labeled images (labels cycle through 5 patterns, one empty) written as 32 px shards, 4 folds.

    Returns (folder, {image_name: label list}, names in written order).
    """
    from tfpipe import Source, write_shards

    root = tmp_path_factory.mktemp("shards")
    images = root / "images"
    images.mkdir()
    patterns = ["a", "b c", "", "c", "a b c"]
    rows = []
    for i in range(40):
        save(images / f"im{i:02d}.jpg", size=(24 + i % 7, 40), seed=i)
        rows.append((f"im{i:02d}", patterns[i % 5]))
    csv_path = write_csv(root / "train.csv", ["image", "labels"], rows)
    out = str(root / "records")
    from tfpipe.writer.images import ImageSpec

    manifest = write_shards(
        Source(str(images), csv=str(csv_path)),
        out,
        spec=ImageSpec(image_size=32),
        num_folds=4,
        num_shards=8,
        workers=0,
        progress=False,
    )
    labels = {name: lab.split() for name, lab in rows}
    return out, labels, manifest


@pytest.fixture(scope="session")
def slow_source(tmp_path_factory):
    """400 noisy 800x600 JPEGs (slow enough to decode that a write can be interrupted half-way)."""
    root = tmp_path_factory.mktemp("slow")
    images = root / "images"
    images.mkdir()
    rng = np.random.default_rng(0)
    rows = []
    for i in range(400):
        img = rng.integers(0, 256, (600, 800, 3), dtype=np.uint8)
        cv2.imwrite(str(images / f"p{i:03d}.jpg"), img, [cv2.IMWRITE_JPEG_QUALITY, 90])
        rows.append((f"p{i:03d}", ["x", "y", "x y", ""][i % 4]))
    csv_path = write_csv(root / "train.csv", ["image", "labels"], rows)
    args = [
        "--csv",
        str(csv_path),
        "--images",
        str(images),
        "--image-size",
        "32",
        "--num-shards",
        "16",
        "--num-folds",
        "4",
    ]
    reference = str(root / "reference")
    from tfpipe.write import main as write_main

    assert write_main(args + ["--out", reference, "--no-progress", "--workers", "0"]) == 0  # the uninterrupted run
    return args, reference


@pytest.fixture(scope="session")
def demo_shards(tmp_path_factory):
    """The demo's shapes, 800 images at 48 px in 4 folds: what the tests that check a model learns train on."""
    import tfpipe
    from tfpipe.demo import make_demo

    root = tmp_path_factory.mktemp("demo")
    make_demo(str(root / "data"), train=800, test=0)
    out = str(root / "records")
    tfpipe.write_shards(tfpipe.Source(str(root / "data" / "images"), csv=str(root / "data" / "train.csv")), out,
                        spec=tfpipe.ImageSpec(image_size=48), num_folds=4, workers=0, progress=False)  # fmt: skip
    return out


@pytest.fixture(scope="session")
def trained_run(shard_dir, tmp_path_factory):
    """A tiny run on 8 virtual replicas with SWA over its last 2 epochs, and unlabeled test shards. The slow
    ``test_eight_virtual_replicas_with_steps_per_execution`` checks 8 replicas with steps_per_execution > 1."""
    from tfpipe import Source, write_shards
    from tfpipe.tf.augment import NO_AUGMENT
    from tfpipe.writer.images import ImageSpec
    from train.fit import FitConfig, fit

    out = tmp_path_factory.mktemp("run") / "run"
    cfg = FitConfig(
        records=shard_dir[0],
        run=str(out),
        strategy="cpu",
        replicas=8,
        model="small-cnn",
        batch_size=1,
        epochs=3,
        steps_per_execution=1,  # >1 traces the step twice (tf-keras' loop); 8 replicas with it: the slow tests
        lr=1e-3,
        augment=NO_AUGMENT,
        verbose=0,
        seed=1,
        swa_epochs=2,
    )
    metrics = fit(cfg).metrics
    root = os.path.dirname(shard_dir[0])
    test = str(tmp_path_factory.mktemp("test") / "records")
    write_shards(
        Source(f"{root}/images", csv=f"{root}/train.csv", labeled=False),
        test,
        spec=ImageSpec(image_size=32),
        split="test",
        num_shards=3,
        workers=0,
        progress=False,
    )
    return str(out), metrics, test


@pytest.fixture
def started():
    """The processes (workers, ranks) a test starts, killed and waited for when it ends, however it ends."""
    procs = []
    yield procs
    for proc in procs:
        proc.kill()
        proc.wait()
        proc.log.close()


@pytest.fixture(scope="session")
def example_data(tmp_path_factory):
    """What ``needs=`` can ask for, made once: a tiny demo dataset and its shards at 32 px, as ``make demo``
    writes them (folds, an unlabeled test split)."""
    import tfpipe
    from tfpipe.demo import make_demo

    root = tmp_path_factory.mktemp("example-data")
    demo = root / "demo" / "data" / "demo"
    make_demo(str(demo), train=64, test=16)
    records = root / "shards" / "records" / "demo"
    spec = tfpipe.ImageSpec(image_size=32)
    source = tfpipe.Source(str(demo / "images"), csv=str(demo / "train.csv"))
    tfpipe.write_shards(source, str(records / "train"), spec=spec, num_folds=5, workers=0, progress=False)
    test = tfpipe.Source(str(demo / "images"), csv=str(demo / "test.csv"), labeled=False)
    tfpipe.write_shards(test, str(records / "test"), spec=spec, split="test", workers=0, progress=False)
    return {"demo": root / "demo", "shards": root / "shards"}
