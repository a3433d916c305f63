"""The hostile tester's cases (issue #16), one test each, grouped by the principle they break.

1. A label is never silently changed, merged, split or dropped.
2. No data is lost or deleted that tfpipe did not write in this job; a finished dataset or run is never replaced
   by a command that was not asked to replace it.
3. Shards and runs are checked against what they claim before they are used.
4. Every process tfpipe starts ends when its parent ends.
5. Bad input or a bad flag is one line and exit code 2, naming the culprit.
"""

import errno
import gzip
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time

import numpy as np
import pytest

import tfpipe
from tests.conftest import save, write_csv
from tests.test_reliability import ENV, ROOT, alive, assert_identical, children, finished_shards
from tfpipe.runtime.errors import TfpipeError
from tfpipe.tf.augment import NO_AUGMENT
from tfpipe.write import main as write_main


def write(args):
    return write_main(args + ["--no-progress", "--workers", "0"])


def one_line_error(capsys, *needles):
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    for needle in needles:
        assert needle in err, err
    return err


def source_args(folder, size="16"):
    return ["--csv", folder["csv"], "--images", folder["images"], "--image-size", size]


def tfrec_files(out):
    return sorted(f for f in os.listdir(out) if f.endswith(".tfrec")) if os.path.isdir(out) else []


# ---------------------------------------------------------------- 2: nothing lost, nothing replaced unasked


