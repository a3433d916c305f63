"""After training: submission CSVs under any strategy, TTA, SWA, and the run's pictures."""

import json
import os
import shutil
import subprocess
import sys
import zipfile

import numpy as np
import pandas as pd
import pytest
import tensorflow as tf
from PIL import Image

import tfpipe
from tests.conftest import BACKEND, backend_devices, backend_keras, validation_auc
from tfpipe.runtime.errors import RunMismatch, TfpipeError
from tfpipe.tf.augment import NO_AUGMENT
from train.fit import FitConfig, fit
from train.keras.compiling import F1Score
from train.keras.models import custom_objects
from train.keras.run_model import load_model
from train.keras.schedules import KaggleRamp, OneCycle
from train.keras.swa import average_weights, recompute_batch_norm
from train.predict import predict
from train.prediction.inference import TTA_VIEWS, predict_probabilities, tta_view

keras = backend_keras()  # tf-keras, or Keras 3 on JAX (TFPIPE_TEST_BACKEND)
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.backends(jax="slow")  # the trained run: 33 s on JAX
def test_run_leaves_thresholds_predictions_and_valid_pictures(trained_run, shard_dir):
    out, metrics, _ = trained_run
    for name in ("learning_curves.png", "roc.png", "predictions.png", "roc-swa.png", "predictions-swa.png"):
        with Image.open(os.path.join(out, name)) as im:
            im.verify()  # a complete, valid PNG
            assert im.format == "PNG" and im.size[0] > 100
    val = pd.read_csv(os.path.join(out, "val_predictions.csv"), keep_default_na=False)
    assert len(val) == metrics["val_examples"]
    labels = shard_dir[1]
    assert [sorted(t.split()) for t in val["true"]] == [sorted(labels[n]) for n in val["image_name"]]
    thresholds = json.loads(open(os.path.join(out, "thresholds.json")).read())
    assert set(thresholds) == {"a", "b", "c"} and all(0 <= t <= 1 for t in thresholds.values())
    assert 0 <= metrics["report"]["roc_auc_macro"] <= 1


@pytest.mark.backends(jax="slow")  # the trained run: 33 s on JAX
def test_swa_reports_both_models(trained_run, shard_dir):
    out, metrics, _ = trained_run
    records = shard_dir[0]
    swa = metrics["swa"]
    assert swa["epochs_averaged"] == 2 and 0 <= swa["val_auc"] <= 1 and "val_auc" in metrics["final"]
    plain, averaged = load_model(f"{out}/model.keras"), load_model(f"{out}/model-swa.keras")
    assert any(not np.allclose(a, b) for a, b in zip(plain.get_weights(), averaged.get_weights()))
    saved = json.loads(open(os.path.join(out, "metrics.json")).read())
    for name, reported in (("model.keras", saved["final"]["val_auc"]), ("model-swa.keras", saved["swa"]["val_auc"])):
        assert reported == pytest.approx(validation_auc(f"{out}/{name}", records, [0]), abs=1e-3), (
            name
        )  # see test_train


@pytest.mark.backends(jax="slow")  # the trained run: 33 s on JAX
def test_predict_with_the_swa_model_uses_it_and_its_own_thresholds(trained_run, tmp_path, capsys):
    """``--swa``: the run's SWA model (model-swa.keras) with the thresholds its report tuned; metrics.json says
    which model each report scored. A run trained without SWA says so in one line."""
    run, metrics, test = trained_run
    assert (metrics["report"]["model"], metrics["swa"]["model"]) == ("model.keras", "model-swa.keras")
    both = {
        swa: predict(run, test, "", probabilities=True, labels=True, strategy="cpu", swa=swa, progress=False)
        for swa in (False, True)
    }
    images = np.concatenate([b[0] for b in tfpipe.make_dataset(test, 16, image_size=32).as_numpy_iterator()])
    expected = load_model(f"{run}/model-swa.keras").predict(images, verbose=0)
    np.testing.assert_allclose(both[True][["a", "b", "c"]].to_numpy(), expected, atol=1e-5)
    assert not np.allclose(both[False][["a", "b", "c"]].to_numpy(), expected, atol=1e-5)
    tuned = json.loads(open(f"{run}/thresholds-swa.json").read())
    labels = [" ".join(c for c in "abc" if row[c] >= tuned[c]) for _, row in both[True].iterrows()]
    assert both[True]["labels"].fillna("").tolist() == labels

    plain = tmp_path / "plain"
    shutil.copytree(run, plain)
    os.remove(plain / "model-swa.keras")  # a run copied without it
    with pytest.raises(TfpipeError, match="no model-swa.keras, though the run was trained with swa_epochs=2; it was"):
        predict(str(plain), test, "", strategy="cpu", swa=True)
    config = json.loads((plain / "config.json").read_text())
    (plain / "config.json").write_text(json.dumps(dict(config, swa_epochs=0)))  # as a run trained without SWA
    with pytest.raises(TfpipeError, match="no model-swa.keras; the run was trained without swa_epochs"):
        predict(str(plain), test, "", strategy="cpu", swa=True)


