"""What the benchmark scripts share: the repo root on sys.path, the child environment, logs, signals."""

from __future__ import annotations

import os
import platform
import signal
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:          # for `shared`, `actors`, `learner` in the scripts and their workers
    sys.path.insert(0, str(ROOT))

from learner.logs import read_jsonl  # noqa: E402  (needs ROOT on sys.path)

__all__ = ["ROOT", "BenchmarkError", "child_env", "tail", "raise_on_signal", "machine_info", "read_jsonl"]


class BenchmarkError(RuntimeError):
    """A phase or variant could not be measured; the message says which and why."""


def child_env(launcher_python: bool = False) -> dict:
    """Environment for child processes: the repo importable, one OpenMP thread, unbuffered output;
    with `launcher_python`, run_local.sh uses this interpreter instead of probing for one."""
    env = dict(os.environ)
    if launcher_python:
        env["TANDEM_PYTHON"] = sys.executable
    env["PYTHONPATH"] = str(ROOT) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env["OMP_NUM_THREADS"] = "1"
    env["PYTHONUNBUFFERED"] = "1"
    return env


def tail(path: Path, n: int = 15) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-n:])
    except OSError:
        return "(no log)"


def raise_on_signal(signum, frame):
    # Unwind through the finally: blocks, which stop every child; a second Ctrl-C must not cut
    # that clean-up short (it is bounded: the scripts' stop timeouts plus a few seconds).
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    raise KeyboardInterrupt(signal.Signals(signum).name)


def machine_info() -> dict:
    return {"cpus": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version(),
            "load_average_at_end": os.getloadavg()[0]}
