"""train.decide.evaluation: exact scores of predictions against labels, checked against hand-counted answers."""

import numpy as np
import pytest
from sklearn.metrics import roc_auc_score

from train.decide.evaluation import class_table, headline, score

CLASSES = ["a", "b", "c"]


def test_exact_match_and_f1_count_whole_label_sets():
    targets = np.array([[1, 0, 0], [1, 1, 0], [0, 0, 0], [0, 1, 0]], np.float32)  # c: nobody, never predicted
    probs = np.array([[0.9, 0.1, 0.2], [0.8, 0.3, 0.1], [0.2, 0.1, 0.1], [0.6, 0.7, 0.3]], np.float32)
    s = score(probs, targets, CLASSES, [0.5, 0.5, 0.5], single_label=False)
    # predicted sets: {a}, {a}, {}, {a, b}: rows 0 and 2 (nothing true, nothing predicted) match exactly
    assert s["exact_match"] == pytest.approx(0.5)
    # a: tp 2, fp 1, fn 0 -> F1 0.8; b: tp 1, fp 0, fn 1 -> F1 2/3; c has no F1 and is not averaged
    assert s["per_class"]["a"]["f1"] == pytest.approx(0.8)
    assert s["per_class"]["b"]["f1"] == pytest.approx(2 / 3)
    assert s["per_class"]["c"]["f1"] is None and s["per_class"]["c"]["roc_auc"] is None
    assert s["f1_macro"] == pytest.approx((0.8 + 2 / 3) / 2)
    assert s["f1_micro"] == pytest.approx(2 * 3 / (2 * 3 + 1 + 1))  # tp 3, fp 1, fn 1
    assert s["roc_auc_macro"] == pytest.approx(np.mean([roc_auc_score(targets[:, c], probs[:, c]) for c in (0, 1)]))
    assert s["roc_auc_micro"] == pytest.approx(roc_auc_score(targets.ravel(), probs.ravel()))
    assert s["per_class"]["b"]["positives"] == 2 and s["examples"] == 4


def test_per_class_thresholds_decide_the_labels():
    targets = np.array([[1, 0, 0], [0, 1, 0]], np.float32)
    probs = np.array([[0.3, 0.2, 0.0], [0.1, 0.25, 0.0]], np.float32)
    assert score(probs, targets, CLASSES, [0.5, 0.5, 0.5], False)["exact_match"] == 0.0
    tuned = score(probs, targets, CLASSES, [0.3, 0.25, 0.5], False)
    assert tuned["exact_match"] == 1.0 and tuned["per_class"]["a"]["threshold"] == pytest.approx(0.3)


def test_single_label_exact_match_is_the_argmax_accuracy():
    targets = np.eye(3, dtype=np.float32)[[0, 1, 2, 2]]
    probs = np.array([[0.5, 0.3, 0.2], [0.1, 0.2, 0.7], [0.1, 0.1, 0.8], [0.4, 0.35, 0.25]], np.float32)
    s = score(probs, targets, CLASSES, [0.99] * 3, single_label=True)  # thresholds play no part
    assert s["exact_match"] == pytest.approx(0.5)
    assert s["per_class"]["a"]["threshold"] is None


def test_the_terminal_table_shows_the_weakest_classes_when_there_are_many():
    rng = np.random.default_rng(0)
    names = [f"class{i}" for i in range(15)]
    targets = (rng.random((200, 15)) < 0.3).astype(np.float32)
    noise = np.linspace(0.05, 2.0, 15)  # later classes are predicted worse
    probs = np.clip(targets + rng.normal(0, 1, (200, 15)) * noise, 0, 1).astype(np.float32)
    s = score(probs, targets, names, [0.5] * 15, False)
    lines = class_table(s, most=4)
    assert len(lines) == 1 + 4 + 1 and "of 15 in all, the 4 with the lowest AUC" in lines[-1]
    shown = [line.split()[0] for line in lines[1:5]]
    worst = sorted(names, key=lambda n: s["per_class"][n]["roc_auc"])[:4]
    assert shown == worst
    assert "exact-match" in headline(s) and "F1 micro" in headline(s)