@pytest.mark.backends(jax="slow")  # the trained run: 33 s on JAX
def test_reports_describe_the_saved_models(trained_run, shard_dir):
    """val_predictions*.csv (made in memory on 8 replicas) hold the saved models' outputs: every replica uses
    the batch-norm statistics that were saved, not its own copy (they differed before sync_batch_norm)."""
    out, _, _ = trained_run
    images = np.concatenate([b[0] for b in tfpipe.make_dataset(shard_dir[0], 16, folds=[0]).as_numpy_iterator()])
    for model_file, table in (("model.keras", "val_predictions.csv"), ("model-swa.keras", "val_predictions-swa.csv")):
        reported = pd.read_csv(os.path.join(out, table), keep_default_na=False)[["a", "b", "c"]].to_numpy()
        np.testing.assert_allclose(
            reported, load_model(f"{out}/{model_file}").predict(images, verbose=0), atol=1e-5, err_msg=model_file
        )


@pytest.mark.parametrize("strategy,replicas", [("cpu", None), ("cpu", 8)])
@pytest.mark.backends(jax="slow")  # the trained run: 33 s on JAX
def test_submission_has_one_row_per_test_id_in_written_order(trained_run, strategy, replicas, tmp_path):
    run, _, test = trained_run
    out = tmp_path / "submission.csv"
    # per-replica batch 5 on 40 records: a partial last batch, and on 8 replicas blank padding batches
    df = predict(run, test, str(out), strategy=strategy, replicas=replicas, batch_size=5, swa=False)
    assert list(df.columns) == ["image", "labels"]
    assert list(df["image"]) == tfpipe.image_names(test) and df["image"].is_unique and len(df) == 40
    assert pd.read_csv(out, keep_default_na=False).equals(df.fillna(""))
    probs = predict(run, test, None, strategy=strategy, replicas=replicas, batch_size=5, probabilities=True, swa=False)
    assert list(probs.columns) == ["image", "a", "b", "c"]
    # rows belong to their ids: the same as a plain forward pass over the records in written order
    model = load_model(f"{run}/model.keras")
    images = np.concatenate([b[0] for b in tfpipe.make_dataset(test, 16, num_classes=3).as_numpy_iterator()])
    np.testing.assert_allclose(probs[["a", "b", "c"]].to_numpy(), model.predict(images, verbose=0), atol=1e-5)
    thresholds = json.loads(open(os.path.join(run, "thresholds.json")).read())
    expected = [" ".join(c for c in "abc" if row[c] >= thresholds[c]) for _, row in probs.iterrows()]
    assert list(df["labels"].fillna("")) == expected


@pytest.mark.backends(jax="slow")  # the trained run: 33 s on JAX
def test_tta_one_view_equals_plain_prediction_and_more_views_average(trained_run):
    run, _, test = trained_run
    strategy = backend_devices("cpu", None)
    model = load_model(f"{run}/model.keras")
    args = {"batch_size": 8, "image_size": 32, "num_classes": 3}
    plain = predict_probabilities(model, test, strategy, tta=1, **args)
    images = np.concatenate([b[0] for b in tfpipe.make_dataset(test, 16, num_classes=3).as_numpy_iterator()])
    np.testing.assert_allclose(plain, model.predict(images, verbose=0), atol=1e-6)
    two = predict_probabilities(model, test, strategy, tta=2, **args)
    mirrored = model.predict(images[:, :, ::-1], verbose=0)
    np.testing.assert_allclose(two, (plain + mirrored) / 2, atol=1e-5)
    with pytest.raises(tfpipe.TfpipeError, match=r"^tta must be in 1\.\.8 \(got 9\)"):
        predict_probabilities(model, test, strategy, tta=len(TTA_VIEWS) + 1, **args)


def test_tta_views_keep_shape_and_view_zero_is_identity():
    images = tf.cast(tf.random.uniform([3, 16, 16, 3], 0, 255, seed=1), tf.uint8)
    assert np.array_equal(tta_view(images, 0), images)
    for k in range(len(TTA_VIEWS)):
        assert tta_view(images, k).shape == images.shape and tta_view(images, k).dtype == tf.uint8
    assert np.array_equal(tta_view(images, 1), images.numpy()[:, :, ::-1])


def test_swa_of_identical_weights_is_a_no_op_and_averages_otherwise():
    w = [np.arange(6, dtype=np.float32).reshape(2, 3), np.ones(4, np.float32)]
    avg, count = None, 0
    for _ in range(3):
        avg, count = average_weights(avg, count, w), count + 1
    for a, b in zip(avg, w):
        np.testing.assert_array_equal(a, b)
    snaps = [[np.full(3, v)] for v in (1.0, 2.0, 6.0)]
    avg = None
    for i, s in enumerate(snaps):
        avg = average_weights(avg, i, s)
    np.testing.assert_allclose(avg[0], np.full(3, 3.0))


