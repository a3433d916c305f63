"""Imbalanced single-label data (issue #65): balanced sampling from the reader, class weights in the loss, and the
run's ``--metric`` recorded and leading its lines. One small, imbalanced, hard-to-separate dataset for all."""

import collections
import json

import cv2
import numpy as np
import pytest

from tests.conftest import BACKEND, write_csv

SIZES = {"common": 120, "rare": 12, "scarce": 12}  # 83% / 8% / 8% of 144 images
SHADES = {"common": 128, "rare": 168, "scarce": 88}  # a class's mean grey; its images' spread of 20 overlaps


@pytest.fixture(scope="module")
def imbalanced(tmp_path_factory):
    """144 single-label 16 px images of three overlapping shades (a model that learns nothing predicts the common
    class), in 3 folds; returns the shard folder."""
    from tfpipe import LabelFormat, Source, write_shards
    from tfpipe.writer.images import ImageSpec

    root = tmp_path_factory.mktemp("imbalanced")
    (root / "images").mkdir()
    rng = np.random.default_rng(0)
    rows = []
    for name, count in SIZES.items():
        for i in range(count):
            shade = SHADES[name] + rng.normal(0, 20) + rng.normal(0, 2, (16, 16, 3))  # faint grain: no fingerprint
            cv2.imwrite(str(root / "images" / f"{name}{i:03d}.png"), np.clip(shade, 0, 255).astype(np.uint8))
            rows.append((f"{name}{i:03d}", name))
    csv_path = write_csv(root / "train.csv", ["image", "label"], rows)
    out = str(root / "records")
    source = Source(str(root / "images"), csv=str(csv_path), label_format=LabelFormat(class_col="label"))
    write_shards(source, out, spec=ImageSpec(image_size=16), num_folds=3, num_shards=6, workers=0, progress=False)
    return out


def test_balanced_sampling_draws_the_classes_evenly_and_refuses_what_it_cannot_balance(imbalanced, shard_dir):
    """Of 1,200 images drawn with sampling='balanced' each class is about a third (without: the common class
    83%); multi-label shards, evaluation and a typo are refused in one line each."""
    import tfpipe
    from tfpipe.runtime.errors import TfpipeError

    def shares(**kw):
        ds = tfpipe.make_dataset(imbalanced, 40, training=True, label_mode="class_id", seed=0, **kw)
        drawn = collections.Counter(int(c) for _, y in ds.take(30) for c in y.numpy())
        return [drawn[c] / 1200 for c in range(3)]

    natural, even = shares(), shares(sampling="balanced")
    assert max(natural) > 0.75, natural
    assert all(0.25 < s < 0.42 for s in even), even
    for records, kw, said in (
        (shard_dir[0], {"training": True}, "some have several labels"),
        (imbalanced, {}, "evaluation reads every record once"),
        (imbalanced, {"training": True, "sampling": "even"}, "sampling must be None or 'balanced'"),
    ):
        with pytest.raises(TfpipeError, match=said):
            tfpipe.make_dataset(records, 8, **dict({"sampling": "balanced"}, **kw))


def test_the_pytorch_reader_balances_by_the_same_rule_and_keeps_its_length(imbalanced, shard_dir):
    """RecordDataset(sampling="balanced"): each of 3 ranks x 2 workers reads its full share (len() holds, so DDP
    ranks stay in step), the classes about a third each over 4 epochs (without: the common class 83%);
    multi-label shards and a typo are refused in one line each."""
    from tfpipe.runtime.errors import TfpipeError
    from tfpipe.torch.dataset import RecordDataset

    def drawn(sampling):
        found = collections.Counter()
        for rank in range(3):
            ds = RecordDataset(imbalanced, shuffle=True, seed=0, rank=rank, world_size=3, sampling=sampling)
            for epoch in range(4):
                ds.set_epoch(epoch)
                got = [int(t.argmax()) for w in range(2) for _, t in _worker_iter(ds, w, 2)]
                assert len(got) == len(ds) == 48
                found.update(got)
        return [found[c] / (3 * 4 * 48) for c in range(3)]

    natural, even = drawn(None), drawn("balanced")
    assert max(natural) > 0.75, natural
    assert all(0.25 < s < 0.42 for s in even), even
    with pytest.raises(TfpipeError, match="some have several labels"):
        RecordDataset(shard_dir[0], sampling="balanced")
    with pytest.raises(TfpipeError, match="sampling must be None or 'balanced'"):
        RecordDataset(imbalanced, sampling="even")


