"""Contracts of train/: a failed fit leaves nothing that blocks the corrected command, typed public entry points,
the model registry's rough edges, and the command lines' wording."""

import ast
import json
import os
import re
import shlex
import subprocess
import sys
import urllib.error

import pytest
import tf_keras as keras

from tfpipe.format.shards import open_shards
from tfpipe.runtime.errors import TfpipeError
from tfpipe.tf.augment import NO_AUGMENT
from train.accel.strategy import resolve_strategy
from train.fit import FitConfig, fit
from train.keras import models
from train.keras.models import MODELS, build_model, min_image_size, register_model
from train.keras.plan import Devices, ModelPlan
from train.keras.planning import check_batch_fits

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
THIS_FILE = os.path.basename(__file__)  # its user script misspells a name on purpose
RUN_FILES_LEFT = ("config.json", "history.csv", "logs", "backup", "checkpoints", "state.json")


def small(shard_dir, run, **overrides):
    """One quick epoch of small-cnn on the default strategy (40 images, 4 folds)."""
    cfg = {
        "records": shard_dir[0],
        "run": str(run),
        "strategy": "cpu",
        "model": "small-cnn",
        "batch_size": 8,
        "epochs": 1,
        "steps_per_execution": 1,
        "augment": NO_AUGMENT,
        "verbose": 0,
        "report": False,
    }
    cfg.update(overrides)
    return FitConfig(**cfg)


def fit_cli(args):
    from train.fit import main

    try:
        return main(args + ["--strategy", "cpu", "--verbose", "0", "--epochs", "1", "--no-report"])
    except SystemExit as e:  # argparse's own errors exit
        return e.code


@pytest.fixture
def offline_model():
    """A registered model whose ImageNet weights cannot be downloaded (what an EfficientNet does offline)."""

    @register_model("test-offline", min_image_size=8)
    def offline(variant, input_shape, weights):
        if weights == "imagenet":
            raise urllib.error.URLError("[Errno -3] Temporary failure in name resolution")
        return models._small_cnn(variant, input_shape, None)

    yield "test-offline"
    MODELS.pop("test-offline")


# ----------------------------------------------------------- 1: a failed first attempt never blocks the corrected one


@pytest.mark.parametrize(
    "wrong",
    [  # a fold outside the folds is refused before training as a batch larger than the data is: make test-slow
        pytest.param(["--fold", "7"], marks=pytest.mark.slow),
        ["--batch-size", "500"],
        ["--weights", "imagenet"],
    ],
    ids=["fold-outside-the-folds", "batch-larger-than-the-data", "imagenet-offline"],
)
def test_the_corrected_command_runs_in_the_folder_a_failed_one_named(shard_dir, tmp_path, capsys, wrong, offline_model):
    run = tmp_path / "run"
    command = ["--records", shard_dir[0], "--run", str(run), "--model", offline_model, "--batch-size", "8"]
    assert fit_cli(command + wrong) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err, err
    assert not run.exists()  # checked before the folder is made; or made by this job, and removed again
    assert fit_cli(command) == 0, capsys.readouterr().err
    assert (run / "model.keras").exists() and json.loads((run / "config.json").read_text())["batch_size"] == 8


def test_an_unknown_model_from_python_writes_nothing_and_the_corrected_config_runs(shard_dir, tmp_path):
    run = tmp_path / "run"
    with pytest.raises(TfpipeError, match="unknown model 'nope'; choose one of .*small-cnn"):
        fit(small(shard_dir, run, model="nope"))
    assert not run.exists()
    # a strategy object (the one a notebook made) is recorded by the strategy's name, not deep-copied
    strategy, _ = resolve_strategy("cpu", 2)
    assert fit(small(shard_dir, run, strategy=strategy)).replicas == 2
    assert json.loads((run / "config.json").read_text())["strategy"] == "cpu"


