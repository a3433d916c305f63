"""Reliability: interrupted writes and training resume exactly, bad input and corrupt shards are named, ram:// works.

Interruption tests start a real subprocess and kill it (SIGINT or SIGKILL) once it has written something.
"""

import filecmp
import glob
import json
import os
import signal
import struct
import subprocess
import sys
import time
import zlib

import pytest
import tensorflow as tf

import tfpipe
from tests.conftest import save, sigint_as_a_terminal_sends_it, write_csv
from tfpipe.runtime.errors import TfpipeError
from tfpipe.write import main as write_main

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENV = dict(os.environ, PYTHONPATH=ROOT, TF_CPP_MIN_LOG_LEVEL="2")


def write(args):
    return write_main(args + ["--no-progress", "--workers", "0"])


def finished_shards(out):
    path = os.path.join(out, ".staging", "progress.json")
    try:
        with open(path) as f:
            return len(json.load(f)["shards"])
    except (FileNotFoundError, json.JSONDecodeError):
        return 0


def children(pid):
    r = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True)
    return [int(p) for p in r.stdout.split()]


def alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie (exited, not yet reaped by its parent) is not running
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ")[1][0] != "Z"
    except FileNotFoundError:
        return False


def start_and_interrupt(args, out, sig, to="process"):
    """Starts a 1-worker write, waits until 2 shards are finished, sends ``sig`` to the ``process``, its DataLoader
    ``worker`` or its process ``group`` (as ``timeout`` and schedulers do); returns (process, workers)."""
    sigint_as_a_terminal_sends_it()  # else, in a CI run started in the background, the write finishes (exit 0)
    proc = subprocess.Popen(
        [sys.executable, "-m", "tfpipe.write", *args, "--out", out, "--workers", "1", "--no-progress"],
        env=ENV,
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=to == "group",
    )
    deadline = time.time() + 120
    workers = []
    while finished_shards(out) < 2:
        assert proc.poll() is None, proc.communicate()
        assert time.time() < deadline
        workers = workers or children(proc.pid)
        time.sleep(0.005)
    workers = workers or children(proc.pid)
    {
        "process": proc.send_signal,
        "worker": lambda s: os.kill(workers[0], s),
        "group": lambda s: os.killpg(proc.pid, s),
    }[to](sig)
    proc.wait(60)
    return proc, workers


def assert_identical(out, reference):
    names = sorted(os.listdir(reference))
    assert sorted(os.listdir(out)) == names
    for name in names:
        assert filecmp.cmp(os.path.join(out, name), os.path.join(reference, name), shallow=False), name


@pytest.mark.slow
@pytest.mark.parametrize(
    "sig, to, code, line",
    [
        (signal.SIGINT, "process", 130, "tfpipe.write: interrupted: "),
        # the out-of-memory killer's way
        (signal.SIGKILL, "worker", 2, "tfpipe.write: error: DataLoader worker (pid {worker}) is killed by signal: "),
        # timeout, kill -- -PGID, a scheduler: the workers end too, and the stop is the news
        (signal.SIGTERM, "group", 143, "tfpipe.write: terminated (SIGTERM): "),
    ],
    ids=["ctrl-c", "its-worker-killed", "sigterm-to-its-group"],
)
def test_ctrl_c_stops_cleanly_and_resume_gives_identical_shards(sig, to, code, line, slow_source, tmp_path):
    """Ctrl-C, its DataLoader worker killed, or SIGTERM to the whole group: one line saying what is kept and how
    to go on, no traceback."""
    args, reference = slow_source
    out = str(tmp_path / "out")
    proc, workers = start_and_interrupt(args, out, sig, to=to)
    err = proc.stderr.read()
    assert proc.returncode == code, err
    assert "Traceback" not in err and err.strip().splitlines()[-1].startswith(line.format(worker=workers[0])), err
    assert "shards were finished" in err and "--resume" in err
    assert not glob.glob(os.path.join(out, "*.tfrec")) and not os.path.exists(os.path.join(out, "manifest.json"))
    assert workers and not any(alive(w) for w in workers)  # no orphan DataLoader workers
    kept = finished_shards(out)
    assert kept >= 2
    assert write(args + ["--out", out, "--resume"]) == 0
    assert_identical(out, reference)


