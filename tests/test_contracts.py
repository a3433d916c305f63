"""On-disk contracts (issue #22): a shard folder's manifest and a run folder are input too, validated before use,
and checked against each other and against the shards while a job uses them."""

import dataclasses
import json
import os
import shutil
import subprocess
import sys
import time

import pytest

import tfpipe
from tests.conftest import save, write_csv
from tests.test_hostile import one_line_error, source_args, tfrec_files, write
from tests.test_reliability import ENV, ROOT
from tfpipe import Source, write_shards
from tfpipe.format.manifest import Manifest
from tfpipe.runtime.errors import TfpipeError
from tfpipe.tf.augment import NO_AUGMENT
from tfpipe.writer.images import ImageSpec


def copy_records(shard_dir, tmp_path, name="records"):
    dst = tmp_path / name
    shutil.copytree(shard_dir[0], dst)
    return dst


def edit_manifest(folder, change):
    """Edits manifest.json in place as a person would (the dataset id is left as it was)."""
    path = folder / "manifest.json"
    data = json.loads(path.read_text())
    change(data)
    path.write_text(json.dumps(data, indent=1))


def _set(key, value):
    return lambda d: d.__setitem__(key, value)


def _shard0(key, value):
    return lambda d: d["shards"][0].__setitem__(key, value)


# ------------------------------------------------------------------ 1: the manifest, validated on load


@pytest.mark.parametrize(
    "change,needle",
    [
        (lambda d: d.pop("shards"), "field 'shards' is required"),
        (_set("shards", []), "field 'shards' lists no shard"),
        (_set("num_classes", 7), "field 'num_classes' does not match the 3 classes"),
        (_shard0("count", 999), "field 'num_examples' does not match the shards' counts"),
        (_shard0("count", -1), "field 'shards[0].count' must be at least 0"),
        (_shard0("count", 2.5), "field 'shards[0].count' must be a whole number"),
        (_shard0("file", "../precious.txt"), "field 'shards[0].file' must be a shard file name inside the folder"),
        (_shard0("file", "/etc/passwd.tfrec"), "field 'shards[0].file' must be a shard file name inside the folder"),
        (_shard0("fold", 9), "field 'shards[0].fold' does not fit the 4 folds"),
        (_set("classes", ["a", "a", "c"]), "field 'classes' lists a class twice"),
        (_set("classes", ["a", "", "c"]), "field 'classes' must list non-empty strings"),
        (lambda d: d["image"].__setitem__("fit", "cover"), "field 'image.fit' must be one of stretch, crop, pad"),
        (lambda d: d["image"].__setitem__("image_size", "32"), "field 'image.image_size' must be a whole number"),
        (_set("labeled", "yes"), "field 'labeled' must be bool"),
        (_set("version", 99), "manifest version 99 was written by a newer tfpipe"),
        (lambda d: d["label_format"].__setitem__("class_col", " "), "field 'label_format.class_col' is empty"),
        (lambda d: d["label_format"].__setitem__("labels_col", 3), "field 'label_format.labels_col' must be str"),
        (_set("classes", ["x", "b", "c"]), "no longer matches its dataset_id"),  # valid, but not what was written
    ],
)
def test_an_edited_manifest_is_one_line_naming_the_field(shard_dir, tmp_path, capsys, change, needle):
    from tfpipe.inspect import main as inspect_main

    folder = copy_records(shard_dir, tmp_path)
    edit_manifest(folder, change)
    with pytest.raises(TfpipeError, match="manifest.json: .*" if "newer" not in needle else "newer") as e:
        tfpipe.open_shards(str(folder))
    assert needle in str(e.value) and str(folder) in str(e.value)
    assert inspect_main([str(folder)]) == 2
    one_line_error(capsys, needle)


@pytest.mark.parametrize("text,needle", [("[1, 2]", "not a JSON object"), ("{", "not valid JSON")])
def test_a_damaged_manifest_is_one_line(shard_dir, tmp_path, text, needle):
    folder = copy_records(shard_dir, tmp_path)
    (folder / "manifest.json").write_text(text)
    with pytest.raises(TfpipeError, match=needle):
        tfpipe.make_dataset(str(folder), 4)


def test_a_manifest_of_tfpipe_0_2_still_reads(shard_dir, tmp_path):
    """No version, dataset id or label counts: read as version 1, its id derived from its content."""
    folder = copy_records(shard_dir, tmp_path)
    edit_manifest(folder, lambda d: [d.pop(k) for k in ("version", "dataset_id", "max_labels", "label_format")])
    m = Manifest.load(str(folder))
    assert m.dataset_id and m.max_labels is None and m.num_examples == 40
    assert m.label_column == "labels"  # no layout recorded: a submission's labels column keeps its old name
    assert tfpipe.count_examples(str(folder)) == 40


