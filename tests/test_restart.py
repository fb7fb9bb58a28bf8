"""Issue 12, done-when 3: kill the learner while two actors run, restart it with --resume, and
training continues, in standard mode and in vla mode with ``lag_policy: pace``, and in both with the
actors acting through an inference server (which takes the weights; the actors subscribe to the
weights socket's control topic alone, for the stop and their credits). In standard mode through a
server, an actor's request for a version newer than its last rollout's is met by the resumed
learner's first (lower) version.

The learner and the actors are separate ``python -m`` processes (as under Slurm or ssh), on fixed
ports so that the actors' sockets reconnect to the restarted learner by themselves. Checkpoints
are written every 4 updates and the learner is killed between two of them, so the restarted
learner resumes at a lower version than the one the actors hold: they must take its versions
anyway (learner incarnations), and nobody may wait for a timeout.
"""

from __future__ import annotations

import signal
import socket
import sys
import time
from pathlib import Path

import pytest

from tests.test_integration import CONFIG, Started, _env, read_jsonl

pytestmark = pytest.mark.slow
RESTART_BUDGET_S = 15.0


def _free_ports(n: int) -> list[int]:
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def _publishes(run_dir: Path) -> list[dict]:
    try:
        return [e for e in read_jsonl(run_dir / "versions.jsonl") if e.get("event") in ("publish", "resume")
                and not e.get("final")]
    except (OSError, ValueError):   # a line being written
        return []


def _checkpoint_versions(run_dir: Path) -> list[int]:
    return sorted(int(p.stem.split("_")[1]) for p in (run_dir / "checkpoints").glob("ckpt_*.pt"))


@pytest.mark.parametrize("mode", ["standard", "standard_server", "vla_pace", "vla_pace_server"])
def test_learner_killed_and_resumed_while_actors_run(tmp_path, mode):
    run_dir = tmp_path / "run"
    rollout_port, weights_port = _free_ports(2)
    sets = ["--set", f"learner.rollout_port={rollout_port}", "--set", f"learner.weights_port={weights_port}",
            "--set", "trainer.total_steps=100000000", "--set", "trainer.eval_freq=0",
            "--set", "trainer.save_freq=2048"]       # 512 env steps per update: a checkpoint every 4 updates
    if mode.startswith("vla_pace"):
        sets += ["--set", "trainer.buffer_type=vla", "--set", "trainer.lag_policy=pace"]
    served = mode.endswith("_server")
    if served:
        sets += ["--set", "actors.inference=server"]
    py = sys.executable
    learner_cmd = [py, "-m", "learner", "--config", str(CONFIG), "--run-dir", str(run_dir), "--no-eval", *sets]
    procs: list[Started] = []
    try:
        procs.append(Started(learner_cmd, tmp_path / "learner1.out"))
        for i in range(2):
            procs.append(Started([py, "-m", "actors", "--config", str(CONFIG), "--actor-id", str(i),
                                  "--run-dir", str(run_dir), "--learner-timeout", "60", *sets],
                                 tmp_path / f"actor{i}.out", env=_env()))
        if served:   # procs[3]: the one server, which outlives the learner as the actors do
            procs.append(Started([py, "-m", "actors.inference", "--config", str(CONFIG), "--server-id", "0",
                                  "--run-dir", str(run_dir), "--learner-timeout", "60", *sets],
                                 tmp_path / "server.out", env=_env()))
        first = procs[0]

        def killable() -> bool:   # a checkpoint exists and the learner is 2+ versions past it
            ckpts = _checkpoint_versions(run_dir)
            pubs = _publishes(run_dir)
            return bool(ckpts) and bool(pubs) and pubs[-1]["version"] >= ckpts[-1] + 2
        assert first.wait(120, until=killable) is None, first.output()
        first.proc.send_signal(signal.SIGKILL)
        first.proc.wait(timeout=10)
        killed_at = _publishes(run_dir)[-1]["version"]
        resume_version = _checkpoint_versions(run_dir)[-1]
        assert resume_version < killed_at
        for a in procs[1:]:
            assert a.proc.poll() is None, "an actor or the server died with the learner:\n" + a.output()

        t0 = time.monotonic()
        second = Started([*learner_cmd, "--resume"], tmp_path / "learner2.out")
        procs.append(second)

        def trains_again() -> bool:
            pubs = _publishes(run_dir)
            new = [e for e in pubs if e.get("incarnation") and e["incarnation"] != pubs[0].get("incarnation")]
            return any(e["event"] == "publish" for e in new)
        assert second.wait(60, until=trains_again) is None, second.output()
        resumed_after_s = time.monotonic() - t0
        # ... and keeps training: a few more versions, with rollouts from both actors
        assert second.wait(60, until=lambda: _publishes(run_dir)[-1]["version"] >= resume_version + 4) is None
        second.proc.send_signal(signal.SIGTERM)
        assert second.proc.wait(timeout=30) == 0, second.output()
        for a in procs[1:4]:     # the learner's stop message ends the actors (and the server)
            assert a.wait(30) == 0, a.output()
    finally:
        for p in procs:
            p.stop()
    events = read_jsonl(run_dir / "versions.jsonl")
    pubs = _publishes(run_dir)
    lives: dict[str, list[int]] = {}
    for e in pubs:
        lives.setdefault(e["incarnation"], []).append(e["version"])
    assert len(lives) == 2, lives
    (old, old_versions), (new, new_versions) = lives.items()
    for versions in (old_versions, new_versions):   # never backwards within one incarnation
        assert versions == list(range(versions[0], versions[0] + len(versions))), versions
    assert new_versions[0] == resume_version < old_versions[-1] == killed_at
    consumed_after = [e for e in events if e["event"] == "consume" and e["learner_version"] >= resume_version
                      and e["time"] > pubs[len(old_versions)]["time"]]
    assert {e["actor"] for e in consumed_after} == {0, 1}
    assert all(e["lag"] >= 0 for e in consumed_after)
    actor_logs = [(tmp_path / f"actor{i}.out").read_text() for i in range(2)]
    # what loads the weights follows the new learner: each actor, or the server that acts for them
    loaders = [(tmp_path / "server.out").read_text()] if served else actor_logs
    assert all("the learner restarted" in log for log in loaders), loaders
    assert all("exiting" not in log for log in actor_logs)   # nobody gave up on a timeout
    print(f"\n[restart] {mode}: killed at v{killed_at}, resumed from the v{resume_version} checkpoint, "
          f"first update of the new learner {resumed_after_s:.1f} s after its start")
    assert resumed_after_s < RESTART_BUDGET_S
