"""The writer end to end: CSV/folder -> shards -> parsed back with FixedLenSequenceFeature."""

import glob
import json
import os
import re
import subprocess
import sys

import pandas as pd
import pytest
import tensorflow as tf

from tests.conftest import save, write_csv
from tfpipe.format import schema
from tfpipe.tf.parse import feature_spec
from tfpipe.write import main

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def read_back(out):
    """All records of a shard folder, in written order, parsed with the shared schema."""
    files = sorted(glob.glob(os.path.join(out, "*.tfrec")))
    rows = []
    for batch in tf.data.TFRecordDataset(files).batch(64):
        parsed = tf.io.parse_example(batch, feature_spec())
        for name, target, h, w, image in zip(
            parsed["image_name"].numpy(),
            parsed["target"].numpy(),
            parsed["height"].numpy(),
            parsed["width"].numpy(),
            parsed["image"].numpy(),
        ):
            rows.append(
                {
                    "name": name.decode(),
                    "target": [int(t) for t in target if t >= 0],
                    "hw": (int(h), int(w)),
                    "image": image,
                }
            )
    return rows


def manifest(out):
    with open(os.path.join(out, "manifest.json")) as f:
        return json.load(f)


def write(args):
    return main(args + ["--no-progress", "--workers", "0"])


def test_round_trip_exact_label_lists(labeled_folder, tmp_path):
    out = str(tmp_path / "out")
    assert (
        write(
            ["--csv", labeled_folder["csv"], "--images", labeled_folder["images"], "--out", out, "--image-size", "32"]
        )
        == 0
    )
    m = manifest(out)
    assert m["classes"] == ["bird", "cat", "dog"] and m["num_examples"] == 12
    rows = read_back(out)
    assert [r["name"] for r in rows] == [name for name, _ in labeled_folder["rows"]]
    for r, (_, labels) in zip(rows, labeled_folder["rows"]):
        assert [m["classes"][t] for t in r["target"]] == sorted(labels.split())
        assert r["hw"] == (32, 32)
        assert tf.io.decode_jpeg(r["image"]).shape == (32, 32, 3)
    assert sum(1 for r in rows if not r["target"]) == 3  # empty label lists survive


def test_shard_names_counts_and_manifest(labeled_folder, tmp_path):
    out = str(tmp_path / "out")
    write(["--csv", labeled_folder["csv"], "--images", labeled_folder["images"], "--out", out, "--num-shards", "3"])
    names = sorted(os.path.basename(p) for p in glob.glob(os.path.join(out, "*.tfrec")))
    assert names == ["train-00-of-03-4.tfrec", "train-01-of-03-4.tfrec", "train-02-of-03-4.tfrec"]
    m = manifest(out)
    assert [s["file"] for s in m["shards"]] == names and [s["count"] for s in m["shards"]] == [4, 4, 4]
    for name in names:  # the count in the name is the Kaggle convention: notebooks regex it
        count = int(re.search(r"-(\d+)\.tfrec$", name).group(1))
        assert sum(1 for _ in tf.data.TFRecordDataset(os.path.join(out, name))) == count
    assert m["schema"] == schema.describe() and m["image"]["image_size"] is None
    assert not os.path.exists(os.path.join(out, ".staging"))


def test_folds_are_stratified_and_never_mixed_in_a_shard(tmp_path):
    images = tmp_path / "images"
    images.mkdir()
    labels = ["a", "b", "a b", "", "c"] * 8
    for i in range(len(labels)):
        save(images / f"{i}.jpg", size=(16, 16), seed=i)
    csv_path = write_csv(tmp_path / "t.csv", ["image", "labels"], [(f"{i}.jpg", lab) for i, lab in enumerate(labels)])
    out = str(tmp_path / "out")
    write(["--csv", str(csv_path), "--images", str(images), "--out", out, "--num-folds", "4", "--num-shards", "8"])
    m = manifest(out)
    assert m["folds"] == 4 and len(m["shards"]) == 8
    by_name = {str(i) + ".jpg": lab for i, lab in enumerate(labels)}
    files = {s["file"]: s["fold"] for s in m["shards"]}
    per_fold = {f: [] for f in range(4)}
    for file, fold in files.items():
        assert f"-fold{fold}-" in file
        per_fold[fold] += [r["name"] for r in read_back_one(os.path.join(out, file))]
    assert sorted(n for names in per_fold.values() for n in names) == sorted(by_name)
    for names in per_fold.values():  # ~10 records each, every label (and "no label") spread evenly
        assert abs(len(names) - 10) <= 2  # iterative stratification balances labels first, sizes second
        for label, expected in (("a", 4), ("b", 4), ("c", 2)):
            assert abs(sum(label in by_name[n].split() for n in names) - expected) <= 1
        assert abs(sum(by_name[n] == "" for n in names) - 2) <= 1


