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


# TANDEM_TEST_CPU=path: append one JSON line per test to that file: its wall seconds and the CPU seconds
# of this process and of the children it waited for (their children included), to compare tests' cost
# on a machine other jobs share.
if os.environ.get("TANDEM_TEST_CPU"):
    import json
    import resource
    import time

    def _cpu_s() -> tuple[float, float]:
        s, c = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
        return s.ru_utime + s.ru_stime, c.ru_utime + c.ru_stime

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_protocol(item, nextitem):
        (self0, kids0), wall0 = _cpu_s(), time.monotonic()
        yield
        (self1, kids1), wall1 = _cpu_s(), time.monotonic()
        with open(os.environ["TANDEM_TEST_CPU"], "a") as f:
            f.write(json.dumps({"test": item.nodeid, "cpu_s": round(self1 - self0 + kids1 - kids0, 1),
                                "self_s": round(self1 - self0, 1), "wall_s": round(wall1 - wall0, 1)}) + "\n")
