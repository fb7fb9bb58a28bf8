"""MuJoCo Warp adapter: same physics, observation and reward as gymnasium's HalfCheetah-v5 (C MuJoCo),
the batched-env protocol (auto-reset, true final observations, group seeds), and a short training run."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch

pytest.importorskip("mujoco_warp", reason="MuJoCo Warp not installed (pip install 'tandem-rl[warp]')")
pytestmark = pytest.mark.slow          # the first use compiles Warp's kernels (~30 s on CPU, then cached)
ROOT = Path(__file__).resolve().parents[1]
# TANDEM_TEST_MJWARP_DEVICE=cuda:0 runs the physics and protocol tests on a GPU (benchmarks/gpu_session.sh)
DEV = os.environ.get("TANDEM_TEST_MJWARP_DEVICE", "cpu")


@pytest.fixture(scope="module")
def env():
    from shared.envs import make_env
    return make_env("tandem/MJWarpHalfCheetah-v0", 8, {"max_episode_steps": 5}, DEV)


def test_spec_matches_gymnasium(env):
    import gymnasium as gym
    ref = gym.make("HalfCheetah-v5")
    assert env.spec.obs_shape == ref.observation_space.shape
    assert env.spec.action.shape == ref.action_space.shape
    np.testing.assert_allclose(env.spec.action.low, ref.action_space.low)
    np.testing.assert_allclose(env.spec.action.high, ref.action_space.high)
    ref.close()


def test_step_matches_c_mujoco(env):
    """From the same state and action, one env step equals C MuJoCo's (float64) to float32 precision."""
    import mujoco
    env.reset(seed=3)
    g = torch.Generator().manual_seed(0)
    for _ in range(3):
        qpos, qvel = env.qpos.double().cpu().numpy(), env.qvel.double().cpu().numpy()
        action = torch.rand(env.num_envs, 6, generator=g) * 2 - 1
        out = env.step(action)
        for i in (0, env.num_envs - 1):
            d = mujoco.MjData(env.mjm)
            d.qpos[:], d.qvel[:], d.ctrl[:] = qpos[i], qvel[i], action[i].numpy()
            mujoco.mj_step(env.mjm, d, nstep=5)
            want_obs = np.concatenate([d.qpos[1:], d.qvel])
            want_reward = (d.qpos[0] - qpos[i][0]) / env.dt - 0.1 * float((action[i].double() ** 2).sum())
            np.testing.assert_allclose(out.final_obs[i].cpu().numpy(), want_obs, atol=2e-4, rtol=1e-4)
            assert float(out.reward[i]) == pytest.approx(want_reward, abs=2e-3)


def test_truncation_auto_resets_with_true_final_obs_and_group_seeds(env):
    obs = env.reset(seed=[7, 7, 7, 7, 9, 9, 9, 9])
    assert torch.equal(obs[0], obs[3]) and torch.equal(obs[4], obs[7]) and not torch.equal(obs[0], obs[4])
    total = torch.zeros(8, dtype=torch.float64)
    for t in range(5):
        out = env.step(torch.zeros(8, 6))
        total += out.reward.double().cpu()
        if t < 4:
            assert not out.truncated.any() and torch.equal(out.obs, out.final_obs)
    assert out.truncated.all() and not out.terminated.any()
    assert not torch.equal(out.obs, out.final_obs)             # obs is the next episode's first
    assert out.episode_lengths == [5] * 8
    np.testing.assert_allclose(out.episode_returns, total.numpy(), rtol=1e-5)
    assert env.t.eq(0).all() and out.obs.device == torch.device(DEV)


def test_trains_through_the_launcher(tmp_path):
    """One actor of 32 envs (each Warp process start-up loads its kernels): 2048 env steps a rollout, four
    updates, and the evaluator on its device."""
    run = tmp_path / "run"
    p = subprocess.run(["bash", str(ROOT / "launch" / "run_local.sh"), "--config", str(ROOT / "configs" /
                        "mjwarp_halfcheetah_ppo.json"), "--steps", "8192", "--actors", "1", "--out", str(run),
                        "--set", "trainer.eval_freq=4096", "--set", f'actors.devices=["{DEV}"]', "--set", f"trainer.eval_device={DEV}"],
                       cwd=ROOT, capture_output=True, text=True, timeout=400, start_new_session=True)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    summary = json.loads((run / "summary.json").read_text())
    assert summary["env_steps"] >= 8192 and summary["updates"] >= 1 and summary["exit_code"] == 0