@pytest.mark.parametrize(
    "setting, message",
    [
        ({"optimizer": "adamm"}, "unknown optimizer 'adamm'"),
        ({"schedule": "cosinus"}, "unknown schedule 'cosinus'"),
        ({"precision": "float8"}, "unknown precision 'float8'"),
        ({"weights": "no/such/weights.h5"}, "cannot load weights 'no/such/weights.h5' for small-cnn: no such file"),
        ({"image_size": 4}, "below small-cnn's smallest input"),
        ({"swa_epochs": 5}, "swa_epochs must be in 0..1"),
        ({"fold": 4}, "fold 4 outside 0..3"),
        ({"batch_size": 30, "strategy": "cpu", "replicas": 2}, "60 images a step, more than the"),
    ],
)
def test_every_check_that_needs_no_training_runs_before_the_folder_is_touched(shard_dir, tmp_path, setting, message):
    run = tmp_path / "run"
    with pytest.raises(TfpipeError, match=re.escape(message)):
        fit(small(shard_dir, run, **setting))
    assert not run.exists()


class CrashAt(keras.callbacks.Callback):
    """Raises at the start of training (before any epoch) or in a given epoch."""

    def __init__(self, epoch=None):
        super().__init__()
        self.crash_epoch = epoch

    def on_train_begin(self, logs=None):
        if self.crash_epoch is None:
            raise RuntimeError("crash before the first epoch")

    def on_epoch_begin(self, epoch, logs=None):
        if epoch == self.crash_epoch:
            raise RuntimeError(f"crash in epoch {epoch}")


def test_a_job_that_fails_before_its_first_epoch_is_saved_leaves_a_new_or_empty_folder_as_it_found_it(
    shard_dir, tmp_path
):
    new, empty = tmp_path / "new", tmp_path / "empty"
    empty.mkdir()
    for run in (new, empty):
        with pytest.raises(RuntimeError, match="crash before the first epoch"):
            fit(small(shard_dir, run, callbacks=(CrashAt(),)))
        assert not new.exists() and os.listdir(empty) == []  # config.json, history.csv, logs/ ... removed
    with pytest.raises(RuntimeError, match="crash in epoch 1"):  # the first epoch was saved: the run is kept
        fit(small(shard_dir, empty, epochs=2, callbacks=(CrashAt(1),)))
    assert {"config.json", "history.csv", "backup"} <= set(os.listdir(empty))
    assert fit(small(shard_dir, empty, epochs=2, resume=True)).epochs == 2


def test_a_run_that_existed_before_the_job_is_never_cleaned_up(shard_dir, tmp_path):
    run = tmp_path / "run"
    with pytest.raises(RuntimeError, match="crash in epoch 1"):
        fit(small(shard_dir, run, epochs=2, callbacks=(CrashAt(1),)))
    before = sorted(os.listdir(run))
    history = (run / "history.csv").read_text()
    with pytest.raises(RuntimeError, match="crash before the first epoch"):  # the resumed job saves no epoch
        fit(small(shard_dir, run, epochs=2, resume=True, callbacks=(CrashAt(),)))
    assert sorted(os.listdir(run)) == before and (run / "history.csv").read_text() == history
    assert fit(small(shard_dir, run, epochs=2, resume=True)).epochs == 2


def test_the_cleanup_removes_only_the_names_a_run_writes():
    from train.runs import run as run_files

    written = set(run_files.WRITTEN)
    assert set(RUN_FILES_LEFT) <= written and run_files.LOGS in written and ".tfpipe-write.lock" not in written


# ------------------------------------------------------------------------------- 2: typed public entry points


def test_predict_mirrors_its_config():
    """``predict(run, records, out, **options)`` takes exactly ``PredictConfig``'s fields, with its defaults, and
    the engine takes the config (one signature, not two)."""
    import dataclasses
    import inspect

    from train import predict as front
    from train.prediction import inference

    ours = inspect.signature(front.predict)
    fields = {f.name: f for f in dataclasses.fields(front.PredictConfig)}
    assert list(ours.parameters) == list(fields) == list(front.PARAMETERS)
    for name, p in ours.parameters.items():
        f = fields[name]
        assert (p.default, p.annotation) == (f.default if f.default is not dataclasses.MISSING else p.empty, f.type)
    assert list(inspect.signature(inference.predict).parameters) == ["cfg"]
    assert ours.parameters["records"].annotation == "Records"
    assert all(p.kind is p.KEYWORD_ONLY for p in list(ours.parameters.values())[3:])
    assert not any(p.kind is p.VAR_KEYWORD for p in ours.parameters.values())