@pytest.mark.slow
def test_a_second_writer_into_the_same_folder_is_refused_while_the_first_runs(slow_source, tmp_path, capsys):
    args, reference = slow_source
    out = str(tmp_path / "out")
    first = subprocess.Popen(
        [sys.executable, "-m", "tfpipe.write", *args, "--out", out, "--workers", "1", "--no-progress"],
        env=ENV,
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    deadline = time.time() + 120
    while finished_shards(out) < 1:
        assert first.poll() is None and time.time() < deadline, first.communicate()
        time.sleep(0.01)
    other = ["--csv", args[1], "--images", args[3], "--image-size", "48"]  # another job, same folder
    assert write(other + ["--out", out, "--overwrite"]) == 2
    one_line_error(capsys, "being written by another tfpipe.write", f"pid {first.pid}")
    assert first.wait(300) == 0, first.communicate()
    assert_identical(out, reference)  # the first job's records are its own


def test_a_lock_left_by_a_dead_job_is_taken_over_and_a_live_one_refused(labeled_folder, tmp_path, capsys):
    out = tmp_path / "out"
    out.mkdir()
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    lock = out / ".tfpipe-write.lock"
    lock.write_text(json.dumps({"id": "x", "host": socket.gethostname(), "pid": int(dead.stdout), "started": "-"}))
    assert write(source_args(labeled_folder) + ["--out", str(out)]) == 0
    assert not lock.exists() and tfpipe.count_examples(str(out)) == 12
    lock.write_text(json.dumps({"id": "y", "host": "another-host", "pid": 1, "started": "today"}))
    assert write(source_args(labeled_folder) + ["--out", str(out), "--overwrite"]) == 2
    one_line_error(capsys, "another-host", "delete", ".tfpipe-write.lock")


def test_a_remote_lock_lost_to_another_writer_commits_nothing(labeled_folder, monkeypatch):
    import tensorflow as tf

    from tfpipe import Source, write_shards
    from tfpipe.runtime.locks import WriteLock
    from tfpipe.writer.images import ImageSpec

    out = "ram://hostile-lock/out"
    original = WriteLock.check

    def raced_then_check(self):  # another host's writer replaced the advisory lock while this job encoded
        tf.io.gfile.remove(self.path)  # (ram:// appends on "w"; a bucket replaces)
        with tf.io.gfile.GFile(self.path, "w") as f:
            f.write(json.dumps({"id": "other", "host": "h2", "pid": 7, "started": "now"}))
        return original(self)

    monkeypatch.setattr(WriteLock, "check", raced_then_check)
    with pytest.raises(TfpipeError, match="h2.*not committed"):
        write_shards(
            Source(labeled_folder["images"], csv=labeled_folder["csv"]),
            out,
            spec=ImageSpec(image_size=16),
            workers=0,
            progress=False,
        )
    assert not tf.io.gfile.glob(f"{out}/*.tfrec") and not tf.io.gfile.exists(f"{out}/manifest.json")
    assert tf.io.gfile.exists(f"{out}/.tfpipe-write.lock")  # the other writer's lock is left alone


def test_resume_on_a_finished_folder_never_replaces_it(labeled_folder, tmp_path, capsys):
    out = str(tmp_path / "out")
    assert write(source_args(labeled_folder) + ["--out", out]) == 0
    before = {f: os.path.getmtime(os.path.join(out, f)) for f in os.listdir(out)}
    assert write(source_args(labeled_folder) + ["--out", out, "--resume"]) == 0  # same job: nothing to do
    assert "already finished" in capsys.readouterr().out
    other = write_csv(tmp_path / "other.csv", ["image", "labels"], labeled_folder["rows"][:6])
    assert (
        write(
            ["--csv", str(other), "--images", labeled_folder["images"], "--image-size", "24", "--out", out, "--resume"]
        )
        == 2
    )
    one_line_error(capsys, "finished write whose inputs or settings changed since", "--overwrite")
    assert {f: os.path.getmtime(os.path.join(out, f)) for f in os.listdir(out)} == before


def test_overwrite_deletes_only_what_tfpipe_wrote_and_never_another_split(labeled_folder, tmp_path, capsys):
    out = tmp_path / "out"
    assert write(source_args(labeled_folder) + ["--out", str(out)]) == 0
    (out / "mine.tfrec").write_bytes(b"a user's other dataset")
    assert write(source_args(labeled_folder) + ["--out", str(out), "--overwrite"]) == 2
    one_line_error(capsys, "mine.tfrec", "not written by tfpipe.write")
    assert (out / "mine.tfrec").read_bytes() == b"a user's other dataset"
    (out / "mine.tfrec").unlink()
    train_files = tfrec_files(out)
    assert (
        write(source_args(labeled_folder) + ["--out", str(out), "--split", "test", "--unlabeled", "--overwrite"]) == 2
    )
    one_line_error(capsys, "'train' split", "own folder")
    assert tfrec_files(out) == train_files
    assert write(source_args(labeled_folder, "24") + ["--out", str(out), "--overwrite", "--num-shards", "2"]) == 0
    assert len(tfrec_files(out)) == 2 and tfpipe.open_shards(str(out)).image_size == 24  # asked: replaced


def test_a_full_disk_at_the_manifest_leaves_no_shards_and_resume_finishes(
    labeled_folder, tmp_path, capsys, monkeypatch
):
    import tfpipe.writer.staging

    out = tmp_path / "out"
    real = tfpipe.writer.staging.write_manifest

    def full(folder, manifest):
        raise OSError(errno.ENOSPC, "No space left on device", os.path.join(folder, "manifest.json"))

    monkeypatch.setattr(tfpipe.writer.staging, "write_manifest", full)
    assert write(source_args(labeled_folder) + ["--out", str(out)]) == 2
    one_line_error(capsys, "No space left on device", "--resume")
    assert tfrec_files(out) == [] and not (out / "manifest.json").exists()
    monkeypatch.setattr(tfpipe.writer.staging, "write_manifest", real)
    assert write(source_args(labeled_folder) + ["--out", str(out), "--resume"]) == 0
    assert tfpipe.count_examples(str(out)) == 12


def test_a_failed_move_puts_every_shard_back(labeled_folder, tmp_path, monkeypatch):
    from tfpipe.runtime import fs

    out = tmp_path / "out"
    real, moved = fs.rename, []

    def failing(src, dst, overwrite=False):
        if dst.endswith(".tfrec"):
            if len(moved) == 2:
                raise OSError(errno.EIO, "Input/output error", dst)
            moved.append(dst)
        return real(src, dst, overwrite)

    monkeypatch.setattr(fs, "rename", failing)
    assert write(source_args(labeled_folder) + ["--out", str(out), "--num-shards", "4"]) == 2
    assert len(moved) == 2 and tfrec_files(out) == [] and not (out / "manifest.json").exists()
    assert len(os.listdir(out / ".staging")) == 4 + 3  # every shard back, the progress, the staged manifest, the mark


def test_an_interrupted_write_is_not_cleared_by_a_new_one_unless_asked(slow_source, tmp_path, capsys):
    args, _ = slow_source
    out = tmp_path / "out"
    (out / ".staging").mkdir(parents=True)
    (out / ".staging" / "progress.json").write_text(json.dumps({"fingerprint": "f", "shards": []}))
    assert write(args + ["--out", str(out)]) == 2
    one_line_error(capsys, "interrupted write", "--resume", "--overwrite")
    assert (out / ".staging" / "progress.json").exists()


@pytest.mark.parametrize(
    "out,needle", [("", "--out is empty"), (" ", "--out is empty"), ("FILE", "is a file; --out names a folder")]
)
def test_output_that_is_empty_or_a_file_is_refused_before_writing(
    labeled_folder, tmp_path, capsys, monkeypatch, out, needle
):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "FILE").write_text("keep me")
    assert write(source_args(labeled_folder) + ["--out", out]) == 2
    one_line_error(capsys, needle)
    assert sorted(os.listdir(tmp_path)) == ["FILE", "images", "train.csv"]  # nothing written into the cwd
    assert (tmp_path / "FILE").read_text() == "keep me"


