"""Cross-validation (issue #51): every fold trained in one process (train.cv), the out-of-fold predictions and
their scores, thresholds tuned for the model and views that predict, the fold ensemble, blending. One CV of the
demo's shapes (3 folds, 16 px, SWA) is trained once and shared."""

import dataclasses
import json
import os
import re
import shutil
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from tests.conftest import BACKEND
from train.decide.metrics import metric_of
from train.runs import files
from train.runs.cv_folder import submitted_model


@pytest.fixture(scope="session")
def cv_shards(tmp_path_factory):
    """The demo's shapes at 16 px: 150 labeled images in 3 folds, and 40 labeled held-back images."""
    import tfpipe
    from tfpipe.demo import make_demo

    root = tmp_path_factory.mktemp("cvdemo")
    make_demo(str(root / "data"), train=190, test=0)
    table = pd.read_csv(root / "data" / "train.csv", dtype=str, keep_default_na=False)
    table[:150].to_csv(root / "train.csv", index=False)
    table[150:].to_csv(root / "heldback.csv", index=False)
    spec = tfpipe.ImageSpec(image_size=16)
    out = {}
    for name, folds in (("train", 3), ("heldback", None)):
        source = tfpipe.Source(str(root / "data" / "images"), csv=str(root / f"{name}.csv"))
        out[name] = str(root / name)
        tfpipe.write_shards(source, out[name], spec=spec, num_folds=folds, workers=0, progress=False)
    return out


def cv_config(records, run, **changes):
    from tfpipe.tf.augment import NO_AUGMENT
    from train.keras.config import FitConfig

    settings = {
        "records": records,
        "run": run,
        "strategy": "cpu",
        "model": "small-cnn",
        "batch_size": 16,
        "epochs": 2,
        "lr": 3e-3,
    }
    # 8 steps per execution, cut to a fold's 6 (recorded as used): the fold runs are still the CV's
    settings.update(steps_per_execution=8, swa_epochs=1, augment=NO_AUGMENT, verbose=0, seed=3, **changes)
    return FitConfig(**settings)


@pytest.fixture(scope="session")
def cv_run(cv_shards, tmp_path_factory):
    """A finished CV of every fold; (folder, its CVResult)."""
    from train.cv import cross_validate

    folder = str(tmp_path_factory.mktemp("cv") / "cv")
    return folder, cross_validate(cv_config(cv_shards["train"], folder))


@pytest.mark.backends(jax="slow")  # the CV: 118 s on JAX, each fold compiling its steps
def test_oof_holds_every_image_once_scored_by_the_model_that_never_trained_on_it(cv_run, cv_shards):
    from sklearn.metrics import roc_auc_score

    import tfpipe
    from train.runs.run import load_digests

    folder, result = cv_run
    oof = pd.read_csv(os.path.join(folder, "oof.csv"), dtype={"image_digest": str}, keep_default_na=False)
    assert sorted(oof["image_digest"]) == sorted(tfpipe.image_digests(cv_shards["train"]))  # each image once
    for k in range(3):
        trained = load_digests(os.path.join(folder, f"fold-{k}"))
        rows = oof[oof["fold"] == k]
        assert len(rows) and not set(rows["image_digest"]) & trained
        assert set(rows["image_digest"]) == set(tfpipe.image_digests(cv_shards["train"], folds=[k]))
    classes = list(result.classes)
    truth = np.array([[c in labels.split() for c in classes] for labels in oof["labels"]])
    both = [c for c in range(len(classes)) if 0 < truth[:, c].sum() < len(truth)]
    expected = np.mean([roc_auc_score(truth[:, c], oof[classes[c]]) for c in both])
    written = json.loads(open(os.path.join(folder, "cv.json")).read())
    final = written["models"][0]
    assert final["model"] == "model.keras" and final["views"] == 1
    assert final["scores"]["roc_auc_macro"] == pytest.approx(expected, abs=1e-9)
    assert [f["fold"] for f in final["folds"]] == [0, 1, 2] and sum(f["examples"] for f in final["folds"]) == 150
    assert written["models"][1]["model"] == "model-swa.keras"  # SWA's OOF too, and the better one submits
    better = max(written["models"], key=lambda m: m["scores"]["roc_auc_macro"])["model"]
    assert written["submits"] == better and written["metric"] == "roc_auc"  # the default --metric decides
    best = max(final["folds"], key=lambda f: f["roc_auc_macro"])  # the best single fold, beside the pooled OOF
    assert final["best_fold"] == best and final["one_view"] is None  # scored over 1 view: nothing to compare


