"""Files other processes read while they are written: replaced whole, never seen half-written."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any


def write_json_atomic(path: str | Path, data: Any, indent: int | None = None) -> Path:
    """Write `data` as JSON to `path` through a temporary file beside it and an atomic rename."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    try:
        tmp.write_text(json.dumps(data, indent=indent) + "\n")
        os.replace(tmp, path)
    except BaseException:   # a full disk: the old file stays, and no temp file is left
        tmp.unlink(missing_ok=True)
        raise
    return path
