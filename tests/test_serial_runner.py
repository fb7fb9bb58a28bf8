"""runners/serial.py: the actors' collectors and the learner in one process, without sockets."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import torch

from children import child_pythonpath
from runners.serial import SerialRunner
from shared.config import load_config
from shared.policies import weights_digest
from shared.rollout import RolloutMeta

ROOT = Path(__file__).resolve().parents[1]


def test_one_command_trains_cartpole_to_500(tmp_path):
    out = tmp_path / "run"
    p = subprocess.run([sys.executable, "-m", "runners.serial", "--steps", "30000", "--out", str(out)], cwd=ROOT,
                       env={"PYTHONPATH": child_pythonpath(), "PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1"},
                       capture_output=True, text=True, timeout=240)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    metrics = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines() if x.strip()]
    evals = [m["eval/return_mean"] for m in metrics if "eval/return_mean" in m]
    assert max(evals) == 500.0, evals
    assert (out / "config.json").is_file() and list((out / "checkpoints").glob("*.pt"))
    assert "[serial] done: eval return" in p.stdout


def small(*sets):
    return load_config(ROOT / "configs" / "cartpole_ppo.json",
                       ["trainer.total_steps=1536", "trainer.eval_freq=0", *sets])


def test_a_fixed_seed_gives_the_same_weights_twice():
    digests = []
    for _ in range(2):
        runner = SerialRunner(small())
        runner.run(log_interval_s=1e9)
        digests.append(weights_digest(runner.learner.policy))
        assert runner.learner.version == 3 and runner.learner.counts["dropped_lag"] == 0
    assert digests[0] == digests[1]


def test_each_actor_acts_with_the_published_weights_and_numbers_its_rollouts():
    runner = SerialRunner(small())
    runner.step()
    for actor in runner.actors:
        assert actor.version == 0 and actor.seq == 1
    runner.step()
    learner_state = {k: v for k, v in runner.learner.policy.state_dict().items()}
    for actor in runner.actors:
        assert actor.version == 1
        # the actor's copy holds version 1, the learner has moved on to version 2
        assert not all(torch.equal(actor.policy.state_dict()[k], v) for k, v in learner_state.items())
    runner.close()


def test_grpo_groups_reset_together_in_the_serial_runner():
    cfg = load_config(ROOT / "configs" / "cartpole_grpo.json", ["trainer.total_steps=2048", "trainer.eval_freq=0"])
    runner = SerialRunner(cfg)
    result = runner.run(log_interval_s=1e9)
    assert runner.learner.version >= 1 and "eval/return_mean" in result


def test_rollout_meta_sends_what_is_set():
    assert RolloutMeta(actor=1, seq=4).to_meta() == {"kind": "rollout", "actor": 1, "seq": 4,
                                                     "episode_returns": [], "episode_lengths": []}
    meta = RolloutMeta(actor=0, seq=0, policy_version=3, time=1.5).to_meta()
    assert meta["policy_version"] == 3 and meta["time"] == 1.5 and "incarnation" not in meta