# ---------------------------------------------------------------- 4: workers die with their parent


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM])
def test_writer_workers_die_with_their_parent(slow_source, tmp_path, sig):
    args, _ = slow_source
    out = str(tmp_path / "out")
    # PNG at 256 px: each batch of results is larger than a pipe's buffer, so workers block writing it once
    # nobody reads -- where torch's own parent check never runs.
    cmd = [
        sys.executable,
        "-m",
        "tfpipe.write",
        *args[:4],
        "--image-size",
        "256",
        "--format",
        "png",
        "--out",
        out,
        "--workers",
        "2",
        "--no-progress",
    ]
    proc = subprocess.Popen(cmd, env=ENV, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    deadline = time.time() + 120
    workers = []
    while len(workers) < 2 or finished_shards(out) < 1:
        assert proc.poll() is None and time.time() < deadline, proc.communicate()
        workers = children(proc.pid)
        time.sleep(0.01)
    time.sleep(1.0)  # let the workers fill their pipes
    proc.send_signal(sig)
    proc.wait(30)
    deadline = time.time() + 3
    while any(alive(w) for w in workers) and time.time() < deadline:
        time.sleep(0.05)
    leftover = [w for w in workers if alive(w)]
    for w in leftover:
        os.kill(w, signal.SIGKILL)
    assert not leftover, f"workers {leftover} outlived their parent"


# ---------------------------------------------------------------- 1: labels and images are never silently changed


def _with_orientation(fmt, orientation):
    """A 24x40 image with an unmistakable corner, saved as ``fmt`` carrying an EXIF orientation."""
    import io

    from PIL import Image

    rgb = np.zeros((24, 40, 3), np.uint8)
    rgb[:8, :12] = (255, 40, 0)
    rgb[:, :, 1] += (np.arange(40) * 5).astype(np.uint8)
    exif = Image.Exif()
    exif[0x0112] = orientation
    extra = {
        "MPO": {"save_all": True, "append_images": [Image.fromarray(rgb)]},
        "WEBP": {"lossless": True},
        "JPEG": {"quality": 98},
    }.get(fmt, {})
    buf = io.BytesIO()
    Image.fromarray(rgb).save(buf, fmt, exif=exif, **extra)
    return buf.getvalue()


@pytest.mark.parametrize("fmt", ["JPEG", "MPO", "PNG", "WEBP", "TIFF"])
def test_every_format_is_stored_upright_as_pillow_shows_it(fmt):
    import io

    import cv2
    from PIL import Image, ImageOps

    from tfpipe.writer.images import ImageSpec, prepare_image

    for orientation in range(1, 9):
        data = _with_orientation(fmt, orientation)
        with Image.open(io.BytesIO(data)) as im:
            assert im.format == fmt and im.getexif().get(0x0112) == orientation  # the file really says so
            expected = np.asarray(ImageOps.exif_transpose(im).convert("RGB")).astype(int)
        stored, _height, _width, _ = prepare_image(data, ImageSpec(format="png"), f"x.{fmt.lower()}")
        got = cv2.imdecode(np.frombuffer(stored, np.uint8), cv2.IMREAD_COLOR)[:, :, ::-1].astype(int)
        assert got.shape == expected.shape, (fmt, orientation)
        assert np.abs(got - expected).mean() < 3, (fmt, orientation)  # JPEG decoders differ by a level or two


def _labels_csv(folder, tmp_path, cells, header=("image", "labels")):
    rows = [(name, cell) for (name, _), cell in zip(folder["rows"], cells)] + list(folder["rows"][len(cells) :])
    return str(write_csv(tmp_path / "labels.csv", list(header), [r + (r[1],) * (len(header) - 2) for r in rows]))


@pytest.mark.parametrize(
    "cell,needles",
    [
        ("cat, dog", ["row 1", "'labels'", "'cat, dog'", "','", "--sep ,"]),
        ("cat,dog", ["row 1", "'cat,dog'", "--sep ,"]),
        ("cat\tdog", ["row 1", "'cat\\tdog'", "'\\t'", "--sep $'\\t'"]),  # a tab is no space: no class 'cat\tdog'
        ("cat dog|bird", ["row 1", "'|'", "--sep '|'"]),
        ("['cat', 'dog']", ["row 1", "Python list", "--sep list"]),
        ("[]", ["row 1", "'[]'", "--sep list"]),
        ("nan", ["row 1", "'nan'", "missing-value"]),
        ("cat None", ["row 1", "'None'", "missing-value"]),
        ("cat none", ["row 1", "'none'", "missing-value"]),  # any case, and pandas' other spellings (issue #53)
        ("-nan", ["row 1", "'-nan'", "missing-value"]),
    ],
)
def test_label_cells_read_one_way_only_or_are_named(labeled_folder, tmp_path, capsys, cell, needles):
    csv_path = _labels_csv(labeled_folder, tmp_path, [cell])
    assert write(["--csv", csv_path, "--images", labeled_folder["images"], "--out", str(tmp_path / "o")]) == 2
    one_line_error(capsys, "labels.csv", *needles)
    assert not (tmp_path / "o").exists() or not tfrec_files(tmp_path / "o")


@pytest.mark.parametrize("column", ["image", "class"])
def test_one_missing_value_rule_for_every_column_read(labeled_folder, tmp_path, capsys, column):
    """Ids and a class column refuse pandas' missing-value spellings as labels and groups do (issue #53): one
    line naming the row and the column, never a real id or class named 'nan'."""
    rows = [(name, cell.split()[0] if cell else "cat") for name, cell in labeled_folder["rows"]]
    rows[2] = ("na", rows[2][1]) if column == "image" else (rows[2][0], "Null")
    csv_path = str(write_csv(tmp_path / "labels.csv", ["image", "class"], rows))
    args = [
        "--csv",
        csv_path,
        "--images",
        labeled_folder["images"],
        "--out",
        str(tmp_path / "o"),
        "--class-col",
        "class",
    ]
    assert write(args) == 2
    one_line_error(capsys, f"labels.csv: row 3, column '{column}': ", "is a missing-value spelling, not a")


def test_a_class_folder_named_as_a_missing_value_is_refused(tmp_path, capsys):
    """A class folder ``None`` (or ``--classes NA``) would be written, then read back as an empty cell from every
    CSV tfpipe writes (oof.csv's labels): refused at the write, as the same name in a CSV is."""
    for name in ("cat", "None"):
        (tmp_path / "images" / name).mkdir(parents=True)
        save(tmp_path / "images" / name / "a.jpg", size=(16, 16))
    assert write(["--images", str(tmp_path / "images"), "--out", str(tmp_path / "o")]) == 2
    one_line_error(capsys, "class folder 'None': 'None' is a missing-value spelling, not a class")


def test_python_list_cells_are_read_as_lists_when_asked(labeled_folder, tmp_path):
    cells = ["['cat', 'dog']", "[]", "['dog']", "", "['bird', 'cat']"]
    csv_path = _labels_csv(labeled_folder, tmp_path, cells)
    rows = [r[1] for r in labeled_folder["rows"][len(cells) :]]
    lists = [f"{r.split()!r}" for r in rows]  # the rest as lists too: "cat dog" -> ['cat', 'dog']
    csv_path = _labels_csv(labeled_folder, tmp_path, cells + lists)
    out = str(tmp_path / "o")
    assert write(["--csv", csv_path, "--images", labeled_folder["images"], "--out", out, "--sep", "list"]) == 0
    targets = tfpipe.read_targets(out, 3)
    names = tfpipe.image_names(out)
    row = {n: targets[names.index(n)].tolist() for n in names}
    assert row["img00"] == [0, 1, 1] and row["img01"] == [0, 0, 0] and row["img04"] == [1, 1, 0]
    manifest = json.loads(open(os.path.join(out, "manifest.json")).read())
    assert manifest["label_format"]["sep"] == "list"


def test_a_column_named_twice_is_refused(labeled_folder, tmp_path, capsys):
    csv_path = _labels_csv(labeled_folder, tmp_path, [], header=("image", "labels", "labels"))
    assert write(["--csv", csv_path, "--images", labeled_folder["images"], "--out", str(tmp_path / "o")]) == 2
    one_line_error(capsys, "labels.csv", "'labels' twice")


def test_a_missing_class_in_a_single_label_column_is_named(tmp_path, capsys):
    (tmp_path / "images").mkdir()
    for i in range(3):
        save(tmp_path / "images" / f"{i}.jpg", seed=i)
    csv_path = write_csv(tmp_path / "c.csv", ["image", "label"], [("0.jpg", "a"), ("1.jpg", "nan"), ("2.jpg", "b")])
    assert (
        write(
            [
                "--csv",
                str(csv_path),
                "--images",
                str(tmp_path / "images"),
                "--class-col",
                "label",
                "--out",
                str(tmp_path / "o"),
            ]
        )
        == 2
    )
    one_line_error(capsys, "row 2", "'nan'")


@pytest.mark.parametrize(
    "ids,needles",
    [
        (["img00", "img00.jpg"], ["rows 1 and 2", "'img00'", "'img00.jpg'", "img00.jpg"]),
        (["img00.jpg", "./img00.jpg"], ["rows 1 and 2", "'./img00.jpg'"]),
        (["../train.csv"], ["row 1", "'../train.csv'", "outside"]),
        (["/etc/hostname"], ["row 1", "'/etc/hostname'", "outside"]),
        (["twin"], ["row 1", "'twin'", "twin.jpg", "twin.png"]),
    ],
)
def test_ids_name_one_file_inside_images_and_one_file_one_row(labeled_folder, tmp_path, capsys, ids, needles):
    save(os.path.join(labeled_folder["images"], "twin.jpg"))
    save(os.path.join(labeled_folder["images"], "twin.png"), kind="png")
    csv_path = write_csv(tmp_path / "ids.csv", ["image", "labels"], [(i, "cat") for i in ids])
    assert write(["--csv", str(csv_path), "--images", labeled_folder["images"], "--out", str(tmp_path / "o")]) == 2
    one_line_error(capsys, "ids.csv", *needles)


def test_a_file_name_that_is_not_utf8_is_named(tmp_path, capsys):
    tree = tmp_path / "tree"
    (tree / "cat").mkdir(parents=True)
    save(tree / "cat" / "ok.jpg")
    save(os.path.join(os.fsencode(tree / "cat"), b"caf\xe9.jpg").decode("utf-8", "surrogateescape"))
    assert write(["--images", str(tree), "--out", str(tmp_path / "o")]) == 2
    one_line_error(capsys, "caf\\xe9.jpg", "not valid UTF-8")


@pytest.mark.parametrize(
    "flag,make,needle",
    [
        ("--csv", lambda p: p.mkdir(), "is a folder"),
        ("--csv", lambda p: p.write_bytes(b"image,labels\nx,\xff\xfe\n"), "cannot parse CSV"),
        (
            "--images",
            lambda p: p.write_text("not a folder"),
            "is a file; --images names the folder that holds the images",
        ),
        ("--csv", None, "--csv is empty"),  # an unset variable: would have read --images as a folder per class
        ("--images", None, "--images is empty"),
    ],
)
def test_unreadable_csv_or_folder_is_one_line(labeled_folder, tmp_path, capsys, flag, make, needle):
    args = {"--csv": labeled_folder["csv"], "--images": labeled_folder["images"]}
    args[flag] = ""
    if make is not None:
        make(tmp_path / "bad")
        args[flag] = str(tmp_path / "bad")
    assert write(["--csv", args["--csv"], "--images", args["--images"], "--out", str(tmp_path / "o")]) == 2
    one_line_error(capsys, needle)


def test_an_unreadable_file_is_one_line(labeled_folder, tmp_path, capsys, monkeypatch):
    import builtins

    real = builtins.open

    def denied(path, *args, **kwargs):  # tests run as root here, where chmod 000 does not stop reading
        if str(path) == labeled_folder["csv"]:
            raise PermissionError(errno.EACCES, "Permission denied", str(path))
        return real(path, *args, **kwargs)

    monkeypatch.setattr(builtins, "open", denied)
    assert write(source_args(labeled_folder) + ["--out", str(tmp_path / "o")]) == 2
    one_line_error(capsys, "train.csv", "Permission denied")


# ---------------------------------------------------------------- 3: shards and runs checked against their claims


def test_a_glob_that_picks_up_a_foreign_tfrec_names_it(shard_dir, tmp_path):
    import shutil

    from tfpipe.format.tfrecord import RecordWriter

    folder = tmp_path / "mixed"
    shutil.copytree(shard_dir[0], folder)
    with RecordWriter(str(folder / "zz-other.tfrec")) as w:  # another dataset's records: an Example without image
        w.write(tfpipe.format.schema.encode_example({"image_name": "x", "height": 1}))
    with pytest.raises(TfpipeError, match="zz-other.tfrec: not a shard of its folder"):  # beside a manifest
        tfpipe.make_dataset(str(folder / "*.tfrec"), 4, num_classes=3, image_size=32)
    os.remove(folder / "manifest.json")  # foreign shards with no manifest: each file's first record is checked
    with pytest.raises(TfpipeError, match="zz-other.tfrec.*no 'image' bytes feature"):
        tfpipe.make_dataset(str(folder / "*.tfrec"), 4, num_classes=3, image_size=32)
    with RecordWriter(str(folder / "zz-other.tfrec")) as w:
        w.write(b"\x01\x02 not a protobuf \xff")
    with pytest.raises(TfpipeError, match="zz-other.tfrec.*not tf.train.Example"):
        tfpipe.count_examples([str(folder / "zz-other.tfrec")])
    ours = sorted(folder.glob("train-*.tfrec"))[0]
    (folder / "zz-other.tfrec").write_bytes(gzip.compress(ours.read_bytes()))  # a shard of ours, gzipped: said so
    with pytest.raises(TfpipeError, match="zz-other.tfrec: not a TFRecord file .*it reads as GZIP-compressed: tfpipe"):
        tfpipe.make_dataset(str(folder / "*.tfrec"), 4, num_classes=3, image_size=32)
    assert tfpipe.inspect_shards(str(folder / "train-*.tfrec"), sheet=None)["files"]  # ours still read


def test_training_on_unlabeled_shards_is_refused(trained_run, tmp_path):
    from train.fit import FitConfig, fit

    _, _, unlabeled = trained_run
    with pytest.raises(TfpipeError, match="unlabeled.*training needs"):
        fit(FitConfig(records=unlabeled, run=str(tmp_path / "run"), strategy="cpu", model="small-cnn"))
    with pytest.raises(TfpipeError, match="unlabeled.*training needs labels"):
        tfpipe.make_dataset(unlabeled, 4, training=True)
    assert not (tmp_path / "run").exists()


def test_predict_refuses_a_run_of_other_classes_or_image_size(trained_run, tmp_path, labeled_folder):
    from tfpipe import Source, write_shards
    from tfpipe.writer.images import ImageSpec
    from train.predict import predict

    run, _, _test = trained_run
    source = Source(labeled_folder["images"], csv=labeled_folder["csv"], labeled=True)
    other = str(tmp_path / "other-classes")
    write_shards(source, other, spec=ImageSpec(image_size=32), workers=0, progress=False)  # bird/cat/dog, not a/b/c
    with pytest.raises(TfpipeError, match="classes .*bird, cat, dog.* are not the run's .*a, b, c"):
        predict(run, other, str(tmp_path / "s.csv"), strategy="cpu")
    bigger = str(tmp_path / "bigger")
    write_shards(
        Source(labeled_folder["images"], labeled=False),
        bigger,
        spec=ImageSpec(image_size=48),
        split="test",
        workers=0,
        progress=False,
    )
    manifest = json.loads(open(os.path.join(bigger, "manifest.json")).read())
    assert manifest["classes"] == []  # unlabeled shards carry no classes: only the size is checked
    with pytest.raises(TfpipeError, match="stored at 48 px, the run.s training images at 32 px"):
        predict(run, bigger, str(tmp_path / "s.csv"), strategy="cpu")
    assert not (tmp_path / "s.csv").exists()


def test_fit_resume_never_trains_over_a_finished_run_or_with_other_settings(trained_run, shard_dir, tmp_path):
    import shutil

    from train.fit import FitConfig, fit

    run, _metrics, _ = trained_run
    copy = tmp_path / "run"
    shutil.copytree(run, copy)
    before = {p: os.path.getmtime(os.path.join(copy, p)) for p in os.listdir(copy)}
    cfg = FitConfig(
        records=shard_dir[0],
        run=str(copy),
        strategy="cpu",
        replicas=8,
        model="small-cnn",
        batch_size=1,
        epochs=3,
        steps_per_execution=1,
        lr=1e-3,
        augment=NO_AUGMENT,
        verbose=0,
        seed=1,
        swa_epochs=2,
        resume=True,
    )
    with pytest.raises(TfpipeError, match="finished run.*another"):
        fit(cfg)
    assert {p: os.path.getmtime(os.path.join(copy, p)) for p in os.listdir(copy)} == before
    state = json.loads((copy / "state.json").read_text())
    (copy / "state.json").write_text(json.dumps(dict(state, finished=False)))  # as if interrupted
    import dataclasses

    with pytest.raises(TfpipeError, match="started with lr=0.001, not 0.01"):
        fit(dataclasses.replace(cfg, lr=1e-2))


def _fit_cli(args):
    from train.fit import main

    try:
        return main(args + ["--strategy", "cpu", "--model", "small-cnn", "--verbose", "0"])
    except SystemExit as e:  # argparse's own errors exit
        return e.code


@pytest.mark.slow
def test_a_second_fit_into_the_same_run_folder_is_refused_while_the_first_runs(shard_dir, tmp_path, capsys):
    """Two fits into one --out used to both train: one history.csv held both runs' rows and both ended in a
    traceback. The first now runs alone (the writer's lock, taken by train.fit on its run folder)."""
    run = tmp_path / "run"
    args = ["--records", shard_dir[0], "--run", str(run), "--epochs", "30"]  # long enough to be caught
    first = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "train.fit",
            *args,
            "--strategy",
            "cpu",
            "--model",
            "small-cnn",
            "--verbose",
            "0",
            "--no-report",
        ],
        env=ENV,
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    deadline = time.time() + 120
    while not (run / "config.json").exists():  # written under the lock, before training
        assert first.poll() is None and time.time() < deadline, first.communicate()
        time.sleep(0.01)
    assert _fit_cli(args) == 2
    one_line_error(capsys, "being written by another train.fit", f"pid {first.pid}")
    assert first.wait(300) == 0, first.communicate()
    assert len((run / "history.csv").read_text().splitlines()) == 1 + 30  # the header and its own 30 epochs
    assert json.loads((run / "metrics.json").read_text())["epochs"] == 30
    assert not (run / ".tfpipe-write.lock").exists()


