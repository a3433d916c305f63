"""tfpipe 1.0's one vocabulary (docs/glossary.md): the parts a machine can check, and the old spellings that keep
working for one minor release with a warning naming the new one."""

import dataclasses
import inspect
import pathlib
import re
import subprocess
import sys
import typing
import warnings

import pytest

import tfpipe
from tfpipe.deprecations import REMOVED_IN, RENAMES
from tfpipe.errors import TfpipeError

ROOT = pathlib.Path(__file__).resolve().parent.parent


def public_callables():
    """Every public function, class and method users reach: ``tfpipe``'s names, the reader's stages, the
    trainer's two doors, with their qualified names."""
    import tfpipe.read
    from train import fit, predict

    found = {}
    objects = [(f"tfpipe.{n}", getattr(tfpipe, n)) for n in tfpipe.__all__]
    objects += [(f"tfpipe.read.{n}", getattr(tfpipe.read, n)) for n in tfpipe.read.__all__]
    objects += [
        ("train.fit.fit", fit.fit),
        ("train.fit.FitConfig", fit.FitConfig),
        ("train.predict.predict", predict.predict),
    ]
    for name, obj in objects:
        if inspect.isclass(obj):
            for attr, member in vars(obj).items():
                if callable(member) and (not attr.startswith("_") or attr == "__init__"):
                    found[f"{name}.{attr}"] = member
        elif callable(obj):
            found[name] = obj
    return found


def parameters():
    for name, fn in public_callables().items():
        fn = inspect.unwrap(fn)
        try:
            hints = typing.get_type_hints(fn)
        except Exception:  # a class body's own annotations may need names only a type checker has
            hints = getattr(fn, "__annotations__", {})
        for p in inspect.signature(fn).parameters.values():
            yield name, p, hints.get(p.name, p.annotation)


def test_folds_only_ever_means_fold_ids_and_counts_are_num():
    seen = 0
    for name, p, hint in parameters():
        text = str(hint)
        if p.name == "folds":
            seen += 1
            assert "Sequence" in text and "int" in text, f"{name}({p.name}: {text}): folds are fold ids"
        if p.name in ("shards", "num_shards", "num_folds"):
            assert p.name != "shards" or "int" not in text, f"{name}: a count of shards is num_shards"
        if p.name in ("source",):  # the writer's input, nothing else
            assert name.startswith(("tfpipe.write_shards", "tfpipe.open_source")), name
    assert seen >= 4  # make_dataset, open_shards, count_examples, image_names, ...


def test_every_public_callable_is_typed():
    untyped = [
        f"{name}({p.name})"
        for name, p, hint in parameters()
        if p.name not in ("self", "cls")
        and hint is inspect.Parameter.empty
        and p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL)
    ]
    assert untyped == []


def test_fit_and_predict_both_take_the_run_folder_as_run_and_out_is_only_a_product():
    from tfpipe.write import build_parser as write_parser
    from train.fit import build_parser as fit_parser
    from train.predict import build_parser as predict_parser

    def shown(parser):
        return {opt: a for a in parser._actions for opt in a.option_strings if a.help != "==SUPPRESS=="}

    fit, predict, write = shown(fit_parser()), shown(predict_parser()), shown(write_parser())
    assert "--run" in fit and "--run" in predict
    assert "--out" not in fit  # the run folder is not a product file
    assert "CSV" in predict["--out"].help and "shard folder" in write["--out"].help
    assert "--num-folds" in write and "--folds" not in write and "--num-shards" in write


def test_sources_satisfy_the_protocol_and_open_source_makes_either(labeled_folder):
    source = tfpipe.open_source(labeled_folder["images"], labeled_folder["csv"])
    assert isinstance(source, tfpipe.Source) and isinstance(source, tfpipe.SourceProtocol)
    assert source.origin == labeled_folder["csv"]
    tfds = tfpipe.open_source(tfds="mnist", tfds_split="test")  # made, not read: no download
    assert isinstance(tfds, tfpipe.TfdsSource) and isinstance(tfds, tfpipe.SourceProtocol)
    assert tfds.split == "test" and tfds.label_format is None
    with pytest.raises(TfpipeError, match="tfds"):
        tfpipe.open_source(labeled_folder["images"], tfds="mnist")
    with pytest.raises(TfpipeError, match="images"):
        tfpipe.open_source()