@pytest.mark.backends
def test_batch_norm_statistics_are_recomputed_as_exact_means():
    """Exact means of the batch statistics: per replica under TensorFlow's strategies (each replica normalises
    its own 2 rows), per global batch on JAX (one program normalises all 16, as a synchronised batch norm)."""
    strategy = backend_devices("cpu", 8)
    rng = np.random.default_rng(0)
    x = rng.normal(3.0, 2.0, size=(64, 4)).astype(np.float32) * np.array([1, 2, 3, 4], np.float32)
    with strategy.scope():
        inputs = keras.Input((4,))
        model = keras.Model(inputs, keras.layers.BatchNormalization(momentum=0.99)(inputs))
    weights = [w.copy() for w in model.get_weights()]
    ds = tf.data.Dataset.from_tensor_slices((x, np.zeros((64, 4), np.float32))).batch(16)  # 4 steps of 8 x 2 rows
    assert recompute_batch_norm(model, ds, 4, strategy) == 1
    bn = model.layers[-1]
    assert bn.momentum == 0.99  # restored
    for before, after in zip(weights[:2], model.get_weights()[:2]):  # gamma and beta: not trained
        np.testing.assert_array_equal(before, after)
    np.testing.assert_allclose(np.asarray(bn.moving_mean), x.mean(0), rtol=1e-4)
    # the mean of the batch variances (Keras keeps the biased batch variance): 2 rows a replica, or 16 a batch
    rows = 2 if BACKEND == "tf" else 16
    per_batch = x.reshape(64 // rows, rows, 4).var(axis=1).mean(0)
    np.testing.assert_allclose(np.asarray(bn.moving_variance), per_batch, rtol=1e-3)


@pytest.mark.slow  # a fresh process: 19 s on TF, over 20 s on JAX
@pytest.mark.backends
def test_predict_cli_writes_submission_and_rejects_a_missing_run(trained_run, tmp_path):
    run, _, test = trained_run
    env = dict(os.environ, PYTHONPATH=ROOT)
    out = tmp_path / "sub.csv"
    # A fresh process on 8 virtual replicas: nothing may touch TensorFlow's devices before the strategy is made.
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "train.predict",
            "--run",
            run,
            "--records",
            test,
            "--out",
            str(out),
            "--tta",
            "2",
            "--threshold",
            "0.5",
            "--strategy",
            "cpu",
            "--replicas",
            "8",
        ],
        capture_output=True,
        text=True,
        env=env,
        cwd=ROOT,
    )
    assert r.returncode == 0, r.stderr[-2000:]
    assert "wrote 40 rows" in r.stdout and len(pd.read_csv(out)) == 40
    r = subprocess.run(
        [sys.executable, "-m", "train.predict", "--run", str(tmp_path / "nope"), "--records", test],
        capture_output=True,
        text=True,
        env=env,
        cwd=ROOT,
    )
    assert r.returncode == 2 and "Traceback" not in r.stderr and "config.json" in r.stderr


@pytest.mark.slow  # 23-30 s alone (a 2-replica fit and two predictions), 50-147 s in make test beside the others
def test_single_label_fit_then_predict(tmp_path):
    """Shards written with a class column train a softmax head, and the submission holds one class per row."""
    from tests.conftest import save, write_csv
    from tfpipe.sources.source import LabelFormat

    (tmp_path / "images").mkdir()
    classes = ["cat", "dog", "fox"]
    rows = [(f"im{i:02d}", classes[i % 3]) for i in range(30)]
    for i, (name, _) in enumerate(rows):
        save(tmp_path / "images" / f"{name}.jpg", size=(32, 40), seed=i)
    csv_path = write_csv(tmp_path / "train.csv", ["image", "label"], rows)
    source = tfpipe.Source(str(tmp_path / "images"), csv=str(csv_path), label_format=LabelFormat(class_col="label"))
    tfpipe.write_shards(
        source, str(tmp_path / "records"), spec=tfpipe.ImageSpec(image_size=32), num_folds=3, workers=0, progress=False
    )
    m = fit(
        FitConfig(
            records=str(tmp_path / "records"),
            run=str(tmp_path / "run"),
            strategy="cpu",
            replicas=2,
            model="small-cnn",
            batch_size=2,
            epochs=1,
            steps_per_execution=2,
            augment=NO_AUGMENT,
            verbose=0,
        )
    ).metrics
    assert "val_accuracy" in m["final"] and m["report"]["accuracy"] is not None
    config = json.loads((tmp_path / "run" / "config.json").read_text())
    assert config["single_label"] is True and config["classes"] == classes
    probs = predict(str(tmp_path / "run"), str(tmp_path / "records"), None, strategy="cpu", probabilities=True)
    np.testing.assert_allclose(probs[classes].sum(axis=1), 1.0, atol=1e-5)  # a softmax head
    df = predict(str(tmp_path / "run"), str(tmp_path / "records"), str(tmp_path / "sub.csv"), strategy="cpu")
    assert config["label_column"] == "label"  # the CSV's class column (issue #65), the submission's header
    assert list(df.columns) == ["image", "label"]
    assert list(df["label"]) == [classes[i] for i in probs[classes].to_numpy().argmax(1)]  # exactly one class
    assert list(df["image"]) == tfpipe.image_names(str(tmp_path / "records"))