@pytest.mark.slow
def test_kill_9_leaves_no_tfrec_and_resume_gives_identical_shards(slow_source, tmp_path):
    args, reference = slow_source
    out = str(tmp_path / "out")
    proc, workers = start_and_interrupt(args, out, signal.SIGKILL)
    assert proc.returncode == -signal.SIGKILL
    assert not glob.glob(os.path.join(out, "*.tfrec"))
    deadline = time.time() + 15  # orphaned workers notice their parent is gone (torch checks every 5 s)
    while any(alive(w) for w in workers) and time.time() < deadline:
        time.sleep(0.2)
    assert not any(alive(w) for w in workers)
    with pytest.raises(TfpipeError, match="--resume"):  # readers are told what happened
        tfpipe.make_dataset(out, 8)
    assert write(args + ["--out", out, "--resume"]) == 0
    assert_identical(out, reference)


def test_resume_refuses_progress_of_another_job(slow_source, tmp_path):
    args, _ = slow_source
    out = tmp_path / "out"
    staging = out / ".staging"
    staging.mkdir(parents=True)
    (staging / "progress.json").write_text(json.dumps({"fingerprint": "another job", "shards": []}))
    assert write(args + ["--out", str(out), "--resume"]) == 2


def test_resume_without_an_interrupted_write_writes_everything(labeled_folder, tmp_path):
    out = str(tmp_path / "out")
    args = ["--csv", labeled_folder["csv"], "--images", labeled_folder["images"], "--image-size", "16"]
    assert write(args + ["--out", out, "--resume"]) == 0
    assert tfpipe.count_examples(out) == 12


# ---------------------------------------------------------------- bad input: one line, the culprit named


def assert_one_line_error(capsys, *needles):
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    for needle in needles:
        assert needle in err, err


def test_duplicate_ids_are_named_with_their_rows(labeled_folder, tmp_path, capsys):
    rows = labeled_folder["rows"] + [("img03", "cat")]
    csv_path = write_csv(tmp_path / "dup.csv", ["image", "labels"], rows)
    assert write(["--csv", str(csv_path), "--images", labeled_folder["images"], "--out", str(tmp_path / "o")]) == 2
    assert_one_line_error(capsys, "dup.csv", "'img03'", "rows 4 and 13")


@pytest.mark.parametrize("bad,needles", [("Cat", ("'Cat'", "'cat'")), ("cat,", ("'dog cat,'", "','"))])
def test_label_spellings_never_become_a_new_class(labeled_folder, tmp_path, capsys, bad, needles):
    rows = list(labeled_folder["rows"])
    rows[5] = (rows[5][0], f"dog {bad}")
    csv_path = write_csv(tmp_path / "labels.csv", ["image", "labels"], rows)
    assert write(["--csv", str(csv_path), "--images", labeled_folder["images"], "--out", str(tmp_path / "o")]) == 2
    assert_one_line_error(capsys, "labels.csv", "row 6", *needles)


def test_stray_whitespace_and_separators_are_normalised(labeled_folder, tmp_path):
    rows = list(labeled_folder["rows"])
    rows[0] = (rows[0][0], "  cat   dog  ")
    rows[2] = (rows[2][0], "dog dog ")
    csv_path = write_csv(tmp_path / "ws.csv", ["image", "labels"], rows)
    out = str(tmp_path / "o")
    assert write(["--csv", str(csv_path), "--images", labeled_folder["images"], "--out", out]) == 0
    m = json.loads(open(os.path.join(out, "manifest.json")).read())
    assert m["classes"] == ["bird", "cat", "dog"]
    targets = tfpipe.read_targets(out, 3)
    names = tfpipe.image_names(out)
    assert targets[names.index("img00")].tolist() == [0, 1, 1] and targets[names.index("img02")].tolist() == [0, 0, 1]


