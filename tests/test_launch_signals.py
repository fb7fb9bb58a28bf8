"""The launcher under a signal sent to its whole process group, and the README's two commands.

Slurm and Kubernetes send SIGTERM to every process of the job's group at once: the launcher, the
learner, the actors and the tees that copy their output to OUT/logs. The learner must still write
its final checkpoint and summary.json, and nothing of the run may be left running afterwards.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
LAUNCH = ROOT / "launch" / "run_local.sh"

PUBLISH_TIMEOUT_S = 90    # start-up and three published versions, on a CPU shared with other jobs
EXIT_TIMEOUT_S = 30       # the launcher gives its children 10 s, then kills them
GONE_TIMEOUT_S = 10       # the group's last processes (zombies of grandchildren) to disappear


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["TANDEM_PYTHON"] = sys.executable
    env.setdefault("OMP_NUM_THREADS", "1")
    return env


def _publish_count(run_dir: Path) -> int:
    try:
        return (run_dir / "versions.jsonl").read_text().count('"event":"publish"')
    except OSError:
        return 0


def _alive(p: psutil.Process) -> bool:
    try:
        return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:      # some member we may not signal: still alive
        return True


def _group_members(pgid: int) -> list[str]:
    out = []
    for p in psutil.process_iter(["pid", "cmdline", "status"]):
        try:
            if os.getpgid(p.pid) == pgid:
                out.append(f"{p.pid} [{p.info['status']}] {' '.join(p.info['cmdline'] or [])[:160]}")
        except (OSError, psutil.Error):
            pass
    return out


def _kill_group(pgid: int) -> None:
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(pgid, sig)
        except (ProcessLookupError, PermissionError):
            return
        deadline = time.monotonic() + 10
        while _group_alive(pgid) and time.monotonic() < deadline:
            time.sleep(0.2)


def _wait_group_gone(proc: subprocess.Popen, timeout_s: float) -> bool:
    """Wait until no process of `proc`'s group is left (`proc` is reaped here: a zombie counts)."""
    pgid, deadline = proc.pid, time.monotonic() + timeout_s
    while proc.poll() is None or _group_alive(pgid):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.1)
    return True


def _end(proc: subprocess.Popen, log) -> None:
    """Whatever a test saw: nothing of the launcher's group left, and its output file closed."""
    _kill_group(proc.pid)
    if proc.poll() is None:
        proc.kill()
        proc.wait(timeout=10)
    log.close()


def _start(args: list[str], log_path: Path) -> tuple[subprocess.Popen, object]:
    log = open(log_path, "wb")
    proc = subprocess.Popen(args, cwd=ROOT, env=_env(), stdin=subprocess.DEVNULL, stdout=log,
                            stderr=subprocess.STDOUT, start_new_session=True)   # leads its own group
    return proc, log


def _wait_publishes(proc: subprocess.Popen, run_dir: Path, log_path: Path, n: int = 3) -> None:
    deadline = time.monotonic() + PUBLISH_TIMEOUT_S
    while _publish_count(run_dir) < n:
        assert proc.poll() is None, f"the run ended early (exit {proc.returncode}):\n{log_path.read_text()[-4000:]}"
        assert time.monotonic() < deadline, f"no {n} published versions in {PUBLISH_TIMEOUT_S} s:\n" \
                                            f"{log_path.read_text()[-4000:]}"
        time.sleep(0.2)


def _assert_final_state(run_dir: Path) -> dict:
    """summary.json names SIGTERM; the newest checkpoint loads with weights_only=True and is the final one."""
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["stopped_by"] == "SIGTERM", summary
    assert summary["exit_code"] == 0, summary
    ckpts = sorted(p for p in (run_dir / "checkpoints").iterdir() if re.fullmatch(r"ckpt_\d+\.pt", p.name))
    assert ckpts, f"no checkpoint in {run_dir / 'checkpoints'}"
    ckpt = torch.load(ckpts[-1], map_location="cpu", weights_only=True)
    assert ckpt["version"] == summary["version"] >= 2, (ckpt["version"], summary)   # 3 publishes: v0, v1, v2
    # The tee survived the signal: what the learner printed after it is in its log.
    assert "[learner] SIGTERM: stopping" in (run_dir / "logs" / "learner.log").read_text()
    return summary


