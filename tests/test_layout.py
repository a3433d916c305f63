"""The layout the code stands on: no import cycles, the library core never reaches back into the commands or
into ``train``, and functions in ``tfpipe/`` stay small enough to read in one look. Read from the source."""

import ast
import os
import pathlib
import re

import pytest
import tomllib

ROOT = pathlib.Path(__file__).resolve().parent.parent
PACKAGES = ("tfpipe", "train")
MAX_FUNCTION_LINES = 40  # body lines after the docstring
MAX_MODULE_LINES = 450  # a room one can read (issue #33)


def commands():
    """Every command (the console scripts of pyproject.toml, each a ``python -m`` module): nothing in ``tfpipe``
    may import one."""
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    return {target.split(":")[0] for target in scripts.values()}


def test_every_command_is_listed():
    """A module that runs as a command (``if __name__ == "__main__":``) is one of the console scripts, so the
    layout's command list cannot miss one (it missed ``tfpipe.service``)."""

    def runs_as_main(path):
        tests = [node.test for node in ast.parse(path.read_text()).body if isinstance(node, ast.If)]
        return any(isinstance(t, ast.Compare) and getattr(t.left, "id", None) == "__name__" for t in tests)

    mains = {name for name, path in modules().items() if runs_as_main(path)}
    assert mains - commands() == set()


def module_name(path):
    """``train/keras/trainer.py`` -> ``train.keras.trainer``; a package's ``__init__.py`` is the package."""
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def source_files():
    """Every module of the packages, sub-packages included."""
    return sorted(p for package in PACKAGES for p in (ROOT / package).rglob("*.py"))


def modules():
    return {module_name(path): path for path in source_files()}


def runtime_nodes(tree):
    """Every node, except what sits under ``if TYPE_CHECKING:`` (imports for type checkers only never run)."""
    stack = [tree]
    while stack:
        node = stack.pop()
        yield node
        if isinstance(node, ast.If) and isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING":
            stack.extend(node.orelse)
            continue
        stack.extend(ast.iter_child_nodes(node))


def imports(path, known, type_checking=False):
    """Project modules ``path`` imports, at the top or inside functions (deferred imports count too; imports
    for type checkers only with ``type_checking``)."""
    found = set()
    tree = ast.parse(path.read_text())
    for node in ast.walk(tree) if type_checking else runtime_nodes(tree):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
            found.update(f"{node.module}.{a.name}" for a in node.names)  # from tfpipe import fs
    return {m for m in found if m in known}


@pytest.mark.parametrize("type_checking", [False, True], ids=["runtime", "with type-checking imports"])
def test_no_import_cycles(type_checking):
    """Also none through imports for type checkers: a circle there is two rooms that cannot be read apart
    (issue #33: train.fit and train.keras.trainer were one)."""
    known = modules()
    if type_checking:  # the packages' own __init__ only lists their public names for type checkers: no room
        known = {name: path for name, path in known.items() if path.name != "__init__.py"}
    graph = {name: imports(path, known, type_checking) - {name} for name, path in known.items()}
    done, path = set(), []

    def visit(name):
        assert name not in path, "import cycle: " + " -> ".join(path[path.index(name) :] + [name])
        if name in done:
            return
        path.append(name)
        for other in sorted(graph[name]):
            visit(other)
        path.pop()
        done.add(name)

    for name in sorted(graph):
        visit(name)


def test_core_depends_on_neither_commands_nor_train():
    known = modules()
    for name, path in known.items():
        if name.startswith("tfpipe"):
            wrong = {m for m in imports(path, known) if m in commands() or m.startswith("train")} - {name}
            assert not wrong, f"{name} imports {sorted(wrong)}"


def test_commands_reach_their_engines_by_plain_imports():
    """No ``importlib.import_module`` of our own modules (the layout and type checkers cannot follow it) outside
    ``tfpipe/__init__.py``'s table of lazy names; commands import their engine where they call it."""
    found = []
    for name, path in modules().items():
        for call in ast.walk(ast.parse(path.read_text())):
            if isinstance(call, ast.Call) and getattr(call.func, "attr", None) == "import_module" and name != "tfpipe":
                argument = ast.unparse(call.args[0])
                if argument not in ("'tf_keras'", "module"):  # tfpipe.runtime.deps.require's: other packages
                    found.append(f"{name}: import_module({argument})")
    assert found == []


def test_functions_in_tfpipe_and_train_are_small():
    long = []
    for path in source_files():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                body = node.body
                has_doc = isinstance(body[0], ast.Expr) and isinstance(getattr(body[0], "value", None), ast.Constant)
                start = body[1].lineno if has_doc and len(body) > 1 else body[0].lineno
                if node.end_lineno - start + 1 > MAX_FUNCTION_LINES:
                    long.append(f"{os.path.relpath(path, ROOT)}:{node.lineno} {node.name}")
    assert long == []