def engine_names_used(module):
    """Names users import from ``module`` (train.fit / train.predict) in the tests, README, docs, notebook and bench."""
    found = set()
    pattern = re.compile(rf"from {re.escape(module)} import ([\w, ]+)")
    paths = [os.path.join(ROOT, "README.md"), os.path.join(ROOT, "examples", "kaggle_tpu.ipynb")]
    for folder in ("tests", "bench", "docs"):
        for base, _, files in os.walk(os.path.join(ROOT, folder)):
            paths += [os.path.join(base, f) for f in files if f.endswith((".py", ".md")) and f != THIS_FILE]
    for path in paths:
        with open(path, encoding="utf-8") as f:
            for names in pattern.findall(f.read()):
                found.update(n.split(" as ")[0].strip() for n in names.split(",") if n.strip())
    return found


@pytest.mark.parametrize(
    "module, engine", [("train.fit", "train.keras.trainer"), ("train.predict", "train.prediction.inference")]
)
def test_the_engine_names_type_checkers_see_are_the_ones_handed_out(module, engine):
    import importlib

    front, back = importlib.import_module(module), importlib.import_module(engine)
    tree = ast.parse(open(front.__file__, encoding="utf-8").read())
    declared = {
        a.asname
        for node in ast.walk(tree)
        if isinstance(node, ast.If) and isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING"
        for stmt in node.body
        if isinstance(stmt, ast.ImportFrom) and stmt.module == engine
        for a in stmt.names
        if a.asname == a.name  # "X as X": re-exported under mypy --strict
    }
    own = {name for name in vars(front) if not name.startswith("__")}
    assert engine_names_used(module) - own <= declared, "declare them under TYPE_CHECKING"
    for name in declared:
        assert getattr(front, name) is getattr(back, name)  # the lazy __getattr__ still hands them out
    hidden = [n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "__getattr__"]
    assert not hidden, "a module-level __getattr__ visible to type checkers makes every typo a valid name"


@pytest.mark.slow  # 12 s: mypy over a user's script
def test_a_type_checker_flags_misspelt_names_keywords_and_types_in_a_users_script(tmp_path):
    script = tmp_path / "user.py"
    script.write_text(
        "import tensorflow as tf\n"
        "from tfpipe.format.shards import open_shards\n"
        "from train.fit import FitConfig, fit\n"
        "from train.fit import FitConfg\n"  # line 4
        "from train.predict import predict; from train.prediction.inference import TTA_VIEWS, predict_probabilities, tta_view\n"
        "cfg = FitConfig(records='r', run='x', strategy=tf.distribute.get_strategy())\n"
        "cfg.out = 'y'\n"  # line 7: 1.x's name of run, removed in 2.0
        "metrics: dict[str, object] = fit(cfg)\n"  # line 8: a FitResult (or preflight or worker result), no dict
        "a = predict('run', open_shards('r'), 's.csv', tta=2, threshold=0.3, strategy='cpu', progress=False)\n"
        "b = predict('run', 'records', 's.csv', ttaa=2)\n"  # line 10
        "c = predict('run', 'records', 's.csv', tta='2')\n"  # line 11
        "print(metrics, a, b, c, TTA_VIEWS, "
        "predict_probabilities, tta_view)\n"
    )
    r = subprocess.run(
        [
            os.path.join(os.path.dirname(sys.executable), "mypy"),
            "--strict",
            "--ignore-missing-imports",
            "--follow-imports=silent",
            "--cache-dir",
            str(tmp_path / "cache"),
            str(script),
        ],
        cwd=tmp_path,
        env=dict(os.environ, MYPYPATH=ROOT),
        capture_output=True,
        text=True,
    )
    errors = sorted(
        (int(m.group(1)), m.group(2)) for m in re.finditer(r"user\.py:(\d+): error: .*\[([\w-]+)\]", r.stdout)
    )
    expected = [(4, "attr-defined"), (7, "attr-defined"), (8, "assignment"), (10, "call-arg"), (11, "arg-type")]
    assert errors == expected, r.stdout + r.stderr