@pytest.mark.parametrize(
    "flags,needle",
    [
        (["--epochs", "0"], "--epochs must be at least 1 (got 0)"),
        (["--batch-size", "0"], "--batch-size must be at least 1 (got 0)"),
        (["--steps-per-execution", "0"], "--steps-per-execution must be at least 1 (got 0)"),
        (["--lr", "-1"], "--lr must be above 0 (got -1.0)"),
        (["--lr", "nan"], "--lr must be above 0 (got nan)"),
        (["--lr", "inf"], "--lr must be finite (got inf)"),  # trained to NaN before
        (["--weight-decay", "inf"], "--weight-decay must be finite (got inf)"),
        (["--replicas", "-2"], "--replicas must be at least 1 (got -2)"),
        (["--image-size", "7"], "--image-size 7 is below small-cnn's smallest input (8 px)"),
        (["--val-fraction", "1.5"], "--val-fraction must be between 0 and 1"),
        (["--epochs", "x"], "argument --epochs: invalid int value: 'x'"),
        (["--run", ""], "--run is empty"),
    ],
)
def test_fit_refuses_nonsense_numbers_in_one_line(shard_dir, tmp_path, capsys, flags, needle):
    assert _fit_cli(["--records", shard_dir[0], "--run", str(tmp_path / "run"), *flags]) == 2
    one_line_error(capsys, needle)
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize(
    "kwargs,needle",
    [
        ({"batch_size": 0}, "batch_size must be at least 1 (got 0)"),
        ({"batch_size": -1}, "batch_size must be at least 1 (got -1)"),
        ({"batch_size": 2.5}, "batch_size must be a whole number (got 2.5)"),
        ({"batch_size": True}, "batch_size must be a whole number (got True)"),
        ({"batch_size": 2, "num_classes": 0}, "num_classes must be at least 1 (got 0)"),  # not "from the manifest"
        ({"batch_size": 2, "image_size": 0}, "image_size must be at least 1 (got 0)"),
    ],
)
def test_make_dataset_refuses_nonsense_numbers_by_name(shard_dir, kwargs, needle):
    """The Python API refuses what the command line refuses, naming the argument (TensorFlow's own message
    named BatchDatasetV2, and 0 classes or 0 px quietly meant "from the manifest")."""
    with pytest.raises(TfpipeError, match=re.escape(needle)):
        tfpipe.make_dataset(shard_dir[0], **kwargs)