def test_predict_on_its_own_training_shards_scores_the_held_out_fold_apart(trained_run, shard_dir, tmp_path, capsys):
    """Labels and probabilities in one run; labeled shards are scored; the run's own training shards are split
    into the fold it held out (whose scores are the report's, same model, same images) and the rows it trained
    on, with a warning."""
    run, metrics, _ = trained_run
    df = predict(
        run,
        shard_dir[0],
        str(tmp_path / "both.csv"),
        probabilities=True,
        labels=True,
        swa=False,  # the report's model: model.keras
        strategy="cpu",
        replicas=8,
        batch_size=1,
        progress=True,
    )
    assert list(df.columns) == ["image", "labels", "a", "b", "c"] and len(df) == 40
    written = pd.read_csv(tmp_path / "both.csv", keep_default_na=False)
    assert list(written.columns) == list(df.columns)
    result = df.attrs["evaluation"]
    assert result["own_training_shards"] and result["held_out_what"] == "fold 0"
    held, trained = result["held_out"], result["trained_on"]
    assert held["examples"] == metrics["val_examples"] and trained["examples"] == 40 - metrics["val_examples"]
    report = metrics["report"]
    assert held["roc_auc_macro"] == pytest.approx(report["roc_auc_macro"], abs=1e-6)
    assert held["exact_match"] == report["exact_match"] == report["accuracy"]
    assert held["f1_micro"] == pytest.approx(report["f1_micro"])
    assert result["all"]["examples"] == 40  # and every image given, always
    captured = capsys.readouterr()
    assert "are the shards this run trained on" in captured.err
    said = captured.out
    assert f"scores on the images the run held out (fold 0) ({held['examples']} images)" in said
    assert (
        f"scores on the images it trained on (they say nothing about unseen ones) ({trained['examples']} images)"
        in said
    )
    assert "model.keras, 1 view, labels at the run's thresholds tuned for it (thresholds.json)" in said
    assert "exact-match" in said


def test_predict_scores_labeled_shards_it_did_not_train_on(trained_run, shard_dir, tmp_path, capsys):
    """A labeled folder that is not the run's own (another dataset id) is scored whole, at the threshold given;
    the scores are those of the submission it wrote. When it holds images the run validated on (by id: the
    run's own data written again), those rows and the others are scored apart, with a warning."""
    from tfpipe import Source, write_shards
    from tfpipe.writer.images import ImageSpec
    from train.decide.evaluation import score

    run, metrics, _ = trained_run
    root = os.path.dirname(shard_dir[0])
    other = str(tmp_path / "other")  # the same images written again: another dataset id
    write_shards(
        Source(f"{root}/images", csv=f"{root}/train.csv"),
        other,
        spec=ImageSpec(image_size=32),
        num_shards=2,
        workers=0,
        progress=False,
    )
    targets = tfpipe.read_targets(other, 3)
    df = predict(run, other, "", labels=True, probabilities=True, threshold=0.4, strategy="cpu", progress=True)
    result = df.attrs["evaluation"]
    assert not result["own_training_shards"] and set(result) == {
        "thresholds",
        "own_training_shards",
        "all",
        "held_out",
        "trained_on",  # every other image: the run recorded the digests of those it trained on
        "held_out_what",
        "metric",  # the run's --metric, which leads each line
    }
    assert result["metric"] == "roc_auc"
    validated = set(pd.read_csv(f"{run}/val_predictions.csv", dtype=str)["image_name"])
    rows = df["image"].isin(validated).to_numpy()
    assert result["held_out"]["examples"] == rows.sum() == metrics["val_examples"]
    assert result["trained_on"]["examples"] == (~rows).sum() == metrics["train_examples"]
    probs = df[["a", "b", "c"]].to_numpy()
    expected = score(probs[rows], targets[rows], ["a", "b", "c"], [0.4] * 3, False)
    assert result["held_out"]["exact_match"] == expected["exact_match"]
    said = capsys.readouterr().out
    assert f"warning: of these images {rows.sum()} it validated on and {(~rows).sum()} it trained on" in said, said

    os.rename(f"{run}/train_digests.txt", f"{run}/away.txt")  # a run without them (--no-report, before 1.1)
    try:
        result = predict(run, other, "", labels=True, threshold=0.4, strategy="cpu", progress=True).attrs["evaluation"]
    finally:
        os.rename(f"{run}/away.txt", f"{run}/train_digests.txt")
    assert result["others"]["examples"] == (~rows).sum() and "trained_on" not in result
    assert "the other rows may be images it trained on (the run has no train_digests.txt)" in capsys.readouterr().out

    elsewhere = tmp_path / "run-without-its-report"  # nothing tells these images from unseen ones: scored whole
    shutil.copytree(run, elsewhere)
    os.remove(elsewhere / "val_predictions.csv")
    df = predict(str(elsewhere), other, "", labels=True, probabilities=True, threshold=0.4, strategy="cpu")
    result = df.attrs["evaluation"]
    assert set(result) == {"thresholds", "own_training_shards", "all", "metric"}
    assert result["thresholds"].endswith(", 1 view, labels at threshold 0.4")  # the model, then the labels
    expected = score(df[["a", "b", "c"]].to_numpy(), targets, ["a", "b", "c"], [0.4] * 3, False)
    assert result["all"]["exact_match"] == expected["exact_match"]
    truth = [" ".join(c for c, on in zip("abc", row) if on) for row in targets > 0]
    assert result["all"]["exact_match"] == pytest.approx(np.mean(df["labels"].to_numpy() == np.array(truth)))


