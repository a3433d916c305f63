"""The documentation site builds with ``mkdocs build --strict``: every API page resolves, every docstring parses."""

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def test_docs_build_strict(tmp_path):
    if importlib.util.find_spec("mkdocs") is None:
        pytest.fail("mkdocs is not installed: install the docs extra (pip install -e '.[docs]', part of '.[dev]')")
    site = tmp_path / "site"
    env = dict(os.environ, NO_MKDOCS_2_WARNING="1")
    result = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(site)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    if result.returncode != 0:
        pytest.fail(f"mkdocs build --strict failed (exit {result.returncode}):\n{result.stderr}", pytrace=False)
    reading = (site / "api" / "reading" / "index.html").read_text(encoding="utf-8")
    assert "make_dataset" in reading
    assert "read_shuffled" in reading
    training = (site / "api" / "training" / "index.html").read_text(encoding="utf-8")
    assert "steps_per_execution" in training and "register_model" in training  # dataclass fields are listed
    glossary = (site / "glossary" / "index.html").read_text(encoding="utf-8")
    assert "num_folds" in glossary