def test_write_shards_refuses_what_is_not_a_source(tmp_path):
    with pytest.raises(TfpipeError, match="source must be a tfpipe Source"):
        tfpipe.write_shards("images/", str(tmp_path / "out"))  # a path is not a source


def test_old_python_names_still_work_and_warn_at_the_callers_line(labeled_folder, tmp_path, capsys):
    source = tfpipe.Source(labeled_folder["images"], csv=labeled_folder["csv"])
    spec = tfpipe.ImageSpec(image_size=16)
    with pytest.warns(DeprecationWarning) as warned:
        old = tfpipe.write_shards(
            source, str(tmp_path / "old"), spec=spec, shards=2, folds=2, workers=0, progress=False
        )
    messages = sorted(str(w.message) for w in warned)
    assert messages == [
        f"write_shards(folds=...) is deprecated, use write_shards(num_folds=...) (the old spelling is removed in "
        f"tfpipe {REMOVED_IN})",
        f"write_shards(shards=...) is deprecated, use write_shards(num_shards=...) (the old spelling is removed "
        f"in tfpipe {REMOVED_IN})",
    ]
    assert {w.filename for w in warned} == {__file__}  # the user's own line, so Python shows it
    new = tfpipe.write_shards(
        source, str(tmp_path / "new"), spec=spec, num_shards=2, num_folds=2, workers=0, progress=False
    )
    assert old.num_examples == new.num_examples and old.num_folds == new.num_folds == 2
    assert [s.file for s in old.shards] == [s.file for s in new.shards]
    with pytest.warns(DeprecationWarning, match="Shards.num_folds"):
        assert tfpipe.open_shards(str(tmp_path / "new")).folds == 2
    with pytest.warns(DeprecationWarning, match="Manifest.num_folds"):
        assert new.folds == 2
    with pytest.raises(TfpipeError, match="both folds= and num_folds="):
        tfpipe.write_shards(source, str(tmp_path / "x"), folds=2, num_folds=3)
    with pytest.warns(DeprecationWarning, match=r"inspect_shards\(stream=...\)") as warned:
        tfpipe.inspect_shards(str(tmp_path / "new"), out=sys.stdout)
    assert warned[0].filename == __file__ and "labels" in capsys.readouterr().out


def test_fit_config_out_is_run_with_a_warning():
    from train.fit import FitConfig

    with pytest.warns(DeprecationWarning, match=r"FitConfig\(run=...\)") as warned:
        cfg = FitConfig(out="runs/x", epochs=3)
    assert cfg.run == "runs/x" and cfg.epochs == 3 and warned[0].filename == __file__
    with pytest.warns(DeprecationWarning, match="FitConfig.run"):
        assert cfg.out == "runs/x"
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert FitConfig(run="runs/y").run == "runs/y"  # the new name is silent


@pytest.mark.parametrize(
    ("module", "old", "new", "args"),
    [
        ("tfpipe.write", "--folds", "--num-folds", ["--images", "i", "--out", "o"]),
        ("tfpipe.write", "--shards", "--num-shards", ["--images", "i", "--out", "o"]),
        ("train.fit", "--out", "--run", []),
    ],
)
def test_old_flags_still_work_with_one_line_on_stderr(module, old, new, args, capsys):
    import importlib

    parser = importlib.import_module(module).build_parser()
    parsed = parser.parse_args([*args, old, "3"])
    assert getattr(parsed, new.lstrip("-").replace("-", "_")) == (3 if new != "--run" else "3")
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [
        f"{module}: warning: {old} is deprecated, use {new} (the old spelling is removed in tfpipe {REMOVED_IN})"
    ]
    assert old not in parser.format_help().replace(new, "")  # --help shows only the new spelling