def test_modules_in_tfpipe_and_train_are_rooms_one_can_read():
    """No module over MAX_MODULE_LINES lines (issue #33 split the six that were, up to 1,066)."""
    sizes = {os.path.relpath(path, ROOT): len(path.read_text().splitlines()) for path in source_files()}
    assert {path: lines for path, lines in sizes.items() if lines > MAX_MODULE_LINES} == {}


def test_the_names_the_command_lines_offer_match_the_tables():
    from train.fit import build_parser
    from train.keras import names
    from train.keras.models import MODELS
    from train.keras.schedules import make_schedule
    from train.prediction.inference import TTA_VIEWS

    model_flag = next(a for a in build_parser()._actions if "--model" in a.option_strings)
    assert tuple(model_flag.choices) == tuple(MODELS) and "small-cnn" in MODELS and "efficientnet-b7" in MODELS
    assert len(TTA_VIEWS) == names.TTA_VIEW_COUNT
    for schedule in names.SCHEDULES:
        make_schedule(schedule, 1e-3, 10, 2, 1.0)  # each name builds


def test_only_train_run_spells_the_name_of_a_run_file():
    """Issue #33: ``train/runs/run.py`` owns the run folder's file names; another module that needs one imports it
    (a message may mention a name in its text). A ``.keras`` archive's own ``config.json`` member is not a run's."""
    tree = ast.parse((ROOT / "train" / "runs" / "run.py").read_text())
    constants = [
        value
        for node in tree.body
        if isinstance(node, ast.Assign)
        and all(name.id.isupper() for name in ast.walk(node.targets[0]) if isinstance(name, ast.Name))
        for value in ([node.value] if isinstance(node.value, ast.Constant) else getattr(node.value, "elts", []))
    ]
    names = {
        c.value
        for c in constants
        if isinstance(c, ast.Constant) and isinstance(c.value, str)
        if "." in c.value or c.value in ("backup", "checkpoints", "logs")
    }
    assert {"config.json", "model.keras", "history.csv", "checkpoints", "model.pt"} <= names
    spelled = [
        f"{path.relative_to(ROOT)} {node.value!r}"
        for path in sorted((ROOT / "train").rglob("*.py")) + sorted((ROOT / "examples").glob("*.py"))
        if path.relative_to(ROOT).as_posix() != "train/runs/run.py"
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.Constant) and node.value in names
    ]
    assert spelled == ["train/keras/run_model.py 'config.json'"]  # KERAS_CONFIG: the archive's member


def test_train_top_level_holds_only_the_commands_and_the_rooms_are_packages():
    """``train/`` shows its architecture from ``ls``: the commands at the top, every other module in a sub-package
    named for its seam."""
    top = {module_name(p) for p in (ROOT / "train").glob("*.py")} - {"train"}
    assert top == {m for m in commands() if m.startswith("train.")}
    assert len(top) <= 8
    packages = {p.parent.name for p in (ROOT / "train").glob("*/__init__.py")}
    assert packages == {"keras", "backends", "accel", "preflight", "prediction", "decide", "runs", "crossval", "torch"}


# tfpipe/'s sub-packages, one a concern; only tf/ uses TensorFlow (and torch/ needs PyTorch).
TFPIPE_PACKAGES = {"format", "sources", "writer", "tf", "torch", "runtime"}
TENSORFLOW_COMMANDS = {"tfpipe.service"}  # python -m tfpipe.service: a tf.data service, TensorFlow is its job


def without_tensorflow():
    """The modules of tfpipe that must not start TensorFlow when imported: all but tf/'s and TENSORFLOW_COMMANDS."""
    names = {n for n in modules() if n.startswith("tfpipe") and not n.startswith("tfpipe.tf.") and n != "tfpipe.tf"}
    return sorted(names - TENSORFLOW_COMMANDS)


def test_tfpipe_top_level_holds_the_commands_and_its_face_and_the_rooms_are_packages():
    top = {module_name(p) for p in (ROOT / "tfpipe").glob("*.py")}
    assert top == {"tfpipe", "tfpipe.version"} | {m for m in commands() if m.startswith("tfpipe.")}
    assert {p.parent.name for p in (ROOT / "tfpipe").glob("*/__init__.py")} == TFPIPE_PACKAGES
    assert not any(p.parent != ROOT / "tfpipe" for p in (ROOT / "tfpipe").glob("*/*/__init__.py"))