def test_fit_without_the_report_packages_is_refused_before_training(shard_dir, tmp_path, monkeypatch, capsys):
    """Installed without [train]'s matplotlib, a run used to train to the end and then fail on its pictures,
    leaving a 'finished' run with no metrics.json. The report's packages are checked before anything starts."""
    import importlib.util

    find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "matplotlib" else find_spec(name, *a)
    )
    run = tmp_path / "run"
    assert _fit_cli(["--records", shard_dir[0], "--run", str(run)]) == 2
    one_line_error(capsys, "matplotlib is not installed", "pip install 'tfpipe[train]'")
    assert not run.exists()
    assert _fit_cli(["--records", shard_dir[0], "--run", str(run), "--epochs", "1", "--no-report"]) == 0  # not needed


def test_fit_from_python_refuses_fractional_counts(shard_dir, tmp_path):
    from train.fit import FitConfig, fit

    with pytest.raises(TfpipeError, match=re.escape("epochs must be a whole number (got 2.5)")):
        fit(FitConfig(records=shard_dir[0], run=str(tmp_path / "run"), epochs=2.5))
    assert not (tmp_path / "run").exists()


def test_fit_fold_on_shards_without_folds_is_refused(labeled_folder, tmp_path, capsys):
    out = str(tmp_path / "r")
    assert write(source_args(labeled_folder) + ["--out", out, "--num-shards", "4"]) == 0
    assert _fit_cli(["--records", out, "--run", str(tmp_path / "run"), "--fold", "9"]) == 2
    one_line_error(capsys, "written without folds", "--fold 9")