def test_empty_class_folder_is_named(tmp_path, capsys):
    for cls in ("cat", "dog"):
        (tmp_path / "tree" / cls).mkdir(parents=True)
    save(tmp_path / "tree" / "cat" / "a.jpg")
    assert write(["--images", str(tmp_path / "tree"), "--out", str(tmp_path / "o")]) == 2
    assert_one_line_error(capsys, os.path.join("tree", "dog"), "no images")


def png_header_only(width, height):
    """A PNG whose header claims ``width`` x ``height`` (no real pixel data behind it)."""

    def chunk(kind, data):
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(b"\0" * 16)) + chunk(b"IEND", b"")


@pytest.mark.parametrize(
    "width,height,needles",
    [(20000, 10000, ("200 MP", "--max-pixels")), (0, 40, ("not a readable image", "invalid header"))],
)
def test_huge_or_empty_images_are_refused_before_decoding(labeled_folder, tmp_path, capsys, width, height, needles):
    with open(os.path.join(labeled_folder["images"], "img04.jpg"), "wb") as f:
        f.write(png_header_only(width, height))
    out = str(tmp_path / "o")
    assert (
        write(
            ["--csv", labeled_folder["csv"], "--images", labeled_folder["images"], "--out", out, "--image-size", "16"]
        )
        == 2
    )
    err = capsys.readouterr().err
    assert "img04.jpg" in err and all(n in err for n in needles) and "Traceback" not in err, err
    assert len(err.strip().splitlines()) == 1 and "<_io" not in err
    assert not os.path.exists(out) or not os.listdir(out)


def test_sixteen_bit_png_is_converted_to_eight_bit(tmp_path):
    (tmp_path / "tree" / "a").mkdir(parents=True)
    save(tmp_path / "tree" / "a" / "deep.png", kind="png16", size=(20, 30))
    out = str(tmp_path / "o")
    assert write(["--images", str(tmp_path / "tree"), "--out", out, "--image-size", "20", "--format", "png"]) == 0
    images, _ = next(iter(tfpipe.make_dataset(out, 1)))
    assert images.dtype == tf.uint8 and int(images.numpy().max()) > 200  # full range kept, not 1/257 of it


def test_missing_manifest_says_how_to_read_foreign_shards(shard_dir, tmp_path):
    folder = tmp_path / "copy"
    folder.mkdir()
    for f in glob.glob(os.path.join(shard_dir[0], "*.tfrec")):
        os.link(f, folder / os.path.basename(f))
    with pytest.raises(TfpipeError, match=r"no manifest.json .*\*\.tfrec"):
        tfpipe.make_dataset(str(folder), 4)
    ds = tfpipe.make_dataset(str(folder / "*.tfrec"), 4, num_classes=3, image_size=32)
    assert sum(int(b[0].shape[0]) for b in ds) == 40


# ---------------------------------------------------------------- corrupt shards are named


def copy_shards(shard_dir, tmp_path):
    out = tmp_path / "records"
    out.mkdir()
    for f in os.listdir(shard_dir[0]):
        with open(os.path.join(shard_dir[0], f), "rb") as src:
            (out / f).write_bytes(src.read())
    return str(out), sorted(glob.glob(str(out / "*.tfrec")))


def test_truncated_shard_is_named_before_reading(shard_dir, tmp_path):
    out, files = copy_shards(shard_dir, tmp_path)
    with open(files[3], "r+b") as f:
        f.truncate(os.path.getsize(files[3]) - 100)
    with pytest.raises(TfpipeError, match=os.path.basename(files[3]) + ".*truncated"):
        tfpipe.make_dataset(out, 4)