def _worker_iter(ds, worker, workers):
    """What DataLoader worker ``worker`` of ``workers`` yields, without starting processes."""
    from unittest import mock

    info = mock.Mock(id=worker, num_workers=workers)
    with mock.patch("tfpipe.torch.dataset.get_worker_info", return_value=info):
        yield from ds


def test_weights_are_scikit_learns_balanced_ones_and_weigh_the_loss():
    """Single-label: n / (classes x n_c); multi-label: each class's positives and negatives as a binary problem;
    the weighted loss is Keras' own cross-entropy times each row's weight (and equal to it at equal weights)."""
    from train.backends import keras_module
    from train.keras.imbalance import make_loss, weights_of

    keras = keras_module()
    single = weights_of([120, 12, 12], 144, single_label=True)
    assert np.allclose(single.positive, [144 / 360, 144 / 36, 144 / 36])
    multi = weights_of([10, 50], 100, single_label=False)
    assert np.allclose(multi.positive, [5.0, 1.0]) and np.allclose(multi.negative, [100 / 180, 1.0])
    lacking = weights_of([120, 0, 24], 144, single_label=True)  # a class of the CSV no training image has
    assert lacking.absent == (1,) and np.allclose(lacking.positive, [144 / 240, 1.0, 144 / 48])
    assert lacking.line(["common", "zebra", "rare"], True) == (
        "class_weight='balanced': each image of its class weighs common 0.60, zebra 1.00, rare 3.00; no training "
        "image of zebra (weighs 1)"
    )
    y = np.array([[1.0, 0, 0], [0, 0, 1]], np.float32)
    p = np.array([[0.7, 0.2, 0.1], [0.2, 0.2, 0.6]], np.float32)
    weighted = np.asarray(make_loss(keras, True, 0.0, single).call(y, p))
    plain = np.asarray(keras.losses.categorical_crossentropy(y, p))
    assert np.allclose(weighted, plain * [single.positive[0], single.positive[2]], rtol=1e-5)
    even = weights_of([50, 50], 100, single_label=False)
    y2, p2 = y[:, :2], np.array([[0.7, 0.2], [0.4, 0.6]], np.float32)
    got = np.asarray(make_loss(keras, False, 0.1, even).call(y2, p2))
    assert np.allclose(got, np.asarray(keras.losses.binary_crossentropy(y2, p2, label_smoothing=0.1)), rtol=1e-5)


@pytest.mark.skipif(BACKEND == "jax", reason="TensorFlow's strategies: the tf backend's replicas")
def test_the_weighted_loss_is_the_batch_mean_of_each_rows_weight_on_1_and_8_replicas():
    """One SGD step on 16 rows of 5 classes, weighted by class: the loss Keras reports is the mean over the
    batch of each row's weight x its cross-entropy (not over the weights' sum), and the step is the same on one
    replica and on 8 (each 2 rows): the loss is reduced over the global batch, whatever the replicas."""
    from train.accel.strategy import resolve_strategy
    from train.backends import keras_module
    from train.keras.imbalance import make_loss, weights_of

    keras = keras_module()
    rng = np.random.default_rng(0)
    x = rng.normal(size=(16, 4)).astype(np.float32)
    y = np.eye(5, dtype=np.float32)[[0, 0, 1, 2, 2, 2] + [3] * 5 + [4] * 5]  # a batch rich in rare rows
    counts = np.array([100, 50, 25, 15, 10])  # the training set's: this batch's rows weigh 2.4 on average
    weights = weights_of(counts, 200, single_label=True)
    assert np.allclose(weights.positive, 200 / (5 * counts))  # in the class index's order
    found = []
    for name, replicas in (("cpu", 1), ("cpu", 8)):
        strategy, _ = resolve_strategy(name, replicas)
        with strategy.scope():
            keras.utils.set_random_seed(1)
            model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(5, activation="softmax")])
            model.compile(keras.optimizers.SGD(0.5), loss=make_loss(keras, True, 0.0, weights))
        before = model.evaluate(x, y, batch_size=16, verbose=0)
        probs = model.predict(x, batch_size=16, verbose=0)
        rows = -np.log(np.clip((probs * y).sum(axis=1), 1e-7, 1)) * (y * weights.positive).sum(axis=1)
        assert before == pytest.approx(rows.mean(), rel=1e-5), (replicas, before, rows.mean())
        assert abs(rows.mean() - rows.sum() / (y * weights.positive).sum()) > 0.1  # not the weights' mean
        model.fit(x, y, batch_size=16, epochs=1, shuffle=False, verbose=0)
        found.append([w.copy() for w in model.get_weights()])
    for one, eight in zip(*found):
        np.testing.assert_allclose(one, eight, rtol=1e-5, atol=1e-6)