def test_predict_never_joins_a_class_name_holding_a_space(trained_run, tmp_path, capsys):
    """Classes from one-hot columns or folder names may hold spaces (`New York`); joined with spaces in a
    multi-label submission they would read back as two labels."""
    import shutil

    from train.predict import main as predict_main
    from train.predict import predict

    run, _, test = trained_run
    spaced = tmp_path / "run"
    shutil.copytree(run, spaced)
    config = json.loads((spaced / "config.json").read_text())
    config["classes"][0] = "New York"
    (spaced / "config.json").write_text(json.dumps(config))
    out = tmp_path / "sub.csv"
    assert predict_main(["--run", str(spaced), "--records", test, "--out", str(out), "--no-progress"]) == 2
    one_line_error(capsys, "'New York' holds a space", "--probabilities")
    assert not out.exists()
    df = predict(str(spaced), test, str(out), probabilities=True, progress=False)
    assert "New York" in df.columns and len(df) == 40


@pytest.mark.parametrize(
    "flags,needle",
    [
        (["--batch-size", "0"], "--batch-size must be at least 1 (got 0)"),
        (["--tta", "9"], "--tta must be in 1..8"),
        (["--replicas", "0"], "--replicas must be at least 1 (got 0)"),
        (["--run", ""], "--run is empty"),
        (["--threshold", "5"], "--threshold must be between 0 and 1 (got 5.0)"),  # an empty submission otherwise
        (["--threshold", "nan"], "--threshold must be between 0 and 1 (got nan)"),
    ],
)
def test_predict_refuses_bad_flags_before_predicting(trained_run, tmp_path, capsys, flags, needle):
    from train.predict import main

    run, _, test = trained_run
    assert main(["--run", run, "--records", test, "--out", str(tmp_path / "s.csv"), "--strategy", "cpu", *flags]) == 2
    one_line_error(capsys, needle)