# ---------------------------------------------------------------------------------- 3: the model registry


def tiny_builder(variant, input_shape, weights):
    inputs = keras.Input(input_shape)
    return keras.Model(inputs, keras.layers.Conv2D(2, 3, padding="same")(inputs)), []


def test_the_smallest_input_is_part_of_the_registration(registry, shard_dir):
    from train.keras.planning import checked_image_size

    register_model("test-small-input", min_image_size=4)(tiny_builder)
    register_model("test-default-input")(tiny_builder)
    assert min_image_size("test-small-input") == 4 and min_image_size("test-default-input") == 32
    assert min_image_size("small-cnn") == 8 and min_image_size("efficientnet-b3") == 32
    shards = open_shards(shard_dir[0])
    assert checked_image_size(FitConfig(model="test-small-input", image_size=4), shards) == 4
    with pytest.raises(TfpipeError, match=r"below test-default-input's smallest input \(32 px\)"):
        checked_image_size(FitConfig(model="test-default-input", image_size=16), shards)
    with pytest.raises(TfpipeError, match="unknown model 'nope'"):
        min_image_size("nope")
    with pytest.raises(ValueError, match="min_image_size"):
        register_model("test-zero", min_image_size=0)


class BuilderBug(ValueError):
    pass


def test_a_builders_own_error_is_not_reported_as_a_weights_problem(registry, tmp_path):
    @register_model("test-buggy")
    def buggy(variant, input_shape, weights):
        if weights is None:
            raise BuilderBug("my layer wants 4 channels")
        raise ValueError("bad weights file")

    with pytest.raises(BuilderBug, match="^my layer wants 4 channels$"):
        build_model("test-buggy", 3, 32)
    with pytest.raises(TfpipeError, match="cannot load weights 'w.h5' for test-buggy: bad weights file"):
        build_model("test-buggy", 3, 32, weights="w.h5")


@pytest.mark.parametrize(
    "pattern, variants, message",
    [
        ("bad-{}", None, "has a {} but no variants"),
        ("bad-{}", ("",), "has a {} but no variants"),
        ("bad", ("a", "b"), "has no {}, so its 2 variants would share one name"),
        ("bad-{}", ("a", "a"), "does not make distinct"),
        ("bad-{}-{}", ("a", "b"), "must hold one {}"),
        ("bad-{name}", ("a", "b"), "must hold one {}"),
        ("bad-{}", "ab", "not the string"),
        ("bad-{}", (), "one or more strings"),
        ("{}", ("", "a"), "does not make distinct, non-empty names"),
    ],
)
def test_a_pattern_that_does_not_make_one_name_per_variant_is_refused(registry, pattern, variants, message):
    before = dict(MODELS)
    with pytest.raises(ValueError, match=re.escape(message)):
        register_model(pattern) if variants is None else register_model(pattern, variants)
    assert dict(MODELS) == before  # nothing half-registered


def test_a_name_registered_twice_registers_none_of_its_variants(registry):
    register_model("test-twice-{}", ("b",))(tiny_builder)
    with pytest.raises(ValueError, match="'test-twice-b' registered twice"):
        register_model("test-twice-{}", ("a", "b"))(tiny_builder)
    assert "test-twice-a" not in MODELS
    register_model("test-one", ("x",))(tiny_builder)  # one variant and no {}: the name is the pattern
    assert MODELS["test-one"].variant == "x"


# ------------------------------------------------------------------------------------- 4: wording