@pytest.mark.backends(jax="slow")  # the CV: 118 s on JAX, each fold compiling its steps
def test_the_fold_ensemble_is_the_mean_of_the_fold_models_at_the_oof_thresholds(cv_run, cv_shards, tmp_path, capsys):
    """--save-probabilities keeps the ensemble's probabilities and each fold model's (issue #65), from the one
    prediction."""
    from train.decide.tuning import tune
    from train.predict import predict
    from train.prediction.submission import label_names
    from train.runs.thresholds import load_thresholds

    folder, result = cv_run
    common = {"probabilities": True, "labels": True, "strategy": "cpu", "swa": False, "progress": False}
    ensemble = predict(folder, cv_shards["heldback"], "", **common, save_probabilities=str(tmp_path / "p.csv"))
    classes = list(result.classes)
    own = [predict(f"{folder}/fold-{k}", cv_shards["heldback"], "", **common)[classes].to_numpy() for k in range(3)]
    np.testing.assert_allclose(ensemble[classes].to_numpy(), np.mean(own, axis=0), atol=1e-6)
    saved = [pd.read_csv(tmp_path / name) for name in ("p.csv", "p-fold-0.csv", "p-fold-1.csv", "p-fold-2.csv")]
    assert all(list(t.columns) == ["image", *classes] and list(t["image"]) == list(ensemble["image"]) for t in saved)
    np.testing.assert_allclose(saved[0][classes].to_numpy(), ensemble[classes].to_numpy(), atol=1e-6)
    for k in range(3):
        np.testing.assert_allclose(saved[k + 1][classes].to_numpy(), own[k], atol=1e-6)
    thresholds = load_thresholds(folder, classes)  # tuned on oof.csv, not a fold's validation
    oof = pd.read_csv(f"{folder}/oof.csv", keep_default_na=False)
    truth = np.array([[c in label_names(cell, classes) for c in classes] for cell in oof["labels"]], np.float32)
    assert thresholds == tune(oof[classes].to_numpy(np.float32), truth, 0.5, result.metric).thresholds
    expected = [" ".join(c for c, t in zip(classes, thresholds) if row[c] >= t) for _, row in ensemble.iterrows()]
    assert list(ensemble["labels"]) == expected
    scores = ensemble.attrs["evaluation"]
    assert set(scores) == {"thresholds", "own_training_shards", "all", "metric"} and scores["all"]["examples"] == 40
    assert scores["metric"] == "roc_auc"  # the CV's default --metric leads the lines


def test_thresholds_are_tuned_for_the_views_that_predict(cv_run, cv_shards, capsys):
    """A run's --tta 2 labels at thresholds tuned on 2-view predictions of its validation images (recorded once,
    then reused), not the report's single-view ones; the prediction at each view count used its own."""
    import tfpipe
    from train.decide.tuning import tune
    from train.predict import predict
    from train.prediction.submission import label_names
    from train.runs.thresholds import load_thresholds

    folder, result = cv_run
    run = f"{folder}/fold-1"
    classes = list(result.classes)
    for views in (2, 1, 2):
        df = predict(run, cv_shards["heldback"], "", tta=views, probabilities=True, labels=True, strategy="cpu",
                     swa=False, progress=False)  # fmt: skip
        used = load_thresholds(run, classes, views=views)
        expected = [" ".join(c for c, t in zip(classes, used) if row[c] >= t) for _, row in df.iterrows()]
        assert list(df["labels"]) == expected
    said = "".join(capsys.readouterr())
    n = tfpipe.count_examples(cv_shards["train"], folds=[1])
    assert said.count(f"thresholds for model.keras, 2 TTA views tuned on {n} images") == 1  # tuned once, then read
    # each --tta 2 says what 2 views did on the same validation images, by the run's metric, before predicting
    worth = re.findall(r"validation images \(model\.keras\), 2 TTA views score AUC \(exact, macro\) ([\d.]+) "
                       r"against ([\d.]+) for 1 view", said)  # fmt: skip
    assert len(worth) == 2 and worth[0] == worth[1]
    for views, name in ((1, "val_predictions.csv"), (2, "val_predictions-tta2.csv")):  # each tuned on its own
        table = pd.read_csv(f"{run}/{name}", keep_default_na=False)
        truth = np.array([[c in label_names(cell, classes) for c in classes] for cell in table["true"]], np.float32)
        tuned = tune(table[classes].to_numpy(np.float32), truth, 0.5, result.metric).thresholds
        assert load_thresholds(run, classes, views=views) == pytest.approx(tuned, abs=1e-6), views
    validation = pd.read_csv(f"{run}/val_predictions-tta2.csv")
    assert len(validation) == n and not np.allclose(
        validation[classes], pd.read_csv(f"{run}/val_predictions.csv")[classes]
    )


def test_the_default_model_follows_validation_and_says_so(cv_run, cv_shards, capsys):
    from train.predict import predict

    folder, result = cv_run
    df = predict(folder, cv_shards["heldback"], "", probabilities=True, strategy="cpu")
    chosen = result.submits
    assert df.attrs["model"] == f"the mean of 3 fold models ({chosen}, 1 view each)"
    said = capsys.readouterr().out
    other = "model.keras" if chosen == "model-swa.keras" else "model-swa.keras"
    assert f"predicting with the fold models' {chosen}" in said and f"for {other}" in said
    flag = chosen == "model-swa.keras"
    again = predict(folder, cv_shards["heldback"], "", probabilities=True, strategy="cpu", progress=False, swa=flag)
    pd.testing.assert_frame_equal(df, again)


