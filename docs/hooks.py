"""mkdocs hook: a code block's info string may carry words for the tests after its language
(```` ```python needs=shards ````, see tests/readme_cells.py). Python-Markdown's fences take no such words, so
the site, like GitHub, keeps the language only."""

import re
from typing import Any

FENCE_INFO = re.compile(r"^(```[\w+-]+)[ \t]+[^`\n]*$", re.M)


def on_page_markdown(markdown: str, **kwargs: Any) -> str:
    return FENCE_INFO.sub(r"\1", markdown)
