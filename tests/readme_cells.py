"""The README's notebook cells: fenced blocks opened with ```` ```python notebook ````, in order."""

import re

CELL = re.compile(r"^```python notebook\n(.*?)^```$", re.M | re.S)


def notebook_cells(readme_path):
    with open(readme_path, encoding="utf-8") as f:
        return [m.group(1) for m in CELL.finditer(f.read())]


def fenced_blocks(readme_path, tag):
    """The README's ```` ```python TAG ```` blocks, in order."""
    with open(readme_path, encoding="utf-8") as f:
        return re.findall(rf"^```python {tag}\n(.*?)^```$", f.read(), re.M | re.S)
