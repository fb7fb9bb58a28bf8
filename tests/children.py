"""What the processes a test starts need to import this checkout."""

from __future__ import annotations

import os
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def child_pythonpath() -> str:
    """This checkout first, then the caller's own ``PYTHONPATH`` (packages installed elsewhere, e.g.
    with ``pip install --target``, stay importable in the children)."""
    return os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