def read_back_one(path):
    return [{"name": schema.decode_example(r.numpy())["image_name"].decode()} for r in tf.data.TFRecordDataset(path)]


def test_one_hot_columns(tmp_path):
    images = tmp_path / "images"
    images.mkdir()
    rows = [("Train_0", 1, 0, 0), ("Train_1", 0, 1, 1), ("Train_2", 0, 0, 0)]
    for r in rows:
        save(images / f"{r[0]}.jpg", size=(16, 16))
    csv_path = write_csv(tmp_path / "train.csv", ["image_id", "healthy", "rust", "scab"], rows)
    out = str(tmp_path / "out")
    assert (
        write(
            [
                "--csv",
                str(csv_path),
                "--images",
                str(images),
                "--out",
                out,
                "--image-col",
                "image_id",
                "--label-cols",
                "healthy,rust,scab",
            ]
        )
        == 0
    )
    assert manifest(out)["classes"] == ["healthy", "rust", "scab"]  # column order, not sorted
    assert [r["target"] for r in read_back(out)] == [[0], [1, 2], []]


def test_single_class_column_with_numeric_classes(tmp_path):
    images = tmp_path / "images"
    images.mkdir()
    rows = [("a.png", "10"), ("b.png", "2"), ("c.png", "0")]
    for r in rows:
        save(images / r[0], "png", size=(16, 16))
    csv_path = write_csv(tmp_path / "train.csv", ["image", "label"], rows)
    out = str(tmp_path / "out")
    assert write(["--csv", str(csv_path), "--images", str(images), "--out", out, "--class-col", "label"]) == 0
    m = manifest(out)
    assert m["classes"] == ["0", "2", "10"] and m["single_label"] is True  # numeric order
    assert [r["target"] for r in read_back(out)] == [[2], [1], [0]]


def test_custom_separator_and_fixed_classes(labeled_folder, tmp_path):
    rows = [(name, ";".join(labels.split())) for name, labels in labeled_folder["rows"]]
    csv_path = write_csv(tmp_path / "semi.csv", ["id", "tags"], rows)
    out = str(tmp_path / "out")
    assert (
        write(
            [
                "--csv",
                str(csv_path),
                "--images",
                labeled_folder["images"],
                "--out",
                out,
                "--image-col",
                "id",
                "--labels-col",
                "tags",
                "--sep",
                ";",
                "--classes",
                "dog,cat,bird,fish",
            ]
        )
        == 0
    )
    m = manifest(out)
    assert m["classes"] == ["dog", "cat", "bird", "fish"]
    assert read_back(out)[0]["target"] == [0, 1]  # "cat dog" with dog=0, cat=1


def test_folder_per_class_tree_and_unicode_names(tmp_path):
    root = tmp_path / "tree"
    for cls in ("daisy", "rosé"):
        (root / cls).mkdir(parents=True)
        for i in range(2):
            save(root / cls / f"fleur ü{i}.jpg", size=(16, 16), seed=i)
    out = str(tmp_path / "out")
    assert write(["--images", str(root), "--out", out]) == 0
    rows = read_back(out)
    assert [r["name"] for r in rows] == [
        "daisy/fleur ü0.jpg",
        "daisy/fleur ü1.jpg",
        "rosé/fleur ü0.jpg",
        "rosé/fleur ü1.jpg",
    ]
    assert [r["target"] for r in rows] == [[0], [0], [1], [1]]