def test_a_shard_linking_out_of_the_folder_is_refused(shard_dir, tmp_path):
    folder = copy_records(shard_dir, tmp_path)
    name = Manifest.load(str(folder)).files[0]
    outside = tmp_path / "elsewhere.tfrec"
    shutil.move(folder / name, outside)
    os.symlink(outside, folder / name)
    with pytest.raises(TfpipeError, match="not a shard file of .* a link out of it"):
        tfpipe.open_shards(str(folder))


@pytest.mark.parametrize(
    "fmt, column",
    [({"class_col": "label"}, "label"), ({"labels_col": "tags"}, "tags"), ({"label_cols": ("cat", "dog")}, "labels")],
    ids=["class-col", "labels-col", "one-hot"],
)
def test_the_manifest_says_the_training_csvs_label_column(tmp_path, fmt, column):
    """Issue #65: a submission's labels column is named as the training CSV's (``--class-col label``: ``label``),
    read from the layout the write recorded; one-hot columns name none, so ``labels``."""
    from tfpipe.sources.labels import LabelFormat

    (tmp_path / "images").mkdir()
    rows = [(f"im{i}", ["cat", "dog"][i % 2]) for i in range(4)]
    for i, (name, _) in enumerate(rows):
        save(tmp_path / "images" / f"{name}.jpg", size=(16, 16), seed=i)
    if "label_cols" in fmt:
        csv_path = write_csv(
            tmp_path / "t.csv", ["image", "cat", "dog"], [(n, int(c == "cat"), int(c == "dog")) for n, c in rows]
        )
    else:
        csv_path = write_csv(tmp_path / "t.csv", ["image", next(iter(fmt.values()))], rows)
    source = Source(str(tmp_path / "images"), csv=str(csv_path), label_format=LabelFormat(**fmt))
    write_shards(source, str(tmp_path / "records"), spec=ImageSpec(image_size=16), workers=0, progress=False)
    assert Manifest.load(str(tmp_path / "records")).label_column == column


def test_write_returns_the_typed_manifest(shard_dir):
    manifest = shard_dir[2]
    assert isinstance(manifest, Manifest) and manifest.classes == ("a", "b", "c") and manifest.num_folds == 4
    assert manifest.max_labels == 3 and not manifest.one_label_each
    with pytest.raises(TypeError):  # dict reads (tfpipe 0.2's dict manifests) warned in 0.3, removed in 1.0
        manifest["classes"]


# ------------------------------------------------------------ --overwrite deletes only what a valid manifest lists


@pytest.mark.parametrize("listed", ["../precious.txt", "ABSOLUTE"])
def test_overwrite_never_deletes_outside_the_folder_whatever_the_manifest_says(
    labeled_folder, tmp_path, capsys, listed
):
    out = tmp_path / "out"
    assert write(source_args(labeled_folder) + ["--out", str(out)]) == 0
    precious = tmp_path / "precious.txt"
    precious.write_text("keep me")
    name = str(precious) if listed == "ABSOLUTE" else listed
    edit_manifest(out, lambda d: d["shards"].append({"file": name, "count": 0, "fold": None, "bytes": 7}))
    assert write(source_args(labeled_folder) + ["--out", str(out), "--overwrite"]) == 2
    one_line_error(capsys, "must be a shard file name inside the folder")
    assert precious.read_text() == "keep me" and len(tfrec_files(out)) > 0  # nothing deleted at all


# ------------------------------------------------------------------------------- 2: a dataset identity


def test_the_dataset_id_names_the_content(labeled_folder, tmp_path):
    args = source_args(labeled_folder)
    for name in ("one", "two"):
        assert write(args + ["--out", str(tmp_path / name)]) == 0
    one, two = (Manifest.load(str(tmp_path / n)) for n in ("one", "two"))
    assert one.dataset_id == two.dataset_id  # byte-identical writes: one dataset
    assert write(args + ["--out", str(tmp_path / "one"), "--overwrite", "--classes", "dog,cat,bird"]) == 0
    assert Manifest.load(str(tmp_path / "one")).dataset_id != two.dataset_id


def _rewrite_after_first_epoch(shard_dir, folder):
    """A Keras callback that rewrites ``folder`` (a class renamed) once the first epoch ends, as a second
    ``tfpipe.write --overwrite`` from another terminal would."""
    import tf_keras as keras

    root = os.path.dirname(shard_dir[0])

    class Rewrite(keras.callbacks.Callback):
        def on_epoch_end(self, epoch, logs=None):
            if epoch == 0:
                write_shards(
                    Source(f"{root}/images", csv=f"{root}/train.csv"),
                    str(folder),
                    spec=ImageSpec(image_size=32),
                    num_folds=4,
                    num_shards=8,
                    workers=0,
                    progress=False,
                    overwrite=True,
                    classes=["c", "b", "a"],
                )

    return Rewrite()