def test_predict_into_a_missing_folder_creates_it_and_a_folder_as_out_is_refused(trained_run, tmp_path, capsys):
    from train.predict import main

    run, _, test = trained_run
    out = tmp_path / "new" / "deeper" / "submission.csv"
    assert main(["--run", run, "--records", test, "--out", str(out), "--strategy", "cpu"]) == 0
    assert len(out.read_text().splitlines()) == 41
    capsys.readouterr()
    assert main(["--run", run, "--records", test, "--out", str(tmp_path), "--strategy", "cpu"]) == 2
    one_line_error(capsys, "is a folder")


def test_the_headline_auc_is_the_exact_one_and_the_estimate_is_labelled(trained_run, shard_dir):
    from sklearn.metrics import roc_auc_score

    run, metrics, _ = trained_run
    val = __import__("pandas").read_csv(os.path.join(run, "val_predictions.csv"), keep_default_na=False)
    truth = np.array([[c in t.split() for c in "abc"] for t in val["true"]], float)
    exact = roc_auc_score(truth, val[["a", "b", "c"]].to_numpy(), average="macro")
    assert metrics["report"]["roc_auc_macro"] == pytest.approx(exact, abs=1e-6)
    from train.fit import summary_lines
    from train.runs.results import FitResult

    line = summary_lines(FitResult.load(run))[0]
    assert line.startswith(f"validation AUC {exact:.4f} (exact; Keras' binned estimate ")


def test_a_benchmark_child_dies_with_its_parent(tmp_path):
    """bench/ starts each contender as a subprocess (``preexec_fn=child_of_this_process()``)."""
    pid_file = tmp_path / "child.pid"
    child_code = f"import os, time; open({str(pid_file)!r}, 'w').write(str(os.getpid())); time.sleep(600)"
    script = tmp_path / "parent.py"
    script.write_text(
        "import subprocess, sys\nfrom tfpipe.runtime.lifecycle import child_of_this_process\n"
        f"subprocess.run([sys.executable, '-c', {child_code!r}], preexec_fn=child_of_this_process())\n"
    )
    parent = subprocess.Popen([sys.executable, str(script)], env=ENV, cwd=ROOT)
    deadline = time.time() + 60
    while not pid_file.exists() or not pid_file.read_text():
        assert parent.poll() is None and time.time() < deadline
        time.sleep(0.05)
    child = int(pid_file.read_text())
    parent.kill()
    parent.wait(10)
    deadline = time.time() + 3
    while alive(child) and time.time() < deadline:
        time.sleep(0.05)
    if alive(child):
        os.kill(child, signal.SIGKILL)
        pytest.fail("the child outlived its parent")