def test_corrupt_bytes_raise_an_error_naming_the_shard(shard_dir, tmp_path):
    out, files = copy_shards(shard_dir, tmp_path)
    data = bytearray(open(files[5], "rb").read())
    data[len(data) // 2] ^= 0xFF  # same size, broken CRC
    open(files[5], "wb").write(bytes(data))
    with pytest.raises(tf.errors.DataLossError):  # TensorFlow's own error does not say which file
        for _ in tfpipe.make_dataset(out, 4, cache=False):
            pass
    with pytest.raises(TfpipeError, match=os.path.basename(files[5])):
        with tfpipe.naming_corrupt_shards(out):
            for _ in tfpipe.make_dataset(out, 4, cache=False):
                pass
    with pytest.raises(TfpipeError, match=os.path.basename(files[5])):
        tfpipe.image_names(out)


# ---------------------------------------------------------------- training: kill -9, then --resume


@pytest.mark.slow
def test_training_killed_mid_epoch_resumes_to_the_same_epochs_and_steps(shard_dir, tmp_path):
    out = tmp_path / "run"
    cmd = [
        sys.executable,
        "-m",
        "train.fit",
        "--records",
        shard_dir[0],
        "--run",
        str(out),
        "--strategy",
        "cpu",
        "--replicas",
        "2",  # MirroredStrategy's code as on 8, a quarter of the tracing (8 replicas: 116 s alone, 287 s in CI)
        "--model",
        "small-cnn",
        "--batch-size",
        "1",
        "--epochs",
        "4",
        "--steps-per-execution",
        "1",
        "--no-augment",
        "--seed",
        "1",
        "--no-report",
        "--verbose",
        "0",
    ]
    proc = subprocess.Popen(cmd, env=ENV, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    history = out / "history.csv"
    deadline = time.time() + 300
    while not (history.exists() and len(history.read_text().splitlines()) >= 2):  # epoch 1 done and backed up
        assert proc.poll() is None, proc.communicate()[1][-2000:]
        assert time.time() < deadline
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)  # now inside epoch 2
    proc.wait(60)
    assert not (out / "model.keras").exists()
    r = subprocess.run(cmd + ["--resume"], env=ENV, cwd=ROOT, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-2000:]
    m = json.loads((out / "metrics.json").read_text())
    assert m["epochs"] == 4 and m["optimizer_steps"] == 4 * m["steps_per_epoch"]
    rows = history.read_text().splitlines()[1:]
    assert [int(r.split(",")[0]) for r in rows] == [0, 1, 2, 3]


# ---------------------------------------------------------------- remote filesystems: everything on ram://


def test_write_verify_read_train_predict_on_ram_filesystem(labeled_folder, tmp_path):
    from tfpipe import Source, write_shards
    from tfpipe.writer.images import ImageSpec
    from train.fit import FitConfig, fit
    from train.predict import predict

    root = "ram://reliability"
    tf.io.gfile.makedirs(f"{root}/images")
    for name in os.listdir(labeled_folder["images"]):  # the inputs too: no open()/os.path anywhere
        tf.io.gfile.copy(os.path.join(labeled_folder["images"], name), f"{root}/images/{name}", overwrite=True)
    tf.io.gfile.copy(labeled_folder["csv"], f"{root}/train.csv", overwrite=True)
    source = Source(f"{root}/images", csv=f"{root}/train.csv")
    write_shards(source, f"{root}/train", spec=ImageSpec(image_size=16), num_shards=4, workers=0, progress=False)
    assert not tf.io.gfile.exists(f"{root}/train/.staging")
    report = tfpipe.inspect_shards(f"{root}/train", do_verify=True)
    assert report["problems"] == [] and len(report["files"]) == 4
    assert tfpipe.count_examples(f"{root}/train") == 12
    m = fit(
        FitConfig(
            records=f"{root}/train",
            run=f"{root}/run",
            strategy="cpu",
            model="small-cnn",
            batch_size=4,
            epochs=1,
            steps_per_execution=1,
            augment=tfpipe.Augment(),
            verbose=0,
            seed=0,
            val_fraction=0.25,
        )
    ).metrics
    assert m["epochs"] == 1
    for name in ("model.keras", "metrics.json", "history.csv", "roc.png", "thresholds.json"):
        assert tf.io.gfile.exists(f"{root}/run/{name}"), name
    df = predict(f"{root}/run", f"{root}/train", f"{root}/submission.csv", strategy="cpu")
    assert len(df) == 12 and tf.io.gfile.exists(f"{root}/submission.csv")