def test_the_metric_leads_the_line_and_single_label_figures_are_scikit_learns():
    """Balanced accuracy and log-loss are scikit-learn's; a single-label line leads with --metric and names no
    threshold; a metric of the other kind is one line naming the ones that apply; log-loss is better lower."""
    from sklearn.metrics import balanced_accuracy_score, log_loss

    from tfpipe.runtime.errors import TfpipeError
    from train.decide.evaluation import figure
    from train.decide.metrics import METRICS, better, metric_of

    rng = np.random.default_rng(0)
    true = np.array([0] * 12 + [1] * 5 + [2] * 3)
    probs = rng.dirichlet([1, 1, 1], len(true)).astype(np.float32)
    probs[np.arange(15), true[:15]] += 1.0
    probs /= probs.sum(axis=1, keepdims=True)
    s = score(probs, np.eye(3)[true], CLASSES, [0.5] * 3, single_label=True)
    assert s["balanced_accuracy"] == pytest.approx(balanced_accuracy_score(true, probs.argmax(axis=1)))
    assert s["log_loss"] == pytest.approx(log_loss(true, probs, labels=[0, 1, 2]), rel=1e-5)
    for key in ("balanced_accuracy", "log_loss", "exact_match", "f1_macro", "roc_auc_macro"):
        assert figure(probs, np.eye(3)[true], [0.5] * 3, True, key) == pytest.approx(s[key]), key
    line = headline(s, metric_of("balanced_accuracy", single_label=True))
    assert (
        line.startswith(f"balanced accuracy {s['balanced_accuracy']:.3f}, AUC (exact, macro) ") and "accuracy" in line
    )
    assert "threshold" not in line and "micro" not in line and "threshold" not in "".join(class_table(s))
    with pytest.raises(TfpipeError, match="exact_match'? does not apply to a single-label run; a single-label run is"):
        metric_of("exact_match", single_label=True)
    worse, good = {"log_loss": 0.9}, {"log_loss": 0.4}
    assert better(good, worse, METRICS["log_loss"]) and not better(worse, good, METRICS["log_loss"])
    assert not better({"log_loss": None}, good, METRICS["log_loss"])  # an unknown figure never wins


def test_thresholds_tuned_for_exact_match_beat_per_class_f1_on_it():
    """Per-class F1 tuning ignores how the classes' errors fall on rows; coordinate ascent for exact_match
    never scores lower on it, and here scores higher."""
    from train.decide.metrics import METRICS
    from train.decide.tuning import tune_thresholds

    rng = np.random.default_rng(3)
    targets = (rng.random((300, 4)) < [0.5, 0.3, 0.2, 0.1]).astype(np.float32)
    probs = np.clip(targets * 0.35 + rng.random((300, 4)) * 0.65, 0, 1).astype(np.float32)
    exact = [
        score(probs, targets, list("abcd"), tune_thresholds(probs, targets, 0.5, m), False)["exact_match"]
        for m in (None, METRICS["exact_match"])
    ]
    assert exact[1] > exact[0] + 0.01, exact


def test_a_blend_searched_on_the_oof_rows_weighs_the_better_model():
    """Nelder-Mead over the simplex from equal weights: a good model beside a random one gets nearly all the
    weight, and the searched blend scores better than the equal one by the metric (log-loss: lower)."""
    from train.decide.metrics import METRICS
    from train.decide.weights import search_weights

    rng = np.random.default_rng(0)
    true = rng.integers(0, 4, 400)
    truth = np.eye(4)[true]
    good = truth * 0.6 + rng.random((400, 4)) * 0.7
    noise = rng.random((400, 4))
    good, noise = good / good.sum(1, keepdims=True), noise / noise.sum(1, keepdims=True)
    for name, single in (("log_loss", True), ("accuracy", True), ("f1_micro", False)):
        found = search_weights([noise, good], truth, single, METRICS[name])
        assert found.weights[1] > 0.9 and abs(sum(found.weights) - 1) < 1e-9, (name, found)
        assert (found.score < found.equal_score) if name == "log_loss" else (found.score > found.equal_score), found