def test_tensorflow_is_imported_at_module_level_only_in_tfpipe_tf():
    """Read from the source: no module of ``tfpipe`` outside ``tfpipe/tf/`` imports TensorFlow (or a module of
    ``tfpipe.tf``) at its top level, so the writer's DataLoader workers and the PyTorch reader never start it."""
    wrong = []
    for name in without_tensorflow():
        top_level = ast.parse(modules()[name].read_text()).body  # a function's own import is deferred: not read
        for node in top_level:
            if isinstance(node, ast.If) and ast.unparse(node.test) == "TYPE_CHECKING":
                continue
            found = [a.name for a in node.names] if isinstance(node, ast.Import) else []
            if isinstance(node, ast.ImportFrom) and node.module:
                found = [node.module, *(f"{node.module}.{a.name}" for a in node.names)]
            if isinstance(node, ast.Assign) and "require(" in ast.unparse(node.value):
                found = [ast.unparse(node.value)]
            wrong += [f"{name}: {m}" for m in found if "tensorflow" in m or m.startswith("tfpipe.tf")]
    assert wrong == []


def test_importing_every_module_outside_tfpipe_tf_leaves_tensorflow_unloaded():
    """The same rule in a real interpreter: every module of the other sub-packages (the PyTorch reader and the
    commands too) imported in one fresh process, and TensorFlow is still not in ``sys.modules``."""
    import subprocess
    import sys

    names = without_tensorflow()
    code = f"import importlib, sys\nfor n in {names!r}:\n    importlib.import_module(n)\n"
    code += "print(sorted(m for m in sys.modules if m.split('.')[0] in ('tensorflow', 'tf_keras', 'keras', 'jax')))"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]" and len(names) > 30


def test_what_differs_between_the_backends_lives_in_their_modules():
    """Nothing outside ``train/backends/`` asks which backend runs (the backends' own modules answer, through
    ``train.backends.current()``), and only the JAX preflight imports a backend's module by name."""
    asking = ("is_keras_3", "keras_backend_set", "running")
    found = []
    for name, path in modules().items():
        if name.startswith("train.backends"):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and ast.unparse(node.func).split(".")[-1] in asking:
                found.append(f"{name}: {ast.unparse(node)}")
        named = {m for m in imports(path, modules()) if m in ("train.backends.tf", "train.backends.jax")}
        found += [f"{name} imports {m}" for m in sorted(named) if name != "train.preflight.jax_check"]
    assert found == []


KERAS_CALLS = {"keras_module", "keras", "require_keras"}  # train.backends' keras_module(), current().keras(), deps'


def keras_bound_at_import(source):
    """Where ``source`` binds a Keras when imported: every statement Python runs at import (module level, class
    bodies, a class's bases and keywords, decorators, default values; not a function's body, nor what sits under
    ``if TYPE_CHECKING:``) that imports ``keras`` or ``tf_keras`` or calls ``KERAS_CALLS``, under any name it is
    imported as."""
    tree = ast.parse(source)
    calls = set(KERAS_CALLS)
    for node in ast.walk(tree):  # from train.backends import keras_module as km
        if isinstance(node, ast.ImportFrom):
            calls |= {a.asname for a in node.names if a.name in KERAS_CALLS and a.asname}
    found, todo = [], list(tree.body)
    while todo:
        node = todo.pop(0)
        if isinstance(node, ast.If) and ast.unparse(node.test) == "TYPE_CHECKING":
            todo += node.orelse
            continue
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            todo += [*getattr(node, "decorator_list", []), node.args]  # the body runs when called
            continue
        if isinstance(node, ast.Import | ast.ImportFrom):
            names = [node.module or ""] if isinstance(node, ast.ImportFrom) else [a.name for a in node.names]
            found += [f"{node.lineno}: {ast.unparse(node)}" for m in names if m.split(".")[0] in ("keras", "tf_keras")]
        called = ast.unparse(node.func).split(".")[-1] if isinstance(node, ast.Call) else None
        if called in calls:
            found.append(f"{node.lineno}: {ast.unparse(node)}")
        todo += ast.iter_child_nodes(node)
    return found


def test_no_module_binds_keras_at_import_but_the_backends():
    """A module that binds Keras when imported ties the process to one backend for life: only ``train/backends/``
    does (its modules are the backends); a class of tfpipe's that extends a Keras class is a ``KerasMixin`` that
    ``train.backends.complete`` completes where it is used."""
    binding = {
        f"{name}:{where}"
        for name, path in modules().items()
        if not name.startswith("train.backends")
        for where in keras_bound_at_import(path.read_text())
    }
    assert binding == set()


