"""What the benchmark scripts share: the repo root on sys.path, the child environment, logs, signals."""

from __future__ import annotations

import json
import os
import platform
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:          # for `shared`, `actors`, `learner` in the scripts and their workers
    sys.path.insert(0, str(ROOT))

from shared.run_dir import RunDir, RunDirError  # noqa: E402  (needs ROOT on sys.path)

__all__ = ["ROOT", "BenchmarkError", "RunDir", "child_env", "finished_run", "group_members", "machine_info",
           "raise_on_signal", "run_launcher", "start_launcher", "stop_launcher", "tail"]

LAUNCHER = ROOT / "launch" / "run_local.sh"
STOP_TIMEOUT_S = 15.0                  # SIGTERM -> SIGKILL grace; the launcher itself needs up to ~10 s


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


def finished_run(run_dir: Path, label: str) -> tuple[RunDir, dict]:
    """A finished run's directory (read through :class:`RunDir`) and its ``summary.json``;
    BenchmarkError naming `label` and the file when there is none or it is malformed."""
    try:
        run = RunDir(run_dir)
        summary = run.summary()
    except RunDirError as e:
        raise BenchmarkError(f"{label}: {e}") from None
    if summary is None:
        raise BenchmarkError(f"{label}: no summary.json in {run_dir} (the run did not finish)")
    return run, summary


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


def write_results(path: Path, doc: dict, tag: str) -> None:
    """--json: `doc`, then the machine and the time, written to `path` (its folder made) and announced."""
    doc = {**doc, "machine": machine_info(), "time": time.strftime("%Y-%m-%dT%H:%M:%S")}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(doc, indent=2) + "\n")
    print(f"[{tag}] results written to {path}")


def group_members(pgid: int) -> list[str]:
    """The live (not zombie) processes of process group `pgid`, as "pid command" strings."""
    out = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            stat = (d / "stat").read_text()
            fields = stat[stat.rindex(")") + 2:].split()     # state ppid pgrp ...
            if int(fields[2]) != pgid or fields[0] == "Z":
                continue
            cmd = (d / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
        except (OSError, ValueError, IndexError):
            continue                   # it exited while we looked
        out.append(f"{d.name} {cmd[:120]}")
    return out


def _signal_group(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def stop_process_groups(procs: list[subprocess.Popen], grace_s: float) -> None:
    """SIGTERM the process group each of `procs` leads (started with ``start_new_session``), wait up
    to `grace_s` in all, then SIGKILL every group, reaping its leader (and what outlived it)."""
    for p in procs:
        if p.poll() is None:
            _signal_group(p.pid, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    for p in procs:
        try:
            p.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            pass
    for p in procs:                    # also group members that outlived their leader
        _signal_group(p.pid, signal.SIGKILL)
        try:
            p.wait(timeout=5)
        except subprocess.TimeoutExpired:
            pass


def _wait_group_gone(pgid: int, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while group_members(pgid):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.1)
    return True


def stop_launcher(p: subprocess.Popen) -> list[str]:
    """Make sure nothing of a launcher's process group (started with ``start_new_session``) is left
    running: after a normal exit give stragglers 2 s; otherwise SIGTERM the group, wait up to
    STOP_TIMEOUT_S, then SIGKILL. Returns notes on whatever had to be stopped."""
    notes = []
    pgid = p.pid
    if p.poll() is not None and _wait_group_gone(pgid, 2.0):
        return notes
    left = group_members(pgid)
    notes.append(("launcher still running" if p.poll() is None else "processes outlived the launcher")
                 + f": SIGTERM to {len(left)} process(es): " + "; ".join(left))
    _signal_group(pgid, signal.SIGTERM)
    deadline = time.monotonic() + STOP_TIMEOUT_S
    try:
        p.wait(timeout=STOP_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        pass
    if not _wait_group_gone(pgid, max(0.0, deadline - time.monotonic())) or p.poll() is None:
        notes.append(f"still running after {STOP_TIMEOUT_S:.0f} s: SIGKILL to " + "; ".join(group_members(pgid)))
        _signal_group(pgid, signal.SIGKILL)
        try:
            p.wait(timeout=5)
        except subprocess.TimeoutExpired:
            notes.append("the launcher did not exit after SIGKILL")
        if not _wait_group_gone(pgid, 5.0):
            notes.append("still present after SIGKILL: " + "; ".join(group_members(pgid)))
    return notes


def start_launcher(args: list[str], run_dir: Path) -> subprocess.Popen:
    """Start ``launch/run_local.sh ARGS --out RUN_DIR`` in its own session (its log: RUN_DIR/launcher.log)
    and return at once; the caller must end it with :func:`stop_launcher`."""
    run_dir.mkdir(parents=True, exist_ok=True)
    with open(run_dir / "launcher.log", "wb") as log:
        return subprocess.Popen(["bash", str(LAUNCHER), *args, "--out", str(run_dir)], cwd=ROOT,
                                env=child_env(launcher_python=True), stdin=subprocess.DEVNULL, stdout=log,
                                stderr=subprocess.STDOUT, start_new_session=True)


def run_launcher(args: list[str], run_dir: Path, timeout_s: float, label: str) -> tuple[float, list[str]]:
    """``launch/run_local.sh ARGS --out RUN_DIR`` in its own session; returns (wall seconds, stop notes).
    Raises BenchmarkError (with the log's tail) on a non-zero exit or a timeout; never leaves processes."""
    log_path = run_dir / "launcher.log"
    t0 = time.monotonic()
    p = start_launcher(args, run_dir)
    try:
        try:
            code = p.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            raise BenchmarkError(f"{label}: not finished within {timeout_s:.0f} s; the launcher's log ends:\n"
                                 f"{tail(log_path)}") from None
        wall = time.monotonic() - t0
        if code != 0:
            raise BenchmarkError(f"{label}: run_local.sh exited with code {code}; its log ends:\n{tail(log_path)}")
    finally:
        notes = stop_launcher(p)
    return wall, notes