def test_no_report_says_what_it_does_and_shows_no_default():
    from train.fit import build_parser

    help_text = " ".join(build_parser().format_help().split())
    line = help_text[help_text.index("--no-report skip") :][:120]
    assert "(default: True)" not in line and "skip the validation report" in line and "by default written" in line


def test_counts_of_one_are_singular(capsys, monkeypatch):
    from train import fit as fit_module
    from train import predict
    from train.keras import trainer
    from train.prediction import inference
    from train.runs import run

    metrics = {
        "final": {"val_auc": 0.5},
        "best": {"val_auc": 0.5, "epoch": 1},
        "epochs": 1,
        "optimizer_steps": 1,
        "replicas": 1,
        "per_replica_batch_size": 1,
        "global_batch_size": 1,
        "steps_per_execution": 1,
        "images_per_sec": 1.0,
        "swa": {"epochs_averaged": 1, "final": {"val_auc": 0.5}, "val_auc": 0.5},
    }
    from train.runs.results import FitResult

    monkeypatch.setattr(fit_module, "fit", lambda cfg: FitResult.from_metrics("r", metrics))
    fit_module.run_command(fit_module.build_parser().parse_args(["--records", "recs", "--run", "r"]))
    out = capsys.readouterr().out
    assert ", 1 epoch, 1 step," in out and "SWA of the last 1 epoch:" in out
    assert inference._batch_for(1, 4, 1, progress=True) == 1
    assert "is more than 1 image needs on 1 replica;" in capsys.readouterr().out
    monkeypatch.setattr(predict, "predict", lambda *a, **k: __import__("pandas").DataFrame({"id": ["x"]}))
    monkeypatch.setattr(predict, "check_inputs", lambda run, records: None)
    predict.run_command(predict.build_parser().parse_args(["--run", "r", "--records", "x", "--out", "s.csv"]))
    assert "wrote 1 row (1 view)" in capsys.readouterr().out
    with pytest.raises(TfpipeError, match="does not match the 1 class listed"):
        run.from_dict({"classes": ["a"], "num_classes": 2, "image_size": 8, "single_label": False}, "c.json")
    cfg = FitConfig(batch_size=1, model="small-cnn", image_size=32)
    with pytest.raises(TfpipeError, match="1 image a step, more than the 0 training images"):
        check_batch_fits(cfg, 1, 0)
    line = trainer.build_line(ModelPlan("small-cnn", 2, 32, False), Devices("tf", None, "cpu", 1), (1, 1), 32)
    assert line.endswith("1 cpu replica; 1 training image, 1 validation image")


def test_a_folder_holding_one_foreign_file_says_a_file(shard_dir, tmp_path):
    run = tmp_path / "mine"
    run.mkdir()
    (run / "notes.txt").write_text("mine")
    with pytest.raises(TfpipeError, match=r"holds a file train.fit did not write \(notes.txt\)"):
        fit(small(shard_dir, run))
    assert os.listdir(run) == ["notes.txt"]


def test_no_count_in_train_is_followed_by_a_fixed_plural():
    """f-strings of train/ never put a count before a fixed plural noun ("1 epochs", "1 files")."""
    nouns = "epochs|steps|images|files|rows|classes|replicas|views|shards|folds|records|labels|seconds"
    fixed = re.compile(rf"\{{[^{{}}]*\}} (?:[a-z]+ )?(?:{nouns})\b(?!/)")
    found = []
    for name in sorted(os.listdir(os.path.join(ROOT, "train"))):
        if name.endswith(".py"):
            tree = ast.parse(open(os.path.join(ROOT, "train", name), encoding="utf-8").read())
            for node in ast.walk(tree):
                if isinstance(node, ast.JoinedStr):
                    text = ast.unparse(node)
                    found += [f"{name}:{node.lineno}: {m}" for m in fixed.findall(text)]
    assert found == []


