"""Integration tests: real processes through ``launch/run_local.sh`` and ``python -m learner``
(DESIGN.md "Launch and outputs", "Weights and versions", "Modes"; STYLE.md habit 15, the slow tier).

Every test that starts processes starts them in a new session (their own process group), stops the
whole group in a ``finally`` within a bounded time, and checks with psutil that no learner, actor,
evaluator or ``tee`` process of the run is left behind. Step budgets are tiny (CartPole, a few
thousand env steps) so that the file runs in a few minutes on two cores.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable

import psutil
import pytest
import torch

from tests.children import child_pythonpath

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "configs" / "cartpole_ppo.json"
LAUNCH = ROOT / "launch" / "run_local.sh"

RUN_TIMEOUT_S = 180      # one short run (CPU may be shared with another job: generous)
STOP_TIMEOUT_S = 20      # our own cleanup: TERM the group, then KILL
GONE_TIMEOUT_S = 10      # how long processes may take to disappear after their launcher exited


# ============================================================================ process helpers

def _env(launcher_python: bool = False) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = child_pythonpath()
    env.setdefault("OMP_NUM_THREADS", "1")
    env["PYTHONUNBUFFERED"] = "1"
    if launcher_python:
        # Skips the launcher's ~4 s dependency probe; test_run_local_two_actors_versions keeps the default path.
        env["TANDEM_PYTHON"] = sys.executable
    return env


def _alive(p: psutil.Process) -> bool:
    try:
        return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


class Started:
    """A process started in its own session, with every descendant it ever had remembered.

    `wait` polls the process and records its descendants (so that grandchildren such as the
    evaluator, which outlive nobody's notice otherwise, can be checked afterwards); `stop`
    TERMs then KILLs the whole process group, always bounded in time.
    """

    def __init__(self, args: list[str], log_path: Path, env: dict[str, str] | None = None):
        self.log_path = log_path
        self._log = open(log_path, "wb")
        self.proc = subprocess.Popen(args, cwd=ROOT, env=env or _env(), stdout=self._log, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL, start_new_session=True)
        self.pgid = self.proc.pid
        self.seen: dict[int, psutil.Process] = {}

    def snapshot(self) -> list[psutil.Process]:
        try:
            kids = psutil.Process(self.proc.pid).children(recursive=True)
        except psutil.Error:
            return []
        for k in kids:
            self.seen.setdefault(k.pid, k)
        return kids

    def wait(self, timeout_s: float, until: Callable[[], bool] | None = None,
             every: Callable[[], None] | None = None) -> int | None:
        """Wait for exit (returns the code) or for `until()` (returns None); fail on timeout."""
        deadline = time.monotonic() + timeout_s
        while True:
            self.snapshot()
            if every is not None:
                every()
            if until is not None and until():
                return None
            rc = self.proc.poll()
            if rc is not None:
                return rc
            if time.monotonic() > deadline:
                pytest.fail(f"{self.proc.args} still running after {timeout_s:.0f} s; output:\n{self.output()}")
            time.sleep(0.1)

    def group(self) -> list[psutil.Process]:
        out = []
        for p in psutil.process_iter():
            try:
                if os.getpgid(p.pid) == self.pgid and _alive(p):
                    out.append(p)
            except (OSError, psutil.Error):
                pass
        return out

    def leftovers(self, run_dir: Path | None = None) -> list[psutil.Process]:
        """Live processes of this run: its group, its remembered descendants, and any
        ``-m learner`` / ``-m actors`` process that names `run_dir`."""
        found = {p.pid: p for p in self.group()}
        found.update({pid: p for pid, p in self.seen.items() if _alive(p)})
        if run_dir is not None:
            found.update({p.pid: p for p in tandem_processes(run_dir)})
        if self.proc.poll() is None:   # the launcher itself, while it runs
            try:
                found[self.proc.pid] = psutil.Process(self.proc.pid)
            except psutil.Error:
                pass
        return list(found.values())

    def assert_all_gone(self, run_dir: Path | None = None, timeout_s: float = GONE_TIMEOUT_S) -> None:
        deadline = time.monotonic() + timeout_s
        while True:
            left = self.leftovers(run_dir)
            if not left or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        assert not left, "processes left behind: " + "; ".join(_describe(p) for p in left)

    def stop(self) -> None:
        """Stop everything this run started, whatever state it is in (bounded: ~2 x STOP_TIMEOUT_S).

        The launcher gets SIGTERM first (it stops its children cleanly); whatever is left then
        gets SIGTERM, then SIGKILL, as a process group and one by one."""
        try:
            self.snapshot()
            if self.proc.poll() is None:
                try:
                    self.proc.send_signal(signal.SIGTERM)
                    self.proc.wait(timeout=STOP_TIMEOUT_S)
                except subprocess.TimeoutExpired:
                    pass
            for sig in (signal.SIGTERM, signal.SIGKILL):
                left = self.leftovers()
                if not left:
                    break
                _killpg(self.pgid, sig)
                for p in left:
                    try:
                        p.send_signal(sig)
                    except psutil.Error:
                        pass
                psutil.wait_procs(left, timeout=STOP_TIMEOUT_S / 2 if sig == signal.SIGTERM else 5)
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass
        finally:
            self._log.close()

    def output(self) -> str:
        self._log.flush()
        try:
            return self.log_path.read_text(errors="replace")[-6000:]
        except OSError:
            return ""


def _killpg(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _describe(p: psutil.Process) -> str:
    try:
        return f"pid {p.pid} ({' '.join(p.cmdline())[:200]})"
    except psutil.Error:
        return f"pid {p.pid}"


def tandem_processes(run_dir: Path) -> list[psutil.Process]:
    """Live python processes started as ``-m learner`` or ``-m actors`` with `run_dir` in their args."""
    out = []
    for p in psutil.process_iter(["pid", "cmdline"]):
        cmd = p.info.get("cmdline") or []
        line = " ".join(cmd)
        if ("-m learner" in line or "-m actors" in line) and any(str(run_dir) in a for a in cmd) and _alive(p):
            out.append(p)
    return out


def launch(tmp_path: Path, out: Path, *args: str, name: str = "launch", probe_python: bool = False) -> Started:
    """``bash launch/run_local.sh --out OUT ARGS...``; `probe_python` lets the launcher find the
    interpreter itself (slower) instead of using the one running the tests."""
    return Started(["bash", str(LAUNCH), "--out", str(out), *args], tmp_path / f"{name}.out",
                   env=_env(launcher_python=not probe_python))


# ============================================================================ run-directory readers

def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def publishes(events: list[dict], final: bool | None = None) -> list[dict]:
    return [e for e in events if e["event"] == "publish" and (final is None or bool(e.get("final")) == final)]


def consumes(events: list[dict]) -> list[dict]:
    return [e for e in events if e["event"] == "consume"]


def update_lines(metrics: list[dict]) -> list[dict]:
    """metrics.jsonl lines written by updates (evaluation lines carry ``eval/…`` keys only)."""
    return [m for m in metrics if "updates" in m]


def newest_checkpoint(run_dir: Path) -> Path:
    found = sorted((run_dir / "checkpoints").glob("ckpt_*.pt"))
    assert found, f"no ckpt_*.pt in {run_dir / 'checkpoints'}"
    return found[-1]


def load_ckpt(path: Path) -> dict:
    return torch.load(path, map_location="cpu", weights_only=True)


def assert_versions_publish_sequence(events: list[dict], start: int = 0) -> list[int]:
    """Non-final publish events go start, start+1, ... without gaps; a final re-publish (the
    weights sent to the evaluator once more at the end) repeats the last version only."""
    versions = [e["version"] for e in publishes(events, final=False)]
    assert versions, "no publish events"
    assert versions == list(range(start, start + len(versions))), f"publish versions not +1 from {start}: {versions}"
    for e in publishes(events, final=True):
        assert e["version"] == versions[-1], f"final publish {e} is not the last version {versions[-1]}"
    steps = [e["env_steps"] for e in publishes(events, final=False)]
    assert steps == sorted(steps), f"publish env_steps go backwards: {steps}"
    return versions


def assert_consume_lags(events: list[dict], max_lag: int) -> list[dict]:
    cons = consumes(events)
    assert cons, "no consume events"
    for e in cons:
        assert e["lag"] == e["learner_version"] - e["policy_version"], e
        assert 0 <= e["lag"] <= max_lag, f"lag outside [0, {max_lag}]: {e}"
    return cons


def assert_update_metrics(metrics: list[dict], updates: int) -> list[dict]:
    lines = update_lines(metrics)
    assert len(lines) == updates, f"{len(lines)} update lines in metrics.jsonl for {updates} updates"
    for m in lines:
        for k in ("loss/policy", "loss/value", "loss/entropy", "loss/approx_kl", "loss/clip_frac", "lag/mean", "perf/sps", "perf/learner_wait_s", "env_steps", "version"):
            assert k in m, f"metrics line lacks {k!r}: {sorted(m)}"
    assert [m["updates"] for m in lines] == sorted(m["updates"] for m in lines)
    return lines


def finish(run: Started, run_dir: Path, every: Callable[[], None] | None = None) -> str:
    """Wait for a launched run to exit 0 (calling `every` while it runs) and leave nothing behind,
    stopping it whatever happens; returns its output."""
    try:
        rc = run.wait(RUN_TIMEOUT_S, every=every)
        out = run.output()
        assert rc == 0, out
        run.assert_all_gone(run_dir)
    finally:
        run.stop()
    return out


def run_to_the_end(run: Started, run_dir: Path) -> list[dict]:
    """:func:`finish`; returns ``endpoints.json`` as seen while the run went (it lives only while the
    learner runs), or [] if it never was."""
    seen: list[dict] = []

    def grab() -> None:
        if not seen:
            try:
                seen.append(json.loads((run_dir / "endpoints.json").read_text()))
            except (OSError, ValueError):
                pass
    finish(run, run_dir, every=grab)
    return seen


# ============================================================================ tests

@pytest.mark.slow
def test_run_local_two_actors_versions(tmp_path):
    run_dir = tmp_path / "run"
    run = launch(tmp_path, run_dir, "--actors", "2", "--steps", "6000", "--set", "trainer.eval_freq=2000",
                 "--set", "trainer.keep_best=true", "--set", 'trainer.eval_seeds="same"', probe_python=True)
    seen_endpoints = run_to_the_end(run, run_dir)

    # endpoints.json: written at start-up, removed at a clean exit; the learner logs the same addresses.
    assert seen_endpoints, "endpoints.json was never seen while the run was going"
    ep = seen_endpoints[0]
    assert re.fullmatch(r"tcp://127\.0\.0\.1:\d+", ep["rollouts"]) and re.fullmatch(r"tcp://127\.0\.0\.1:\d+",
                                                                                   ep["weights"]), ep
    learner_log = (run_dir / "logs" / "learner.log").read_text()
    assert f"rollouts {ep['rollouts']}" in learner_log and f"weights {ep['weights']}" in learner_log, learner_log
    assert not (run_dir / "endpoints.json").exists(), "endpoints.json left after a clean exit"
    for i in (0, 1):
        assert (run_dir / "logs" / f"actor_{i}.log").is_file()

    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["exit_code"] == 0 and summary["stopped_by"] is None, summary
    assert summary["env_steps"] >= 6000 and summary["updates"] >= 1, summary

    events = read_jsonl(run_dir / "versions.jsonl")
    versions = assert_versions_publish_sequence(events, start=0)
    assert versions[-1] == summary["version"] == summary["updates"], (versions, summary)
    # every sample trained was one of a consumed rollout's, each counted once
    assert summary["env_steps_trained"] == sum(e["env_steps"] for e in events if e["event"] == "consume"), summary
    cons = assert_consume_lags(events, max_lag=0)       # standard mode is strictly on-policy: lag 0
    assert {e["actor"] for e in cons} == {0, 1}, "both actors' rollouts must be consumed"
    assert all(e["env_steps"] == 8 * 32 for e in cons)  # num_envs x buffer_size

    metrics = read_jsonl(run_dir / "metrics.jsonl")
    lines = assert_update_metrics(metrics, summary["updates"])
    assert [m["version"] for m in lines] == list(range(1, summary["updates"] + 1))
    assert all(m["lag/mean"] == 0.0 for m in lines)
    evals = [m for m in metrics if "eval/return_mean" in m]
    assert evals, "no eval/return_mean line in metrics.jsonl"
    assert all(m["eval/return_mean"] > 0 for m in evals)

    ckpt_path = newest_checkpoint(run_dir)
    ckpt = load_ckpt(ckpt_path)
    for k in ("policy", "optimizer", "version", "env_steps"):
        assert k in ckpt, f"{ckpt_path.name} lacks {k!r}"
    assert ckpt["version"] == summary["version"] and ckpt_path.name == f"ckpt_{summary['version']:08d}.pt"
    assert 6000 <= ckpt["env_steps"] <= summary["env_steps"]

    assert list(run_dir.glob("events.out.tfevents.*")), "no TensorBoard events file"

    # trainer.keep_best: best.pt holds the evaluated version with the highest return (the earliest of a tie)
    best = load_ckpt(run_dir / "checkpoints" / "best.pt")
    top = max(m["eval/return_mean"] for m in evals)
    first_top = next(m for m in evals if m["eval/return_mean"] == top)
    assert best["eval"]["metric"] == "return_mean" and best["eval"]["score"] == pytest.approx(top)
    assert best["version"] == first_top["version"] == summary["best/version"], (best["version"], evals, summary)
    assert set(best["policy"]) == set(ckpt["policy"])
    assert evals[-1]["eval/best_score"] == pytest.approx(top)
    # launch/evaluate.py on the run's best checkpoint (in this process: the script as a command is run
    # by test_finetune_guide.py, test_own_checkpoint_recipe.py and test_checkpoint_integrity.py)
    from launch.evaluate import main as evaluate_main
    out = tmp_path / "best_eval.json"
    assert evaluate_main([str(run_dir), "--checkpoint", "best", "--episodes", "4", "--json", str(out)]) == 0
    assert json.loads(out.read_text())["version"] == best["version"]


# The launcher's run with --no-eval in vla mode, lag_policy drop, actor 1 slowed down:
# test_mps_runs_the_processes_under_a_daemon_of_the_runs_own_and_stops_it launches it (under a stand-in
# MPS daemon), check_vla_mode_run and check_slow_actor_run check it: one launch for the three.
SLOWDOWN_S = 0.02
VLA_MODE_RUN = ("--no-eval", "--actors", "2", "--steps", "30000", "--set", "trainer.buffer_type=vla",
                "--set", "trainer.lag_policy=drop", "--set", "trainer.eval_freq=0",
                "--set", f"actors.slowdown_s={SLOWDOWN_S}", "--set", "actors.slow_actor_ids=[1]")


def check_vla_mode_run(run_dir: Path) -> None:
    """What a vla-mode run (:data:`VLA_MODE_RUN`) must have written."""
    cfg = json.loads((run_dir / "config.json").read_text())
    assert cfg["trainer"]["buffer_type"] == "async"           # "vla", the older spelling, is read as async
    assert cfg["algorithm"]["cfg"]["correction"] == "trust"   # the default resolved for async mode
    max_lag = cfg["trainer"]["max_policy_lag"]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["exit_code"] == 0, summary
    events = read_jsonl(run_dir / "versions.jsonl")
    assert_versions_publish_sequence(events, start=0)
    assert_consume_lags(events, max_lag=max_lag)
    for e in events:
        if e["event"] == "drop":
            assert e["reason"] in ("lag", "stale", "overwritten", "shutdown"), e
    assert_update_metrics(read_jsonl(run_dir / "metrics.jsonl"), summary["updates"])
    assert "mode async" in (run_dir / "logs" / "learner.log").read_text()
    # --no-eval: no evaluator process, so no evaluation at all (not even the final one)
    assert not any(k.startswith("last_eval/") for k in summary), summary
    assert not any("eval/return_mean" in m for m in read_jsonl(run_dir / "metrics.jsonl"))


def check_slow_actor_run(run_dir: Path) -> None:
    """Actor 1 sleeps 20 ms per env step (>= 0.64 s per 32-step rollout); in vla mode with
    lag_policy drop (actors run free) the learner takes any rollouts, so it keeps training on actor
    0's data and never waits for actor 1. (Under the default, pace, actor 0 is held to its credit
    instead: tests/test_lag_bias.py.)

    ``total_steps`` counts every env step received (actor 0 alone sends thousands per second), so
    the budget is sized for a few seconds of training, enough for actor 1 to send some rollouts.
    """
    slowdown_s = SLOWDOWN_S
    cfg = json.loads((run_dir / "config.json").read_text())
    slow_rollout_s = cfg["trainer"]["buffer_size"] * slowdown_s      # a lower bound on actor 1's collect time
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["exit_code"] == 0, summary
    events = read_jsonl(run_dir / "versions.jsonl")
    cons = assert_consume_lags(events, max_lag=cfg["trainer"]["max_policy_lag"])
    by_actor = {a: sum(1 for e in cons if e["actor"] == a) for a in (0, 1)}
    sent_by_1 = [e for e in events if e["event"] in ("consume", "drop") and e["actor"] == 1]
    assert sent_by_1, "actor 1 never delivered a rollout (is it running?)"
    assert by_actor[0] >= 4 * max(by_actor[1], 1), f"consume events per actor: {by_actor}"

    lines = assert_update_metrics(read_jsonl(run_dir / "metrics.jsonl"), summary["updates"])
    assert len(lines) >= 4, f"only {len(lines)} updates"
    # The first update waits for the actors' start-up; after that the learner must not wait on actor 1.
    wait_after_first = sum(m["perf/learner_wait_s"] for m in lines[1:])
    assert wait_after_first < 0.5 * slow_rollout_s, (
        f"learner waited {wait_after_first:.3f} s over {len(lines) - 1} updates; actor 1 needs >= "
        f"{slow_rollout_s:.2f} s per rollout")
    # The learner takes any rollouts: most updates were made of actor 0's data alone.
    updates_with_1 = {e["learner_version"] for e in cons if e["actor"] == 1}
    assert len(updates_with_1) <= len(lines) // 2, f"{len(updates_with_1)} of {len(lines)} updates used actor 1's data"


# SIGTERM to the launcher of a default run (two actors, the evaluator): test_faults.py's killed-actor test
# ends with it, and checks what stopping everything means (one run for both).


def test_sigterm_during_a_long_update_stops_in_time(tmp_path):
    """An update far longer than the launcher's 10 s grace (a big model's PPO or GRPO update) is cut
    short between minibatches: the run stops in time, saves the cut update's weights as a version
    and counts it, instead of being SIGKILLed with its next data lost."""
    run_dir = tmp_path / "run"
    versions_path = run_dir / "versions.jsonl"

    def first_consume() -> bool:
        try:
            return '"event":"consume"' in versions_path.read_text()
        except OSError:
            return False

    # 200,000 epochs of two minibatches: minutes for one update, were it not cut short
    run = launch(tmp_path, run_dir, "--no-eval", "--actors", "1", "--steps", "10000000", "--set", "algorithm.cfg.n_epochs=200000",
                 "--set", "trainer.eval_freq=0")
    try:
        assert run.wait(120, until=first_consume) is None, f"the run ended early:\n{run.output()}"
        time.sleep(1.0)                       # well inside the first update
        stop_s = _sigterm_and_wait(run, run_dir)
    finally:
        run.stop()

    out = (tmp_path / "launch.out").read_text(errors="replace")
    assert stop_s < 10 and "did not stop in time" not in out, out
    assert "update 1 cut short" in out, out
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["updates_cut_short"] == 1 and summary["stopped_by"] == "SIGTERM", summary
    assert summary["version"] == 1 and load_ckpt(newest_checkpoint(run_dir))["version"] == 1, summary


def assert_resume_continues(run_dir: Path, ckpt: dict, n_before: int, m_before: int, steps: int) -> None:
    """A standard-mode launch with --resume (budget `steps`) went on from checkpoint `ckpt` exactly: its
    versions.jsonl lines (from line `n_before`) and metrics.jsonl lines (from `m_before`) continue the
    checkpoint's version, env steps and update count, every actor acted with post-resume weights, and the
    final checkpoint and summary count the updates since. (tests/test_checkpoint_integrity.py's launcher
    test resumes a run past a damaged newest checkpoint and checks it here: one run for both.)"""
    assert f"resumed at v{ckpt['version']}" in (run_dir / "logs" / "learner.log").read_text()
    after = read_jsonl(run_dir / "versions.jsonl")[n_before:]
    resumes = [e for e in after if e["event"] == "resume"]
    assert len(resumes) == 1 and resumes[0]["version"] == ckpt["version"], resumes
    assert resumes[0]["env_steps"] == ckpt["env_steps"]
    pubs = publishes(after, final=False)
    assert pubs, "no publish after resume"
    assert pubs[0]["version"] == ckpt["version"] + 1, f"first publish after resume {pubs[0]} vs checkpoint v{ckpt['version']}"
    assert_versions_publish_sequence(after, start=ckpt["version"] + 1)
    assert len(pubs) >= 2, "no update after resume"
    cons = assert_consume_lags(after, max_lag=0)
    assert all(e["policy_version"] >= ckpt["version"] for e in cons), "an actor acted with pre-resume weights"

    lines = update_lines(read_jsonl(run_dir / "metrics.jsonl")[m_before:])
    assert lines, "no update metrics after resume"
    assert lines[0]["version"] == ckpt["version"] + 1 and lines[0]["updates"] == ckpt["updates"] + 1, lines[0]
    assert all(m["env_steps"] > ckpt["env_steps"] for m in lines)
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["exit_code"] == 0 and summary["env_steps"] >= steps, summary
    final = load_ckpt(newest_checkpoint(run_dir))
    assert final["version"] > ckpt["version"] and final["env_steps"] >= steps
    assert final["updates"] == summary["updates"] == ckpt["updates"] + len(lines)


@pytest.mark.slow
def test_learner_refuses_bad_messages(tmp_path):
    import zmq

    from shared.rollout import rollout_template
    from learner.learner import env_spec_of
    from shared import keys, wire
    from shared.config import load_config

    run_dir = tmp_path / "run"
    learner = Started([sys.executable, "-m", "learner", "--config", str(CONFIG), "--run-dir", str(run_dir),
                       "--no-eval", "--set", "trainer.buffer_type=vla"], tmp_path / "learner.out")
    ctx = zmq.Context()
    try:
        ep_path = run_dir / "endpoints.json"
        learner.wait(120, until=ep_path.is_file)
        endpoints = json.loads(ep_path.read_text())

        cfg = load_config(CONFIG, ["trainer.buffer_type=vla"])
        good = rollout_template(env_spec_of(cfg), cfg.actors.num_envs, cfg.trainer.buffer_size)
        obs = good[keys.OBS]
        bad = good.clone()
        bad.set(keys.OBS, torch.zeros(*obs.shape[:-1], obs.shape[-1] + 1, dtype=obs.dtype), inplace=False)
        bad_frames = wire.encode(bad, kind="rollout", actor=0, seq=0, policy_version=0)

        push = ctx.socket(zmq.PUSH)
        push.setsockopt(zmq.LINGER, 2000)
        push.connect(endpoints["rollouts"])
        garbage = bytes(torch.randint(0, 256, (257,), generator=torch.Generator().manual_seed(0),
                                      dtype=torch.uint8).tolist())
        push.send(garbage, copy=True)
        push.send_multipart(bad_frames, copy=True)

        def both_logged() -> bool:
            text = learner.output()
            return "dropped malformed message" in text and "does not match the learner's schema" in text

        assert learner.wait(30, until=both_logged) is None, f"the learner exited:\n{learner.output()}"
        push.close(linger=0)
        os.kill(learner.proc.pid, signal.SIGTERM)
        try:
            rc = learner.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pytest.fail(f"learner still running 10 s after SIGTERM:\n{learner.output()}")
        assert rc in (0, -signal.SIGTERM), f"exit code {rc}\n{learner.output()}"
        learner.assert_all_gone(run_dir, timeout_s=5)
    finally:
        ctx.destroy(linger=0)
        learner.stop()

    text = (tmp_path / "learner.out").read_text()
    assert re.search(r"dropped malformed message #1 from .*: header", text), text
    assert re.search(r"rejected message #1 from tcp://127\.0\.0\.1 \(actor 0\): actor 0: rollout does not match the "
                     r"learner's schema: "
                     r".*'observation' is torch\.float32 \[8, 32, 5\], expected torch\.float32 \[8, 32, 4\]", text), text
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["malformed"] >= 1 and summary["rejected"] >= 1, summary
    assert summary["rollouts"] == 0 and summary["updates"] == 0 and summary["version"] == 0, summary
    assert summary["stopped_by"] == "SIGTERM", summary
    assert not (run_dir / "endpoints.json").exists()


@pytest.mark.slow
def test_grpo_run_local(tmp_path):
    """configs/cartpole_grpo.json through the launcher: critic-free rollouts cross the wire and
    the learner publishes a version per update. The policy returns chunks of 3 actions and the envs
    execute 2: GRPO's group returns run over macro steps."""
    run_dir = tmp_path / "run"
    run = launch(tmp_path, run_dir, "--no-eval", "--config", str(ROOT / "configs" / "cartpole_grpo.json"), "--steps", "24000",
                 "--set", "trainer.eval_freq=0", "--set", "policy.chunk_size=3", "--set", "actors.actions_per_call=2")
    finish(run, run_dir)
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["exit_code"] == 0 and summary["updates"] >= 2, summary
    events = read_jsonl(run_dir / "versions.jsonl")
    assert_versions_publish_sequence(events, start=0)
    assert_consume_lags(events, max_lag=0)
    updates = update_lines(read_jsonl(run_dir / "metrics.jsonl"))
    assert updates and all("loss/policy" in u and "loss/samples" in u for u in updates)