def test_tta_worth_warns_when_one_view_scored_better_by_the_metric_either_way_up(monkeypatch):
    """Worth compares the two figures of the same held-out rows by the run's metric (log-loss: lower wins): a
    warning naming both and the remedy (the flag in a command, the argument from Python) where N views lost, a
    plain line where they helped or tied, and no verdict where a figure is undefined."""
    from train.decide.metrics import metric_of
    from train.decide.tta import views_worth

    acc, loss = metric_of("balanced_accuracy", True), metric_of("log_loss", True)
    rows = "the OOF rows (5 fold models' model.keras, each on its own fold)"
    lost = views_worth({"balanced_accuracy": 0.72}, {"balanced_accuracy": 0.7012}, 4, acc)
    assert lost.hurts and lost.line("train.predict", rows) == (
        f"train.predict: warning: on {rows}, 4 TTA views score balanced accuracy 0.7012 against 0.7200 for 1 view: "
        "tta=1 predicts better there"
    )
    monkeypatch.setattr("tfpipe.runtime.errors.in_command", lambda: True)
    assert lost.line("train.predict", rows).endswith(": --tta 1 predicts better there")
    assert views_worth({"log_loss": 0.50}, {"log_loss": 0.61}, 2, loss).hurts  # higher log-loss: worse
    assert not views_worth({"log_loss": 0.61}, {"log_loss": 0.50}, 2, loss).hurts
    tied = views_worth({"balanced_accuracy": 0.7}, {"balanced_accuracy": 0.7}, 2, acc)
    assert not tied.hurts and "warning" not in tied.line("train.predict", rows)
    unknown = views_worth({"balanced_accuracy": 0.7}, None, 2, acc)
    assert not unknown.hurts and unknown.line("p", rows).endswith("not defined at 1 or 2 views: TTA unmeasured")


def collages(rng, n, weak=3):
    """Multi-label rows of 5 classes (shares 40..10 %) whose probabilities rank every class but ``weak``, which
    the model cannot rank (its probabilities are noise): the collages of a hostile round, where one class's
    threshold labelled it on 39% of the test images (9% true)."""
    targets = (rng.random((n, 5)) < [0.4, 0.3, 0.2, 0.1, 0.15]).astype(np.float32)
    probs = np.clip(targets * 0.45 + rng.random((n, 5)) * 0.55, 0, 1)
    probs[:, weak] = rng.random(n) * 0.4  # below 0.5: a class the model never learnt to call
    return probs.astype(np.float32), targets


def test_a_class_near_chance_keeps_the_default_threshold_and_is_named(capsys):
    """Per-class F1 labels a class nobody can rank everywhere (F1 = 2p / (1 + p) > 0); ``tune`` keeps it at the
    default and says what the tuned threshold would have done. On unseen rows drawn alike, the kept thresholds
    score exact-match and F1 micro above the per-class F1 ones (what was tuned before)."""
    from train.decide.metrics import METRICS
    from train.decide.tuning import chance_bound, f1_thresholds, tune

    rng = np.random.default_rng(5)
    probs, targets = collages(rng, 800)
    tuned = tune(probs, targets, 0.5, METRICS["roc_auc"])
    assert [n.column for n in tuned.near_chance] == [3] and tuned.thresholds[3] == 0.5
    old = f1_thresholds(probs, targets, 0.5)
    assert tuned.near_chance[0].tuned == old[3] and tuned.near_chance[0].tuned_share > 0.5  # everywhere
    assert [t for c, t in enumerate(tuned.thresholds) if c != 3] == [t for c, t in enumerate(old) if c != 3]
    note = tuned.notes(list("abcde"), 0.5, "OOF")
    assert len(note) == 1 and note[0].startswith("'d': OOF AUC 0.") and "labelled at 0.5 (0%) instead" in note[0]
    assert chance_bound(80, 800) == pytest.approx(0.5 + 2 * np.sqrt(801 / (12 * 80 * 720)))

    unseen, truth = collages(rng, 4000)
    for key in ("exact_match", "f1_micro"):
        now, before = (score(unseen, truth, list("abcde"), t, False)[key] for t in (tuned.thresholds, old))
        assert now > before + 0.02, (key, now, before)


def test_the_default_is_kept_when_the_tuned_thresholds_score_no_better():
    """Predictions the default 0.5 already splits perfectly: the tuned thresholds tie at exact-match 1.0, and
    the naive choice is kept, said with both figures."""
    from train.decide.metrics import METRICS
    from train.decide.tuning import tune

    rng = np.random.default_rng(0)
    targets = (rng.random((300, 3)) < 0.3).astype(np.float32)
    probs = np.where(targets > 0, 0.6 + rng.random((300, 3)) * 0.4, rng.random((300, 3)) * 0.4)
    tuned = tune(probs, targets, 0.5, METRICS["exact_match"])
    assert tuned.thresholds == [0.5] * 3 and tuned.naive == ("exact_match", 1.0, 1.0)
    assert tuned.notes(list("abc"), 0.5, "validation") == [
        "the tuned thresholds scored exact_match 1.0000 on the validation predictions, 0.5 for every class "
        "1.0000: every class labelled at 0.5"
    ]
    assert tune(probs * 0.5, targets, 0.5, METRICS["exact_match"]).naive is None  # 0.5 labels nothing: tuned wins