def test_predict_replaces_only_an_earlier_submission(trained_run, tmp_path, capsys):
    from train.predict import main

    run, _, test = trained_run
    victim = tmp_path / "train.csv"
    victim.write_text("image,labels\nx,cat\n")
    assert main(["--run", run, "--records", test, "--out", str(victim), "--strategy", "cpu"]) == 2
    one_line_error(capsys, "train.csv exists and was not written by train.predict")
    assert victim.read_text() == "image,labels\nx,cat\n"
    manifest = os.path.join(test, "manifest.json")
    before = open(manifest).read()
    assert main(["--run", run, "--records", test, "--out", manifest, "--strategy", "cpu"]) == 2
    assert open(manifest).read() == before
    out = tmp_path / "submission.csv"
    assert main(["--run", run, "--records", test, "--out", str(out), "--strategy", "cpu"]) == 0
    assert main(["--run", run, "--records", test, "--out", str(out), "--strategy", "cpu"]) == 0  # a re-run replaces


# Principle 2 beyond the writer: the demo and the contact sheet write only over what they wrote before.


def test_inspect_sheet_replaces_only_a_sheet_it_wrote(shard_dir, tmp_path, capsys):
    from PIL import Image

    from tfpipe.inspect import main as inspect_main

    csv_file, photo = tmp_path / "train.csv", tmp_path / "contact_sheet.png"
    csv_file.write_text("image,labels\na,cat\n")
    Image.new("RGB", (4, 4), "red").save(photo)  # the user's own PNG of that name
    for victim in (csv_file, photo):
        before = victim.read_bytes()
        assert inspect_main([shard_dir[0], "--sheet", str(victim)]) == 2
        one_line_error(capsys, str(victim), "not a contact sheet tfpipe.inspect wrote", "--no-sheet")
        assert victim.read_bytes() == before
    sheet = tmp_path / "sheet.png"
    for _ in range(2):  # its own sheet: written, then replaced by the re-run
        assert inspect_main([shard_dir[0], "--sheet", str(sheet)]) == 0
        with Image.open(sheet) as im:
            assert im.text["Software"] == "tfpipe.inspect contact sheet" and im.size[0] > 100
    assert inspect_main([shard_dir[0], "--sheet", str(tmp_path)]) == 2


def test_the_demo_never_writes_over_a_users_dataset(tmp_path, capsys):
    from tfpipe.demo import main as demo_main

    users = tmp_path / "kaggle"
    users.mkdir()
    (users / "train.csv").write_text("image,labels\nmine,cat\n")
    assert demo_main([str(users), "--train", "3", "--test", "1"]) == 2
    one_line_error(capsys, "train.csv", "the demo did not write")
    assert (users / "train.csv").read_text() == "image,labels\nmine,cat\n" and sorted(os.listdir(users)) == [
        "train.csv"
    ]
    ours = tmp_path / "demo"
    for _ in range(2):  # a new folder, then over itself
        assert demo_main([str(ours), "--train", "3", "--test", "1"]) == 0
    assert (ours / "train.csv").read_text().splitlines()[1].startswith("train_00000,")
    os.remove(ours / ".tfpipe-demo.json")  # a demo folder written before the mark existed is still the demo's
    assert demo_main([str(ours), "--train", "3", "--test", "1"]) == 0
    (tmp_path / "file").write_text("x")
    assert demo_main([str(tmp_path / "file")]) == 2


def test_demo_counts_are_checked_from_python_and_the_command_line(tmp_path, capsys):
    from tfpipe.demo import main as demo_main
    from tfpipe.demo import make_demo

    for kwargs, culprit in (
        ({"train": 0}, "train must be at least 1"),
        ({"test": -1}, "test must be at least 0"),
        ({"train": 2.5}, "train must be a whole number"),
    ):
        with pytest.raises(TfpipeError, match=culprit):
            make_demo(str(tmp_path / "py"), **kwargs)
    assert not (tmp_path / "py").exists()  # refused before anything is written
    assert demo_main([str(tmp_path / "cli"), "--train", "0"]) == 2
    one_line_error(capsys, "--train must be at least 1 (got 0)")
    assert not (tmp_path / "cli").exists()


@pytest.mark.parametrize(
    "seed,needle",
    [("-1", "--seed must be at least 0 (got -1)"), (str(2**32), "--seed must be below 2**32 (got 4294967296)")],
)
def test_a_seed_numpy_cannot_take_is_one_line_before_anything_is_written(
    labeled_folder, shard_dir, tmp_path, capsys, seed, needle
):
    """--seed -1 was NumPy's / scikit-learn's traceback from deep inside the demo, the fold split or fit."""
    from tfpipe.demo import main as demo_main

    assert demo_main([str(tmp_path / "demo"), "--train", "3", "--seed", seed]) == 2
    one_line_error(capsys, needle)
    assert (
        write(source_args(labeled_folder) + ["--out", str(tmp_path / "rec"), "--num-folds", "2", "--seed", seed]) == 2
    )
    one_line_error(capsys, needle)
    assert _fit_cli(["--records", shard_dir[0], "--run", str(tmp_path / "run"), "--seed", seed]) == 2
    one_line_error(capsys, needle)
    assert not [p for p in ("demo", "rec", "run") if (tmp_path / p).exists()]
