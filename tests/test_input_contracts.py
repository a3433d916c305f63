"""What the writer accepts as input (issue #22, items 7, 8 and the image settings of 9), one test per case.

1. Bounded input: a source is stat'ed before it is opened (only regular files), its size and its header's
   pixels are checked before the rest is read. /dev/zero, a FIFO and a 3 GB sparse file end in one line within
   seconds and bounded memory, or are skipped and listed with --skip-bad.
2. Labels are read one way only: NFC, no invisible characters, one spelling per number, no space in a label read
   with a non-whitespace separator unless class names have spaces; a 1 x N image is fitted like any other.
3. Image settings that parse but mean nothing are refused when the ImageSpec is made, before any work.
"""

import contextlib
import glob
import json
import os
import re
import resource
import subprocess
import sys
import threading
import time
import unicodedata

import cv2
import numpy as np
import pytest
import tensorflow as tf

from tests.conftest import save, write_csv
from tests.test_hostile import one_line_error, write
from tests.test_reliability import ENV, ROOT
from tfpipe.runtime.errors import TfpipeError
from tfpipe.tf.parse import feature_spec

MEMORY_HEADROOM = 1 << 30  # what an in-process write of a few small images may allocate on top of the test process
SECONDS = 20  # "within seconds", with room for a slow shared CPU
SPARSE_BYTES = 3 * 2**30


def manifest(out):
    with open(os.path.join(out, "manifest.json")) as f:
        return json.load(f)


def records(out):
    """{image_name: (target list, decoded BGR image)} of a shard folder."""
    files = sorted(glob.glob(os.path.join(out, "*.tfrec")))
    rows = {}
    for batch in tf.data.TFRecordDataset(files).batch(64):
        parsed = tf.io.parse_example(batch, feature_spec())
        targets = parsed["target"].numpy() if "target" in parsed else [[]] * len(parsed["image_name"])
        for name, target, image in zip(parsed["image_name"].numpy(), targets, parsed["image"].numpy()):
            rows[name.decode()] = (
                [int(t) for t in target if t >= 0],
                cv2.imdecode(np.frombuffer(image, np.uint8), cv2.IMREAD_COLOR),
            )
    return rows


def tfrec_files(out):
    return glob.glob(os.path.join(out, "*.tfrec"))


# ---------------------------------------------------------------- 1: bounded input


def _vm_data():
    with open("/proc/self/status") as f:
        return int(re.search(r"VmData:\s+(\d+) kB", f.read()).group(1)) * 1024


