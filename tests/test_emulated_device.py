"""The emulated inference device (actors/emulated_device.py): latency a + b * batch, and actors that
share a device never infer at the same moment, across processes."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from actors.emulated_device import EmulatedDevice, device_for
from actors.rollout import Collector
from shared.config import ConfigError, config_from_dict
from shared.envs import make_env
from shared.policies import make_policy
from tests.children import child_pythonpath

ROOT = Path(__file__).resolve().parents[1]

# One "actor": a real Collector on CartPole whose policy records the interval of every forward pass
# (made 10 ms long), with the emulated device named on the command line.
ACTOR = textwrap.dedent("""
    import json, sys, time, torch
    from actors.emulated_device import EmulatedDevice
    from actors.rollout import Collector
    from shared.config import config_from_dict
    from shared.envs import make_env
    from shared.policies import make_policy
    lock_dir, name, out = sys.argv[1], sys.argv[2], sys.argv[3]
    cfg = config_from_dict({"env": {"id": "CartPole-v1"}}, source="test")
    env = make_env("CartPole-v1", 4)
    inner = make_policy(cfg, env.spec)
    spans = []

    class Slow(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.inner, self.critic = inner, inner.critic
        def forward(self, td, deterministic=False):
            t0 = time.monotonic()
            out = self.inner(td, deterministic)
            time.sleep(0.01)
            spans.append((t0, time.monotonic()))
            return out
        def get_value(self, td):
            return self.inner.get_value(td)

    device = EmulatedDevice(name, lock_dir)
    col = Collector(env, Slow(), num_steps=15, seed=0, device_lock=device)
    print("ready", flush=True)
    sys.stdin.readline()                 # start together
    col.collect(version=0)
    json.dump(spans, open(out, "w"))
""")


def _run(tmp_path: Path, names: tuple[str, ...]) -> list[list[tuple[float, float]]]:
    procs = []
    try:
        for i, name in enumerate(names):
            procs.append(subprocess.Popen([sys.executable, "-c", ACTOR, str(tmp_path / "devices"), name,
                                           str(tmp_path / f"spans{i}.json")], cwd=ROOT, stdin=subprocess.PIPE,
                                          stdout=subprocess.PIPE, text=True,
                                          env={"PYTHONPATH": child_pythonpath(), "OMP_NUM_THREADS": "1",
                                               "PATH": "/usr/bin:/bin"}))
        for p in procs:
            assert p.stdout.readline().strip() == "ready"
        for p in procs:
            p.stdin.write("go\n")
            p.stdin.flush()
        for p in procs:
            assert p.wait(timeout=60) == 0
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait(timeout=10)
    return [[tuple(s) for s in json.loads((tmp_path / f"spans{i}.json").read_text())] for i in range(len(names))]


def _overlaps(a: list[tuple[float, float]], b: list[tuple[float, float]]) -> int:
    return sum(1 for s0, e0 in a for s1, e1 in b if s0 < e1 and s1 < e0)


def test_two_actor_processes_on_one_emulated_device_never_infer_at_once(tmp_path):
    """Two actors share gpu0, two others have gpu1 and gpu2: the first pair never infers at once,
    and the second pair, started together, does (the control: this test can fail)."""
    a, b, c, d = _run(tmp_path, ("gpu0", "gpu0", "gpu1", "gpu2"))
    assert len(a) == len(b) == len(c) == len(d) == 15
    assert _overlaps(a, b) == 0
    assert _overlaps(c, d) > 0


def test_latency_is_a_plus_b_times_batch():
    cfg = config_from_dict({"env": {"id": "CartPole-v1"}}, source="test")
    env = make_env("CartPole-v1", 4)
    try:
        col = Collector(env, make_policy(cfg, env.spec), num_steps=5, seed=0, inference_latency_s=0.004,
                        inference_latency_per_env_s=0.002)
        assert (col.policy.latency_s, col.policy.per_env_s) == (0.004, 0.002)   # the policy, wrapped
        _, stats, _ = col.collect(version=0)
        assert stats.inference_s >= 5 * 0.012
        assert stats.collect_cpu_s < stats.collect_s      # sleeping is not CPU
    finally:
        env.close()


def test_device_for_assigns_round_robin_and_checks_names(tmp_path):
    assert device_for([], 3, tmp_path) is None
    d = device_for(["a", "b"], 3, tmp_path)
    try:
        assert d.name == "b" and d.path == tmp_path / "devices" / "b.lock"
        with d:
            pass
    finally:
        d.close()
    with pytest.raises(ValueError, match="emulated device name"):
        EmulatedDevice("../etc", tmp_path)


def test_config_refuses_device_names_that_are_not_file_names():
    with pytest.raises(ConfigError, match=r"actors.emulated_devices\[1\]"):
        config_from_dict({"actors": {"emulated_devices": ["gpu0", "a/b"]}}, source="test")
    cfg = config_from_dict({"actors": {"emulated_devices": ["gpu0"], "inference_latency_per_env_s": 0.01}},
                           source="test")
    assert cfg.actors.emulated_devices == ["gpu0"]


def test_an_actor_with_emulated_devices_needs_a_lock_directory():
    from actors.actor import Actor
    cfg = config_from_dict({"env": {"id": "CartPole-v1"}, "actors": {"emulated_devices": ["gpu0"]}}, source="test")
    with pytest.raises(ValueError, match="lock files"):
        Actor(cfg, 0, weights=None, sink=None)


def test_without_study_knobs_the_collector_steps_the_env_and_policy_themselves():
    from actors.emulated_device import EmulatedInference, SlowEnv
    cfg = config_from_dict({"env": {"id": "CartPole-v1"}}, source="test")
    env = make_env("CartPole-v1", 2)
    try:
        policy = make_policy(cfg, env.spec)
        plain = Collector(env, policy, num_steps=3, seed=0)
        assert plain.env is env and plain.policy is policy
        slow = Collector(env, policy, num_steps=3, seed=0, step_delay_s=0.001)
        assert isinstance(slow.env, SlowEnv) and slow.env.num_envs == 2 and slow.policy is policy
        _, stats, _ = slow.collect(version=0)
        assert stats.env_s >= 3 * 0.001
        assert isinstance(Collector(env, policy, num_steps=3, seed=0, inference_latency_s=0.001).policy,
                          EmulatedInference)
    finally:
        env.close()