def test_the_recipes_weigh_the_loss_by_the_training_folds_and_refuse_balanced_multi_label(imbalanced, shard_dir):
    """The PyTorch recipes' --class-weight balanced: BCE on logits whose mean equals each class's scikit-learn
    log-loss with balanced sample weights, averaged over the classes (counts of the training folds only); without
    it torch's own BCE. --sampling balanced of multi-label shards is refused in one line before anything starts."""
    import argparse

    import torch
    from sklearn.metrics import log_loss
    from sklearn.utils.class_weight import compute_sample_weight

    from tfpipe.runtime.errors import TfpipeError
    from tfpipe.torch.dataset import RecordDataset
    from train.torch.models import WeightedBCE, add_recipe_arguments, recipe_loss
    from train.torch.run import add_run_arguments, prepare

    training = RecordDataset(imbalanced, folds=[1, 2])
    y = training.targets()
    assert 0 < y[:, 1].sum() < 12  # the training folds' share of a rare class, not the folder's
    loss = recipe_loss("balanced", training)
    logits = torch.tensor(np.random.default_rng(0).normal(size=y.shape), dtype=torch.float32)
    p = torch.sigmoid(logits).numpy().astype(np.float64)
    each = [log_loss(y[:, c], p[:, c], sample_weight=compute_sample_weight("balanced", y[:, c])) for c in range(3)]
    assert isinstance(loss, WeightedBCE)
    assert float(loss(logits, torch.tensor(y))) == pytest.approx(np.mean(each), rel=1e-5)
    assert type(recipe_loss(None, training)) is torch.nn.BCEWithLogitsLoss

    parser = argparse.ArgumentParser()
    add_recipe_arguments(parser, per="process")
    add_run_arguments(parser)
    args = parser.parse_args(["--records", shard_dir[0], "--sampling", "balanced"])
    with pytest.raises(TfpipeError, match=f"{shard_dir[0]} is multi-label \\(an image of several classes\\)"):
        prepare("torch_ddp", args)


@pytest.mark.slow  # three short trainings
def test_class_weights_and_balanced_sampling_raise_the_rare_classes_recall(imbalanced, tmp_path, capsys):
    """Trained alike three times on fold 0: as it is, with --class-weight balanced, with --sampling balanced. The
    rare classes' mean recall rises with either; the run records --metric balanced_accuracy, its summary line
    leads with it and says the labels are the argmax, never thresholds."""
    from train.fit import main

    def recall(extra):
        run = tmp_path / f"run{len(extra)}{extra[:1]}"
        args = ["--records", imbalanced, "--run", str(run), "--strategy", "cpu", "--model", "small-cnn",
                "--batch-size", "16", "--epochs", "8", "--lr", "3e-3", "--no-augment", "--seed", "0",
                "--steps-per-execution", "1", "--verbose", "0", "--metric", "balanced_accuracy", *extra]  # fmt: skip
        assert main(args) == 0
        out = capsys.readouterr().out
        metrics = json.loads((run / "metrics.json").read_text())
        table = metrics["report"]["per_class"]
        return np.mean([table[c]["recall"] for c in ("rare", "scarce")]), out, metrics, run

    plain, out, metrics, run = recall([])
    weighted, said, _, _ = recall(["--class-weight", "balanced", "--verbose", "1"])  # verbose: its line of weights
    sampled, _, _, _ = recall(["--sampling", "balanced"])
    assert "--class-weight balanced: each image of its class weighs common 0.40, rare 4.00, scarce 4.00" in said
    assert weighted > plain + 0.2 and sampled > plain + 0.2, (plain, weighted, sampled)
    assert metrics["metric"] == "balanced_accuracy" and metrics["single_label"] is True
    line = next(s for s in out.splitlines() if s.startswith("validation "))
    assert line.startswith("validation balanced accuracy ") and "(labels by argmax)" in line, line
    assert "threshold" not in out.replace("thresholds.json", ""), out
    from train.predict import main as predict

    argv = ["--run", str(run), "--records", imbalanced, "--out", str(tmp_path / "s.csv"), "--threshold", "0.3"]
    assert predict([*argv, "--strategy", "cpu", "--no-progress"]) == 2  # argmax labels: a threshold is refused
    assert "is single-label, labelled by argmax (one class an image), no threshold" in capsys.readouterr().err