def _sigterm_and_wait(run, run_dir) -> float:
    """SIGTERM the launcher, check it exits with 128 + SIGTERM within 15 s and leaves no process of
    the run; returns the seconds it took."""
    t0 = time.monotonic()
    os.kill(run.proc.pid, signal.SIGTERM)
    try:
        rc = run.proc.wait(timeout=15)
    except subprocess.TimeoutExpired:
        pytest.fail(f"launcher still running 15 s after SIGTERM:\n{run.output()}")
    stop_s = time.monotonic() - t0
    assert rc == 128 + signal.SIGTERM, f"exit code {rc}\n{run.output()}"
    run.assert_all_gone(run_dir, timeout_s=5)
    return stop_s


@pytest.mark.slow
def test_reach_token_vla_trains_through_inference_servers_and_survives_a_killed_server(tmp_path):
    """actors.inference "server" with the Reach token-VLA smoke config through the launcher: two
    actors act through one server, each with its envs in two parts (two requests in flight); the
    server is killed (SIGKILL) after the second update, the launcher restarts it, the actors re-send
    every request in flight to the new one, and the run ends normally. Every
    consumed rollout's steps were acted within the lag the run allows. The model decodes action
    chunks (H = 4 actions of 2 tokens in one parallel pass) and the envs execute 3 of each: the
    server serves chunks and the learner counts env steps, not calls."""
    run_dir = tmp_path / "run"
    stale = run_dir / "inference" / "server_0.progress.json"   # an earlier run's, in the same directory
    stale.parent.mkdir(parents=True)
    stale.write_text('{"batches": 1000000000}\n')
    run = launch(tmp_path, run_dir, "--no-eval", "--config", str(ROOT / "configs" / "vla_tokens_reach_smoke.json"),
                 "--steps", "4096", "--set", "trainer.eval_freq=0", "--set", "actors.inference=server",
                 "--set", "actors.server_splits=2", "--set", "policy.chunk_size=4", "--set", "actors.actions_per_call=3")
    killed: list[int] = []

    def kill_once() -> None:
        path = run_dir / "inference" / "server_0.json"
        try:
            published = (run_dir / "versions.jsonl").read_text().count('"event":"publish"')
        except OSError:
            published = 0
        if killed or not path.exists() or published < 3:
            return
        pid = json.loads(path.read_text())["pid"]
        os.kill(pid, signal.SIGKILL)
        killed.append(pid)
    out = finish(run, run_dir, every=kill_once)
    assert killed, "the run ended before the server could be killed"
    assert "[launch] inference server 0 exited with code 137: restart 1/" in out, out
    log = (run_dir / "logs" / "inference_0.log").read_text()
    assert log.count("inference server 0 on cpu for actors [0, 1]") == 2, log      # two incarnations
    # the actors reached both over the Unix socket (actors.server_transport's default), reconnecting to the new one
    connections = re.findall(r"inference server 0: (\d+) actor connections over its Unix socket", log)
    assert connections and int(connections[-1]) >= 2, log
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["exit_code"] == 0 and summary["env_steps"] >= 4096, summary
    events = read_jsonl(run_dir / "versions.jsonl")
    assert_versions_publish_sequence(events, start=0)
    assert_consume_lags(events, max_lag=2)
    rows = 8 * 16   # num_envs x buffer_size calls per rollout; each call executed 1 to 3 env steps
    assert all(rows < e["env_steps"] <= 3 * rows for e in consumes(events)), consumes(events)
    # a fresh launch counts its server's TensorBoard steps from 0, not from the earlier run's
    assert not stale.exists() or json.loads(stale.read_text())["batches"] < 1000000000