@pytest.mark.slow
def test_group_sigterm_writes_final_checkpoint_and_summary(tmp_path):
    run_dir = tmp_path / "run"
    log_path = tmp_path / "launch.out"
    proc, log = _start(["bash", str(LAUNCH), "--steps", "1000000", "--out", str(run_dir)], log_path)
    pgid = proc.pid
    try:
        _wait_publishes(proc, run_dir, log_path)
        tees = [p for p in psutil.Process(proc.pid).children() if p.name() == "tee"]
        assert len(tees) == 3, [p.cmdline() for p in tees]      # learner and two actors
        os.killpg(pgid, signal.SIGTERM)
        try:
            rc = proc.wait(timeout=EXIT_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            pytest.fail(f"launcher still running {EXIT_TIMEOUT_S} s after a group SIGTERM:\n{log_path.read_text()}")
        # The launcher waits for its tees: none outlives it.
        assert not [p for p in tees if _alive(p)], "a tee outlived the launcher"
        assert _wait_group_gone(proc, GONE_TIMEOUT_S), f"left running: {_group_members(pgid)}"
    finally:
        _end(proc, log)
    out = log_path.read_text()
    assert rc == 128 + signal.SIGTERM, f"exit code {rc}:\n{out}"
    for bad in ("Traceback", "BrokenPipeError", "Broken pipe", "Terminated", "killing"):
        assert bad not in out, f"{bad!r} in the launcher's output:\n{out}"
    _assert_final_state(run_dir)


@pytest.mark.slow
def test_group_sigterm_with_the_launchers_reader_in_the_group(tmp_path):
    """`run_local.sh | cat` in one group: the reader of the launcher's output dies at once, so
    the launcher and the tees write to a closed pipe; the run still ends cleanly. (One actor and no
    evaluator: the test above stops the whole default run with a group SIGTERM.)"""
    run_dir = tmp_path / "run"
    log_path = tmp_path / "launch.out"
    proc, log = _start(["bash", "-c", 'bash "$0" "$@" | cat', str(LAUNCH), "--no-eval", "--actors", "1",
                        "--steps", "1000000", "--out", str(run_dir)], log_path)
    pgid = proc.pid
    try:
        _wait_publishes(proc, run_dir, log_path)
        os.killpg(pgid, signal.SIGTERM)
        assert _wait_group_gone(proc, EXIT_TIMEOUT_S + GONE_TIMEOUT_S), f"left running: {_group_members(pgid)}"
    finally:
        _end(proc, log)
    _assert_final_state(run_dir)


def test_a_process_that_does_not_stop_in_time_leaves_its_stacks_in_its_log(tmp_path):
    """An actor stuck in a 60 s env step ignores the launcher's SIGTERM past the 10 s it is given:
    before killing it, the launcher asks it for its threads' stacks (SIGUSR1), and its log shows
    where it was."""
    run_dir = tmp_path / "run"
    log_path = tmp_path / "launch.out"
    proc, log = _start(["bash", str(LAUNCH), "--no-eval", "--actors", "1", "--steps", "1000000", "--out", str(run_dir),
                        "--set", "actors.slowdown_s=60"], log_path)
    pgid = proc.pid
    actor_log = run_dir / "logs" / "actor_0.log"
    try:
        deadline = time.monotonic() + PUBLISH_TIMEOUT_S
        while "running on cpu" not in (actor_log.read_text() if actor_log.exists() else ""):
            assert proc.poll() is None and time.monotonic() < deadline, log_path.read_text()
            time.sleep(0.2)
        time.sleep(1)                                       # into its first (60 s) step
        os.kill(proc.pid, signal.SIGTERM)                   # the launcher alone: it stops the others
        rc = proc.wait(timeout=EXIT_TIMEOUT_S)
        assert _wait_group_gone(proc, GONE_TIMEOUT_S), f"left running: {_group_members(pgid)}"
    finally:
        _end(proc, log)
    out = log_path.read_text()
    assert rc == 128 + signal.SIGTERM, out
    assert re.search(r"\[launch\] killing \d+ \(did not stop in time; its threads' stacks are in its log\)", out), out
    stacks = actor_log.read_text()
    assert "Current thread" in stacks and re.search(r'File ".*emulated_device.py", line \d+ in step', stacks), stacks


def _readme_commands() -> list[str]:
    text = (ROOT / "README.md").read_text()
    m = re.search(r"```bash\n(.*?)```", text, re.S)
    assert m, "README.md has no ```bash block"
    return [line.split("#", 1)[0].strip() for line in m.group(1).splitlines() if line.split("#", 1)[0].strip()]


def test_ci_runs_the_readmes_second_command():
    cmds = _readme_commands()
    assert cmds[:2] == ["launch/run_local.sh", "launch/test.sh"], cmds
    ci = [line.strip() for line in (ROOT / ".ci" / "run").read_text().splitlines()
          if line.strip() and not line.lstrip().startswith("#")]
    assert any(line in (cmds[1], f"exec {cmds[1]}") for line in ci), ci
    for cmd in cmds[:2]:
        assert os.access(ROOT / cmd, os.X_OK), f"{cmd} is not executable"


SIGNAL_INSIDE_SET = """
import os, signal, sys, threading
sys.path.insert(0, {root!r})
from shared.teardown import stop_on_signals

class Reentrant(threading.Event):
    def set(self):                   # a signal lands while the event's lock is held
        with self._cond:
            if not hasattr(self, "_once"):
                self._once = True
                os.kill(os.getpid(), signal.{sig})
                for _ in range(10000):   # the handler runs here, at a bytecode boundary
                    pass
            self._flag = True
            self._cond.notify_all()

stop, noted = Reentrant(), []
stop_on_signals(stop, noted)
{start}
for _ in range(10000):
    pass
print(stop.wait(10), noted)
"""
@pytest.mark.parametrize("case", ["a second signal inside the first handler's set",
                                  "a signal while the main thread is inside set"])
def test_a_signal_while_the_stop_event_is_being_set_does_not_deadlock(case):
    """Event.set holds a lock that is not re-entrant, and a signal handler runs in the main thread:
    a group SIGTERM plus the launcher's forward lands the second handler inside the first one's set,
    and a stop message handled by the main thread can be inside set when a signal comes. The handler
    must not take that lock itself (a plain ``stop.set()`` handler hangs this process for ever)."""
    import subprocess
    import sys
    first = case.startswith("a second")
    code = SIGNAL_INSIDE_SET.format(root=str(ROOT), sig="SIGTERM",
                                    start="os.kill(os.getpid(), signal.SIGINT)" if first else "stop.set()")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    expected = "True ['SIGINT', 'SIGTERM']" if first else "True ['SIGTERM']"
    assert r.returncode == 0 and r.stdout.strip() == expected, (r.stdout, r.stderr)