@pytest.mark.parametrize(
    "source",
    [
        "keras = keras_module()",
        "from train import backends\nKERAS = backends.current().keras()",
        "from train.backends import keras_module as km\nk = km()",
        "class Watch(keras_module().callbacks.Callback):\n    pass",
        "class Watch(Base, metaclass=keras_module().Meta):\n    pass",
        "@keras_module().utils.register_keras_serializable(package='tfpipe')\nclass F1:\n    pass",
        "class F1:\n    base = keras_module().metrics.F1Score",
        "class F1:\n    @keras_module().utils.register_keras_serializable()\n    def get(self):\n        pass",
        "def make(keras=keras_module()):\n    pass",
        "try:\n    import tf_keras\nexcept ImportError:\n    pass",
        "from keras import ops",
        "if TYPE_CHECKING:\n    pass\nelse:\n    keras = keras_module()",
    ],
)
def test_binding_keras_at_import_is_found_wherever_it_hides(source):
    assert keras_bound_at_import(source) != []


def test_binding_keras_late_is_not_binding_it_at_import():
    source = (
        "if TYPE_CHECKING:\n    import tf_keras as keras\n"
        "def make():\n    keras = keras_module()\n    return keras.Model\n"
        "class Watch(KerasMixin):\n    def on_epoch_end(self):\n        current().keras().backend.clear_session()\n"
        "build = lambda: keras_module()\n"
    )
    assert keras_bound_at_import(source) == []


def test_the_layout_page_shows_every_module():
    """docs/project/layout.md names every module and package of the tree, and nothing that is not there."""
    page = (ROOT / "docs" / "project" / "layout.md").read_text()
    shown = set(re.findall(r"`((?:tfpipe|train)/[\w/]*?(?:\.py|/))`", page))
    files = {p.relative_to(ROOT).as_posix() for p in source_files() if p.name != "__init__.py"}
    files |= {p.parent.relative_to(ROOT).as_posix() + "/" for p in ROOT.glob("*/*/__init__.py")}
    assert files - shown == set(), "not on the layout page"
    assert shown - files - {"tfpipe/", "train/"} == set(), "on the layout page, not in the tree"


def _calls(paths, test):
    return [
        f"{p.relative_to(ROOT)}:{node.lineno} {ast.unparse(node)}"
        for p in paths
        for node in ast.walk(ast.parse(p.read_text()))
        if isinstance(node, ast.Call) and test(node)
    ]


def test_one_exit_path_signal_handlers_in_one_module_and_exit_codes_from_its_table():
    """Issue #62: ``tfpipe/runtime/lifecycle.py`` installs every signal handler, and every process -- command, rank,
    server -- ends with a code of its table (no 2, 3, 130 or 143 typed by hand elsewhere)."""
    from tfpipe.runtime import lifecycle

    code = source_files() + sorted((ROOT / "examples").glob("*.py"))
    handlers = _calls(code, lambda c: ast.unparse(c.func) == "signal.signal")
    assert handlers and {h.split(":")[0] for h in handlers} == {"tfpipe/runtime/lifecycle.py"}, handlers

    def typed_exit(c):
        exits = ("sys.exit", "SystemExit", "exit_now", "os._exit")
        return ast.unparse(c.func) in exits and any(isinstance(a, ast.Constant) and a.value != 0 for a in c.args)

    assert _calls(code, typed_exit) == []
    assert (lifecycle.BAD_INPUT, lifecycle.LOST_A_RANK, lifecycle.INTERRUPTED, lifecycle.TERMINATED) == (2, 3, 130, 143)
    assert lifecycle.PARENT_GONE == 1 and set(lifecycle.EXITS) == {1, 2, 3, 130, 141, 143}
    assert lifecycle.READER_GONE == 141  # stdout's reader gone (| head): 128 + SIGPIPE, as a shell gives
    assert lifecycle.STOPS == {2: (130, "interrupted"), 15: (143, "terminated (SIGTERM)")}


def test_the_tests_dealt_out_first_are_still_there():
    """Each name in conftest's LONGEST_FIRST is a test (and its parameter an id of it): a renamed test falls silently
    to its place in collection order, where pytest-xdist deals it last and it runs alone at the end of CI's stage."""
    from tests.conftest import LONGEST_FIRST

    defined = {
        node.name: text
        for text in (path.read_text() for path in (ROOT / "tests").glob("test_*.py"))
        for node in ast.walk(ast.parse(text))
        if isinstance(node, ast.FunctionDef) and node.name.startswith("test_")
    }
    for entry in LONGEST_FIRST:
        name, _, param = entry.partition("[")
        assert name in defined, f"LONGEST_FIRST names {name}, which no test is called"
        assert not param or f'"{param[:-1]}"' in defined[name], f"{name} has no parameter {param[:-1]}"
