"""Per-episode env metrics: bounded cleaning (fuzzed), the gymnasium adapter's reward components,
and ``train/metrics/<key>`` / ``eval/metrics/<key>`` equal to hand-computed means on a fake env
that runs through the serial runner (an actor's collector, the learner) and the evaluator's episode
loop."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from learner.evaluator import evaluate
from runners.serial import SerialRunner
from shared.envs import make_env
from shared.envs.base import ActionSpec, EnvSpec, StepResult
from shared.metrics import MAX_KEYS, MAX_NAME, clean_metrics, mean_metrics
from tests.test_learner_component import small_config

_values = st.one_of(st.floats(allow_nan=True, allow_infinity=True), st.integers(-2**70, 2**70), st.booleans(),
                    st.text(max_size=5), st.none(), st.lists(st.integers(), max_size=3))


@settings(max_examples=300, deadline=None)
@given(st.one_of(st.dictionaries(st.one_of(st.text(max_size=80), st.integers()), _values, max_size=60),
                 st.lists(st.integers()), st.text(), st.none()))
def test_cleaning_never_fails_and_stays_bounded(d):
    out = clean_metrics(d)
    assert len(out) <= MAX_KEYS
    for k, v in out.items():
        assert isinstance(k, str) and 0 < len(k) <= MAX_NAME and isinstance(v, float) and math.isfinite(v)
        assert d[k] == v or (isinstance(d[k], bool) and float(d[k]) == v) or float(d[k]) == v


def test_gym_reward_components_sum_over_the_episode():
    """HalfCheetah's reward is reward_forward + reward_ctrl: their per-episode sums add up to the return."""
    env = make_env("HalfCheetah-v5", 3, {"max_episode_steps": 7})
    env.reset(seed=0)
    g = torch.Generator().manual_seed(0)
    ended = []
    for _ in range(14):
        step = env.step(torch.rand(3, 6, generator=g) * 2 - 1)
        ended += list(zip(step.episode_returns, step.episode_metrics))
    env.close()
    assert len(ended) == 6
    for ret, m in ended:
        assert m["reward_forward"] + m["reward_ctrl"] == pytest.approx(ret, rel=1e-5, abs=1e-6)
        assert "x_position" in m and "x_velocity" in m


class MetricsEnv:
    """CartPole-shaped fake: env i's episodes last 2 + i steps and report ``{"dist": d, "hits": h}``
    from a counter, so every emitted value is known."""

    def __init__(self, num_envs: int, device="cpu"):
        self.num_envs, self.device = num_envs, torch.device("cpu")
        self.spec = EnvSpec(obs_shape=(4,), obs_dtype=torch.float32, action=ActionSpec(kind="discrete", shape=(), n=2),
                            max_episode_steps=50)
        self.t = torch.zeros(num_envs, dtype=torch.int64)
        self.count = 0
        self.emitted: list[dict] = []

    def reset(self, seed=None):
        self.t.zero_()
        return torch.zeros(self.num_envs, 4)

    def step(self, action):
        self.t += 1
        done = self.t >= 2 + torch.arange(self.num_envs)
        metrics = []
        for i in done.nonzero().flatten().tolist():
            self.count += 1
            m = {"dist": 0.5 * self.count + i, "hits": float(self.count % 3), "bad name!": 1.0, "nan": float("nan")}
            metrics.append(m)
            self.emitted.append({"dist": m["dist"], "hits": m["hits"], "env": i})
        lengths = self.t[done].tolist()
        self.t[done] = 0
        obs = torch.randn(self.num_envs, 4)
        return StepResult(obs=obs, reward=torch.ones(self.num_envs), terminated=done, truncated=torch.zeros_like(done),
                          final_obs=obs, episode_returns=[float(n) for n in lengths], episode_lengths=lengths,
                          episode_metrics=metrics)

    def close(self):
        pass


def test_train_and_eval_metrics_equal_hand_computed_means(monkeypatch):
    import runners.serial
    import shared.envs
    envs: list[MetricsEnv] = []

    def fake_make_env(env_id, num_envs, env_kwargs=None, device="cpu", render=False, tokenizer=None):
        envs.append(MetricsEnv(num_envs))
        return envs[-1]

    monkeypatch.setattr(runners.serial, "make_env", fake_make_env)   # the actor's env
    monkeypatch.setattr(shared.envs, "make_env", fake_make_env)      # the learner's env_spec builds one
    runner = SerialRunner(small_config())
    for _ in range(6):                                     # one rollout and one update each
        assert runner.step()
    lrn = runner.learner
    assert lrn.updates == 6
    emitted = envs[-1].emitted[-100:]                      # the learner keeps the last 100 episodes
    assert len(envs[-1].emitted) > 100
    values = lrn.last_update_values
    assert values["train/metrics/dist"] == pytest.approx(sum(m["dist"] for m in emitted) / len(emitted))
    assert values["train/metrics/hits"] == pytest.approx(sum(m["hits"] for m in emitted) / len(emitted))
    assert not any("bad" in k or k.endswith("/nan") for k in values)

    # evaluation: the first episode of each env, means over the evaluated episodes
    env = MetricsEnv(5)
    result = evaluate(lrn.policy.eval(), env, 5, seed=0)
    returns, lengths, found = result.returns, result.lengths, result.metrics
    firsts = [next(m for m in env.emitted if m["env"] == i) for i in range(5)]   # each env's first episode
    assert lengths == [2, 3, 4, 5, 6]
    lrn.log_eval({"returns": returns, "lengths": lengths, "version": lrn.version, "env_steps": 0,
                  "metrics": mean_metrics(found)})
    assert lrn.last_eval["eval/metrics/dist"] == pytest.approx(np.mean([m["dist"] for m in firsts]))
    assert lrn.last_eval["eval/metrics/hits"] == pytest.approx(np.mean([m["hits"] for m in firsts]))


def test_hostile_episode_metrics_are_cleaned_and_the_rollout_kept():
    runner = SerialRunner(small_config())
    lrn = runner.learner
    (td, meta), = runner.collect()                         # a real rollout; its meta is then forged
    meta = dict(meta)
    flood = {f"k{i}": float(i) for i in range(500)}
    meta["episode_metrics"] = [flood, {"x" * 500: 1.0, "ok": float("inf")}, "junk", 7, {"fine": 2.0}] * 400
    lrn.ingest(td, meta)
    assert len(lrn.buffer) == 1                            # the data is kept
    kept = list(lrn.stats.metrics)
    assert len(kept) == 100 and all(len(m) <= MAX_KEYS for m in kept)
    assert len(runner.train()) == 1
    assert sum(k.startswith("train/metrics/") for k in lrn.last_update_values) <= MAX_KEYS
    before = dict(lrn.counts)
    lrn.ingest(td, {**meta, "episode_metrics": {"not": "a list"}})   # ignored; the rollout is received
    assert lrn.counts["rollouts"] == before["rollouts"] + 1 and lrn.counts["rejected"] == before["rejected"]
    runner.close()
