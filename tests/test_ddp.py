"""Several learner ranks (DDP over gloo, started by torchrun through launch/run_local.sh): the ranks
hold identical weights after every update, every actor's data is trained on, and nothing is left."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.test_integration import launch, read_jsonl

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[1]


def test_two_learner_ranks_train_cartpole_with_identical_weights(tmp_path):
    run = tmp_path / "run"
    started = launch(tmp_path, run, "--actors", "2", "--steps", "12000", "--set", 'learner.devices=["cpu","cpu"]',
                     "--set", "learner.rank_digests=true", "--set", "trainer.eval_freq=4000", probe_python=True)
    try:   # on a failure or a hang, the whole group (torchrun and its ranks too) is stopped
        rc = started.wait(300)
        output = started.output()
        assert rc == 0, output
        started.assert_all_gone(run)
    finally:
        started.stop()
    assert "2 learner rank(s)" in output
    rank0 = read_jsonl(run / "ranks" / "rank0.jsonl")
    rank1 = read_jsonl(run / "ranks" / "rank1.jsonl")
    summary = json.loads((run / "summary.json").read_text())
    assert len(rank0) == len(rank1) == summary["updates"] >= 5
    for a, b in zip(rank0, rank1):                 # after every update, the same weights on both ranks
        assert (a["version"], a["sha256"]) == (b["version"], b["sha256"]), (a, b)
    assert len({r["sha256"] for r in rank0}) == len(rank0)        # and they change every update
    # actor i sends to rank i % 2: each rank's log has its own actor's rollouts, every one consumed
    # (standard mode), and rank 0 published every version once
    consumed0 = [e for e in read_jsonl(run / "versions.jsonl") if e["event"] == "consume"]
    consumed1 = [e for e in read_jsonl(run / "versions.rank1.jsonl") if e["event"] == "consume"]
    assert {e["actor"] for e in consumed0} == {0} and {e["actor"] for e in consumed1} == {1}
    assert len(consumed0) == len(consumed1) == summary["updates"]
    publishes = [e["version"] for e in read_jsonl(run / "versions.jsonl") if e["event"] == "publish"]
    assert publishes == list(range(summary["updates"] + 1))
    assert summary["env_steps"] >= 12000 and summary["last_eval/return_mean"] > 30
    assert not (run / "endpoints.json").exists()