@pytest.mark.parametrize(
    "flags", [["--unlabeled"], ["--unlabeled", "--split", "holdout"], ["--unlabeled", "--split", "test"]]
)
def test_unlabeled_source(labeled_folder, tmp_path, flags):
    """--unlabeled makes unlabeled records under any split name (a split is only a name)."""
    csv_path = write_csv(tmp_path / "test.csv", ["image"], [(n,) for n, _ in labeled_folder["rows"][:5]])
    out = str(tmp_path / "out")
    assert write(["--csv", str(csv_path), "--images", labeled_folder["images"], "--out", out] + flags) == 0
    m = manifest(out)
    split = flags[flags.index("--split") + 1] if "--split" in flags else "train"
    assert m["labeled"] is False and m["shards"][0]["file"].startswith(f"{split}-")
    for path in glob.glob(os.path.join(out, "*.tfrec")):
        for r in tf.data.TFRecordDataset(path):
            assert "target" not in schema.decode_example(r.numpy())


def test_split_test_is_only_a_name(labeled_folder, tmp_path, capsys):
    """tfpipe 0.x read --split test as --unlabeled; in 1.0 a split is a name, so a CSV without labels says so."""
    csv_path = write_csv(tmp_path / "test.csv", ["image"], [(n,) for n, _ in labeled_folder["rows"][:5]])
    args = [
        "--csv",
        str(csv_path),
        "--images",
        labeled_folder["images"],
        "--out",
        str(tmp_path / "o"),
        "--split",
        "test",
    ]
    assert write(args) == 2
    assert "labels" in capsys.readouterr().err


def test_awkward_images_all_convert(tmp_path):
    images = tmp_path / "images"
    images.mkdir()
    kinds = {
        "gray.jpg": "gray",
        "cmyk.jpg": "cmyk",
        "rgba.png": "rgba",
        "pal.png": "palette",
        "deep.png": "png16",
        "rot.jpg": "jpeg",
    }
    for name, kind in kinds.items():
        save(images / name, kind, size=(20, 30), orientation=6 if name == "rot.jpg" else None)
    csv_path = write_csv(tmp_path / "t.csv", ["image", "labels"], [(n, "x") for n in kinds])
    out = str(tmp_path / "out")
    assert write(["--csv", str(csv_path), "--images", str(images), "--out", out]) == 0
    shapes = {r["name"]: tf.io.decode_jpeg(r["image"]).shape for r in read_back(out)}
    assert all(shape[2] == 3 for shape in shapes.values())
    assert shapes["rot.jpg"][:2] == (30, 20) and shapes["gray.jpg"][:2] == (20, 30)


def test_pass_through_keeps_source_bytes(labeled_folder, tmp_path):
    out = str(tmp_path / "out")
    write(["--csv", labeled_folder["csv"], "--images", labeled_folder["images"], "--out", out])
    for r in read_back(out):
        with open(os.path.join(labeled_folder["images"], r["name"] + ".jpg"), "rb") as f:
            assert r["image"] == f.read()


def test_reruns_are_byte_identical_across_worker_counts(labeled_folder, tmp_path):
    common = [
        "--csv",
        labeled_folder["csv"],
        "--images",
        labeled_folder["images"],
        "--image-size",
        "24",
        "--num-folds",
        "3",
        "--no-progress",
    ]
    assert main(common + ["--out", str(tmp_path / "a"), "--workers", "0"]) == 0
    assert main(common + ["--out", str(tmp_path / "b"), "--workers", "2", "--start-method", "spawn"]) == 0
    files_a = sorted(glob.glob(str(tmp_path / "a" / "*.tfrec")))
    files_b = sorted(glob.glob(str(tmp_path / "b" / "*.tfrec")))
    assert [os.path.basename(f) for f in files_a] == [os.path.basename(f) for f in files_b] and files_a
    for fa, fb in zip(files_a, files_b):
        with open(fa, "rb") as a, open(fb, "rb") as b:
            assert a.read() == b.read()


def test_ram_filesystem_output(labeled_folder):
    """ram:// behaves like gs://: plain open()/os.path would fail there."""
    out = "ram://bucket/write-test"
    assert (
        write(
            ["--csv", labeled_folder["csv"], "--images", labeled_folder["images"], "--out", out, "--image-size", "16"]
        )
        == 0
    )
    files = tf.io.gfile.glob(out + "/*.tfrec")
    assert len(files) == 1 and sum(1 for _ in tf.data.TFRecordDataset(files)) == 12
    assert json.loads(tf.io.gfile.GFile(out + "/manifest.json").read())["num_examples"] == 12


