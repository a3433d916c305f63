"""tfpipe 1.0's one vocabulary (docs/glossary.md): the parts a machine can check, and the old spellings that keep
working for one minor release with a warning naming the new one."""

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


def test_changelog_lists_every_rename_and_the_version_is_1_0():
    changelog = (ROOT / "CHANGELOG.md").read_text()
    assert tfpipe.__version__ == "1.0.0" and "## [1.0.0]" in changelog
    for where, old, new in RENAMES:
        assert f"`{old}`" in changelog and f"`{new}`" in changelog, (where, old, new)


def test_docs_readme_and_notebook_use_only_the_new_names():
    texts = {p: p.read_text() for p in [ROOT / "README.md", ROOT / "examples" / "kaggle_tpu.ipynb", ROOT / "Makefile"]}
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
    texts = {p: "\n".join(line for line in text.splitlines() if "→" not in line) for p, text in texts.items()}
    found = [  # lines with "→" say what was renamed to what
        (p.name, m.group(0)) for p, text in texts.items() for pat in old_spellings for m in re.finditer(pat, text)
    ]
    assert found == []


def test_the_glossary_names_every_public_word():
    glossary = (ROOT / "docs" / "glossary.md").read_text()
    for word in ("records", "shard folder", "run folder", "source", "split", "fold", "folds", "num_folds", "out"):
        assert re.search(rf"\*\*{re.escape(word)}\*\*", glossary), word