def test_predict_refuses_a_threshold_with_probabilities_only_and_columns_named_twice(trained_run, tmp_path):
    run, _, test = trained_run
    with pytest.raises(TfpipeError, match="threshold makes the labels column"):
        predict(run, test, str(tmp_path / "p.csv"), probabilities=True, threshold=0.3, strategy="cpu")
    with pytest.raises(TfpipeError, match="nothing to write"):
        predict(run, test, str(tmp_path / "p.csv"), labels=False, strategy="cpu")
    with pytest.raises(TfpipeError, match="two columns named 'a'"):
        predict(run, test, str(tmp_path / "p.csv"), probabilities=True, id_column="a", strategy="cpu")
    assert not (tmp_path / "p.csv").exists()


def test_a_model_file_loads_front_to_back_with_the_same_weights_and_a_damaged_one_is_one_line(trained_run, tmp_path):
    """load_model reads the .keras archive once (Keras' loader re-read it per seek: 27 s for an EfficientNet-B0);
    the weights are those of Keras' own loader, bit for bit."""
    run, _, _ = trained_run
    ours = load_model(f"{run}/model.keras")
    theirs = keras.models.load_model(f"{run}/model.keras", compile=False)
    assert [w.tolist() for w in ours.get_weights()] == [w.tolist() for w in theirs.get_weights()]
    assert ours.get_config() == theirs.get_config()
    damaged = tmp_path / "model.keras"
    damaged.write_bytes(b"not a zip")
    with pytest.raises(TfpipeError, match="not a Keras model file"):
        load_model(str(damaged))

    with zipfile.ZipFile(damaged, "w") as archive:  # a zip, but no model
        archive.writestr("config.json", "{}")
    with pytest.raises(TfpipeError, match="a zip archive without model.weights.h5; not a model train.fit saved"):
        load_model(str(damaged))


@pytest.mark.backends
@pytest.mark.parametrize(
    "name, schedule, setting",
    [("onecycle", OneCycle, ("total_steps", 40)), ("kaggle", KaggleRamp, ("steps_per_epoch", 10))],
)
def test_a_saved_model_file_gets_tfpipes_metric_and_schedule_back(name, schedule, setting):
    """``tests/data/model-<backend>-<name>.keras``, saved by an earlier tfpipe (a run's ``model.keras`` loads in
    every later one): a Dense layer compiled with tfpipe's F1 metric and a one-cycle or Kaggle-ramp schedule.
    tfpipe's loader builds it (Keras 3 compiles it too, as its file says; tf-keras' ``model_from_json`` never
    does), and Keras' own loader with tfpipe's custom objects compiles it: the metric and the schedule are
    tfpipe's classes again, with their settings, and are saved under the names the file gives them."""
    path = os.path.join(ROOT, "tests", "data", f"model-{BACKEND}-{name}.keras")
    ours, theirs = load_model(path), keras.models.load_model(path, custom_objects=custom_objects())
    assert [w.tolist() for w in ours.get_weights()] == [w.tolist() for w in theirs.get_weights()]
    with zipfile.ZipFile(path) as archive:
        saved = json.loads(archive.read("config.json"))["compile_config"]
    for model in [theirs, ours] if BACKEND == "jax" else [theirs]:
        rate = model.optimizer._learning_rate  # the schedule (learning_rate is its value at the current step)
        assert isinstance(rate, schedule) and isinstance(rate, keras.optimizers.schedules.LearningRateSchedule)
        assert getattr(rate, setting[0]) == setting[1]
        model.evaluate(np.zeros((2, 4), np.float32), np.zeros((2, 3), np.float32), verbose=0)  # builds the metrics
        f1 = [m for top in model.metrics for m in [top, *getattr(top, "metrics", [])] if isinstance(m, F1Score)]
        assert len(f1) == 1 and isinstance(f1[0], keras.metrics.F1Score) and f1[0].get_config()["threshold"] == 0.4
        again = model.get_compile_config()
        assert again["optimizer"]["config"]["learning_rate"] == saved["optimizer"]["config"]["learning_rate"]
        assert again["weighted_metrics"] == saved["weighted_metrics"]
        for mixin, made in ((F1Score, f1[0]), (schedule, rate)):  # tf-keras' loader may find the class by its module
            assert type(mixin.from_config(made.get_config())) is type(made)


