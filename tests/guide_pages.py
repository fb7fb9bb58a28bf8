"""Reading a guide page's bash blocks, for the tests that run a guide's commands as written."""

from __future__ import annotations

import re
import shlex
from pathlib import Path


def page_block(page: Path, marker: str) -> list[str]:
    """The lines of the bash block after `page`'s ``<!-- <marker>`` comment, comments and blanks left out."""
    found = re.search(rf"<!-- {marker}.*?-->\s*```bash\n(.*?)```", page.read_text(), re.S)
    assert found, f"{page}: no {marker} block"
    return [line for line in found.group(1).splitlines() if line.strip() and not line.startswith("#")]


def page_quick_flags(page: Path) -> dict[str, list[str]]:
    """The ``NAME="--flag ..."`` assignments of `page`'s quick block, each as its list of arguments."""
    out = {}
    for line in page_block(page, "quick"):
        name, _, value = line.partition("=")
        out[name] = shlex.split(shlex.split(value)[0])
    return out