@pytest.mark.slow  # 17 s: a fold trained again
def test_a_cv_interrupted_in_its_last_fold_resumes_there(cv_run, cv_shards, tmp_path):
    """Folds 0 and 1 finished, fold 2 stopped after its first epoch (Ctrl-C, a notebook's time limit): --resume
    keeps the finished folds untouched and continues fold 2, ending with the folder an uninterrupted CV has."""
    import tf_keras as keras

    from train.cv import cross_validate
    from train.runs.cv_folder import CVResult

    folder, _ = cv_run
    copy = str(tmp_path / "cv")
    shutil.copytree(folder, copy)
    shutil.rmtree(f"{copy}/fold-2")
    plan = CVResult.load(copy)
    dataclasses.replace(plan, models=(), submits=None).save(copy)  # as while fold 2 trained
    for name in os.listdir(copy):
        if name.startswith(("oof", "thresholds")):
            os.remove(f"{copy}/{name}")
    kept = {k: os.stat(f"{copy}/fold-{k}/model.keras").st_mtime_ns for k in (0, 1)}

    class Stop(keras.callbacks.Callback):
        def on_epoch_end(self, epoch, logs=None):
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        cross_validate(cv_config(cv_shards["train"], copy, resume=True, callbacks=(Stop(),)))
    assert sorted(os.listdir(f"{copy}/fold-2")).count("model.keras") == 0 and not CVResult.load(copy).finished
    result = cross_validate(cv_config(cv_shards["train"], copy, resume=True))
    assert result.finished and {k: os.stat(f"{copy}/fold-{k}/model.keras").st_mtime_ns for k in (0, 1)} == kept
    assert sorted(os.listdir(copy)) == sorted(os.listdir(folder))
    history = pd.read_csv(f"{copy}/fold-2/history.csv")
    assert list(history["epoch"]) == [0, 1]  # each epoch once


@pytest.mark.parametrize(
    "change, line",
    [
        ({"folds": [0, 3]}, "--fold 0,3: the folds of {train} are 0..2"),
        ({"settings": {"lr": 0.01}, "resume": True}, "was started with lr=0.003, not 0.01; a CV folder never mixes"),
        ({"resume": True}, "holds a finished cross-validation; --resume continues an interrupted one"),
        ({}, "already holds a cross-validation; pass --resume to continue it or --overwrite"),
        ({"folds": [1, 1]}, "--fold 1,1: the folds of {train} are 0..2; name each at most once"),
        ({"settings": {"strategy": "multiworker"}}, "train.cv trains on a cluster with --backend jax; a TensorFlow"),
    ],
    ids=["fold-out-of-range", "other-settings", "resume-finished", "no-resume", "fold-twice", "tf-cluster"],
)
def test_what_bad_input_gets(cv_run, cv_shards, capsys, change, line):
    from train.cv import main

    folder, _ = cv_run
    before = {n: os.stat(f"{folder}/{n}").st_mtime_ns for n in os.listdir(folder)}
    flags = {"lr": 0.003, **change.get("settings", {})}
    argv = ["--records", cv_shards["train"], "--run", folder, "--strategy", "cpu", "--model", "small-cnn"]
    argv += [a for k, v in flags.items() for a in (f"--{k}", str(v))]
    argv += ["--resume"] * change.get("resume", False)
    argv += ["--fold", ",".join(map(str, change["folds"]))] if "folds" in change else []
    argv += ["--batch-size", "16", "--epochs", "2", "--steps-per-execution", "8", "--swa-epochs", "1"]
    argv += ["--no-augment", "--seed", "3", "--verbose", "0"]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and line.format(train=cv_shards["train"]) in err[0], err
    assert {n: os.stat(f"{folder}/{n}").st_mtime_ns for n in os.listdir(folder)} == before  # nothing written


