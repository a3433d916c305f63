"""The writer's Apache Beam runner: the same records, shards and manifest as the default runner."""

import glob
import os
import subprocess
import sys

import tensorflow as tf

from tests.test_write import ROOT, assert_clean_failure, manifest, read_back
from tfpipe.write import main


def source_args(folder, *extra):
    return ["--csv", folder["csv"], "--images", folder["images"], "--no-progress", *extra]


def same_files(a, b):
    """Both folders hold the same file names with the same bytes (shards and manifest)."""
    names = sorted(os.listdir(a))
    assert names == sorted(os.listdir(b)) and any(n.endswith(".tfrec") for n in names)
    for name in names:
        with open(os.path.join(a, name), "rb") as fa, open(os.path.join(b, name), "rb") as fb:
            assert fa.read() == fb.read(), name


def test_beam_output_is_byte_identical_to_the_default_writer(labeled_folder, tmp_path):
    args = source_args(labeled_folder, "--image-size", "24", "--num-folds", "3", "--num-shards", "6")
    assert main(args + ["--out", str(tmp_path / "local"), "--workers", "0"]) == 0
    assert main(args + ["--out", str(tmp_path / "beam"), "--runner", "beam"]) == 0
    same_files(tmp_path / "local", tmp_path / "beam")
    assert len(glob.glob(str(tmp_path / "beam" / "*.tfrec"))) == 6
    assert not os.path.exists(tmp_path / "beam" / ".staging")
    assert [r["name"] for r in read_back(str(tmp_path / "beam"))] == [
        r["name"] for r in read_back(str(tmp_path / "local"))
    ]


def test_beam_skip_bad_matches_the_default_writer(labeled_folder, tmp_path, capsys):
    with open(os.path.join(labeled_folder["images"], "img05.jpg"), "wb") as f:
        f.write(b"garbage")
    args = source_args(labeled_folder, "--image-size", "16", "--num-shards", "3", "--skip-bad")
    assert main(args + ["--out", str(tmp_path / "local"), "--workers", "0"]) == 0
    assert main(args + ["--out", str(tmp_path / "beam"), "--runner", "beam"]) == 0
    assert "skipped 1 images: img05" in capsys.readouterr().out
    same_files(tmp_path / "local", tmp_path / "beam")
    m = manifest(str(tmp_path / "beam"))
    assert m["num_examples"] == 11 and [s["image"] for s in m["skipped"]] == ["img05"]


def test_beam_bad_image_stops_with_one_line_and_writes_nothing(labeled_folder, tmp_path, capsys):
    for name in ("img09.jpg", "img04.jpg"):  # two bad images in different shards: the first in input order is named
        with open(os.path.join(labeled_folder["images"], name), "wb") as f:
            f.write(b"\xff\xd8 no jpeg")
    out = str(tmp_path / "beam")
    code = main(
        source_args(labeled_folder, "--image-size", "16", "--num-shards", "3") + ["--out", out, "--runner", "beam"]
    )
    assert_clean_failure(code, capsys, out, "img04.jpg")
    assert not os.path.exists(os.path.join(out, ".staging"))


def test_beam_writes_to_a_bucket_like_filesystem(labeled_folder):
    """ram:// stands in for gs://: plans, staged shards and the manifest all go through tf.io.gfile."""
    out = "ram://bucket/beam-test"
    assert (
        main(source_args(labeled_folder, "--image-size", "16", "--split", "test") + ["--out", out, "--runner", "beam"])
        == 0
    )
    files = tf.io.gfile.glob(out + "/*.tfrec")
    assert len(files) == 1 and sum(1 for _ in tf.data.TFRecordDataset(files)) == 12
    assert not tf.io.gfile.exists(out + "/.staging")


def test_beam_option_errors_are_one_line(labeled_folder, tmp_path, capsys):
    out = str(tmp_path / "beam")
    cases = [
        (["--runner", "beam", "--", "--direct_num_wokers=2"], "--direct_num_wokers"),
        (["--runner", "beam", "--", "--direct_num_workers=two"], "invalid int value"),
        (["--", "--direct_num_workers=2"], "need --runner beam"),
        (["--runner", "beam", "--resume"], "--resume"),
    ]
    for extra, needle in cases:
        assert_clean_failure(main(source_args(labeled_folder, "--out", out) + extra), capsys, out, needle)
        assert not os.path.exists(out)


def test_beam_cli_with_worker_processes(labeled_folder, tmp_path):
    """The real command with Beam's multi-processing DirectRunner: the encode and write steps are pickled into
    separate worker processes, as on Dataflow, and the result still equals the default writer's."""
    args = source_args(labeled_folder, "--image-size", "20", "--num-shards", "2")
    assert main(args + ["--out", str(tmp_path / "local"), "--workers", "0"]) == 0
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "tfpipe.write",
            *args,
            "--out",
            str(tmp_path / "beam"),
            "--runner",
            "beam",
            "--",
            "--direct_num_workers=2",
            "--direct_running_mode=multi_processing",
        ],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "wrote 12 images in 2 shards" in proc.stdout
    same_files(tmp_path / "local", tmp_path / "beam")