def test_two_servers_on_one_device_deal_out_the_actors_and_each_grpo_group_acts_with_one_version(tmp_path):
    """GRPO in vla mode through inference servers, with dynamic sampling, through the launcher.

    actors.servers_per_device 2: two servers for the one device, actors dealt out in turn (0 and 2 to
    server 0, 1 and 3 to server 1), each acting for its own, and the run ends normally with every
    actor's rollouts trained on. Each actor's envs are in two parts (two requests in flight, each of
    whole groups): from the recorded batches, at every step all members of a group acted with one
    version (a group is always in one request, which one batch serves), and the updates counted the
    groups kept and left out. (One run for both: each launch is seven process start-ups.)"""
    from tensordict import TensorDict
    run_dir = tmp_path / "run"
    group = 4
    run = launch(tmp_path, run_dir, "--no-eval", "--config", str(ROOT / "configs" / "cartpole_grpo.json"),
                 "--actors", "4", "--steps", "12800", "--set", "trainer.eval_freq=0", "--set", "trainer.buffer_type=vla",
                 "--set", "trainer.buffer_size=100", "--set", "trainer.record=true",
                 "--set", "actors.inference=server", "--set", "actors.servers_per_device=2",
                 "--set", "actors.server_splits=2",
                 "--set", f"algorithm.cfg.group_size={group}", "--set", "algorithm.cfg.dynamic_sampling=true")
    finish(run, run_dir)
    for server, actors in ((0, "[0, 2]"), (1, "[1, 3]")):
        log = (run_dir / "logs" / f"inference_{server}.log").read_text()
        assert f"inference server {server} on cpu for actors {actors}" in log, log
        assert re.search(rf"inference server {server}: stopping after [1-9]\d* batches", log), log
    assert {e["actor"] for e in consumes(read_jsonl(run_dir / "versions.jsonl"))} == {0, 1, 2, 3}

    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["exit_code"] == 0 and summary["updates"] >= 2 and summary["malformed"] == 0, summary
    updates = update_lines(read_jsonl(run_dir / "metrics.jsonl"))
    assert updates and all("grpo/groups_kept" in u and u["grpo/groups_kept"] >= 1 for u in updates), updates
    batches = sorted((run_dir / "record").glob("update_*"))
    assert len(batches) == summary["updates"], batches
    acted = set()
    for path in batches:
        versions = TensorDict.load_memmap(path)["policy_version"]           # [k, N, T]
        k, n, t = versions.shape
        by_group = versions.reshape(k, n // group, group, t)
        assert (by_group == by_group[:, :, :1]).all(), f"{path.name}: a group acted with two versions at one step"
        acted.update(versions.unique().tolist())
    assert len(acted) >= 2, acted                                           # versions did change under way


FAKE_MPS = """#!/usr/bin/env bash
# a stand-in for nvidia-cuda-mps-control: says what it was asked, with the directories it was given
if [[ "${1:-}" == -d ]]; then
  echo "start $CUDA_MPS_PIPE_DIRECTORY $CUDA_MPS_LOG_DIRECTORY" >> "$TANDEM_FAKE_MPS_LOG"
else
  read -r command; echo "$command $CUDA_MPS_PIPE_DIRECTORY" >> "$TANDEM_FAKE_MPS_LOG"
fi
"""


def test_mps_runs_the_processes_under_a_daemon_of_the_runs_own_and_stops_it(tmp_path):
    """--mps: the launcher starts an MPS control daemon with a private pipe directory before any
    process of the run, every process inherits its directories, and the daemon is told to quit
    (and its pipe directory removed) once they have all ended. Without the daemon on PATH, --mps is
    refused before anything starts. (Here a stand-in records what it is asked; a GPU run is in
    benchmarks/gpu_session.sh.) The run is :data:`VLA_MODE_RUN`, a vla-mode run with a slow actor,
    checked by :func:`check_vla_mode_run` and :func:`check_slow_actor_run` too."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    fake = bin_dir / "nvidia-cuda-mps-control"
    fake.write_text(FAKE_MPS)
    fake.chmod(0o755)
    calls = tmp_path / "mps_calls.txt"
    env = {**_env(launcher_python=True), "PATH": f"{bin_dir}:{os.environ['PATH']}", "TANDEM_FAKE_MPS_LOG": str(calls)}
    run_dir = tmp_path / "run"
    run = Started(["bash", str(LAUNCH), "--out", str(run_dir), "--mps", *VLA_MODE_RUN], tmp_path / "launch.out",
                  env=env)
    seen: dict[str, str] = {}

    def inherited() -> None:
        for p in tandem_processes(run_dir):
            try:
                seen.setdefault(p.cmdline()[2], p.environ().get("CUDA_MPS_PIPE_DIRECTORY", ""))
            except (psutil.Error, IndexError):
                pass
    out = finish(run, run_dir, every=inherited)
    lines = calls.read_text().splitlines()
    assert len(lines) == 2 and lines[0].startswith("start ") and lines[1].startswith("quit "), lines
    pipe, log_dir = lines[0].split()[1:]
    assert lines[1].split()[1] == pipe and log_dir == str(run_dir / "logs" / "mps")
    assert seen.get("learner") == pipe and seen.get("actors") == pipe, seen      # both roles inherited it
    assert not Path(pipe).exists() and "CUDA MPS" in out
    check_vla_mode_run(run_dir)     # the run itself: vla mode through the launcher,
    check_slow_actor_run(run_dir)   # and a slow actor that never holds the learner up

    fake.write_text(FAKE_MPS.replace('if [[ "${1:-}" == -d ]]; then', 'if [[ "${1:-}" == -d ]]; then exit 1'))
    failed = subprocess.run(["bash", str(LAUNCH), "--out", str(tmp_path / "failed"), "--mps"], cwd=ROOT, env=env,
                            capture_output=True, text=True, timeout=60)
    assert failed.returncode == 1 and "the MPS control daemon did not start" in failed.stderr, failed.stderr
    (sent,) = calls.read_text().splitlines()[2:]          # the launcher still sent quit, and cleaned up
    assert sent.startswith("quit ") and not Path(sent.split()[1]).exists(), sent
    missing = {**env, "PATH": "/usr/bin:/bin"}
    if shutil.which("nvidia-cuda-mps-control", path=missing["PATH"]):
        return                          # a machine with the real one: the refusal cannot be seen here
    refused = subprocess.run(["bash", str(LAUNCH), "--out", str(tmp_path / "none"), "--mps"], cwd=ROOT, env=missing,
                             capture_output=True, text=True, timeout=60)
    assert refused.returncode == 2 and "--mps: no nvidia-cuda-mps-control" in refused.stderr, refused.stderr
    assert not (tmp_path / "none").exists()