# --- bad input: one line, exit code != 0, nothing written -------------------------------------------------------


def assert_clean_failure(code, capsys, out, *needles):
    err = capsys.readouterr().err.strip()
    assert code != 0
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    for needle in needles:
        assert needle in err, err
    assert not glob.glob(os.path.join(out, "**", "*.tfrec"), recursive=True)
    assert not os.path.exists(os.path.join(out, "manifest.json"))


def test_corrupt_image_stops_and_leaves_no_shards(labeled_folder, tmp_path, capsys):
    bad = os.path.join(labeled_folder["images"], "img05.jpg")
    with open(bad, "wb") as f:
        f.write(b"\xff\xd8 this is no jpeg")
    out = str(tmp_path / "out")
    code = write(["--csv", labeled_folder["csv"], "--images", labeled_folder["images"], "--out", out])
    assert_clean_failure(code, capsys, out, "img05.jpg")


def test_missing_image(labeled_folder, tmp_path, capsys):
    os.remove(os.path.join(labeled_folder["images"], "img03.jpg"))
    out = str(tmp_path / "out")
    code = write(["--csv", labeled_folder["csv"], "--images", labeled_folder["images"], "--out", out])
    assert_clean_failure(code, capsys, out, "img03", "row 4")


def test_missing_column(labeled_folder, tmp_path, capsys):
    out = str(tmp_path / "out")
    code = write(
        ["--csv", labeled_folder["csv"], "--images", labeled_folder["images"], "--out", out, "--labels-col", "tags"]
    )
    assert_clean_failure(code, capsys, out, "'tags'", "train.csv")


def test_a_missing_image_column_names_the_flag_and_the_id_column(labeled_folder, tmp_path, capsys):
    """A Kaggle CSV whose id column is not called ``image`` (``image_id``, ``id``): the error says what to pass."""
    csv_path = tmp_path / "ids.csv"
    pd.read_csv(labeled_folder["csv"], dtype=str).rename(columns={"image": "image_id"}).to_csv(csv_path, index=False)
    out = str(tmp_path / "out")
    code = write(["--csv", str(csv_path), "--images", labeled_folder["images"], "--out", out])
    assert_clean_failure(code, capsys, out, "column 'image' not found", "set --image-col image_id")


def test_unknown_label(labeled_folder, tmp_path, capsys):
    out = str(tmp_path / "out")
    code = write(
        ["--csv", labeled_folder["csv"], "--images", labeled_folder["images"], "--out", out, "--classes", "cat,dog"]
    )
    assert_clean_failure(code, capsys, out, "'bird'")


def test_existing_shards_are_refused_without_overwrite(labeled_folder, tmp_path, capsys):
    out = str(tmp_path / "out")
    args = ["--csv", labeled_folder["csv"], "--images", labeled_folder["images"], "--out", out]
    assert write(args + ["--image-size", "16"]) == 0
    before = {p: os.path.getmtime(p) for p in glob.glob(os.path.join(out, "*"))}
    assert write(args) != 0
    assert "--overwrite" in capsys.readouterr().err
    assert {p: os.path.getmtime(p) for p in glob.glob(os.path.join(out, "*"))} == before
    assert write(args + ["--overwrite"]) == 0
    assert manifest(out)["image"]["image_size"] is None
    shard = sorted(glob.glob(os.path.join(out, "*.tfrec")))[0]  # issue #64: a folder where a shard was
    os.remove(shard)
    os.mkdir(shard)
    with open(os.path.join(shard, "notes.txt"), "w") as f:
        f.write("mine")
    before = sorted(glob.glob(os.path.join(out, "**"), recursive=True))
    assert write(args + ["--overwrite"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"{shard} is a folder named like a shard" in err[0], err
    assert sorted(glob.glob(os.path.join(out, "**"), recursive=True)) == before  # nothing removed


def test_skip_bad_writes_the_rest_and_reports(labeled_folder, tmp_path, capsys):
    with open(os.path.join(labeled_folder["images"], "img05.jpg"), "wb") as f:
        f.write(b"garbage")
    os.remove(os.path.join(labeled_folder["images"], "img07.jpg"))
    out = str(tmp_path / "out")
    code = write(["--csv", labeled_folder["csv"], "--images", labeled_folder["images"], "--out", out, "--skip-bad"])
    assert code == 0
    stdout = capsys.readouterr().out
    assert "skipped 2 images" in stdout and "img05" in stdout and "img07" in stdout
    m = manifest(out)
    assert sorted(s["image"] for s in m["skipped"]) == ["img05", "img07"] and m["num_examples"] == 10
    assert len(read_back(out)) == 10


def test_cli_error_has_no_traceback(labeled_folder, tmp_path):
    """The real command line: exit code 2, one line on stderr naming the culprit."""
    with open(os.path.join(labeled_folder["images"], "img02.jpg"), "wb") as f:
        f.write(b"\xff\xd8\xff")
    out = str(tmp_path / "out")
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "tfpipe.write",
            "--csv",
            labeled_folder["csv"],
            "--images",
            labeled_folder["images"],
            "--out",
            out,
            "--image-size",
            "16",
            "--no-progress",
        ],
        capture_output=True,
        text=True,
        cwd=ROOT,
    )
    assert proc.returncode == 2
    ours = [line for line in proc.stderr.splitlines() if line.startswith("tfpipe.write")]
    assert len(ours) == 1 and "img02.jpg" in ours[0] and "Traceback" not in proc.stderr
    assert not glob.glob(os.path.join(out, "**", "*.tfrec"), recursive=True)


