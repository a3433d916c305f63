"""Every Python example of README.md and the docs pages runs, read from the Markdown (issue #24).

A page is run as a notebook user runs it: in a fresh interpreter that has imported TensorFlow, its blocks top to
bottom in one namespace, in a new working folder that holds the data its blocks say they need (``needs=demo``,
``needs=shards``; the conventions are in tests/readme_cells.py and docs/project/tests.md). A failure names the
page, the block's line and the error; the traceback carries the Markdown file's own line numbers.
"""

import json
import os
import re
import shutil
import subprocess
import sys

import pytest

from tests.readme_cells import NEEDS, ROOT, blocks, notebook_cells, pages

JAX_RECIPE = "docs/guides/reading.md"  # the page of the one block run in a JAX process (tests/test_jax_hosts.py)

# over ~30 s on 2 cores: they train a model; the writing, torch and reading pages 11-17 s each (in make test-slow since
# issue #64 brought make test back toward its 6 minutes); the notebook guide's reading blocks 6-9 s (its cells run
# in tests/test_install.py)
SLOW = {
    "README.md",
    "docs/guides/notebook.md",
    "docs/guides/writing.md",
    "docs/guides/torch.md",
    "docs/guides/reading.md",
}

# Runs the blocks of one page (a JSON list) like notebook cells; the first failure ends the page with one line.
RUNNER = """
import json, sys, traceback
import tensorflow  # a notebook user has it imported before the first cell

namespace = {"__name__": "__main__"}
for block in json.load(open(sys.argv[1], encoding="utf-8")):
    code = "\\n" * (block["line"] - 1) + block["code"]  # tracebacks show the Markdown file's own line numbers
    try:
        exec(compile(code, block["path"], "exec"), namespace)
    except BaseException as e:
        traceback.print_exc()
        print(f"{block['name']}: {type(e).__name__}: {e}", file=sys.stderr)
        sys.exit(1)
"""


def runnable(block):
    """What this test runs of a block: the code, or None for what only tests/test_install.py runs: the notebook's
    cells (docs/guides/notebook.md), which it runs as a notebook in a fresh venv, its install cell first (they ran
    here too, on tf-keras: 144 s of CI's time for the calls examples/kaggle_tpu.ipynb makes on tf-keras)."""
    if "notebook" in block.tags or "jax" in block.tags:
        return None  # a jax block: Keras 3 on JAX needs a process of its own (tests/test_jax_hosts.py runs it)
    return block.code


def example_pages():
    found = []
    for page in pages():
        name = str(page.relative_to(ROOT))
        if any(runnable(b) is not None for b in blocks(page)):
            marks = [pytest.mark.slow] if name in SLOW else []
            found.append(pytest.param(page, id=name, marks=marks))
    return found


def test_the_pages_hold_examples_and_every_one_is_run_here_or_by_test_install():
    found = {str(p.relative_to(ROOT)): blocks(p) for p in pages()}
    assert found["README.md"] and found["docs/guides/notebook.md"]
    skipped = [b for bs in found.values() for b in bs if runnable(b) is None]
    assert [b.code for b in skipped if "jax" not in b.tags] == notebook_cells(), [b.name for b in skipped]
    assert [str(b.path.relative_to(ROOT)) for b in skipped if "jax" in b.tags] == [JAX_RECIPE]  # test_jax_hosts
    for page in pages():  # blocks are read at the start of a line: one indented in a list would be missed
        assert not re.search(r"^[ \t]+```python", page.read_text(encoding="utf-8"), re.M), page


@pytest.mark.parametrize("page", example_pages())
def test_the_examples_of_a_page_run(page, example_data, tmp_path):
    page_blocks = [b for b in blocks(page) if runnable(b) is not None]
    needs = {n for b in page_blocks for n in b.needs}
    for need in NEEDS[: max((NEEDS.index(n) + 1 for n in needs), default=0)]:  # shards come with their images
        shutil.copytree(example_data[need], tmp_path, dirs_exist_ok=True)
    cells = [
        {"path": str(page.relative_to(ROOT)), "line": b.line, "name": b.name, "code": runnable(b)} for b in page_blocks
    ]
    script = tmp_path / ".examples.json"
    script.write_text(json.dumps(cells), encoding="utf-8")
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2")
    done = subprocess.run(
        [sys.executable, "-c", RUNNER, str(script)], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=900
    )
    if done.returncode != 0:
        last = done.stderr.strip().splitlines()[-1] if done.stderr.strip() else f"exit {done.returncode}"
        pytest.fail(f"{last}\n\n{done.stderr[-6000:]}", pytrace=False)
