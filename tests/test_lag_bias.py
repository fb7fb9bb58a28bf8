"""The bias that bounding staleness by dropping data brings, and that admission control avoids
(issue 20): two real actors on loopback, actor 1 slowed down per env step, a tight lag bound.

- ``lag_policy: pace`` (the default): each actor's share of the trained samples equals its share
  of the collected ones, nothing finished is discarded, and nothing older than the bound is trained.
- ``lag_policy: drop``: the slow actor's rollouts arrive too old and are dropped, so its share of
  the trained samples falls below its share of the collected ones: the skew the docs describe.
  Measured here (2-core VM): actor 1 collected 17-20% of the samples and got 0-1% of the training.
"""

from __future__ import annotations

import json

import pytest

from tests.test_integration import CONFIG, finish, launch, read_jsonl

MAX_LAG = 1
pytestmark = pytest.mark.slow   # two launcher runs (~30-60 s here); CI runs it


def _run(tmp_path, policy: str, steps: int) -> tuple[dict, list[dict]]:
    run_dir = tmp_path / policy
    run = launch(tmp_path, run_dir, "--no-eval", "--config", str(CONFIG), "--actors", "2", "--steps", str(steps),
                 "--set", "trainer.buffer_type=vla", "--set", f"trainer.lag_policy={policy}",
                 "--set", f"trainer.max_policy_lag={MAX_LAG}", "--set", "trainer.eval_freq=0",
                 "--set", "actors.num_envs=4", "--set", "trainer.buffer_size=32",
                 "--set", "algorithm.cfg.batch_size=64", "--set", "algorithm.cfg.n_epochs=1",
                 "--set", "actors.slowdown_s=0.01", "--set", "actors.slow_actor_ids=[1]", name=policy)
    finish(run, run_dir)
    return json.loads((run_dir / "summary.json").read_text()), read_jsonl(run_dir / "versions.jsonl")


def _shares(events: list[dict]) -> tuple[dict[int, float], dict[int, float], list[dict]]:
    """Per actor: its share of the collected samples (every rollout received: consumed or dropped)
    and of the trained samples (consumed)."""
    received = [e for e in events if e["event"] in ("consume", "drop") and e.get("reason") != "shutdown"]
    consumed = [e for e in events if e["event"] == "consume"]

    def share(rows):
        total = sum(e["env_steps"] for e in rows)
        return {a: sum(e["env_steps"] for e in rows if e["actor"] == a) / total for a in (0, 1)}

    return share(received), share(consumed), consumed


def test_pace_trains_each_actor_at_its_share_and_drop_skews_it(tmp_path):
    # pace runs at the slow actor's speed: 4,000 env steps (~30 rollouts) show its shares; drop runs at
    # the fast one's, and needs 8,000 for the slow actor to deliver a few
    summary, events = _run(tmp_path, "pace", 4000)
    collected, trained, consumed = _shares(events)
    # (with a bound this tight, pace holds the fast actor to the slow one's credit: shares near 1/2)
    assert abs(trained[1] - collected[1]) < 0.03, (collected, trained)
    assert summary["dropped_lag"] == 0 and summary["overwritten"] == 0     # nothing finished was discarded
    assert max(e["lag"] for e in consumed) <= MAX_LAG

    summary, events = _run(tmp_path, "drop", 8000)
    collected, trained, consumed = _shares(events)
    # the slow actor's share depends on how fast the machine runs the other one (17-20% on an AMD
    # EPYC VM, 1.6-3.2% on a faster Intel Xeon one): it must have delivered something, and less
    assert 0 < collected[1] < 0.45, f"actor 1 should be the slow one: collected shares {collected}"
    assert max(e["lag"] for e in consumed) <= MAX_LAG
    assert summary["dropped_lag"] + summary["overwritten"] > 0
    # the slow actor's data arrives old and is the data thrown away: trained below its collected share
    assert trained[1] < 0.8 * collected[1], (collected, trained)