def test_the_default_records_folder_missing_says_it_is_the_default(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)  # no records/demo/train here
    assert fit_cli(["--run", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err
    assert "records/demo/train does not exist; it is the default of --records" in err and "Traceback" not in err
    assert not (tmp_path / "run").exists()


def test_steps_per_execution_beyond_an_epoch_is_cut_with_a_line(shard_dir, tmp_path, capsys):
    # 30 training images at batch 8: 3 steps an epoch, so 32 steps per execution are 3
    m = fit(small(shard_dir, tmp_path / "run", steps_per_execution=32, verbose=2)).metrics
    out = capsys.readouterr().out
    assert "steps_per_execution=32 is more than the 3 steps of an epoch; using 3" in out
    assert m["steps_per_execution"] == 3 and m["optimizer_steps"] == 3
    saved = json.loads((tmp_path / "run" / "config.json").read_text())
    assert saved["steps_per_execution"] == 3


def test_boolean_flags_show_no_false_default_in_help():
    """--no-report, --resume, --probabilities...: a flag's help says what it does, never "(default: True)" for a
    flag that turns something off (argparse's store_false)."""
    from tfpipe.inspect import build_parser as inspect_parser
    from tfpipe.write import build_parser as write_parser
    from train.fit import build_parser as fit_parser
    from train.predict import build_parser as predict_parser

    for parser in (fit_parser(), predict_parser(), write_parser(), inspect_parser()):
        for action in parser._actions:
            if action.nargs == 0 and action.option_strings and action.help and action.help != "==SUPPRESS==":
                text = parser.formatter_class(parser.prog)._get_help_string(action)
                assert "(default: True)" not in text and "(default: False)" not in text, (parser.prog, text)


@pytest.mark.parametrize("command", ["train.fit", "train.predict"])
def test_a_command_started_with_stdout_closed_still_ends_in_one_line(command, tmp_path):
    """``>&-`` (a daemon, cron): Python's sys.stdout is None. The command still runs its checks and says what is
    wrong on stderr with exit code 2, instead of an AttributeError traceback."""
    argv = [sys.executable, "-m", command, "--records", str(tmp_path / "none"), "--run", str(tmp_path / "run")]
    argv += ["--out", str(tmp_path / "s.csv")] if command == "train.predict" else []
    shell = " ".join(shlex.quote(a) for a in argv) + " >&-"  # the shell closes fd 1 (no preexec_fn: TF's threads)
    done = subprocess.run(["sh", "-c", shell], stderr=subprocess.PIPE, text=True, cwd=ROOT, timeout=120)
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 2 and len(lines) == 1 and lines[0].startswith(f"{command}: error: "), done.stderr


# The frames of our own code between `python -m train.fit` and Keras' Model.fit: the module, main, run_cli,
# run_command, fit, the trainer's train, train_and_report, run_phase.
MAX_OWN_FRAMES = 8


@pytest.mark.backends
def test_from_the_command_to_keras_fit_are_at_most_eight_of_our_frames(shard_dir, tmp_path, monkeypatch):
    """The command hands one plan down to Model.fit through few frames of its own (the module's own frame, which
    main() called in-process has not, counts one more)."""
    import traceback

    from tests.conftest import backend_keras
    from train import fit as fit_module

    class Reached(Exception):
        pass

    seen = []

    def fit(self, *args, **kwargs):
        seen.extend(
            f"{os.path.relpath(f.filename, ROOT)} {f.name}"
            for f in traceback.extract_stack()
            if os.path.relpath(f.filename, ROOT).split(os.sep)[0] in ("train", "tfpipe")
        )
        raise Reached

    monkeypatch.setattr(backend_keras().Model, "fit", fit)
    args = ["--records", shard_dir[0], "--run", str(tmp_path / "run"), "--model", "small-cnn", "--batch-size", "8"]
    with pytest.raises(Reached):
        fit_module.main([*args, "--strategy", "cpu", "--verbose", "0", "--epochs", "1", "--no-report"])
    assert seen[0] == "train/fit.py main" and seen[-1] == "train/keras/trainer.py run_phase"
    assert 1 + len(seen) <= MAX_OWN_FRAMES, "\n".join(seen)