@contextlib.contextmanager
def bounded_memory(headroom=MEMORY_HEADROOM):
    """Caps this process's heap at its current size plus ``headroom`` (RLIMIT_DATA), so a write that reads
    /dev/zero or a 3 GB file to its end fails the test with a MemoryError instead of exhausting the machine."""
    soft, hard = resource.getrlimit(resource.RLIMIT_DATA)
    resource.setrlimit(resource.RLIMIT_DATA, (_vm_data() + headroom, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_DATA, (soft, hard))


@contextlib.contextmanager
def fifo_rescue(path, after=SECONDS):
    """After ``after`` seconds, opens and closes the FIFO's write end whenever a reader waits on it: a writer
    that blocked on the FIFO then reads an empty file and the test fails on its message instead of hanging."""
    done = threading.Event()

    def rescue():
        if done.wait(after):
            return
        while not done.is_set():
            try:
                os.close(os.open(path, os.O_WRONLY | os.O_NONBLOCK))
            except OSError:  # ENXIO: nobody is reading
                pass
            time.sleep(0.1)

    thread = threading.Thread(target=rescue, daemon=True)
    thread.start()
    try:
        yield
    finally:
        done.set()
        thread.join()


def _dev_zero(path):
    os.symlink("/dev/zero", path)


def _sparse(path, size=SPARSE_BYTES):
    with open(path, "wb") as f:
        f.truncate(size)  # sparse: costs no disk


BAD_SOURCES = {  # name in the CSV -> (how to make it, what the one line says)
    "zero": (_dev_zero, ["zero.jpg", "is a character device", "/dev/zero", "not a regular file"]),
    "pipe": (os.mkfifo, ["pipe.jpg", "is a FIFO (named pipe)", "not a regular file"]),
    "sparse": (_sparse, ["sparse.jpg", "3,221", "MB, above the 1,000 MB limit", "--max-bytes"]),
}


def _folder_with(tmp_path, *bad):
    """Six good JPEGs plus the ``bad`` sources (``BAD_SOURCES`` names), all named in one CSV, bad ones in the
    middle so good images come before and after them."""
    images = tmp_path / "images"
    images.mkdir()
    rows = []
    for i in range(6):
        save(images / f"ok{i}.jpg", size=(40, 56), seed=i)
        rows.append((f"ok{i}", ["cat", "dog"][i % 2]))
    for name in bad:
        BAD_SOURCES[name][0](str(images / f"{name}.jpg"))
    rows[3:3] = [(name, "cat") for name in bad]
    return str(write_csv(tmp_path / "train.csv", ["image", "labels"], rows)), str(images)


@pytest.mark.parametrize("skip_bad", [False, True], ids=["stop", "skip-bad"])
@pytest.mark.parametrize("bad", sorted(BAD_SOURCES))
def test_dev_zero_a_fifo_and_a_sparse_file_end_in_one_line(tmp_path, capsys, bad, skip_bad):
    csv_path, images = _folder_with(tmp_path, bad)
    out = str(tmp_path / "out")
    started = time.monotonic()
    with bounded_memory(), fifo_rescue(os.path.join(images, "pipe.jpg")):
        code = write(
            ["--csv", csv_path, "--images", images, "--out", out, "--image-size", "16"] + ["--skip-bad"] * skip_bad
        )
    assert time.monotonic() - started < SECONDS
    if not skip_bad:
        assert code == 2
        one_line_error(capsys, *BAD_SOURCES[bad][1])
        assert not tfrec_files(out)
        return
    assert code == 0, capsys.readouterr().err
    m = manifest(out)
    assert m["num_examples"] == 6 and sorted(records(out)) == [f"ok{i}" for i in range(6)]
    assert [s["image"] for s in m["skipped"]] == [bad]
    assert all(needle in m["skipped"][0]["reason"] for needle in BAD_SOURCES[bad][1])
    assert re.search(f"skipped 1 images?: {bad} ", capsys.readouterr().out)


def test_a_file_over_a_raised_byte_limit_is_refused_from_its_header(tmp_path, capsys):
    csv_path, images = _folder_with(tmp_path, "sparse")
    with bounded_memory():  # 3 GB of zeros: Pillow reads a few kB and finds no image format
        assert write(["--csv", csv_path, "--images", images, "--out", str(tmp_path / "o"), "--max-bytes", "4000"]) == 2
    one_line_error(capsys, "sparse.jpg", "not a readable image")


def test_declared_pixels_are_refused_before_the_rest_is_read(tmp_path, capsys):
    from tests.test_reliability import png_header_only

    csv_path, images = _folder_with(tmp_path)
    with open(os.path.join(images, "ok2.jpg"), "wb") as f:  # a 200 MP header, then 3 GB of nothing
        f.write(png_header_only(20000, 10000))
        f.truncate(SPARSE_BYTES)
    with bounded_memory():
        assert write(["--csv", csv_path, "--images", images, "--out", str(tmp_path / "o"), "--max-bytes", "4000"]) == 2
    one_line_error(capsys, "ok2.jpg", "20000x10000 is 200 MP", "--max-pixels")


# Runs argv[2:] and writes the peak RSS (kB) of it and its descendants to argv[1]. The command is started from
# this small process, not from pytest: a child forked from a large parent inherits the parent's high-water mark
# (Linux keeps ru_maxrss across exec), which made a 320 MB write read as 2.3 GB in the full suite.
_LAUNCHER = (
    "import resource, subprocess, sys; code = subprocess.call(sys.argv[2:]); "
    "open(sys.argv[1], 'w').write(str(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)); "
    "sys.exit(code)"
)


def _run_with_rusage(cmd, timeout, folder):
    """Runs ``cmd``; returns (exit code or None if killed at ``timeout``, stdout, stderr, peak RSS in MB of it and
    its children). Its output goes through files in ``folder`` (a pipe nobody reads could block it)."""
    peak = folder / "peak_kb"
    with open(os.devnull) as stdin, open(folder / "stdout", "w+") as out, open(folder / "stderr", "w+") as err:
        proc = subprocess.Popen(
            [sys.executable, "-c", _LAUNCHER, str(peak), *cmd],
            env=ENV,
            cwd=ROOT,
            stdin=stdin,
            stdout=out,
            stderr=err,
            start_new_session=True,
        )
        killer = threading.Timer(timeout, lambda: os.killpg(proc.pid, 9))
        killer.start()
        proc.wait()
        timed_out = not killer.is_alive()
        killer.cancel()
        out.seek(0), err.seek(0)
        return None if timed_out else proc.returncode, out.read(), err.read(), int(peak.read_text()) / 1024


@pytest.mark.parametrize("skip_bad", [False, True], ids=["stop", "skip-bad"])
def test_bad_sources_with_worker_processes_end_in_time(tmp_path, skip_bad):
    csv_path, images = _folder_with(tmp_path, "zero", "pipe", "sparse")
    out = str(tmp_path / "out")
    cmd = [
        sys.executable,
        "-m",
        "tfpipe.write",
        "--csv",
        csv_path,
        "--images",
        images,
        "--out",
        out,
        "--image-size",
        "16",
        "--workers",
        "2",
        "--no-progress",
    ] + ["--skip-bad"] * skip_bad
    code, stdout, stderr, peak_mb = _run_with_rusage(cmd, 120, tmp_path)  # a hang is killed and fails here
    assert code == (0 if skip_bad else 2), stderr
    assert peak_mb < 1500, peak_mb  # the sparse file was never read (it took 3.4 GB)
    if not skip_bad:  # the first bad source in input order
        assert stderr.strip().splitlines() == [
            f"tfpipe.write: error: {images}/zero.jpg: is a character device "
            "(a link to /dev/zero), not a regular file; images must be regular files"
        ]
        return
    assert [s["image"] for s in manifest(out)["skipped"]] == ["zero", "pipe", "sparse"]
    assert manifest(out)["num_examples"] == 6 and re.search("skipped 3 images?: zero, pipe, sparse ", stdout)


def test_folder_listings_name_what_is_not_a_regular_file(tmp_path, capsys):
    tree = tmp_path / "tree"
    (tree / "cat").mkdir(parents=True)
    save(tree / "cat" / "a.jpg")
    _dev_zero(str(tree / "cat" / "zero.jpg"))
    os.mkfifo(tree / "cat" / "pipe.png")
    (tree / "cat" / "folder.jpg").mkdir()  # a folder with an image's name
    out = str(tmp_path / "o")
    with bounded_memory(), fifo_rescue(str(tree / "cat" / "pipe.png")):
        assert write(["--images", str(tree), "--out", out, "--skip-bad"]) == 0
    reasons = {s["image"]: s["reason"] for s in manifest(out)["skipped"]}
    assert sorted(reasons) == ["cat/folder.jpg", "cat/pipe.png", "cat/zero.jpg"], reasons
    assert "is a folder" in reasons["cat/folder.jpg"] and "FIFO" in reasons["cat/pipe.png"]
    flat = tmp_path / "flat"  # unlabeled: a FIFO or a broken link was silently left out of the test set
    flat.mkdir()
    save(flat / "a.jpg")
    os.mkfifo(flat / "b.jpg")
    os.symlink(flat / "gone.jpg", flat / "c.jpg")
    (flat / "sub").mkdir()  # sub-folders are not images: still left out
    with fifo_rescue(str(flat / "b.jpg")):
        assert (
            write(
                ["--images", str(flat), "--unlabeled", "--out", str(tmp_path / "u"), "--skip-bad", "--image-size", "16"]
            )
            == 0
        )
    reasons = {s["image"]: s["reason"] for s in manifest(str(tmp_path / "u"))["skipped"]}
    assert sorted(reasons) == ["b.jpg", "c.jpg"] and "No such file" in reasons["c.jpg"], reasons
    with fifo_rescue(str(flat / "b.jpg")):
        assert write(["--images", str(flat), "--unlabeled", "--out", str(tmp_path / "u2"), "--image-size", "16"]) == 2
    one_line_error(capsys, "b.jpg", "FIFO")


def _counting_file(data):
    """A buffered file over ``data`` that records the furthest byte read."""
    import io

    class Raw(io.BytesIO):
        furthest = 0

        def readinto(self, buf):
            n = super().readinto(buf)
            Raw.furthest = max(Raw.furthest, self.tell())
            return n

    raw = Raw(data)
    return io.BufferedReader(raw, buffer_size=8192), raw


def _formats():
    import io

    from PIL import Image

    rgb = np.random.default_rng(0).integers(0, 256, (300, 400, 3), np.uint8)
    exif = Image.Exif()
    exif[0x0112] = 6
    big_exif = Image.Exif()
    big_exif[0x0112] = 6
    big_exif[0x010E] = "x" * 60000  # a 60 kB APP1 segment (camera EXIF with a thumbnail is that size)

    def saved(fmt, **kwargs):
        buf = io.BytesIO()
        Image.fromarray(rgb).save(buf, fmt, **kwargs)
        return buf.getvalue()

    return {
        "jpeg, 60 kB EXIF": (saved("JPEG", exif=big_exif.tobytes()), 6),
        "jpeg, 300 kB ICC": (saved("JPEG", icc_profile=b"\0" * 300_000, exif=exif), 6),
        "png": (saved("PNG", exif=exif), 6),
        "gif": (saved("GIF"), 1),
        "bmp": (saved("BMP"), 1),
        "webp": (saved("WEBP", exif=exif), 6),
        "tiff, directory at the end": (saved("TIFF", compression="tiff_lzw", exif=exif), 6),
    }


@pytest.mark.parametrize("fmt", list(_formats()))
def test_the_header_is_read_from_the_file_wherever_it_is(fmt, monkeypatch):
    """No fixed prefix holds every header (a 300 kB ICC profile comes before a JPEG's size; libtiff writes a TIFF's
    directory after its pixels), so Pillow reads the open file; a 1 kB prefix was enough only for the simple ones."""
    from tfpipe.writer import images
    from tfpipe.writer.images import ImageSpec, prepare_image, read_bounded, read_header

    monkeypatch.setattr(images, "WHOLE_READ_BYTES", 0)  # every file takes the large files' path: header first
    data, orientation = _formats()[fmt]
    f, raw = _counting_file(data)
    got, header = read_bounded(f, len(data), ImageSpec(), fmt)
    assert got == data and header == read_header(data, fmt) and header[3] == orientation
    assert prepare_image(data, ImageSpec(image_size=16), fmt, header=header)[1:3] == (16, 16)
    f, raw = _counting_file(data)
    with pytest.raises(TfpipeError, match="is 0.12 MP, above the 0.0001 MP limit"):
        read_bounded(f, len(data), ImageSpec(max_pixels=100), fmt)  # the header alone decides
    if fmt in ("png", "gif", "bmp"):
        assert raw.furthest <= 8192  # one buffer


def test_a_remote_source_is_read_bounded_too(tmp_path):
    from tfpipe.sources.source import Item
    from tfpipe.writer.encode import encode_item
    from tfpipe.writer.images import ImageSpec

    path = "ram://contracts/a.jpg"
    with tf.io.gfile.GFile(path, "wb") as f:
        f.write(open(save(tmp_path / "a.jpg"), "rb").read())
    assert encode_item(Item(path, "a"), [0], ImageSpec(image_size=16))[1] is None
    record, error = encode_item(Item(path, "a"), [0], ImageSpec(max_bytes=100))
    assert record is None and error.startswith(f"{path}: the file is 0.00") and "MB, above the 0.0001 MB" in error


# ---------------------------------------------------------------- 2: labels read one way only

CAFE_NFC, CAFE_NFD = unicodedata.normalize("NFC", "café"), unicodedata.normalize("NFD", "café")


def _images(tmp_path, n=4):
    images = tmp_path / "images"
    images.mkdir(parents=True, exist_ok=True)
    for i in range(n):
        save(images / f"i{i}.jpg", seed=i)
    return str(images)


def _write_labels(tmp_path, cells, *flags, header=("image", "labels")):
    images = _images(tmp_path, len(cells))
    rows = [(f"i{i}",) + (cell if isinstance(cell, tuple) else (cell,)) for i, cell in enumerate(cells)]
    csv_path = write_csv(tmp_path / "labels.csv", list(header), rows)
    out = str(tmp_path / "o")
    return write(["--csv", str(csv_path), "--images", images, "--out", out, *flags]), out


def test_nfc_and_nfd_spellings_are_one_class(tmp_path):
    assert CAFE_NFC != CAFE_NFD
    code, out = _write_labels(tmp_path, [CAFE_NFC, CAFE_NFD, f"tea {CAFE_NFD}", "tea"])
    assert code == 0 and manifest(out)["classes"] == [CAFE_NFC, "tea"]
    assert [records(out)[f"i{i}"][0] for i in range(4)] == [[0], [0], [0, 1], [1]]
    code, out = _write_labels(tmp_path / "classes", [CAFE_NFC, "tea"], "--classes", f"tea,{CAFE_NFD}")
    assert code == 0 and manifest(out)["classes"] == ["tea", CAFE_NFC]  # --classes typed in the other form


def test_a_folder_name_in_nfd_is_the_nfc_class(tmp_path):
    for name in (CAFE_NFD, "tea"):
        (tmp_path / "tree" / name).mkdir(parents=True)
        save(tmp_path / "tree" / name / "a.jpg")
    out = str(tmp_path / "o")
    assert write(["--images", str(tmp_path / "tree"), "--out", out, "--classes", f"{CAFE_NFC},tea"]) == 0
    assert manifest(out)["classes"] == [CAFE_NFC, "tea"]
    assert records(out)[f"{CAFE_NFD}/a.jpg"][0] == [0]  # the id is the file's own path


@pytest.mark.parametrize(
    "char,name",
    [
        ("\u200b", "U+200B ZERO WIDTH SPACE"),
        ("\u200d", "U+200D ZERO WIDTH JOINER"),
        ("\ufeff", "U+FEFF ZERO WIDTH NO-BREAK SPACE"),
        ("\u00a0", "U+00A0 NO-BREAK SPACE"),
        ("\u3000", "U+3000 IDEOGRAPHIC SPACE"),
        ("\u00ad", "U+00AD SOFT HYPHEN"),
        ("\x1b", "U+001B a control character"),
    ],
)
def test_an_invisible_character_in_a_label_is_named(tmp_path, capsys, char, name):
    code, _ = _write_labels(tmp_path, ["cat", f"dog ca{char}t"])
    assert code == 2
    one_line_error(capsys, "labels.csv", "row 2", "column 'labels'", name, "invisible")


@pytest.mark.parametrize("where", ["class column", "one-hot column", "--classes", "class folder"])
def test_invisible_characters_are_refused_wherever_a_class_is_named(tmp_path, capsys, where):
    zwsp = "cat\u200b"
    images = _images(tmp_path, 2)
    out = str(tmp_path / "o")
    if where == "class folder":
        (tmp_path / "tree" / zwsp).mkdir(parents=True)
        save(tmp_path / "tree" / zwsp / "a.jpg")
        args = ["--images", str(tmp_path / "tree")]
    elif where == "--classes":
        csv_path = write_csv(tmp_path / "c.csv", ["image", "labels"], [("i0", "cat"), ("i1", "")])
        args = ["--csv", str(csv_path), "--images", images, "--classes", f"{zwsp},dog"]
    else:
        header, rows = (
            (["image", "label"], [("i0", zwsp), ("i1", "dog")])
            if where == "class column"
            else (["image", zwsp, "dog"], [("i0", 1, 0), ("i1", 0, 1)])
        )
        csv_path = write_csv(tmp_path / "c.csv", header, rows)
        args = ["--csv", str(csv_path), "--images", images] + (
            ["--class-col", "label"] if where == "class column" else ["--label-cols", f"{zwsp},dog"]
        )
    assert write(args + ["--out", out]) == 2
    one_line_error(capsys, "U+200B ZERO WIDTH SPACE")


@pytest.mark.parametrize("a,b", [("5", "05"), ("5", "+5"), ("5", "5.0"), ("0", "-0"), ("12", "１２")])
def test_one_number_written_two_ways_is_an_error_naming_both(tmp_path, capsys, a, b):
    code, _ = _write_labels(tmp_path, [a, "7", b])
    assert code == 2
    one_line_error(capsys, "labels.csv", f"labels {a!r} (row 1) and {b!r} (row 3)")


def test_numbered_folders_are_checked_like_labels(tmp_path, capsys):
    for name in ("5", "05"):
        (tmp_path / "tree" / name).mkdir(parents=True)
        save(tmp_path / "tree" / name / "a.jpg")
    assert write(["--images", str(tmp_path / "tree"), "--out", str(tmp_path / "o")]) == 2
    one_line_error(capsys, "labels '05' (folder '05') and '5' (folder '5') are one number written two ways")


@pytest.mark.parametrize("a,b", [("cat", "ｃａｔ"), ("2", "²"), ("1", "①")])
def test_compatibility_forms_are_two_spellings(tmp_path, capsys, a, b):
    code, _ = _write_labels(tmp_path, [a, b])
    assert code == 2
    one_line_error(capsys, f"labels {a!r} (row 1) and {b!r} (row 2)", "one spelling")


def test_class_names_sort_only_ascii_integers_as_numbers(tmp_path):
    from tfpipe.sources.source import Item, class_names

    def items(*labels):
        return [Item(f"x{i}", f"x{i}", (label,)) for i, label in enumerate(labels)]

    assert class_names(items("10", "2", "-1", "+3")) == ["-1", "2", "+3", "10"]
    assert class_names(items("①", "10", "3", "²")) == ["10", "3", "²", "①"]  # int("①") was a traceback
    code, out = _write_labels(tmp_path, ["①", "10", "3"])
    assert code == 0 and manifest(out)["classes"] == ["10", "3", "①"]


def test_a_space_in_a_label_read_with_a_comma_needs_spaces_in_names(tmp_path, capsys):
    cells = ["circle cross,square", "square", "", "circle cross"]
    code, _ = _write_labels(tmp_path, cells, "--sep", ",")
    assert code == 2
    one_line_error(capsys, "row 1", "'circle cross'", "separator is ','", "--spaces-in-names", "--sep ' '")
    code, out = _write_labels(tmp_path / "yes", cells, "--sep", ",", "--spaces-in-names")
    assert code == 0 and manifest(out)["classes"] == ["circle cross", "square"]
    assert manifest(out)["label_format"]["spaces_in_names"] is True
    code, out = _write_labels(tmp_path / "spaces", ["circle cross", "square", "", "cross"])  # --sep ' ': 3 classes
    assert code == 0 and manifest(out)["classes"] == ["circle", "cross", "square"]


def test_spaces_in_names_from_python(tmp_path):
    from tfpipe.sources.source import LabelFormat, Source

    images = _images(tmp_path, 2)
    csv_path = str(
        write_csv(tmp_path / "c.csv", ["image", "labels"], [("i0", "golden retriever,poodle"), ("i1", "poodle")])
    )
    with pytest.raises(TfpipeError, match=r"'golden retriever'.*spaces_in_names=True"):
        Source(images, csv=csv_path, label_format=LabelFormat(sep=",")).items()
    items, _ = Source(images, csv=csv_path, label_format=LabelFormat(sep=",", spaces_in_names=True)).items()
    assert items[0].labels == ("golden retriever", "poodle")


def test_class_names_with_spaces_stay_allowed_where_they_are_one_name(tmp_path):
    images = _images(tmp_path, 2)
    csv_path = write_csv(tmp_path / "c.csv", ["image", "label"], [("i0", "golden retriever"), ("i1", "poodle")])
    assert (
        write(["--csv", str(csv_path), "--images", images, "--class-col", "label", "--out", str(tmp_path / "o")]) == 0
    )
    assert manifest(str(tmp_path / "o"))["classes"] == ["golden retriever", "poodle"]
    (tmp_path / "tree" / "golden retriever").mkdir(parents=True)
    save(tmp_path / "tree" / "golden retriever" / "a.jpg")
    assert write(["--images", str(tmp_path / "tree"), "--out", str(tmp_path / "t")]) == 0
    assert manifest(str(tmp_path / "t"))["classes"] == ["golden retriever"]


def _strip(path, height, width):
    """A PNG of alternating black and white pixels along its long side."""
    values = (np.arange(max(height, width)) % 2 * 255).astype(np.uint8).reshape(height, width)
    cv2.imwrite(str(path), np.dstack([values] * 3))


@pytest.mark.parametrize("fit", ["stretch", "crop", "pad"])
def test_a_one_pixel_strip_is_fitted_like_any_other_image(tmp_path, fit):
    images = tmp_path / "images"
    images.mkdir()
    _strip(images / "wide.png", 1, 70000)
    _strip(images / "tall.png", 70000, 1)
    save(images / "plain.jpg")
    csv_path = write_csv(
        tmp_path / "c.csv", ["image", "labels"], [("wide.png", "a"), ("tall.png", "b"), ("plain.jpg", "a")]
    )
    out = str(tmp_path / "o")
    with bounded_memory():  # crop scaled the whole strip up first: 1.4 GB at 64 px, 4.3 GB at 128 px
        assert (
            write(
                [
                    "--csv",
                    str(csv_path),
                    "--images",
                    str(images),
                    "--out",
                    out,
                    "--image-size",
                    "64",
                    "--fit",
                    fit,
                    "--format",
                    "png",
                ]
            )
            == 0
        )
    rows = records(out)
    for name, content in (("wide.png", np.s_[31:32, :]), ("tall.png", np.s_[:, 31:32])):
        img = rows[name][1].astype(int)
        assert img.shape == (64, 64, 3)
        if fit == "stretch":  # every pixel averages the 1094 source pixels it covers, none is a lone sample
            assert np.abs(img - 127.5).max() <= 1, np.unique(img)
        elif fit == "pad":  # one row of averages, padded above and below
            assert np.abs(img[content] - 127.5).max() <= 1 and img.sum() == img[content].sum()
        else:  # the centre pixel, scaled up
            assert len(np.unique(img)) == 1


def test_a_strip_too_long_for_jpeg_is_one_line_and_png_stores_it(tmp_path, capsys):
    images = tmp_path / "images"
    images.mkdir()
    _strip(images / "wide.png", 1, 70000)
    csv_path = write_csv(tmp_path / "c.csv", ["image", "labels"], [("wide.png", "a")])
    args = ["--csv", str(csv_path), "--images", str(images)]
    assert write(args + ["--out", str(tmp_path / "o")]) == 2
    one_line_error(capsys, "wide.png", "70000x1 is too long for JPEG", "65535", "--format png")
    assert write(args + ["--out", str(tmp_path / "p"), "--format", "png"]) == 0
    assert records(str(tmp_path / "p"))["wide.png"][1].shape == (1, 70000, 3)


# ---------------------------------------------------------------- 3: image settings that parse but mean nothing


@pytest.mark.parametrize(
    "flag,value,needle",
    [
        ("--max-pixels", "nan", "--max-pixels must be a positive, finite number (got nan)"),
        ("--max-pixels", "inf", "--max-pixels must be a positive, finite number (got inf)"),
        ("--max-pixels", "-1", "--max-pixels must be a positive, finite number (got -1.0)"),
        ("--max-pixels", "0", "--max-pixels must be a positive, finite number (got 0.0)"),
        ("--max-bytes", "nan", "--max-bytes must be a positive, finite number (got nan)"),
        ("--max-bytes", "0", "--max-bytes must be a positive, finite number (got 0.0)"),
        ("--image-size", "0", "--image-size must be at least 1 (got 0)"),
        ("--image-size", "-5", "--image-size must be at least 1 (got -5)"),
        ("--quality", "500", "--quality must be in 1..100 (got 500)"),
        ("--quality", "0", "--quality must be at least 1 (got 0)"),
    ],
)
def test_image_settings_that_mean_nothing_are_one_line_before_any_work(
    labeled_folder, tmp_path, capsys, flag, value, needle
):
    out = tmp_path / "o"
    assert (
        write(["--csv", labeled_folder["csv"], "--images", labeled_folder["images"], "--out", str(out), flag, value])
        == 2
    )
    one_line_error(capsys, needle)
    assert not out.exists()


@pytest.mark.parametrize(
    "kwargs,needle",
    [
        ({"image_size": -5}, "image_size must be at least 1 (got -5)"),
        ({"image_size": 0}, "image_size must be at least 1 (got 0)"),
        ({"image_size": 32.5}, "image_size must be a whole number (got 32.5)"),
        ({"image_size": True}, "image_size must be a whole number (got True)"),
        ({"fit": "cover"}, "fit must be one of stretch, crop, pad (got 'cover')"),
        ({"format": "webp"}, "format must be one of jpeg, png (got 'webp')"),
        ({"quality": 500}, "quality must be in 1..100 (got 500)"),
        ({"quality": 0}, "quality must be at least 1 (got 0)"),
        ({"quality": 90.5}, "quality must be a whole number (got 90.5)"),
        ({"max_pixels": 0}, "max_pixels must be at least 1 (got 0)"),
        ({"max_pixels": float("nan")}, "max_pixels must be a whole number (got nan)"),
        ({"max_bytes": -1}, "max_bytes must be at least 1 (got -1)"),
    ],
)
def test_an_image_spec_that_means_nothing_is_refused_when_made(kwargs, needle):
    from tfpipe.writer.images import ImageSpec

    with pytest.raises(TfpipeError, match=re.escape(needle)):
        ImageSpec(**kwargs)
    with pytest.raises(TypeError):  # tfpipe 0.1's name, warned since 0.2, removed in 1.0
        ImageSpec(size=16)
    assert type(ImageSpec(image_size=np.int64(16)).image_size) is int  # a NumPy integer is a whole number