def test_fit_stops_when_its_shards_are_rewritten_and_leaves_no_finished_run(shard_dir, tmp_path):
    from train.fit import FitConfig, fit

    folder = copy_records(shard_dir, tmp_path)
    run = tmp_path / "run"
    cfg = FitConfig(
        records=str(folder),
        run=str(run),
        strategy="cpu",
        model="small-cnn",
        batch_size=4,
        epochs=3,
        steps_per_execution=1,
        augment=NO_AUGMENT,
        verbose=0,
        callbacks=(_rewrite_after_first_epoch(shard_dir, folder),),
    )
    with pytest.raises(TfpipeError, match="was rewritten while this job read it"):
        fit(cfg)
    assert not (run / "model.keras").exists() and not (run / "metrics.json").exists()
    assert not json.loads((run / "state.json").read_text() if (run / "state.json").exists() else "{}").get("finished")
    with pytest.raises(TfpipeError, match="rewritten since .* started"):  # and --resume will not continue it
        fit(dataclasses.replace(cfg, resume=True, callbacks=()))


@pytest.mark.slow
def test_a_rewrite_from_another_process_during_fit_ends_it_in_one_line(shard_dir, tmp_path):
    folder = copy_records(shard_dir, tmp_path)
    run = tmp_path / "run"
    fit = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "train.fit",
            "--records",
            str(folder),
            "--run",
            str(run),
            "--strategy",
            "cpu",
            "--model",
            "small-cnn",
            "--batch-size",
            "4",
            "--epochs",
            "60",
            "--steps-per-execution",
            "1",
            "--verbose",
            "0",
            "--no-augment",
        ],
        env=ENV,
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    deadline = time.time() + 240
    history = run / "history.csv"
    while not (history.exists() and len(history.read_text().splitlines()) >= 2):  # one epoch done
        assert fit.poll() is None and time.time() < deadline, fit.communicate()
        time.sleep(0.2)
    root = os.path.dirname(shard_dir[0])
    assert (
        write(
            [
                "--csv",
                f"{root}/train.csv",
                "--images",
                f"{root}/images",
                "--image-size",
                "32",
                "--num-folds",
                "4",
                "--num-shards",
                "8",
                "--classes",
                "c,b,a",
                "--out",
                str(folder),
                "--overwrite",
            ]
        )
        == 0
    )
    _out, err = fit.communicate(timeout=300)
    assert fit.returncode == 2, err
    assert "was rewritten while this job read it" in err and "Traceback" not in err
    assert not (run / "model.keras").exists() and not (run / "metrics.json").exists()


# ------------------------------------------------------------------------------ 3: --resume knows its inputs


def test_resume_after_an_image_changed_is_refused_not_nothing_to_do(labeled_folder, tmp_path, capsys):
    out = str(tmp_path / "out")
    args = source_args(labeled_folder) + ["--out", out]
    assert write(args) == 0
    assert write(args + ["--resume"]) == 0  # unchanged: nothing to do
    assert "nothing to do" in capsys.readouterr().out
    save(os.path.join(labeled_folder["images"], "img03.jpg"), size=(43, 56), seed=99)  # other bytes, same name
    assert write(args + ["--resume"]) == 2
    one_line_error(capsys, "inputs or settings changed since", "--overwrite")
    assert write(args + ["--overwrite"]) == 0


def test_a_damaged_progress_file_is_one_line_on_resume(slow_source, tmp_path, capsys):
    args, _ = slow_source
    out = tmp_path / "out"
    (out / ".staging").mkdir(parents=True)
    (out / ".staging" / ".tfpipe-staging").write_text("x\n")  # tfpipe's staging, its progress damaged
    (out / ".staging" / "progress.json").write_text('{"fingerprint": "x", "shards": [{"index": "zero"}]}')
    assert write(args + ["--out", str(out), "--resume"]) == 2
    one_line_error(capsys, "progress.json is damaged", "--overwrite")


# ------------------------------------------------------------------------------- 4: the run folder's contract


def test_the_run_records_what_prediction_depends_on(trained_run, shard_dir):
    from train.runs.run import RunConfig

    config = RunConfig.load(trained_run[0])
    assert config.classes == ("a", "b", "c") and config.image_size == 32 and config.fit == "stretch"
    assert config.dataset_id == Manifest.load(shard_dir[0]).dataset_id and config.fold == 0
    assert config.single_label is False


def _other_fit_shards(labeled_folder, tmp_path, **kwargs):
    out = str(tmp_path / "test-crop")
    write_shards(
        Source(labeled_folder["images"], labeled=False),
        out,
        split="test",
        workers=0,
        progress=False,
        spec=ImageSpec(image_size=32, **kwargs),
    )
    return out


def test_predict_refuses_shards_fitted_another_way(trained_run, labeled_folder, tmp_path):
    from train.predict import predict

    crop = _other_fit_shards(labeled_folder, tmp_path, fit="crop")
    with pytest.raises(TfpipeError, match="fitted to a square by 'crop', the run's training images by 'stretch'"):
        predict(trained_run[0], crop, str(tmp_path / "s.csv"), strategy="cpu")
    assert not (tmp_path / "s.csv").exists()


