"""tfpipe's one vocabulary (docs/glossary.md): the parts a machine can check, and the 1.x spellings 2.0 removed
(each refused, each in the CHANGELOG's migration table)."""

import dataclasses
import inspect
import pathlib
import re
import sys
import typing

import pytest

import tfpipe
from tfpipe.runtime.errors import TfpipeError

ROOT = pathlib.Path(__file__).resolve().parent.parent


def public_callables():
    """Every public function, class and method users reach: ``tfpipe``'s names, the reader's stages, the
    trainer's two doors, with their qualified names."""
    import tfpipe.tf.read
    from train import fit, predict

    found = {}
    objects = [(f"tfpipe.{n}", getattr(tfpipe, n)) for n in tfpipe.__all__]
    objects += [(f"tfpipe.tf.read.{n}", getattr(tfpipe.tf.read, n)) for n in tfpipe.tf.read.__all__]
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


# 2.0 removed the spellings 1.x deprecated: (where, old, new). The CHANGELOG's migration table lists each.
REMOVED_SPELLINGS = (
    ("tfpipe.write_shards", "shards=", "num_shards="),
    ("tfpipe.write_shards", "folds=", "num_folds="),
    ("tfpipe.inspect_shards", "out=", "stream="),
    ("tfpipe.Shards", ".folds", ".num_folds"),
    ("tfpipe.Manifest", ".folds", ".num_folds"),
    ("train.fit.FitConfig", "out=", "run="),
    ("train.predict.predict_probabilities", "source=", "records="),
    ("python -m tfpipe.write", "--shards", "--num-shards"),
    ("python -m tfpipe.write", "--folds", "--num-folds"),
    ("python -m train.fit", "--out", "--run"),
)


def test_removed_python_spellings_are_refused(shard_dir):
    """2.0 removed the spellings 1.x warned about: each is an error now, never a silent other meaning."""
    from train.fit import FitConfig
    from train.prediction.inference import predict_probabilities

    source = tfpipe.Source("images", csv="train.csv")
    calls = [
        lambda: tfpipe.write_shards(source, "o", shards=2),
        lambda: tfpipe.write_shards(source, "o", folds=2),
        lambda: tfpipe.inspect_shards(shard_dir[0], out=sys.stdout),
        lambda: FitConfig(out="runs/x"),
        lambda: predict_probabilities(
            None, source="r/*.tfrec", strategy=None, batch_size=1, image_size=None, num_classes=1
        ),
    ]
    for call in calls:
        with pytest.raises(TypeError, match="unexpected keyword argument"):
            call()
    for opened in (tfpipe.open_shards(shard_dir[0]), tfpipe.Manifest.load(shard_dir[0])):
        assert opened.num_folds is not None and not hasattr(opened, "folds")
    assert not hasattr(FitConfig(), "out")


@pytest.mark.parametrize(
    ("module", "old", "args"),
    [
        ("tfpipe.write", "--folds", ["--images", "i", "--out", "o"]),
        ("tfpipe.write", "--shards", ["--images", "i", "--out", "o"]),
        ("train.fit", "--out", []),
    ],
)
def test_removed_flags_are_refused_in_one_line(module, old, args, capsys):
    import importlib

    parser = importlib.import_module(module).build_parser()
    with pytest.raises(SystemExit) as stop:
        parser.parse_args([*args, old, "3"])
    err = capsys.readouterr().err.strip().splitlines()
    assert stop.value.code == 2 and err == [f"{parser.prog}: error: unrecognized arguments: {old} 3 (see --help)"]


def test_changelog_has_a_migration_table_and_tells_the_one_version_story():
    """The package's version is the CHANGELOG's newest release (or the development release after it), and
    2.0.0's migration table gives every removed spelling with the one that replaced it, and every moved module."""
    from packaging.version import Version

    changelog = (ROOT / "CHANGELOG.md").read_text()
    version = Version(tfpipe.__version__)
    releases = re.findall(r"^## \[([^\]]+)\]", changelog, re.M)
    assert releases[:3] == ["Unreleased", "2.0.0", "1.0.0"]
    newest = Version(releases[1])
    assert version == newest or (version.is_devrelease and version.release > newest.release)
    two = changelog.split("## [2.0.0]")[1].split("## [1.0.0]")[0]
    table = two.split("### Migrating from 1.x")[1].split("\n### ")[0]
    for where, old, new in REMOVED_SPELLINGS:
        assert re.search(rf"\| `{re.escape(where)}` \| `{re.escape(old)}` \| `{re.escape(new)}` \|", table), old


def test_docs_readme_and_notebook_use_only_the_new_names():
    texts = {p: p.read_text() for p in [ROOT / "README.md", ROOT / "examples" / "kaggle_tpu.ipynb", ROOT / "Makefile"]}
    code = [p for folder in ("tfpipe", "train", "bench") for p in (ROOT / folder).rglob("*.py")]
    texts.update({p: p.read_text() for p in code})  # docstrings, messages, help
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
        "→", "deprecated", "old spelling", "removed", "fold ids",
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


# ---------------------------------------------------------------- the second look: what a hostile tester found


def _write_cli(args):
    from tfpipe.write import main

    return main(args)


@pytest.mark.parametrize(
    ("module", "args", "needle"),
    [
        ("tfpipe.write", ["--fold", "3"], "unrecognized arguments: --fold 3"),  # no abbreviation of --num-folds
        ("train.fit", ["--rec", "r"], "unrecognized arguments: --rec r"),  # nor of --records
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
    from tfpipe.torch.dataset import RecordDataset

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
        (lambda: tfpipe.ImageSpec(size=16), "unexpected keyword argument 'size'"),
        (lambda: tfpipe.write_shards(None, "o", num_workers=0), "unexpected keyword argument 'num_workers'"),
        (lambda: tfpipe.make_dataset("r", 8, shuffle_buffer=4), "unexpected keyword argument 'shuffle_buffer'"),
        (lambda: tfpipe.Manifest("train", (), ())["classes"], "use manifest.classes"),
    ],
)
def test_removed_arguments_are_type_errors(call, needle):
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
    from tfpipe.tf.augment import AUGMENT_LIMITS, Augment
    from tfpipe.tf.parse import READ_LIMITS

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

    from tfpipe.tf.augment import NO_AUGMENT, Augment
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
    from tfpipe.runtime.errors import as_command
    from train.fit import build_parser, config_from_args

    with as_command("train.fit"), pytest.raises(TfpipeError, match=re.escape(needle)):  # flags, as the command says
        config_from_args(build_parser().parse_args(args))


def test_flags_that_agree_with_no_augment_are_taken():
    from tfpipe.tf.augment import NO_AUGMENT, Augment
    from train.fit import build_parser, config_from_args

    parser = build_parser()
    for args in (["--no-flip"], ["--mixup", "0"], ["--crop", "none"], ["--no-jit"]):
        got = config_from_args(parser.parse_args(["--no-augment", *args])).augment
        assert dataclasses.replace(got, jit=True) == NO_AUGMENT, args
    with pytest.raises(TfpipeError, match=r"pad must be"):  # Python refuses alike
        Augment(pad=-4)
