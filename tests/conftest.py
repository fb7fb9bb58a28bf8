import multiprocessing as mp
import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

os.environ.setdefault("OMP_NUM_THREADS", "1")


def pytest_configure(config):
    # tensordict and torch multiprocessing are only safe with spawn; make it the default everywhere.
    try:
        mp.set_start_method("spawn", force=True)
    except RuntimeError:
        pass


@pytest.fixture
def repo_root() -> Path:
    return ROOT