@pytest.mark.backends(jax="slow")  # the trained run: 33 s on JAX
def test_fit_returns_a_fit_result_whose_serialisation_is_metrics_json(trained_run):
    """Issue #62: ``fit()`` returns types, not a dict in three shapes; ``FitResult.load`` reads the run back to the
    same figures, and tfpipe 1.0's ``result["key"]`` still reads them, with a warning naming the attribute."""
    import typing

    import train.fit
    from train.runs.results import FitResult, PreflightReport, WorkerResult

    assert typing.get_type_hints(train.fit.fit)["return"] == FitResult | PreflightReport | WorkerResult
    out, metrics, _ = trained_run
    result = FitResult.load(out)
    assert result.metrics == metrics == json.loads(open(f"{out}/metrics.json").read())
    assert (result.epochs, result.replicas, result.global_batch_size) == (metrics["epochs"], 8, 8)
    assert result.backend == metrics["backend"] == BACKEND
    assert result.report["roc_auc_macro"] == metrics["report"]["roc_auc_macro"]
    assert result.swa.epochs_averaged == 2 and result.swa.report == metrics["swa"]["report"]
    assert result.best.epoch == metrics["best"]["epoch"] and result.keras_auc == metrics["final"]["val_auc"]
    with pytest.raises(TypeError, match="not subscriptable"):  # 1.x's dict reads were removed in 2.0
        result["epochs"]
    with pytest.raises(RunMismatch, match="metrics.json: not the metrics of a finished train.fit run"):
        FitResult.from_metrics(out, dict(metrics, epochs="two"))
    swa = dict(metrics["swa"], report=dict(metrics["swa"]["report"], exact_match=2.0))
    with pytest.raises(RunMismatch, match=r"metrics.json: its swa.report is damaged \(exact_match: not a number"):
        FitResult.from_metrics(out, dict(metrics, swa=swa))  # what the type says of a report is checked first


