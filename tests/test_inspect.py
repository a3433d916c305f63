"""inspect: our shards, foreign shards, a contact sheet, and --verify on a truncated shard."""

import io
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest
import tensorflow as tf
from PIL import Image

from tests.conftest import gradient_image, jpeg_bytes
from tfpipe.inspect import CAPTION_HEIGHT, SHEET_GAP, SHEET_TILE, inspect_shards
from tfpipe.runtime.errors import TfpipeError

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_our_shards_schema_labels_and_sheet(shard_dir, tmp_path):
    out, _labels, _ = shard_dir
    sheet = str(tmp_path / "sheet.png")
    buf = io.StringIO()
    info = inspect_shards(out, sheet=sheet, sheet_count=10, do_verify=True, stream=buf)
    assert info["image_key"] == "image" and info["label_key"] == "target"
    assert info["schema"]["target"][:3] == ("int64_list", 0, 3)  # variable length, empty allowed
    assert info["label_counts"] == {0: 16, 1: 16, 2: 24}  # a, b, c over the 40 records
    assert "8 files, 40 records" in buf.getvalue() and "verified" in buf.getvalue()
    with Image.open(sheet) as im:
        assert im.format == "PNG"
        pixels = np.asarray(im.convert("RGB"))
    gap, tile, height = SHEET_GAP, SHEET_TILE, SHEET_TILE + CAPTION_HEIGHT
    assert pixels.shape == (gap + 2 * (height + gap), gap + 8 * (tile + gap), 3)
    # a grey gap around every tile: its captions and image never touch the neighbours'
    for x in range(0, pixels.shape[1], tile + gap):
        assert (pixels[:, x : x + gap] == 96).all()
    for y in range(0, pixels.shape[0], height + gap):
        assert (pixels[y : y + gap] == 96).all()
    assert not (pixels[gap : gap + tile, gap : gap + tile] == 96).all()  # and an image inside


def foreign_example(i):
    feature = {
        "image": tf.train.Feature(bytes_list=tf.train.BytesList(value=[jpeg_bytes(gradient_image(20, 20, i))])),
        "label": tf.train.Feature(int64_list=tf.train.Int64List(value=[i % 3])),
        "patient_id": tf.train.Feature(bytes_list=tf.train.BytesList(value=[b"p%d" % i])),
        "age": tf.train.Feature(float_list=tf.train.FloatList(value=[40.0 + i])),
    }
    return tf.train.Example(features=tf.train.Features(feature=feature)).SerializeToString()


def test_foreign_schema_is_inferred(tmp_path):
    path = str(tmp_path / "melanoma00-9.tfrec")
    with tf.io.TFRecordWriter(path) as w:
        for i in range(9):
            w.write(foreign_example(i))
    info = inspect_shards(
        str(tmp_path / "*.tfrec"), sheet=str(tmp_path / "s.png"), do_verify=True, stream=io.StringIO()
    )
    assert info["schema"]["age"][0] == "float_list" and info["schema"]["patient_id"][0] == "bytes_list"
    assert info["image_key"] == "image" and info["label_key"] == "label"
    assert info["label_counts"] == {0: 3, 1: 3, 2: 3}
    assert os.path.exists(tmp_path / "s.png")


def test_verify_names_a_truncated_shard(shard_dir, tmp_path):
    out = str(tmp_path / "copy")
    shutil.copytree(shard_dir[0], out)
    victim = sorted(f for f in os.listdir(out) if f.endswith(".tfrec"))[3]
    with open(os.path.join(out, victim), "r+b") as f:
        f.truncate(os.path.getsize(os.path.join(out, victim)) - 100)
    with pytest.raises(TfpipeError, match=victim):
        inspect_shards(out, do_verify=True, stream=io.StringIO())
    proc = subprocess.run(
        [sys.executable, "-m", "tfpipe.inspect", out, "--verify", "--no-sheet"],
        capture_output=True,
        text=True,
        cwd=ROOT,
    )
    assert proc.returncode == 2 and victim in proc.stderr and "Traceback" not in proc.stderr


def test_verify_catches_a_flipped_byte(shard_dir, tmp_path):
    out = str(tmp_path / "copy")
    shutil.copytree(shard_dir[0], out)
    victim = sorted(f for f in os.listdir(out) if f.endswith(".tfrec"))[0]
    path = os.path.join(out, victim)
    data = bytearray(open(path, "rb").read())
    data[len(data) // 2] ^= 0xFF
    open(path, "wb").write(bytes(data))
    with pytest.raises(TfpipeError, match=victim):
        inspect_shards(out, do_verify=True, stream=io.StringIO())


def test_count_mismatch_is_reported(shard_dir, tmp_path):
    out = str(tmp_path / "copy")
    shutil.copytree(shard_dir[0], out)
    victim = sorted(f for f in os.listdir(out) if f.endswith(".tfrec"))[0]
    records = list(tf.data.TFRecordDataset(os.path.join(out, victim)).as_numpy_iterator())
    with tf.io.TFRecordWriter(os.path.join(out, victim)) as w:
        for r in records[:-1]:
            w.write(r)
    with pytest.raises(TfpipeError, match=victim):
        inspect_shards(out, do_verify=True, stream=io.StringIO())


@pytest.mark.parametrize("flag", ["--sheet-count", "--scan-records"])
def test_counts_below_one_are_one_line_errors(shard_dir, flag, capsys):
    from tfpipe.inspect import main

    assert main([shard_dir[0], flag, "0", "--no-sheet"]) == 2
    assert capsys.readouterr().err.strip() == f"tfpipe.inspect: error: {flag} must be at least 1 (got 0)"


def test_sheet_captions_carry_the_id_and_say_unlabeled_or_no_labels():
    from tfpipe.inspect import _caption_id, _caption_labels

    row = {"image_name": ("bytes_list", [b"folder/some-rather-long-image-name-0042.jpg"]), "target": ("int64_list", [])}
    assert _caption_id(row).endswith("name-0042.jpg") and len(_caption_id(row)) <= 40
    assert _caption_labels(row, "target", ["a", "b"], labeled=True) == "no labels"
    assert _caption_labels(row, "target", ["a", "b"], labeled=False) == "unlabeled"
    row["target"] = ("int64_list", [1, 0])
    assert _caption_labels(row, "target", ["a", "b"], labeled=True) == "b, a"  # "5, 6", never a "56"
    from tfpipe.inspect import SHEET_TILE, _fitted

    long = _fitted("x" * 200, SHEET_TILE - 6, "end")
    assert long.startswith("..") and 5 < len(long) < 200  # shortened to the tile's width, by its pixels


def test_a_run_or_cv_folder_given_as_shards_points_to_train_inspect(tmp_path, capsys):
    """Issue #54: ``tfpipe.inspect RUN`` answered with a glob to pass; a run (config.json) or CV folder (cv.json)
    is now named as one, with the command that reads it back."""
    from tfpipe.inspect import main

    for mark in ("config.json", "cv.json"):
        folder = tmp_path / mark.split(".")[0]
        folder.mkdir()
        (folder / mark).write_text("{}")
        assert main([str(folder)]) == 2
        assert capsys.readouterr().err == (
            f"tfpipe.inspect: error: {folder}: a run folder ({mark}), not shards; read it back with python -m "
            f"train.inspect {folder} (its shards: the records it names)\n"
        )