def test_errors_name_the_setting_as_the_user_wrote_it(labeled_folder, tmp_path, capsys):
    """The same refusal names the flag under the command and the argument from Python."""
    from tfpipe import Source, write_shards
    from tfpipe.runtime.errors import TfpipeError

    out = str(tmp_path / "out")
    args = ["--csv", labeled_folder["csv"], "--images", labeled_folder["images"], "--out", out, "--image-size", "16"]
    assert write(args) == 0 and write(args) == 2
    assert "already holds shards; pass --overwrite to replace them" in capsys.readouterr().err
    with pytest.raises(TfpipeError, match=r"already holds shards; pass overwrite=True to replace them"):
        write_shards(Source(labeled_folder["images"], csv=labeled_folder["csv"]), out, workers=0, progress=False)


def test_a_script_without_a_main_guard_is_told_instead_of_hanging(labeled_folder, tmp_path):
    """Spawned workers run a script's top level again: a ``write_shards`` call there made every worker fail as it
    started and the script hang for good (Python's spawn kept writing the job to a dead worker). It is refused
    before any worker starts, naming the script's line; the same call under the main guard writes."""
    call = (
        f"tfpipe.write_shards(tfpipe.Source({labeled_folder['images']!r}, csv={labeled_folder['csv']!r}), "
        f"{str(tmp_path / 'out')!r}, workers=2, start_method='spawn', progress=False, overwrite=True)"
    )
    scripts = {
        "bare.py": f"import tfpipe\n{call}\n",
        "guarded.py": f"import tfpipe\n\nif __name__ == '__main__':\n    {call}\n    print('wrote')\n",
    }
    done = {}
    for name, text in scripts.items():
        (tmp_path / name).write_text(text)
        done[name] = subprocess.run([sys.executable, str(tmp_path / name)], capture_output=True, text=True,
                                    timeout=300, env={**os.environ, "PYTHONPATH": ROOT})  # fmt: skip
    assert done["bare.py"].returncode == 1 and "bootstrapping" not in done["bare.py"].stderr
    assert "bare.py, line 2: with the 'spawn' start method" in done["bare.py"].stderr
    assert 'put it under `if __name__ == "__main__":`, or pass workers=0' in done["bare.py"].stderr
    assert done["guarded.py"].returncode == 0 and "wrote" in done["guarded.py"].stdout, done["guarded.py"].stderr
    piped = subprocess.run([sys.executable, "-"], input=scripts["guarded.py"], capture_output=True, text=True,
                           timeout=300, env={**os.environ, "PYTHONPATH": ROOT}, cwd=tmp_path)  # fmt: skip
    assert piped.returncode == 1 and "DataLoader worker" not in piped.stderr.replace("spawned DataLoader workers", "")
    assert "the main script is <stdin>, which spawned DataLoader workers cannot import; pass workers=0" in piped.stderr