def test_a_runs_files_are_checked_against_its_record_and_a_resume_against_its_layout(
    trained_run, shard_dir, tmp_path, capsys
):
    """Issue #64: a model or thresholds file copied over another, or the record gone, is refused in one line
    naming the file before anything is predicted; a resume on other replicas, or on another shard folder, is
    refused naming what differs (the folder as another one, not as rewritten)."""
    from train.fit import main as fit_main
    from train.predict import main as predict_main

    run, _, test = trained_run
    copy = tmp_path / "run"
    with open(os.path.join(run, "files.json")) as f:
        record = json.load(f)["files"]
    assert {"model.keras", "model-swa.keras", "thresholds-swa.json", "val_predictions.csv"} <= set(record)
    assert (record["thresholds-swa.json"]["model"], record["val_predictions.csv"]["views"]) == ("model-swa.keras", 1)
    out = tmp_path / "s.csv"
    argv = ["--run", str(copy), "--records", test, "--out", str(out), "--strategy", "cpu", "--no-swa"]
    for source, target, said in (
        ("model-swa.keras", "model.keras", "model.keras: not the file this folder's job wrote"),
        ("rewrite", "thresholds.json", "thresholds.json: not the file this folder's job wrote (of "
         "model.keras, 1 view)"),
        (None, "files.json", "files.json: missing, the record of the files this folder's job wrote"),
        ("edit", "metrics.json", "metrics.json: not the file this folder's job wrote"),  # its scores choose
    ):  # fmt: skip
        shutil.rmtree(copy, ignore_errors=True)
        shutil.copytree(run, copy)
        if source == "edit":  # the final model's AUC raised: it would be chosen over the SWA model
            metrics = json.loads((copy / target).read_text())
            metrics["report"]["roc_auc_macro"] = 0.99
            (copy / target).write_text(json.dumps(metrics))
        elif source == "rewrite":  # another model's thresholds (the tiny run's may all be the default 0.5)
            classes = list(json.loads((copy / target).read_text()))
            (copy / target).write_text(json.dumps(dict.fromkeys(classes, 0.25)))
        elif source:
            shutil.copy(copy / source, copy / target)
        else:
            (copy / target).unlink()
        assert predict_main(argv if source != "edit" else argv[:-1]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and f"{copy}/{said}" in err[0], err
        assert not out.exists()
    shutil.rmtree(copy)
    shutil.copytree(run, copy)
    (copy / "state.json").write_text(json.dumps({"finished": False}))  # as a job stopped mid-run leaves it
    others, root = tmp_path / "others", os.path.dirname(shard_dir[0])  # the same images in other shards
    source = tfpipe.Source(f"{root}/images", csv=f"{root}/train.csv")
    tfpipe.write_shards(source, str(others), spec=tfpipe.ImageSpec(image_size=32), num_folds=4, num_shards=4,
                        workers=0, progress=False)  # fmt: skip
    config = json.loads((copy / "config.json").read_text())
    assert (config["replicas_in_sync"], config["global_batch_size"]) == (8, 8 * config["batch_size"])
    flags = ["--run", str(copy), "--resume", "--model", "small-cnn", "--batch-size", "1", "--epochs", "3"]
    flags += ["--lr", "1e-3", "--swa-epochs", "2", "--no-augment", "--seed", "1", "--strategy", "cpu"]
    for records, replicas, said in (
        (shard_dir[0], "2", "was started with replicas_in_sync=8, not 2; --resume continues a run with its own "
         "settings (--strategy, --replicas:"),
        (str(others), "8", f"{others} holds other shards than {copy} trained on ({shard_dir[0]})"),
    ):  # fmt: skip
        assert fit_main([*flags, "--records", records, "--replicas", replicas]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and said in err[0], err


@pytest.mark.backends(jax="slow")  # the trained run: 33 s on JAX
def test_predict_follows_a_sample_submission_and_saves_its_probabilities(trained_run, tmp_path, capsys):
    """Issue #65: --sample-submission gives the submission the competition's header, id column and id order (a
    grader expecting ``image_id,label`` refused ``image,labels``); its class columns take the probabilities, in
    its order; a sample of other ids, or of an id twice, is one line. --save-probabilities keeps the test
    probabilities (what train.blend --test reads) and never replaces a file it did not write."""
    from train.predict import main

    run, _, test = trained_run
    ids = tfpipe.image_names(test)
    order = ids[::-1]
    sample, saved, out = tmp_path / "sample.csv", tmp_path / "probs.csv", tmp_path / "sub.csv"
    pd.DataFrame({"image_id": order, "label": "x"}).to_csv(sample, index=False)
    common = ["--run", run, "--records", test, "--strategy", "cpu", "--no-swa", "--no-progress"]
    assert (
        main([*common, "--out", str(out), "--sample-submission", str(sample), "--save-probabilities", str(saved)]) == 0
    )
    written, probs = pd.read_csv(out, keep_default_na=False), pd.read_csv(saved)
    assert list(written.columns) == ["image_id", "label"] and list(written["image_id"]) == order
    assert list(probs.columns) == ["image_id", "a", "b", "c"] and list(probs["image_id"]) == ids  # the shards' order
    tuned = json.loads(open(f"{run}/thresholds.json").read())
    expected = {row["image_id"]: " ".join(c for c in "abc" if row[c] >= tuned[c]) for _, row in probs.iterrows()}
    assert list(written["label"]) == [expected[i] for i in order]

    by_class = tmp_path / "by-class.csv"
    pd.DataFrame({"id": order, "c": 0.5, "a": 0.5, "b": 0.5}).to_csv(by_class, index=False)
    df = predict(run, test, "", sample_submission=str(by_class), strategy="cpu", swa=False, progress=False)
    assert list(df.columns) == ["id", "c", "a", "b"] and list(df["id"]) == order
    expected_probs = probs.set_index("image_id").loc[order, ["a", "b", "c"]].to_numpy()
    np.testing.assert_allclose(df[["a", "b", "c"]].to_numpy(), expected_probs, atol=1e-6)

    saved.write_text(saved.read_text() + "\n")  # changed since train.predict wrote it
    bad = tmp_path / "bad.csv"
    for rows, columns, more, needle in (
        ([*order, order[0]], ("image_id", "label"), [], f"1 id in two rows or more (e.g. {order[0]!r})"),
        ([*order, "stranger"], ("image_id", "label"), [], "1 id not predicted (not in"),
        (order[2:], ("image_id", "label"), [], f"lacks 2 predicted ids (of {test}; e.g. {ids[-2]!r})"),
        (order, ("image_id", "label"), ["--probabilities"], "is a labels column, not one column per class"),
        (order, ("image_id", "a", "b"), [], "expected the id column, then one labels column or one column per class"),
        (order, ("image_id", "label"), ["--save-probabilities", str(saved)], "exists and was not written by"),
    ):
        pd.DataFrame({c: rows if c == columns[0] else "" for c in columns}).to_csv(bad, index=False)
        assert main([*common, "--out", str(tmp_path / "x.csv"), "--sample-submission", str(bad), *more]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and needle in err[0] and "Traceback" not in err[0], err
        assert str(saved if more[:1] == ["--save-probabilities"] else bad) in err[0]
    assert not (tmp_path / "x.csv").exists()

    copy = tmp_path / "copy"  # without a sample the labels column is named as the training CSV's
    shutil.copytree(run, copy)
    config = json.loads((copy / "config.json").read_text())
    assert config["label_column"] == "labels"  # trained on shard_dir's "labels" column
    (copy / "config.json").write_text(json.dumps(dict(config, label_column="label")))  # as --class-col label
    assert list(predict(str(copy), test, "", strategy="cpu", swa=False, progress=False).columns) == ["image", "label"]
    (copy / "config.json").write_text(json.dumps(dict(config, label_column=" ")))
    with pytest.raises(RunMismatch, match="field 'label_column' must name the training CSV's label column"):
        predict(str(copy), test, "", strategy="cpu", swa=False)


def test_predict_names_a_class_its_run_cannot_tell_from_chance(monkeypatch):
    """A run whose validation AUC of a class is near chance (its report's figures): train.predict's line says
    what that class's threshold does to the images predicted (labelled everywhere), against its share in
    validation; a class told apart says nothing."""
    from types import SimpleNamespace

    from train.decide.choice import RunScores
    from train.decide.tuning import chance_bound
    from train.prediction import target as targets

    report = {
        "examples": 400,
        "per_class": {"sky": {"roc_auc": 0.95, "positives": 100}, "brick": {"roc_auc": 0.52, "positives": 36}},
    }
    monkeypatch.setattr(targets, "run_scores", lambda folder: RunScores(report, None, False))
    config = SimpleNamespace(single_label=False, classes=("sky", "brick"))
    target = targets.Target("runs/x", (("runs/x", config),), False)
    probs = np.column_stack([np.linspace(0, 1, 50), np.full(50, 0.2)])
    bound = chance_bound(36, 400)
    assert targets.near_chance_lines(target, probs, [0.5, 0.09]) == [
        f"'brick': validation AUC 0.520 does not tell it from chance ({bound:.3f} would, on its 400 images); its "
        "threshold 0.09 labels it on 100% of these images, 9% of the validation images hold it"
    ]
    report["per_class"]["brick"]["roc_auc"] = 0.9
    assert targets.near_chance_lines(target, probs, [0.5, 0.09]) == []


def test_predict_leaves_only_the_files_it_documents_in_the_output_folder(trained_run, tmp_path):
    """On Kaggle /kaggle/working held 7 hidden ``.NAME.tfpipe`` files after train.predict: the record of each CSV
    it wrote (so a rerun may replace it) lived beside the CSV. It lives in this user's state folder now
    (``train.prediction.written``): the folder holds the submission and the probabilities asked for, after a
    prediction, a rerun (its own files replaced without --overwrite), and a failed one. A record an earlier
    version left beside a file is honoured once, then removed."""
    from train.predict import main
    from train.prediction import written

    run, _, test = trained_run
    work = tmp_path / "working"
    common = ["--run", run, "--records", test, "--strategy", "cpu", "--no-swa", "--no-progress"]
    argv = [*common, "--out", str(work / "submission.csv"), "--save-probabilities", str(work / "probs.csv")]
    assert main(argv) == 0 and sorted(os.listdir(work)) == ["probs.csv", "submission.csv"]
    assert main(argv) == 0 and sorted(os.listdir(work)) == ["probs.csv", "submission.csv"]
    (work / "sample.csv").write_text("image,labels\nnot-an-id,a\n")
    assert main([*common, "--out", str(work / "other.csv"), "--sample-submission", str(work / "sample.csv")]) == 2
    assert sorted(os.listdir(work)) == ["probs.csv", "sample.csv", "submission.csv"]
    submission = str(work / "submission.csv")
    os.remove(written.record_path(submission))  # as an earlier tfpipe left it: its record beside the file
    (work / ".submission.csv.tfpipe").write_text(written.sha256_of(submission) + "\n")
    assert main(argv) == 0 and sorted(os.listdir(work)) == ["probs.csv", "sample.csv", "submission.csv"]
    assert written.wrote_it(submission)


def test_a_runs_metric_equals_its_name_both_ways(trained_run):
    """``FitResult.metric`` is a ``Metric``, metrics.json's ``"metric"`` its name: code moving from the key to the
    attribute (1.x's ``result["metric"]`` -> ``result.metric``) compared ``== "roc_auc"`` and got False. A metric
    equals its name, either side of ``==``, and hashes as it does; two metrics still differ by name."""
    from train.decide.metrics import METRICS
    from train.runs.results import FitResult

    out, metrics, _ = trained_run
    result = FitResult.load(out)
    assert metrics["metric"] == "roc_auc" and result.metric == metrics["metric"] and metrics["metric"] == result.metric
    other = "accuracy"
    assert result.metric != other and other != result.metric and result.metric != METRICS[other]
    assert result.metric == METRICS["roc_auc"] and {result.metric} == {"roc_auc"} and "roc_auc" in {result.metric}
    assert {"roc_auc": 1}[result.metric] == 1 and result.metric != 0.5
