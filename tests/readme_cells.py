"""The Python examples of README.md and the docs pages, read from the Markdown (never copied into a test).

An example is a fenced block opened with ```` ```python ````; the rest of its info string says what the tests do
with it (GitHub and the docs site show only the language, see docs/hooks.py):

- ```` ```python ```` -- tests/test_examples.py runs it with the page's other blocks, top to bottom in one
  interpreter (like notebook cells), after ``import tensorflow``, in a new temporary working folder.
- ``needs=demo`` -- that folder holds a tiny demo dataset in ``data/demo`` (images, train.csv, test.csv, as
  ``python -m tfpipe.demo data/demo`` writes them); ``needs=shards`` -- and its shards in ``records/demo/train``
  (5 folds) and ``records/demo/test`` (unlabeled), as ``make demo`` writes them. Several: ``needs=demo,shards``.
- ``notebook`` -- a cell of the Kaggle / Colab notebook (docs/guides/notebook.md): tests/test_install.py runs
  these, as a notebook in a fresh venv (tests/test_examples.py does not).
- ``install`` -- installs tfpipe: only tests/test_install.py runs it (in a fresh venv).
- ``jax`` -- Keras 3 on JAX, which needs a process of its own: tests/test_jax_hosts.py runs it, in a process of 8
  XLA host devices and in two processes of 4 (tests/test_examples.py does not).
- ``parameters`` -- the settings a user edits; the tests follow it with ``TEST_PARAMETERS`` (tiny data), as
  papermill does with a cell tagged ``parameters``.
- any other word names the block for a test that reads it (``fenced_blocks(path, "canonical")``).
"""

import dataclasses
import re
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
NOTEBOOK_PAGE = ROOT / "docs" / "guides" / "notebook.md"
NEEDS = ("demo", "shards")  # what tests/test_examples.py can prepare, in the order it prepares it

FENCE = re.compile(r"^```python(?P<info>[ \t][^\n]*)?\n(?P<code>.*?)^```$", re.M | re.S)

# The settings the tests put after the notebook's ``parameters`` cell: a tiny demo dataset, one epoch of small-cnn.
TEST_PARAMETERS = """
DATA = "nbdata"
IMAGES, TRAIN_CSV = f"{DATA}/images", f"{DATA}/train.csv"
TEST_IMAGES, TEST_CSV = f"{DATA}/images", f"{DATA}/test.csv"
RECORDS, RUN = "nbrecords", "nbrun"
IMAGE_SIZE, MODEL, WEIGHTS, EPOCHS, BATCH_SIZE, STEPS_PER_EXECUTION = 32, "small-cnn", None, 1, 2, 2
FOLDS = [0, 1]
from tfpipe.demo import make_demo
make_demo(DATA, train=64, test=8)
"""


@dataclasses.dataclass(frozen=True)
class Block:
    """One ```` ```python ```` block: where it is, its code, the words of its info string."""

    path: Path
    line: int  # the line of its first line of code, 1-based
    code: str
    tags: frozenset[str]
    needs: tuple[str, ...]

    @property
    def name(self) -> str:
        return f"{self.path.relative_to(ROOT)}, block at line {self.line}"


def blocks(path):
    """The page's ```` ```python ```` blocks, in order."""
    text = Path(path).read_text(encoding="utf-8")
    found = []
    for m in FENCE.finditer(text):
        words = (m.group("info") or "").split()
        needs = [w for w in words if w.startswith("needs=")]
        wanted = tuple(n for w in needs for n in w.removeprefix("needs=").split(",") if n)
        unknown = set(wanted) - set(NEEDS)
        line = text.count("\n", 0, m.start("code")) + 1
        if unknown:
            raise ValueError(f"{path}:{line}: needs={','.join(sorted(unknown))} is none of {', '.join(NEEDS)}")
        tags = frozenset(w for w in words if not w.startswith("needs="))
        found.append(Block(Path(path), line, m.group("code"), tags, wanted))
    return found


def notebook_cells(path=NOTEBOOK_PAGE):
    """The notebook's cells: blocks opened with ```` ```python notebook ````, in order."""
    return [b.code for b in blocks(path) if "notebook" in b.tags]


def fenced_blocks(path, tag):
    """The page's ```` ```python TAG ```` blocks, in order."""
    return [b.code for b in blocks(path) if tag in b.tags]


def pages():
    """README.md, then the docs pages in the order of the site's navigation (pages outside it last)."""
    config = yaml.load((ROOT / "mkdocs.yml").read_text(encoding="utf-8"), Loader=yaml.BaseLoader)

    def walk(nav):
        for entry in nav:
            value = next(iter(entry.values())) if isinstance(entry, dict) else entry
            yield from walk(value) if isinstance(value, list) else [ROOT / "docs" / value]

    listed = list(walk(config["nav"]))
    rest = sorted(p for p in (ROOT / "docs").rglob("*.md") if p not in listed)
    return [README, *listed, *rest]