def test_a_command_with_an_old_flag_runs_to_the_end(labeled_folder, tmp_path):
    out = str(tmp_path / "out")
    proc = subprocess.run(
        [sys.executable, "-m", "tfpipe.write", "--images", labeled_folder["images"], "--csv", labeled_folder["csv"],
         "--out", out, "--folds", "2", "--workers", "0", "--no-progress"],
        capture_output=True, text=True, cwd=ROOT,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert "--folds is deprecated, use --num-folds" in proc.stderr
    assert tfpipe.Manifest.load(out).num_folds == 2


def test_changelog_lists_every_rename_and_tells_the_one_version_story():
    """Issue #54: the package said 1.0.0 while the docs spoke of "tfpipe 1.1" and the CHANGELOG's top was
    [Unreleased]. Now the package is 1.1's development version, the CHANGELOG's top says it becomes 1.1.0, and
    the renamed spellings are removed in that release, not before."""
    from packaging.version import Version

    changelog = (ROOT / "CHANGELOG.md").read_text()
    version = Version(tfpipe.__version__)
    releases = re.findall(r"^## \[([^\]]+)\]", changelog, re.M)
    assert releases[:2] == ["Unreleased", "1.0.0"] and version.is_devrelease and version.release[:2] == (1, 1)
    assert f"`{tfpipe.__version__}`" in changelog.split("## [1.0.0]")[0] and "released as 1.1.0" in changelog
    assert Version(REMOVED_IN) == Version("1.1") > version  # the old spellings still work in this version
    for where, old, new in RENAMES:
        assert f"`{old}`" in changelog and f"`{new}`" in changelog, (where, old, new)


def test_docs_readme_and_notebook_use_only_the_new_names():
    texts = {p: p.read_text() for p in [ROOT / "README.md", ROOT / "examples" / "kaggle_tpu.ipynb", ROOT / "Makefile"]}
    code = [p for folder in ("tfpipe", "train", "bench") for p in (ROOT / folder).rglob("*.py")]
    texts.update({p: p.read_text() for p in code if p.name != "deprecations.py"})  # docstrings, messages, help
    texts.update(
        {p: p.read_text() for p in (ROOT / "docs").rglob("*.md") if p.name not in ("changelog.md", "glossary.md")}
    )  # these two list the old names
    old_spellings = [
        r"--folds\b",
        r"--shards\b",
        r"\bfolds=\d",
        r"\bshards=\d",
        r"train\.fit [^\n]*--out\b",
        r"FitConfig\([^)]*\bout=",
    ]
    kept = (  # lines that say what was renamed, removed or is refused
        "→", "deprecated", "old spelling", "removed", "fold ids", "add_deprecated_flag", "renamed_arguments",
        "warn_renamed",
    )  # fmt: skip
    texts = {
        p: "\n".join(ln for ln in text.splitlines() if not any(k in ln for k in kept)) for p, text in texts.items()
    }
    found = [  # lines with "→" say what was renamed to what
        (p.name, m.group(0)) for p, text in texts.items() for pat in old_spellings for m in re.finditer(pat, text)
    ]
    assert found == []


def test_the_glossary_names_every_public_word():
    glossary = (ROOT / "docs" / "glossary.md").read_text()
    for word in ("records", "shard folder", "run folder", "source", "split", "fold", "folds", "num_folds", "out"):
        assert re.search(rf"\*\*{re.escape(word)}\*\*", glossary), word


def test_predict_probabilities_takes_records_and_source_warns():
    from train.predict import predict_probabilities

    with pytest.warns(DeprecationWarning, match=r"predict_probabilities\(records=...\)"):
        with pytest.raises(TfpipeError, match="no shard files"):  # warned first, then the records are opened
            predict_probabilities(
                None, source="/nonexistent/*.tfrec", strategy=None, batch_size=1, image_size=None, num_classes=1
            )


# ---------------------------------------------------------------- the second look: what a hostile tester found


def _write_cli(args):
    from tfpipe.write import main

    return main(args)


@pytest.mark.parametrize(
    ("module", "args", "needle"),
    [
        ("tfpipe.write", ["--folds", "3", "--num-folds", "5"], "--folds is the old spelling of --num-folds"),
        ("tfpipe.write", ["--num-shards=4", "--shards=8"], "--shards is the old spelling of --num-shards"),
        ("train.fit", ["--out", "a", "--run", "b"], "--out is the old spelling of --run"),
        ("tfpipe.write", ["--fold", "3"], "unrecognized arguments: --fold 3"),  # no abbreviations of --folds
    ],
)
def test_old_and_new_flag_together_is_one_line_exit_2(module, args, needle, capsys):
    import importlib

    with pytest.raises(SystemExit) as stop:
        required = ["--images", "i", "--out", "o"] if module == "tfpipe.write" else []
        importlib.import_module(module).build_parser().parse_args(required + args)
    err = capsys.readouterr().err.strip().splitlines()
    assert stop.value.code == 2 and needle in err[-1] and "Traceback" not in "".join(err)


def test_messages_name_the_setting_as_the_user_spells_it_there(labeled_folder, tmp_path, capsys):
    rows = [(name, "") for name, _ in labeled_folder["rows"]]
    from tests.conftest import write_csv

    empty = write_csv(tmp_path / "empty.csv", ["image", "labels"], rows)
    with pytest.raises(TfpipeError, match=re.escape("pass Source(..., labeled=False)")):
        tfpipe.write_shards(tfpipe.Source(labeled_folder["images"], csv=str(empty)), str(tmp_path / "o"), workers=0)
    source_args = ["--images", labeled_folder["images"], "--csv", labeled_folder["csv"], "--workers", "0"]
    assert _write_cli([*source_args, "--out", str(tmp_path / "o2"), "--num-folds", "500"]) == 2
    assert "--num-folds 500 is more than the 12 images" in capsys.readouterr().err
    assert _write_cli([*source_args, "--out", str(tmp_path / "o3"), "--num-folds", "3", "--num-shards", "2"]) == 2
    assert "--num-shards 2 is fewer than --num-folds 3" in capsys.readouterr().err


def test_unlabeled_shards_read_with_targets_of_width_zero(labeled_folder, tmp_path):
    out = str(tmp_path / "test")
    source = tfpipe.Source(labeled_folder["images"], csv=labeled_folder["csv"], labeled=False)
    tfpipe.write_shards(source, out, split="test", spec=tfpipe.ImageSpec(image_size=16), workers=0, progress=False)
    images, targets, ids = next(iter(tfpipe.make_dataset(out, 12, with_ids=True)))
    assert images.shape == (12, 16, 16, 3) and targets.shape == (12, 0) and len(set(ids.numpy())) == 12
    _, wide = next(iter(tfpipe.make_dataset(out, 12, num_classes=4)))  # the width of a run's classes: zeros
    assert wide.shape == (12, 4) and float(wide.numpy().sum()) == 0.0
    from tfpipe.torch import RecordDataset

    image, target = next(iter(RecordDataset(out)))
    assert tuple(image.shape) == (3, 16, 16) and tuple(target.shape) == (0,)


class _Mine:
    """A source of one's own: every SourceProtocol member, with the items it is given."""

    labeled, single_label, id_column, label_format, origin, classes = True, False, "image", None, "mine", None

    def __init__(self, items, **overrides):
        self._items = items
        for name, value in overrides.items():
            setattr(self, name, value)

    def items(self, skip_bad=False):
        return self._items, []


def _items(folder, labels):
    return [tfpipe.Item(f"{folder}/img{i:02d}.jpg", f"img{i:02d}", lab) for i, lab in enumerate(labels)]


@pytest.mark.parametrize(
    ("make", "needle"),
    [
        (lambda f: object(), "a object has no classes, id_column, items, label_format, labeled, origin"),
        (lambda f: _Mine(_items(f, [("a",)]), labeled="yes"), "source.labeled must be a bool"),
        (lambda f: _Mine(_items(f, [("a",)]), classes="abc"), "source.classes must be None or a list"),
        (lambda f: _Mine(_items(f, ["cat", ("dog",)])), "labels must be a tuple of class names (got 'cat')"),
        (lambda f: _Mine(_items(f, [("a",), ("b",)])[:1] * 2), "the id 'img00' comes twice"),
        (lambda f: _Mine(_items(f, [("a", "b")]), single_label=True), "single-label but the item has 2 labels"),
        (lambda f: _Mine([("img.jpg", ["a"])]), "is a tuple, not a tfpipe Item"),
        (lambda f: "images/", "not the path 'images/': write_shards(source, out)"),
    ],
)
def test_a_source_of_ones_own_is_checked_like_input(labeled_folder, tmp_path, make, needle):
    source = make(labeled_folder["images"])
    with pytest.raises(TfpipeError, match=re.escape(needle)):
        tfpipe.write_shards(source, str(tmp_path / "out"), workers=0, progress=False)
    assert not (tmp_path / "out").exists()


def test_a_source_of_ones_own_that_is_right_writes(labeled_folder, tmp_path):
    source = _Mine(_items(labeled_folder["images"], [("a",), ("b", "a"), ()]))
    assert isinstance(source, tfpipe.SourceProtocol)
    m = tfpipe.write_shards(source, str(tmp_path / "out"), workers=0, progress=False)
    assert m.classes == ("a", "b") and m.num_examples == 3 and m.max_labels == 2


@pytest.mark.parametrize(
    ("call", "needle"),
    [
        (lambda r: tfpipe.make_dataset(r, 8, folds=3), "folds are fold ids, a list such as folds=[0, 1] (got 3)"),
        (lambda r: tfpipe.count_examples(r, [True]), "folds are fold ids"),
        (lambda r: tfpipe.open_shards(r, []), "folds=[] selects no fold"),
        (lambda r: tfpipe.fold_split(r, [0]), "fold must be a whole number"),
        (lambda r: tfpipe.make_dataset(tfpipe.open_shards(r, [0]), 8, folds=[1]), "records: no shard files found"),
    ],
)
def test_fold_ids_and_counts_are_told_apart(shard_dir, call, needle):
    with pytest.raises(TfpipeError, match=re.escape(needle)) as err:
        call(shard_dir[0])
    assert len(str(err.value)) < 300  # opened Shards are named by their folder, not their whole repr


@pytest.mark.parametrize(
    ("call", "needle"),
    [
        (lambda: tfpipe.ImageSpec(size=16), "ImageSpec(size=...) was removed in tfpipe 1.0: use image_size="),
        (lambda: tfpipe.write_shards(None, "o", num_workers=0), "use workers="),
        (lambda: tfpipe.make_dataset("r", 8, shuffle_buffer=4), "options=ReadOptions(shuffle_buffer=...)"),
        (lambda: tfpipe.Manifest("train", (), ())["classes"], "use manifest.classes"),
    ],
)
def test_what_1_0_removed_says_what_replaced_it(call, needle):
    with pytest.raises(TypeError, match=re.escape(needle)):
        call()


@pytest.mark.parametrize(
    ("kwargs", "needle"),
    [
        ({"images": "i", "tfds": "mnist"}, "reads a TFDS dataset, which has no images"),
        ({"tfds": "mnist", "image_col": "id"}, "which has no image_col"),
        ({"images": "i", "tfds_split": "test"}, "tfds_split belong to tfds NAME"),
        ({"images": "i", "data_dir": "/d"}, "data_dir belong to tfds NAME"),
    ],
)
def test_open_source_refuses_settings_that_would_be_ignored(kwargs, needle):
    with pytest.raises(TfpipeError, match=re.escape(needle)):
        tfpipe.open_source(**kwargs)


def test_read_options_help_and_dir_hold_no_surprises():
    from tfpipe.augment import AUGMENT_LIMITS, Augment
    from tfpipe.parse import READ_LIMITS

    with pytest.raises(TfpipeError, match="parse_batch must be at least 1"):
        tfpipe.ReadOptions(parse_batch=0)
    for make, limits in ((tfpipe.ReadOptions, READ_LIMITS), (Augment, AUGMENT_LIMITS)):  # issue #64: every field
        for name, high in limits.items():
            make(**{name: high})  # the limit itself is fine
            beyond = high * 2 if isinstance(high, int) else high * 1.5
            with pytest.raises(TfpipeError, match=f"^{name} must be at most "):
                make(**{name: beyond})
    with pytest.raises(TfpipeError, match=re.escape("read_buffer must be at most 1,073,741,824 (got 9,223,372")):
        tfpipe.ReadOptions(read_buffer=2**63)  # was TensorFlow's InvalidArgumentError at the first batch
    from tfpipe.write import build_parser

    text = " ".join(build_parser().format_help().split())
    assert "seed of the fold assignment (default: 0)" in text  # a zero default is shown
    assert "list them (default: False)" not in text  # a flag's help says what it does
    assert {"make_dataset", "write_shards", "Item", "SourceProtocol"} <= set(dir(tfpipe))


def test_fit_names_its_run_folder_as_run(shard_dir, tmp_path, capsys):
    from tests.test_hostile import _fit_cli

    afile = tmp_path / "afile"
    afile.write_text("mine")
    assert _fit_cli(["--records", shard_dir[0], "--run", str(afile), "--epochs", "1"]) == 2
    assert f"{afile} is a file; --run names a folder" in capsys.readouterr().err
    assert afile.read_text() == "mine"


def test_every_augment_field_is_a_flag_of_train_fit_and_reads_back_as_in_python(capsys):
    """Issue #33: the flags are made from Augment's fields, so each is reachable from the command line with the
    same meaning; none given is Augment(); --no-augment with a flag asking for some is one refusal."""
    import dataclasses

    from tfpipe.augment import NO_AUGMENT, Augment
    from train.fit import build_parser, config_from_args

    parser = build_parser()
    flags = {option for action in parser._actions for option in action.option_strings}
    assert {"--" + f.name.replace("_", "-") for f in dataclasses.fields(Augment)} <= flags
    assert config_from_args(parser.parse_args([])).augment == Augment()
    args = ["--no-flip", "--crop", "resized", "--crop-scale", "0.8,1", "--crop-ratio", "0.5,2", "--pad", "4",
            "--brightness", "0.2", "--contrast", "0", "--saturation", "0.3", "--erasing", "2", "--erasing-prob",
            "0.25", "--mixup", "0.4", "--cutmix", "1", "--no-jit"]  # fmt: skip
    assert config_from_args(parser.parse_args(args)).augment == Augment(
        flip=False, crop="resized", crop_scale=(0.8, 1.0), crop_ratio=(0.5, 2.0), pad=4, brightness=0.2,
        contrast=0.0, saturation=0.3, erasing=2, erasing_prob=0.25, mixup=0.4, cutmix=1.0, jit=False,
    )  # fmt: skip
    assert config_from_args(parser.parse_args(["--crop", "none"])).augment.crop is None
    assert config_from_args(parser.parse_args(["--no-augment"])).augment == NO_AUGMENT
    with pytest.raises(TfpipeError, match="--no-augment turns training augmentation off, and --mixup asks for some"):
        config_from_args(parser.parse_args(["--no-augment", "--mixup", "0.2"]))
    with pytest.raises(SystemExit) as e:
        parser.parse_args(["--crop-scale", "0.5"])  # one number: argparse's one line, exit 2
    (line,) = capsys.readouterr().err.strip().splitlines()[-1:]
    assert e.value.code == 2 and "--crop-scale" in line and "0.5" in line, line


@pytest.mark.parametrize(
    "args, needle",
    [
        (["--mixup", "-1"], "--mixup must be at least 0 (got -1.0)"),  # made the targets NaN
        (["--pad", "-4"], "--pad must be"),  # failed inside the input pipeline
        (["--crop-scale", "1,0.5"], "--crop-scale must be two numbers 0 < low <= high <= 1"),
        (["--crop-scale", "nan,1"], "--crop-scale must be two numbers"),
        (["--crop-ratio", "0,0"], "--crop-ratio must be two numbers 0 < low <= high"),
        (["--erasing-prob", "2"], "--erasing-prob must be a probability"),
        (["--erasing", "-1"], "--erasing must be"),
        (["--contrast", "inf"], "--contrast must be finite (got inf)"),
        (["--no-augment", "--flip"], "--no-augment turns training augmentation off, and --flip asks for some"),
    ],
)
def test_augmentation_values_out_of_range_are_one_line(args, needle):
    """The second hostile round of issue #33: these were accepted and failed (or went NaN) only in training."""
    from tfpipe.errors import as_command
    from train.fit import build_parser, config_from_args

    with as_command("train.fit"), pytest.raises(TfpipeError, match=re.escape(needle)):  # flags, as the command says
        config_from_args(build_parser().parse_args(args))


def test_flags_that_agree_with_no_augment_are_taken():
    from tfpipe.augment import NO_AUGMENT, Augment
    from train.fit import build_parser, config_from_args

    parser = build_parser()
    for args in (["--no-flip"], ["--mixup", "0"], ["--crop", "none"], ["--no-jit"]):
        got = config_from_args(parser.parse_args(["--no-augment", *args])).augment
        assert dataclasses.replace(got, jit=True) == NO_AUGMENT, args
    with pytest.raises(TfpipeError, match=r"pad must be"):  # Python refuses alike
        Augment(pad=-4)