def test_a_blend_is_the_weighted_mean_scored_on_oof_and_refuses_what_disagrees(cv_run, cv_shards, tmp_path, capsys):
    """Two models of one dataset (the CV's final and SWA fold models): their OOF and test predictions blended
    with weights 1:3 are the weighted means, labelled at thresholds tuned on the blended OOF; other classes or
    other ids are one line each."""
    from train.blend import main
    from train.decide.evaluation import score
    from train.decide.tuning import tune_thresholds
    from train.predict import predict

    folder, result = cv_run
    classes = list(result.classes)
    tests = []
    for swa in (False, True):  # a submission with --probabilities, and --save-probabilities' file (issue #65)
        tests.append(str(tmp_path / f"test-{swa}.csv"))
        how = {"out": "", "save_probabilities": tests[-1]} if swa else {"out": tests[-1], "probabilities": True}
        predict(folder, cv_shards["heldback"], **how, strategy="cpu", swa=swa, progress=False)
    oofs = [f"{folder}/oof.csv", f"{folder}/oof-swa.csv"]
    out = str(tmp_path / "blend.csv")
    argv = ["--oof", *oofs, "--test", *tests, "--out", out, "--weights", "5e307,1.5e308", "--probabilities"]  # 1:3
    assert main(argv) == 0
    a, b = (pd.read_csv(p) for p in oofs)
    mixed = 0.25 * a[classes].to_numpy() + 0.75 * b[classes].to_numpy()
    truth = np.array([[c in str(row).split() for c in classes] for row in a["labels"].fillna("")], np.float32)
    thresholds = tune_thresholds(mixed, truth, 0.5)
    expected = score(mixed, truth, classes, thresholds, False)
    said = capsys.readouterr().out
    assert f"the blend (weights 0.250, 0.750): AUC (exact, macro) {expected['roc_auc_macro']:.4f}" in said
    assert main(["--oof", *oofs, "--search-weights"]) == 0  # by the CV's metric, from equal weights
    said = capsys.readouterr().out
    searched = re.search(r"searched on the OOF rows by AUC \(exact, macro\): ([\d.]+), ([\d.]+) score ([\d.]+) there, "
                         r"equal weights ([\d.]+)", said)  # fmt: skip
    assert searched and float(searched[3]) >= float(searched[4]), said
    assert f"the blend (weights {searched[1]}, {searched[2]}): AUC (exact, macro) {searched[3]}" in said
    written = pd.read_csv(out, keep_default_na=False)
    ta, tb = (pd.read_csv(p)[classes].to_numpy() for p in tests)
    blended = 0.25 * ta + 0.75 * tb
    np.testing.assert_allclose(written[classes].to_numpy(), blended, atol=1e-6)
    expected_labels = [" ".join(c for c, t, v in zip(classes, thresholds, row) if v >= t) for row in blended]
    assert list(written["labels"]) == expected_labels
    swapped = str(tmp_path / "swapped.csv")
    b[["image_name", "image_digest", "fold", *classes[::-1], "labels"]].to_csv(swapped, index=False)
    fewer = str(tmp_path / "fewer.csv")
    b[1:].to_csv(fewer, index=False)
    wrong = {}  # an OOF truth cell that is no list of classes was read as "no labels" (issue #53)
    for name, cell in (("nan", "NA"), ("unknown", f"{classes[0]} dog"), ("commas", ",".join(classes[:2]))):
        wrong[name] = str(tmp_path / f"{name}.csv")
        pd.read_csv(oofs[0], keep_default_na=False).assign(labels=lambda t, c=cell: [c] + list(t["labels"][1:])).to_csv(
            wrong[name], index=False
        )
    na_test = str(tmp_path / "na-test.csv")
    pd.read_csv(tests[0], keep_default_na=False).assign(**{classes[1]: lambda t: ["NA", *t[classes[1]][1:]]}).to_csv(
        na_test, index=False
    )
    for argv, bad, line in (
        (
            [*oofs, "--test", na_test, tests[1], "--out", out, "--overwrite"],
            na_test,
            f"row 1, column '{classes[1]}': 'NA' is not a probability",
        ),
        ([oofs[0], swapped], swapped, "classes"),
        ([oofs[0], fewer], fewer, "the ids are not"),
        ([wrong["nan"], oofs[0]], wrong["nan"], "row 1, column 'labels': 'NA' is a missing-value spelling"),
        ([oofs[0], wrong["unknown"]], wrong["unknown"], "row 1, column 'labels': 'dog' is not one of the class"),
        ([oofs[0], wrong["commas"]], wrong["commas"], "row 1, column 'labels': "),
        ([*oofs, "--test", *tests, "--out", tests[1]], tests[1], "is one of the blend's inputs"),
        ([*oofs, "--search-weights", "--weights", "1,2"], "--search-weights", "leave out --weights"),
        ([*oofs, "--metric", "accuracy"], "--metric accuracy", "does not apply to a multi-label run"),
    ):
        assert main(["--oof", *argv]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and bad in err[0] and line in err[0], err
    other = tmp_path / "other-cv"  # a CV that decided by another metric: the blend's is asked for, not guessed
    os.makedirs(other)
    shutil.copy(f"{folder}/oof-swa.csv", other)
    settings = dict(result.settings, metric="f1_macro")
    decided = dataclasses.replace(
        result, settings=settings, submits=submitted_model(result.models, metric_of("f1_macro", False))
    )
    decided.save(str(other))  # as train.cv writes and records it
    files.record(str(other), ["oof-swa.csv"])
    assert main(["--oof", oofs[0], f"{other}/oof-swa.csv"]) == 2
    assert f"decided by different metrics ({folder}: roc_auc, {other}: f1_macro)" in capsys.readouterr().err
    assert main(["--oof", oofs[0], f"{other}/oof-swa.csv", "--metric", "f1_macro"]) == 0


@pytest.mark.parametrize(
    "edit, field",
    [
        (lambda d: d.update(folds=[0, 1]), "'folds' must be the folds each model was scored on"),
        (lambda d: d.update(submits=next(m for m in ("model.keras", "model-swa.keras") if m != d["submits"])),
         "'submits' must name the better OOF AUC"),
        (lambda d: d["models"][0]["scores"].update(roc_auc_macro=float("nan")), "'scores' must hold the OOF scores"),
        (lambda d: d.update(replicas=0), "'replicas' must be a count"),
        (lambda d: d.update(metric="log_loss"), "'metric' must be the settings' metric \\(roc_auc\\)"),
    ],
    ids=["fewer-folds", "submits-flipped", "nan", "replicas", "metric"],
)  # fmt: skip
def test_an_edited_cv_json_is_refused_naming_the_field(cv_run, tmp_path, edit, field):
    from tfpipe.runtime.errors import TfpipeError
    from train.runs.cv_folder import CVResult

    folder, _ = cv_run
    data = json.loads(open(f"{folder}/cv.json").read())
    edit(data)
    (tmp_path / "cv.json").write_text(json.dumps(data))
    with pytest.raises(TfpipeError, match=f"cv.json: field {field}"):
        CVResult.load(str(tmp_path))


def test_a_fold_folder_of_another_fold_or_with_a_users_file_is_refused_before_anything_changes(
    cv_run, cv_shards, tmp_path, capsys
):
    """A fold's run copied over another fold's folder would make the ensemble one fold twice; a user's file in a
    fold folder made --overwrite remove the other folds' runs, then refuse. Both: one line, nothing changed."""
    from tfpipe.runtime.errors import TfpipeError
    from train.cv import main
    from train.predict import predict

    folder, _ = cv_run
    copy = str(tmp_path / "cv")
    shutil.copytree(folder, copy)
    shutil.rmtree(f"{copy}/fold-2")
    shutil.copytree(f"{copy}/fold-0", f"{copy}/fold-2")
    with pytest.raises(TfpipeError, match="fold-2 holds the run of fold 0 .*, not of fold 2"):
        predict(copy, cv_shards["heldback"], "", probabilities=True, strategy="cpu", progress=False)
    shutil.rmtree(f"{copy}/fold-2")
    shutil.copytree(f"{folder}/fold-2", f"{copy}/fold-2")
    (tmp_path / "cv" / "fold-1" / "notes.txt").write_text("mine")
    before = sorted(str(p.relative_to(copy)) for p in (tmp_path / "cv").rglob("*"))
    argv = ["--records", cv_shards["train"], "--run", copy, "--strategy", "cpu", "--model", "small-cnn", "--overwrite"]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "fold-1/notes.txt is not a file train.fit writes" in err[0], err
    assert sorted(str(p.relative_to(copy)) for p in (tmp_path / "cv").rglob("*")) == before


@pytest.mark.backends(jax="slow")  # the CV: 118 s on JAX, each fold compiling its steps
def test_a_cv_folder_and_its_fold_runs_read_back_with_train_inspect(cv_run, capsys, tmp_path):
    """Issue #54: a CV folder read back days later: its out-of-fold scores of both models side by side (each
    column naming its model and views, the figures cv.json's), each model's class table titled with its
    thresholds file, every fold's run, and what train.predict predicts with; --json for scripts."""
    from train.inspect import main

    folder, result = cv_run
    assert main([folder, "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["kind"] == "cv" and info["finished"] and [f["fold"] for f in info["folds"]] == [0, 1, 2]
    assert [m["model"] for m in info["models"]] == ["model.keras", "model-swa.keras"]
    final = result.scores_of(swa=False).scores
    assert info["models"][0]["scores"]["roc_auc_macro"] == final["roc_auc_macro"]
    assert info["folds"][1]["run_info"]["trained_by"] == "train.fit" and info["folds"][1]["finished"]
    assert main([folder]) == 0
    lines = capsys.readouterr().out.splitlines()
    words = {"tf": "tf-keras on TensorFlow", "jax": "Keras 3 on JAX"}[BACKEND]
    assert lines[0] == f"{folder}: a cross-validation of train.cv ({words}), finished"
    header = next(ln for ln in lines if "model.keras, 1 view" in ln and "model-swa.keras, 1 view" in ln)
    auc = lines[lines.index(header) + 1].split()
    assert auc[:2] == ["AUC,", "macro"] and auc[2] == f"{final['roc_auc_macro']:.4f}"
    assert "per class, model-swa.keras, 1 view, at the thresholds of thresholds-swa.json:" in lines
    assert lines[-1].startswith(
        f"python -m train.predict: predicting with the mean of the 3 fold models, {result.submits}"
    )
    copy = tmp_path / "cv"
    shutil.copytree(folder, copy)  # the session's CV stays as it is
    fold = copy / "fold-0"
    tuned = json.loads((fold / "thresholds.json").read_text())
    (fold / "thresholds.json").write_text(json.dumps({**tuned, result.classes[0]: 0.99}))  # edited since
    assert main([str(fold)]) == 0
    said = capsys.readouterr().out
    assert "at the thresholds it was scored at (thresholds.json now holds others: edited or copied?):" in said
    (fold / "metrics.json").unlink()  # as a run stopped by a signal before it finished leaves it
    (fold / "state.json").write_text(json.dumps({"stops": [{"signal": "SIGINT", "at": "epoch 2, step 3"}]}))
    assert main([str(fold)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].endswith(f"a run of train.fit ({words}), not finished") and lines[3] == (
        f"  {result.settings['epochs']} epochs of {result.settings['epochs']} recorded; stopped by SIGINT at epoch "
        "2, step 3; train.fit --resume continues it"
    )
    (copy / "thresholds.json").write_text(json.dumps(dict.fromkeys(result.classes, 0.99)))  # the CV's, edited
    (copy / "fold-1" / "config.json").write_text(
        (copy / "fold-1" / "config.json").read_text().replace('"lr": ', '"lr": NaN, "was": ')
    )
    assert main([str(copy)]) == 0 and "(thresholds.json now holds others: edited or copied?)" in capsys.readouterr().out
    assert main([str(copy / "fold-1"), "--json"]) == 0  # strict JSON: a non-finite number is null
    assert json.loads(capsys.readouterr().out)["settings"]["lr"] is None
    shutil.rmtree(copy / "fold-2")  # a CV that lost a fold: said on its line, and predict's refusal said
    assert main([str(copy)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert f"  fold 2: {copy}/fold-2: fold 2's run is missing from the cross-validation {copy}" in lines
    assert lines[-1].startswith("python -m train.predict: train.predict refuses this CV: ")
    (copy / "fold-1" / "metrics.json").write_text('{"report": [1, 2]}')  # damaged: one line naming it
    assert main([str(copy / "fold-1")]) == 2
    assert capsys.readouterr().err == (
        f"train.inspect: error: {copy}/fold-1/metrics.json: the final model's report is damaged (no per-class table)\n"
    )
    assert main([str(tmp_path)]) == 2 and "no config.json; not a run folder" in capsys.readouterr().err


def test_what_a_cv_folder_holds_is_checked_against_its_record_before_anything_uses_it(
    cv_run, cv_shards, tmp_path, capsys
):
    """Issue #64: a fold's model copied over another's, a fold's thresholds copied over the CV's, an edited OOF
    file, a fold folder turned into a file: each refused in one line naming the file, before any prediction, blend
    or removal; train.inspect names each."""
    from train.blend import main as blend_main
    from train.cv import main as cv_main
    from train.inspect import main as inspect_main
    from train.predict import main as predict_main

    folder, result = cv_run
    copy = tmp_path / "cv"
    shutil.copytree(folder, copy)
    record = json.loads((copy / "files.json").read_text())["files"]
    assert {"oof.csv", "oof-swa.csv", "fold-2/model.keras", "fold-2/model-swa.keras"} <= set(record)
    assert record["thresholds.json"]["model"] == "model.keras" and record["thresholds.json"]["views"] == 1
    predict = ["--run", str(copy), "--records", cv_shards["heldback"], "--out", str(tmp_path / "s.csv")]
    predict += ["--strategy", "cpu", "--swa" if result.submits == "model-swa.keras" else "--no-swa"]
    model = result.submits
    cases = [  # (what is done to the copy, the file named, what the line says)
        (lambda: shutil.copy(copy / "fold-0" / model, copy / "fold-1" / model), f"fold-1/{model}", "SHA-256"),
        (lambda: [shutil.copy(copy / "fold-0" / n, copy / "fold-1" / n) for n in (model, "files.json")],
         f"fold-1/{model}", "SHA-256"),  # the fold's own record copied with it: the CV's record still knows
        (lambda: (copy / "thresholds.json").write_text(json.dumps(dict.fromkeys(result.classes, 0.25))),
         "thresholds.json", "not the file this folder's job wrote"),  # a fold's (the tiny CV's may be all 0.5)
        (lambda: (copy / "cv.json").write_text((copy / "cv.json").read_text().replace('"tta": 1', '"tta": 1 ')),
         "cv.json", "not the file this folder's job wrote"),  # an edit that still validates: its scores choose
        (lambda: (copy / "files.json").unlink(), "files.json", "missing"),
    ]  # fmt: skip
    for change, named, said in cases:
        shutil.rmtree(copy)
        shutil.copytree(folder, copy)
        change()
        argv = predict if named != "thresholds.json" else [*predict[:-1], "--no-swa"]
        assert predict_main(argv) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and f"{copy}/{named}" in err[0] and said in err[0], err
        assert not (tmp_path / "s.csv").exists()
    assert inspect_main([str(copy)]) == 0  # files.json gone: said, not a crash
    assert "files not as their job wrote them (predicting refuses them):" in capsys.readouterr().out
    shutil.rmtree(copy)
    shutil.copytree(folder, copy)
    shutil.copy(copy / "fold-0" / "model.keras", copy / "fold-1" / "model.keras")
    oof = pd.read_csv(copy / "oof.csv", keep_default_na=False)
    oof[result.classes[0]] = 1 - oof[result.classes[0]]  # edited probabilities, still probabilities
    oof.to_csv(copy / "oof.csv", index=False)
    assert inspect_main([str(copy)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert any(ln.startswith("  fold-1/model.keras: not the file this folder's job wrote") for ln in lines), lines
    assert any(ln.startswith("  oof.csv: not the file") for ln in lines) and "refuses the folder" in lines[-1]
    assert blend_main(["--oof", str(copy / "oof.csv"), f"{folder}/oof-swa.csv"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"{copy}/oof.csv: not the file this folder's job wrote" in err[0], err
    again = os.path.join(folder, "..", os.path.basename(folder), "oof.csv")  # the same file under another name
    assert blend_main(["--oof", f"{folder}/oof.csv", again]) == 2
    assert f"{again} is given twice" in capsys.readouterr().err
    assert blend_main(["--oof", f"{folder}/oof.csv", f"{folder}/oof-swa.csv", "--single-label"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "holds multi-label predictions (its CV's cv.json says so), where a single" in err[0], err
    shutil.rmtree(copy / "fold-1")
    (copy / "fold-1").write_text("mine")  # a user's file where a fold's run was: --overwrite removes nothing
    before = {str(p.relative_to(copy)): p.stat().st_mtime_ns for p in copy.rglob("*")}
    argv = ["--records", cv_shards["train"], "--run", str(copy), "--strategy", "cpu", "--model", "small-cnn"]
    assert cv_main([*argv, "--overwrite"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"{copy}/fold-1 is a file, where train.cv keeps fold 1's run folder" in err[0], err
    assert {str(p.relative_to(copy)): p.stat().st_mtime_ns for p in copy.rglob("*")} == before
    assert cv_main([*argv, "--no-report"]) == 2 and "which --no-report turns off" in capsys.readouterr().err


def test_a_blend_reads_single_or_multi_label_from_the_rows_and_class_names_with_spaces_round_trip(tmp_path, capsys):
    """Issue #64: OOF files of no CV folder: softmax rows with one true label each are single-label (argmax, said
    so); rows with several labels refuse --single-label; a class named "big circle" round-trips through the
    labels cells we write and read (one name as it is, several as a JSON list)."""
    from train.blend import main
    from train.prediction.submission import label_names, label_strings

    classes = ["big circle", "cross", "big"]
    hits = np.array([[1, 0, 0], [1, 1, 0], [0, 0, 1], [0, 0, 0], [1, 0, 1]], bool)
    cells = label_strings(hits, classes)
    assert cells[:4] == ["big circle", '["big circle", "cross"]', "big", ""]
    assert [[c in label_names(cell, classes) for c in classes] for cell in cells] == hits.tolist()
    assert label_strings(hits[:, 1:], ["a", "b"]) == ["", "a", "b", "", "b"]  # no spaces: Kaggle's form
    rng = np.random.default_rng(0)
    truth = rng.integers(0, 3, 60)
    paths = []
    for k in range(2):
        logits = rng.normal(size=(60, 3)) + 2 * np.eye(3)[truth]
        probs = np.exp(logits) / np.exp(logits).sum(axis=1, keepdims=True)
        table = pd.DataFrame(probs, columns=classes).assign(labels=[classes[t] for t in truth])
        paths.append(str(tmp_path / f"oof-{k}.csv"))
        table.insert(0, "image_name", [f"im{i}" for i in range(60)])
        table.to_csv(paths[-1], index=False)
    assert main(["--oof", *paths]) == 0
    assert "(labels by argmax)" in capsys.readouterr().out
    multi = pd.read_csv(paths[0], keep_default_na=False)
    multi.loc[3, "labels"] = json.dumps(classes[:2])
    multi.to_csv(paths[1], index=False)
    multi.to_csv(paths[0], index=False)
    assert main(["--oof", *paths, "--single-label"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "holds multi-label predictions (row 4 holds 2 true labels)" in err[0], err
    assert "leave the flag out to blend them as multi-label" in err[0]


def loose_oof(path, probs, truth, classes):
    table = pd.DataFrame(probs, columns=classes).assign(labels=[classes[t] for t in truth])
    table.insert(0, "image_name", [f"im{i}" for i in range(len(truth))])
    table.to_csv(path, index=False)
    return str(path)


def test_predictions_of_both_kinds_or_rows_that_are_no_softmax_are_refused_before_any_score(tmp_path, capsys):
    """Round 7: one softmax and one sigmoid OOF file of a single-label task blended silently went multi-label,
    and a copy of a single-label OOF scaled by 2.5 won a log-loss weight search it should never have entered.
    Every reader of predictions applies one rule: files of both kinds are refused naming one of each; a
    single-label file's row that does not sum to 1 is refused naming it, in OOF files, test files and a run's
    recorded validation predictions."""
    from tfpipe.runtime.errors import TfpipeError
    from train.blend import main
    from train.decide.tuning import read_probabilities

    rng = np.random.default_rng(1)
    classes, truth = ["a", "b", "c"], rng.integers(0, 3, 40)
    logits = rng.normal(size=(40, 3)) + 2 * np.eye(3)[truth]
    softmax = np.exp(logits) / np.exp(logits).sum(axis=1, keepdims=True)
    sigmoid = 1 / (1 + np.exp(-logits))
    soft, sig = (
        loose_oof(tmp_path / "soft.csv", softmax, truth, classes),
        loose_oof(tmp_path / "sig.csv", sigmoid, truth, classes),
    )
    assert main(["--oof", soft, sig]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"{sig} holds multi-label predictions (row 1's probabilities sum to " in err[0], err
    assert f"and {soft} single-label ones (every row's probabilities sum to 1); a blend mixes" in err[0]

    scaled = softmax * 0.4  # in [0, 1], but no softmax's: rows sum to 0.4
    small = loose_oof(tmp_path / "small.csv", scaled, truth, classes)
    assert main(["--oof", soft, small, "--search-weights", "--metric", "log_loss"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"{small} holds multi-label predictions" in err[0], err

    test = pd.DataFrame(scaled, columns=classes)
    test.insert(0, "id", [f"im{i}" for i in range(40)])
    test.to_csv(tmp_path / "test.csv", index=False)
    other = np.exp(logits * 0.5) / np.exp(logits * 0.5).sum(axis=1, keepdims=True)
    argv = ["--oof", soft, loose_oof(tmp_path / "other.csv", other, truth, classes), "--test"]
    argv += [str(tmp_path / "test.csv"), str(tmp_path / "test.csv"), "--out", str(tmp_path / "out.csv")]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"{tmp_path}/test.csv: row 1: its probabilities sum to 0.4" in err[0], err
    assert not (tmp_path / "out.csv").exists()

    recorded = pd.DataFrame(scaled, columns=classes)
    recorded.insert(0, "image_digest", [f"d{i}" for i in range(40)])
    recorded.to_csv(tmp_path / "val.csv", index=False)
    digests = [f"d{i}" for i in range(40)]
    assert read_probabilities(str(tmp_path / "val.csv"), classes, digests, False).shape == (40, 3)  # multi: as is
    with pytest.raises(TfpipeError, match=r"val.csv: row 1: its probabilities sum to 0.4.*delete it to predict"):
        read_probabilities(str(tmp_path / "val.csv"), classes, digests, True)


def test_a_blend_follows_a_sample_submission_and_refuses_one_of_other_ids(tmp_path, capsys):
    """Issue #65: --sample-submission gives the blend the competition's header, id column and id order; class
    columns there take the blended probabilities (in its order); an id twice, an id not blended and a blended
    id it lacks are one line each naming the file, how many and one id; --probabilities on its one labels column
    is refused (the sample decides the form)."""
    from train.blend import main

    rng = np.random.default_rng(1)
    classes, n = ["a", "b", "c"], 30
    truth = rng.random((n, 3)) < 0.4
    oofs, tests = [], []
    for k in range(2):
        oof = pd.DataFrame(np.clip(truth + rng.normal(0, 0.4, (n, 3)), 0, 1), columns=classes)
        oof.insert(0, "image_name", [f"im{i}" for i in range(n)])
        oof["labels"] = [" ".join(c for c, on in zip(classes, row) if on) for row in truth]
        oofs.append(str(tmp_path / f"oof-{k}.csv"))
        oof.to_csv(oofs[-1], index=False)
        test = pd.DataFrame(rng.random((8, 3)), columns=classes)
        test.insert(0, "image", [f"t{i}" for i in range(8)])
        tests.append(str(tmp_path / f"test-{k}.csv"))
        test.to_csv(tests[-1], index=False)
    order = [f"t{i}" for i in (3, 1, 7, 0, 2, 6, 5, 4)]
    sample, out, plain = (str(tmp_path / name) for name in ("sample.csv", "blend.csv", "plain.csv"))
    blend = ["--oof", *oofs, "--test", *tests]
    assert main([*blend, "--out", plain]) == 0
    pd.DataFrame({"image_id": order, "label": ""}).to_csv(sample, index=False)
    assert main([*blend, "--out", out, "--sample-submission", sample]) == 0
    written, labelled = pd.read_csv(out, keep_default_na=False), pd.read_csv(plain, keep_default_na=False)
    assert list(labelled.columns) == ["image", "labels"]  # no CV folder says the training CSV's name
    assert list(written.columns) == ["image_id", "label"] and list(written["image_id"]) == order
    assert list(written["label"]) == list(labelled.set_index("image").loc[order, "labels"])
    pd.DataFrame({"image_id": order, "c": 0, "a": 0, "b": 0}).to_csv(sample, index=False)
    assert main([*blend, "--out", out, "--sample-submission", sample]) == 0
    written = pd.read_csv(out)
    mixed = np.mean([pd.read_csv(p).set_index("image").loc[order, ["c", "a", "b"]].to_numpy() for p in tests], axis=0)
    assert list(written.columns) == ["image_id", "c", "a", "b"]
    np.testing.assert_allclose(written[["c", "a", "b"]].to_numpy(), mixed, atol=1e-6)
    capsys.readouterr()
    for ids, more, needle in (
        ([*order, "t3"], [], "1 id in two rows or more (e.g. 't3')"),
        ([*order, "x1", "x2"], [], "2 ids not predicted (not in"),
        (order[1:], [], "lacks 1 predicted id (of"),
        (order, ["--probabilities"], "its one column 'label' is a labels column"),
    ):
        pd.DataFrame({"image_id": ids, "label": ""}).to_csv(sample, index=False)
        assert main([*blend, "--out", out, "--overwrite", "--sample-submission", sample, *more]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and sample in err[0] and needle in err[0] and "Traceback" not in err[0], err
    # a file as a competition or a hand made it: an old Mac's line ends are read; a comma closing each row, a
    # header field past the csv module's limit, a folder: one line each, the culprit cut short
    Path(sample).write_bytes(("image_id,label\r" + "".join(f"{i},\r" for i in order)).encode())
    assert main([*blend, "--out", out, "--overwrite", "--sample-submission", sample]) == 0
    assert list(pd.read_csv(out)["image_id"]) == order
    for text, needle in (
        ("image_id,label\n" + "".join(f"{i},x,\n" for i in order), "line 2 has 3 fields, the header 2"),
        ("image_id" + "x" * 200_000 + ",label\nt0,\n", "not a CSV file (field larger than field limit"),
        ("\0" * 4000, "are none"),  # one column named by 4,000 NULs: quoted in 40
    ):
        Path(sample).write_text(text)
        assert main([*blend, "--out", out, "--overwrite", "--sample-submission", sample]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and needle in err and len(err) < len(sample) + 400, err[:500]
    assert main([*blend, "--out", out, "--overwrite", "--sample-submission", str(tmp_path)]) == 2
    assert "is a folder" in capsys.readouterr().err
    # a test file as train.predict --probabilities --labels writes it (its labels column named as the training
    # CSV named it): the labels are left out, the blend labels anew; a column of numbers that is no class is not
    labelled = pd.read_csv(tests[0]).assign(label="a b")
    labelled.to_csv(tests[0], index=False)
    assert main([*blend, "--out", out, "--overwrite"]) == 0
    labelled.assign(label=0.5).rename(columns={"label": "d"}).to_csv(tests[0], index=False)
    assert main([*blend, "--out", out, "--overwrite"]) == 2
    assert "column 'd' is no class of the OOF files (a, b, c)" in capsys.readouterr().err


def test_jax_devices_on_a_tpu_serve_every_fold():
    """Between folds a TensorFlow TPU gets a new strategy over its connection; JAX's TPU devices are kept as
    they are (they have no TensorFlow resolver to reconnect through)."""
    from train.crossval.engine import between_folds

    class Devices:  # what train.cv holds between folds: JAX's devices know nothing of TensorFlow's resolver
        kind = "tpu"

    devices = Devices()
    assert between_folds(devices, "tpu", "jax") is devices
    with pytest.raises(AttributeError, match="cluster_resolver"):
        between_folds(devices, "tpu", "tf")  # the TensorFlow path asks the strategy for its resolver