def copy_run(trained_run, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(trained_run[0], run)
    return run


@pytest.mark.parametrize(
    "change,needle",
    [
        (lambda c: c.update(image_size="32"), "field 'image_size' must be a whole number"),
        (lambda c: c.update(classes=[]), "field 'classes' must list the class names"),
        (lambda c: c.update(fit="cover"), "field 'fit' must be one of stretch, crop, pad"),
        (lambda c: c.update(single_label="no"), "field 'single_label' must be true or false"),
        (lambda c: c.update(run_version=7), "run version 7 was written by a newer tfpipe"),
    ],
)
def test_an_edited_run_config_is_one_line_before_predicting(trained_run, tmp_path, capsys, change, needle):
    from train.predict import main

    run = copy_run(trained_run, tmp_path)
    config = json.loads((run / "config.json").read_text())
    change(config)
    (run / "config.json").write_text(json.dumps(config))
    assert (
        main(["--run", str(run), "--records", trained_run[2], "--out", str(tmp_path / "s.csv"), "--strategy", "cpu"])
        == 2
    )
    one_line_error(capsys, needle)
    assert not (tmp_path / "s.csv").exists()


def test_a_model_or_thresholds_from_another_run_are_refused(trained_run, tmp_path):
    from train.keras.run_model import load_model
    from train.predict import predict

    # model.keras and thresholds.json: the final model (the run has an SWA model too)

    run = copy_run(trained_run, tmp_path)
    (run / "thresholds.json").write_text(json.dumps({"x": 0.5, "y": 0.5}))
    with pytest.raises(TfpipeError, match="thresholds.json: names classes x, y, not the run's"):
        predict(str(run), trained_run[2], str(tmp_path / "s.csv"), strategy="cpu", swa=False)
    (run / "thresholds.json").write_text(json.dumps({"a": 0.5, "b": 2.0, "c": 0.1}))
    with pytest.raises(TfpipeError, match="threshold of 'b' is 2.0"):
        predict(str(run), trained_run[2], str(tmp_path / "s.csv"), strategy="cpu", swa=False)
    # a run uploaded without its thresholds: labels at one threshold instead would change without a word
    (run / "thresholds.json").unlink()
    with pytest.raises(TfpipeError, match=r"thresholds.json is missing .* or pass threshold=0.5 to label every class"):
        predict(str(run), trained_run[2], str(tmp_path / "s.csv"), strategy="cpu", swa=False)
    shutil.copy(os.path.join(trained_run[0], "thresholds.json"), run / "thresholds.json")
    from train.keras.models import build_model
    from train.runs import files

    other, _ = build_model("small-cnn", 5, 32)  # a model of five classes where the run's of three should be
    other.save(str(run / "model.keras"))
    assert load_model(str(run / "model.keras")).output_shape[-1] == 5
    with pytest.raises(TfpipeError, match="model.keras: not the file this folder's job wrote"):  # its record (#64)
        predict(str(run), trained_run[2], str(tmp_path / "s.csv"), strategy="cpu", swa=False)
    files.record(str(run), ["model.keras"])  # the record edited with it: the model itself is checked against the run
    with pytest.raises(TfpipeError, match="outputs 5 classes, but config.json lists 3"):
        predict(str(run), trained_run[2], str(tmp_path / "s.csv"), strategy="cpu", swa=False)
    assert not (tmp_path / "s.csv").exists()


def test_predict_on_a_list_of_files_and_on_its_own_training_shards(trained_run, shard_dir, tmp_path, capsys):
    from train.predict import predict

    files = list(tfpipe.open_shards(trained_run[2]).files)
    df = predict(trained_run[0], files, str(tmp_path / "s.csv"), strategy="cpu", progress=False)
    assert len(df) == tfpipe.count_examples(trained_run[2]) and list(df.columns) == ["image", "labels"]
    capsys.readouterr()
    predict(trained_run[0], shard_dir[0], str(tmp_path / "t.csv"), strategy="cpu", progress=False)
    assert "are the shards this run trained on" in capsys.readouterr().err


def test_predict_opens_its_records_once(trained_run, tmp_path, monkeypatch):
    import tfpipe.format.shards
    from train.predict import predict

    calls = []
    real = tfpipe.format.shards.check_sizes
    monkeypatch.setattr(tfpipe.format.shards, "check_sizes", lambda *a: calls.append(a) or real(*a))
    predict(
        trained_run[0],
        trained_run[2],
        str(tmp_path / "s.csv"),
        strategy="cpu",
        tta=2,
        progress=False,
        probabilities=True,
    )  # fmt: skip  (labels at 2 views would tune thresholds on the training shards)
    # the test shards opened once (not once a view); their sizes checked once more before the CSV is written (the
    # run's validation shards are opened too: --tta 2 is measured against 1 view on them first)
    assert [a[-1] for a in calls].count(trained_run[2]) == 2, calls


# --------------------------------------------------------------------------------- 5: label modes are a contract


def test_one_label_modes_on_multi_label_shards_are_refused(shard_dir, tmp_path, capsys):
    from tests.test_hostile import _fit_cli

    for mode in ("one_hot", "class_id"):
        with pytest.raises(TfpipeError, match=f"multi-label data .*label_mode='{mode}' would keep one label"):
            tfpipe.make_dataset(shard_dir[0], 4, label_mode=mode)
    assert _fit_cli(["--records", shard_dir[0], "--run", str(tmp_path / "run"), "--single-label"]) == 2
    one_line_error(capsys, "multi-label data (up to 3 labels an image", "--single-label")
    assert not (tmp_path / "run").exists()


def test_the_torch_reader_checks_the_class_count_like_make_dataset(shard_dir):
    from tfpipe.torch.dataset import RecordDataset

    with pytest.raises(TfpipeError, match="num_classes=2, but the shards hold 3 classes"):
        RecordDataset(shard_dir[0], num_classes=2)
    with pytest.raises(TfpipeError, match="num_classes must be at least 1"):
        RecordDataset(shard_dir[0], num_classes=0)


def test_one_label_modes_work_where_every_image_has_one_label(labeled_folder, tmp_path):
    rows = [(name, (lab.split() or ["cat"])[0]) for name, lab in labeled_folder["rows"]]
    csv = write_csv(tmp_path / "one.csv", ["image", "labels"], rows)  # a labels column, one label each
    out = str(tmp_path / "out")
    write_shards(
        Source(labeled_folder["images"], csv=str(csv)), out, spec=ImageSpec(image_size=16), workers=0, progress=False
    )
    _, ids = next(iter(tfpipe.make_dataset(out, 12, label_mode="class_id")))
    classes = Manifest.load(out).classes
    assert [classes[i] for i in ids.numpy()] == [lab for _, lab in rows]


# -------------------------------------------------------------------- 6: predict --out replaces only what it wrote


def test_predict_never_replaces_the_ground_truth_csv(shard_dir, tmp_path, capsys):
    """Un-folded labeled shards predicted into the CSV they were written from: same columns, same ids in order
    -- the old "is it an earlier submission?" test was true of the ground truth itself."""
    from train.fit import FitConfig, fit
    from train.predict import main

    root = tmp_path / "data"
    shutil.copytree(os.path.dirname(shard_dir[0]) + "/images", root / "images")
    truth = root / "train.csv"
    truth.write_text(open(os.path.dirname(shard_dir[0]) + "/train.csv").read())
    records = str(tmp_path / "records")
    write_shards(
        Source(str(root / "images"), csv=str(truth)),
        records,
        spec=ImageSpec(image_size=32),
        num_shards=4,
        workers=0,
        progress=False,
    )
    run = str(tmp_path / "run")
    fit(
        FitConfig(
            records=records,
            run=run,
            strategy="cpu",
            model="small-cnn",
            batch_size=4,
            epochs=1,
            steps_per_execution=1,
            augment=NO_AUGMENT,
            verbose=0,
            report=False,
        )
    )
    before = truth.read_text()
    for flags in ([], ["--probabilities"], ["--threshold", "0.5"], ["--tta", "2"]):
        assert (
            main(
                ["--run", run, "--records", records, "--out", str(truth), "--strategy", "cpu", "--no-progress"] + flags
            )
            == 2
        )
        one_line_error(capsys, "was not written by train.predict", "--overwrite")
        assert truth.read_text() == before


def test_predict_replaces_its_own_unchanged_submission_only(trained_run, tmp_path, capsys):
    from train.predict import main

    run, _, test = trained_run
    out = tmp_path / "submission.csv"
    args = ["--run", run, "--records", test, "--out", str(out), "--strategy", "cpu", "--no-progress"]
    assert main(args) == 0
    assert main(args + ["--probabilities"]) == 0  # its own file: replaced
    out.write_text(out.read_text() + "\n")  # changed by hand since
    assert main(args) == 2
    one_line_error(capsys, "was not written by train.predict (or was changed since)")
    assert main(args + ["--overwrite"]) == 0 and out.read_text().startswith("image,labels")


# ------------------------------------------------------------------------------------ 9: numbers and edge cases


def test_a_global_batch_larger_than_the_data_is_refused_by_fit_and_capped_by_predict(
    trained_run, shard_dir, tmp_path, capsys
):
    from tests.test_hostile import _fit_cli
    from train.predict import main

    assert _fit_cli(["--records", shard_dir[0], "--run", str(tmp_path / "run"), "--batch-size", "100000"]) == 2
    one_line_error(capsys, "--batch-size 100000 x 1 replica = 100000 images a step, more than the 29 training")
    run, _, test = trained_run
    assert (
        main(
            [
                "--run",
                run,
                "--records",
                test,
                "--out",
                str(tmp_path / "s.csv"),
                "--strategy",
                "cpu",
                "--replicas",
                "8",
                "--batch-size",
                "100000",
            ]
        )
        == 0
    )
    assert "--batch-size 100000 is more than 40 images need on 8 replicas; using 5" in capsys.readouterr().out


@pytest.mark.parametrize("folds", [[], ["--num-folds", "3"]])
def test_a_labeled_source_without_any_label_is_refused(labeled_folder, tmp_path, capsys, folds):
    csv = write_csv(tmp_path / "empty.csv", ["image", "labels"], [(n, "") for n, _ in labeled_folder["rows"]])
    out = tmp_path / "out"
    assert write(["--csv", str(csv), "--images", labeled_folder["images"], "--out", str(out)] + folds) == 2
    one_line_error(capsys, "no image has a label", "--unlabeled")
    assert not out.exists() or tfrec_files(out) == []


def test_an_undefined_validation_auc_is_not_reported_as_zero(trained_run, tmp_path):
    """A run's metrics.json as train.fit wrote it, read back as the command reads it (``FitResult``), with the
    exact AUC a validation fold without both kinds of image gives (null): never printed as a number."""
    from train.fit import summary_lines
    from train.runs.results import FitResult

    run, metrics, _ = trained_run
    (tmp_path / "metrics.json").write_text(
        json.dumps(dict(metrics, report=dict(metrics["report"], roc_auc_macro=None)))
    )
    (line, *_) = summary_lines(FitResult.load(str(tmp_path)))
    assert line.startswith("validation AUC undefined (no class has both positive and negative validation images; ")
    (line, *_) = summary_lines(FitResult.load(run))
    assert line.startswith(f"validation AUC {metrics['report']['roc_auc_macro']:.4f} (exact; Keras' binned estimate")


def test_a_full_disk_at_the_epoch_backup_is_one_line_and_leaves_no_temporaries(shard_dir, tmp_path, capsys):
    """The run folder on a 96 kB tmpfs: config and history fit, the first epoch's backup does not."""
    from tests.test_hostile import _fit_cli

    run = tmp_path / "small"
    run.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=96k", "tmpfs", str(run)], capture_output=True)
    assert mounted.returncode == 0, f"this test needs root to mount a tmpfs: {mounted.stderr}"
    try:
        assert (
            _fit_cli(
                [
                    "--records",
                    shard_dir[0],
                    "--run",
                    str(run / "run"),
                    "--batch-size",
                    "4",
                    "--epochs",
                    "2",
                    "--steps-per-execution",
                    "1",
                    "--no-report",
                ]
            )
            == 2
        )
        one_line_error(capsys, "no space left on the device", "--resume")
        leftovers = [os.path.join(r, n) for r, ds, fs in os.walk(run) for n in ds + fs if "_temp" in n]
        assert leftovers == [] and not (run / "run" / "model.keras").exists()
    finally:
        subprocess.run(["umount", str(run)], check=True)


# ------------------------------------------------- the second hostile pass (new cases, after the first fixes)


def test_fit_never_trains_into_a_folder_of_the_users_files(shard_dir, tmp_path, capsys):
    from tests.test_hostile import _fit_cli

    proj = tmp_path / "proj"
    proj.mkdir()
    mine = {"config.json": '{"my": "settings"}', "model.keras": "my model", "history.csv": "date,weight\n1,80\n"}
    for name, text in mine.items():
        (proj / name).write_text(text)
    for resume in ([], ["--resume"]):
        (proj / "config.json").unlink() if resume else None
        assert _fit_cli(["--records", shard_dir[0], "--run", str(proj), "--no-report"] + resume) == 2
        err = capsys.readouterr().err
        assert len(err.strip().splitlines()) == 1 and "Traceback" not in err
        assert ("holds files train.fit did not write" in err) if resume else ("config.json" in err), err
    assert (proj / "model.keras").read_text() == "my model" and (proj / "history.csv").read_text() == mine[
        "history.csv"
    ]


def test_atomic_writes_never_touch_a_users_tmp_file_or_write_through_a_link(trained_run, tmp_path):
    from train.predict import main

    folder = tmp_path / "sub"
    folder.mkdir()
    (folder / "s.csv.tmp").write_text("my notes")
    (folder / "train.csv").write_text("image,labels\nx,cat\n")
    os.symlink("train.csv", folder / "s.csv.tmp-")  # what a fixed temporary name plus a prefix would hit
    assert (
        main(
            [
                "--run",
                trained_run[0],
                "--records",
                trained_run[2],
                "--out",
                str(folder / "s.csv"),
                "--strategy",
                "cpu",
                "--no-progress",
            ]
        )
        == 0
    )
    assert (folder / "s.csv.tmp").read_text() == "my notes"
    assert (folder / "train.csv").read_text() == "image,labels\nx,cat\n"


def test_a_users_staging_folder_is_never_deleted(labeled_folder, tmp_path, capsys):
    out = tmp_path / "out"
    (out / ".staging" / "site").mkdir(parents=True)
    (out / ".staging" / "site" / "app.yaml").write_text("deploy")
    for flags in ([], ["--overwrite"], ["--resume"]):
        assert write(source_args(labeled_folder) + ["--out", str(out)] + flags) == 2
        one_line_error(capsys, ".staging exists and was not made by tfpipe.write")
    assert (out / ".staging" / "site" / "app.yaml").read_text() == "deploy"


@pytest.fixture(scope="module")
def interrupted_write(slow_source, tmp_path_factory):
    """A real write stopped with SIGINT after its second finished shard: (its folder, the write's arguments)."""
    import signal

    from tests.test_reliability import start_and_interrupt

    args, _ = slow_source
    out = tmp_path_factory.mktemp("interrupted") / "out"
    proc, _ = start_and_interrupt(args, str(out), signal.SIGINT)
    assert proc.returncode == 130 and (out / ".staging" / "progress.json").exists(), proc.stderr.read()
    return out, args


@pytest.mark.parametrize(
    "change",
    [
        lambda e: e.update(count=0),  # the shard's records would vanish
        lambda e: e.update(count=e["count"] - 1),  # the manifest would claim fewer records than the file holds
        lambda e: e.update(skipped=[1, None]),
        lambda e: e.update(bytes=e["bytes"] + 1),  # not the staged file it recorded
    ],
)
def test_a_progress_file_that_does_not_add_up_is_refused_on_resume(interrupted_write, tmp_path, capsys, change):
    out = tmp_path / "out"
    shutil.copytree(interrupted_write[0], out)
    progress = out / ".staging" / "progress.json"
    data = json.loads(progress.read_text())
    change(data["shards"][0])
    progress.write_text(json.dumps(data))
    assert write(interrupted_write[1] + ["--out", str(out), "--resume"]) == 2
    one_line_error(capsys, "--overwrite")
    assert tfrec_files(out) == []


def test_an_untouched_progress_file_resumes(interrupted_write, tmp_path):
    out = tmp_path / "out"
    shutil.copytree(interrupted_write[0], out)
    assert write(interrupted_write[1] + ["--out", str(out), "--resume"]) == 0
    assert tfpipe.count_examples(str(out)) == 400


def test_a_softmax_or_other_size_model_in_a_run_is_refused(trained_run, tmp_path):
    from train.keras.models import build_model
    from train.predict import predict
    from train.runs import files

    run = copy_run(trained_run, tmp_path)
    for kwargs, needle in (
        ({"multi_label": False}, "ends in softmax, but the run is multi-label"),
        ({"image_size": 16}, "takes 16x16 px, but config.json says 32"),
    ):
        model, _ = build_model("small-cnn", 3, kwargs.pop("image_size", 32), **kwargs)
        model.save(str(run / "model.keras"))
        files.record(str(run), ["model.keras"])  # its record edited too: the model itself is checked against the run
        with pytest.raises(TfpipeError, match=needle):
            predict(str(run), trained_run[2], str(tmp_path / "s.csv"), strategy="cpu", progress=False, swa=False)


def test_the_torch_reader_stops_when_its_folder_is_rewritten_between_epochs(shard_dir, tmp_path):
    from tfpipe.torch.dataset import RecordDataset

    folder = copy_records(shard_dir, tmp_path)
    ds = RecordDataset(str(folder))
    assert len(list(ds)) == 40
    root = os.path.dirname(shard_dir[0])
    write_shards(
        Source(f"{root}/images", csv=f"{root}/train.csv"),
        str(folder),
        spec=ImageSpec(image_size=32),
        num_folds=4,
        num_shards=8,
        workers=0,
        progress=False,
        overwrite=True,
        classes=["c", "b", "a"],
    )
    with pytest.raises(TfpipeError, match="was rewritten while this job read it"):
        list(ds)


@pytest.mark.parametrize(
    "flags,cells,needle",
    [
        (
            ["--spaces-in-names"],
            ["golden retriever", "poodle"],
            "--spaces-in-names needs a separator that is not a space",
        ),
        (["--sep", ""], ["circle\u00a0cross", "star"], "--sep is empty"),
        ([], ["circle", "circle\ufe0f"], "U+FE0F VARIATION SELECTOR-16"),
        ([], ["circle", "circle\u3164"], "U+3164 HANGUL FILLER"),
        ([], ["\u3000", "star"], "U+3000 IDEOGRAPHIC SPACE"),  # a label of nothing visible, not an empty list
    ],
)
def test_blank_labels_and_meaningless_separators_are_refused(labeled_folder, tmp_path, capsys, flags, cells, needle):
    rows = [(name, cells[i % len(cells)]) for i, (name, _) in enumerate(labeled_folder["rows"])]
    csv = write_csv(tmp_path / "l.csv", ["image", "labels"], rows)
    assert write(["--csv", str(csv), "--images", labeled_folder["images"], "--out", str(tmp_path / "o")] + flags) == 2
    one_line_error(capsys, needle)


def test_a_manifest_without_its_version_still_has_its_id_checked(shard_dir, tmp_path):
    folder = copy_records(shard_dir, tmp_path)
    edit_manifest(folder, lambda d: (d.pop("version"), d.__setitem__("classes", ["x", "b", "c"])))
    with pytest.raises(TfpipeError, match="no longer matches its dataset_id"):
        tfpipe.open_shards(str(folder))


@pytest.mark.parametrize("kind", ["fifo", "dev-zero", "nested", "digits"])
def test_files_tfpipe_reads_back_are_bounded(shard_dir, trained_run, tmp_path, capsys, kind):
    from tfpipe.inspect import main as inspect_main
    from train.predict import main as predict_main

    folder = copy_records(shard_dir, tmp_path)
    manifest, out = folder / "manifest.json", tmp_path / "s.csv"
    manifest.unlink()
    if kind == "fifo":
        os.mkfifo(manifest)
        os.mkfifo(out)
    elif kind == "dev-zero":
        os.symlink("/dev/zero", manifest)
        os.symlink("/dev/zero", out)
    else:
        manifest.write_text('{"a": ' + ("[" * 100000 + "]" * 100000 if kind == "nested" else "9" * 5000) + "}")
    assert inspect_main([str(folder)]) == 2
    one_line_error(capsys, "manifest.json")
    if kind in ("fifo", "dev-zero"):
        assert (
            predict_main(
                [
                    "--run",
                    trained_run[0],
                    "--records",
                    trained_run[2],
                    "--out",
                    str(out),
                    "--strategy",
                    "cpu",
                    "--overwrite",
                ]
            )
            == 2
        )
        one_line_error(capsys, "s.csv is a", "not a regular file")
        assert not out.is_file()


def test_an_empty_lock_is_taken_over_once_it_is_old_and_a_junk_one_never(labeled_folder, tmp_path, capsys, monkeypatch):
    """An empty lock is a job that died between creating and writing it (or one doing so now); content that is
    not a lock tfpipe wrote says nothing about whether its job lives, so it is refused however old."""
    out = tmp_path / "out"
    out.mkdir()
    lock = out / ".tfpipe-write.lock"
    old = time.time() - 60
    for junk, why in [
        ("[]", "not a JSON object"),
        ('{"host": "a", "host": "b", "pid": 1}', "gives the key 'host' twice"),
        ('{"id": "x"}', "no host and pid"),
        ("lock", "not valid JSON"),
    ]:
        lock.write_text(junk)
        os.utime(lock, (old, old))
        assert write(source_args(labeled_folder) + ["--out", str(out)]) == 2
        one_line_error(capsys, "is not a lock this job can read as tfpipe's", why, "if none does, delete it")
    from tfpipe.runtime import fs

    real = fs.read_bytes  # another user's live lock, mode 0600 (root reads it anyway: the denial is faked)

    def denied(path, limit=None):
        if path.endswith(".tfpipe-write.lock"):
            raise PermissionError(13, "Permission denied", path)
        return real(path, limit)

    monkeypatch.setattr(fs, "read_bytes", denied)
    assert write(source_args(labeled_folder) + ["--out", str(out)]) == 2
    one_line_error(capsys, "as tfpipe's (it cannot be read: Permission denied)")
    monkeypatch.setattr(fs, "read_bytes", real)
    lock.unlink()
    lock.symlink_to(out / "gone")  # a dangling link: not an empty lock, however old
    assert write(source_args(labeled_folder) + ["--out", str(out)]) == 2
    one_line_error(capsys, "as tfpipe's (a symbolic link, not a file)")
    lock.unlink()
    lock.write_text("")
    assert write(source_args(labeled_folder) + ["--out", str(out)]) == 2  # just made: maybe a writer starting
    one_line_error(capsys, "is being taken by another job just now", "still empty")
    os.utime(lock, (old, old))
    assert write(source_args(labeled_folder) + ["--out", str(out)]) == 0 and not lock.exists()


def test_two_submissions_in_one_folder_keep_their_own_records(trained_run, tmp_path):
    from train.predict import main

    args = ["--run", trained_run[0], "--records", trained_run[2], "--strategy", "cpu", "--no-progress", "--out"]
    for _ in range(2):
        for name in ("a.csv", "b.csv"):
            assert main(args + [str(tmp_path / name)]) == 0  # each replaces only itself, both stay replaceable


def test_make_demo_then_write_shards_in_one_process_does_not_hang(tmp_path):
    """OpenCV's thread pool, started by drawing the demo, hung the forked writer workers for good (the TPU
    dry-run benchmark does exactly this); a fresh process, as a notebook or script is."""
    code = (
        "import sys; from tfpipe.demo import make_demo; from tfpipe.writer.images import ImageSpec; "
        "from tfpipe import Source, write_shards; d = sys.argv[1]; make_demo(d + '/demo', 24, 0, 0); "
        "write_shards(Source(d + '/demo/images', csv=d + '/demo/train.csv'), d + '/out', workers=2, "
        "spec=ImageSpec(image_size=16), progress=False)"
    )
    done = subprocess.run(
        [sys.executable, "-c", code, str(tmp_path)],
        env=ENV,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        start_new_session=True,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert tfpipe.count_examples(str(tmp_path / "out")) == 24
