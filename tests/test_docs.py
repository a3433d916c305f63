"""The documentation site builds with ``mkdocs build --strict``: every API page resolves, every docstring parses;
every relative link of README.md and the pages reaches a file and a heading."""

import importlib.util
import os
import re
import subprocess
import sys
import unicodedata
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


# Links: README.md is read on GitHub (and PyPI), the docs pages on GitHub and on the site; a relative link must
# reach a file that exists (inside docs/ for a page of the site) and an anchor must name a heading of it, as both
# GitHub and the site's table of contents spell it.
LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
CODE = re.compile(r"^```.*?^```$|`+[^`\n]*`+", re.M | re.S)


def heading_anchors(path):
    """Each heading's anchor as mkdocs' toc makes it and as GitHub makes it; an anchor must be both."""
    text = CODE.sub(lambda m: m.group(0).strip("`") if "\n" not in m.group(0) else "", path.read_text("utf-8"))
    toc, github = set(), set()
    for title in re.findall(r"^#{1,6}\s+(.*?)\s*#*\s*$", text, re.M):
        title = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", title).replace("`", "")
        ascii_title = unicodedata.normalize("NFKD", title).encode("ascii", "ignore").decode()
        toc.add(re.sub(r"[-\s]+", "-", re.sub(r"[^\w\s-]", "", ascii_title).strip().lower()))
        github.add(re.sub(r"[^\w\- ]", "", title.lower()).replace(" ", "-"))
    return toc & github


def markdown_files():
    return [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


@pytest.mark.parametrize("page", markdown_files(), ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_reach_a_file_and_a_heading(page):
    text = CODE.sub("", page.read_text("utf-8"))
    broken = []
    for target in LINK.findall(text):
        if re.match(r"[a-z][a-z0-9+.-]*:", target):  # https:, mailto: -- not ours to check offline
            continue
        file, _, anchor = target.partition("#")
        path = (page.parent / file).resolve() if file else page
        inside = ROOT / "docs" if page.is_relative_to(ROOT / "docs") else ROOT
        if not path.is_file() or not path.is_relative_to(inside):
            broken.append(f"{target}: no such file{' inside docs/' if path.is_file() else ''}")
        elif anchor and path.suffix == ".md" and anchor not in heading_anchors(path):
            broken.append(f"{target}: no heading '#{anchor}' in {path.relative_to(ROOT)}")
    assert broken == [], f"{page.relative_to(ROOT)}: {broken}"
