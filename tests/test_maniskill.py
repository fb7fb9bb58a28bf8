"""ManiSkill3 adapter (``maniskill/<EnvId>``, shared/envs/maniskill.py) on the CPU PhysX backend.

Needs the ``maniskill`` extra and a Vulkan driver: ``launch/setup_maniskill.sh`` installs both (the
tests are skipped, naming that command, where either is missing).
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
SETUP = "launch/setup_maniskill.sh"


def _available() -> str | None:
    try:
        from shared.envs.maniskill import import_maniskill, use_local_vulkan
        import_maniskill()
    except ImportError as e:
        return str(e)
    import os
    if not (use_local_vulkan() or os.environ.get("VK_ICD_FILENAMES") or os.environ.get("VK_DRIVER_FILES")
            or Path("/usr/share/vulkan/icd.d").is_dir()):
        return "no Vulkan driver"
    return None


_why = _available()
pytestmark = pytest.mark.skipif(_why is not None, reason=f"ManiSkill3 not set up ({_why}); run `{SETUP}`")

CFG = {"control_mode": "pd_ee_delta_pos"}


def make(n: int, **cfg):
    from shared.envs import make_env
    return make_env("maniskill/PushCube-v1", n, {**CFG, **cfg})


def test_state_spec_and_equal_seeds_give_equal_starts():
    env = make(3)
    try:
        assert env.spec.obs_shape == (35,) and env.spec.action.shape == (4,) and env.spec.max_episode_steps == 50
        assert env.spec.action.low == (-1.0,) * 4 and env.spec.action.high == (1.0,) * 4
        obs = env.reset(seed=[7, 7, 8])                     # a GRPO group of two, and one other
        assert obs.dtype == torch.float32 and obs.shape == (3, 35)
        assert torch.equal(obs[0], obs[1]) and not torch.equal(obs[0], obs[2])
        a = torch.rand(1, 4) * 2 - 1
        out = env.step(a.expand(3, 4))                       # same state, same action: same next state
        assert torch.equal(out.obs[0], out.obs[1]) and torch.equal(out.reward[0], out.reward[1])
        again = env.reset(seed=[7, 7, 8])
        assert torch.equal(again, obs)                       # a seed gives the same start every time
    finally:
        env.close()


def test_truncation_keeps_the_true_final_observation_and_resets_only_that_env():
    limit = 5
    env, twin = make(2, max_episode_steps=limit), make(2, max_episode_steps=limit + 10)
    try:
        env.reset(seed=[3, 4])
        twin.reset(seed=[3, 4])
        gen = torch.Generator().manual_seed(0)
        total = torch.zeros(2, dtype=torch.float64)
        for t in range(limit):
            a = torch.rand(2, 4, generator=gen) * 2 - 1
            out, ref = env.step(a), twin.step(a)
            total += out.reward.double()
            assert torch.equal(out.reward, ref.reward)
            if t < limit - 1:
                assert not (out.terminated | out.truncated).any() and torch.equal(out.obs, out.final_obs)
        # the step that hits the limit: truncated (not terminated), final_obs is where the twin is now,
        # obs is a fresh episode's first observation
        assert out.truncated.all() and not out.terminated.any()
        assert torch.equal(out.final_obs, ref.obs)
        assert not torch.equal(out.obs, out.final_obs)
        assert out.episode_lengths == [limit, limit] and out.episode_successes == [False, False]
        assert out.episode_returns == pytest.approx(total.tolist(), rel=1e-6)
    finally:
        env.close()
        twin.close()


def test_rgb_observations_with_an_instruction():
    from shared.envs import make_env
    env = make_env("maniskill/PickCube-v1", 2, {**CFG, "obs_mode": "rgb", "image_size": 32,
                                                "instruction": [5, 6, 7], "state_key": "proprio"})
    try:
        keys = env.spec.obs_keys
        assert keys["rgb"] == ((32, 32, 3), torch.uint8) and keys["instruction"] == ((3,), torch.int64)
        assert keys["proprio"][1] == torch.float32 and len(keys["proprio"][0]) == 1
        obs = env.reset(seed=0)
        assert obs["rgb"].dtype == torch.uint8 and obs["rgb"].float().std() > 5      # a rendered scene
        assert obs["instruction"].tolist() == [[5, 6, 7]] * 2
        out = env.step(torch.zeros(2, 4))
        assert out.obs["rgb"].shape == (2, 32, 32, 3) and out.reward.shape == (2,)
    finally:
        env.close()


def test_a_text_instruction_is_the_model_tokenizers_ids(tmp_path):
    from foreign_vla import make_tokenizer
    from shared.envs import env_spec, make_env
    from shared.instructions import InstructionTokenizer
    make_tokenizer().save_pretrained(str(tmp_path))
    hf = make_tokenizer()
    cfg = {**CFG, "obs_mode": "rgb", "image_size": 32, "instruction": "pick up the cube", "instruction_length": 6,
           "state_key": "proprio"}
    env = make_env("maniskill/PickCube-v1", 2, cfg, tokenizer=InstructionTokenizer(tmp_path))
    try:
        ids = hf("pick up the cube", add_special_tokens=False).input_ids
        assert env.reset(seed=0)["instruction"].tolist() == [ids + [hf.pad_token_id] * (6 - len(ids))] * 2
        assert env.spec.extra["instructions"] == "text"
    finally:
        env.close()
    assert env_spec("maniskill/PickCube-v1", cfg).obs_keys["instruction"] == ((6,), torch.int64)   # no tokenizer
    with pytest.raises(ValueError, match="text env.cfg.instruction needs the model's tokenizer"):
        make_env("maniskill/PickCube-v1", 1, cfg)
    with pytest.raises(ValueError, match="instruction_length applies to a text instruction only"):
        make_env("maniskill/PickCube-v1", 1, {**cfg, "instruction": [5, 6]})


@pytest.mark.parametrize("cfg, match", [({"obs_modes": "state"}, "env.cfg.obs_modes: unknown key"),
                                        ({"obs_mode": "pointcloud"}, "obs_mode"),
                                        ({"sim_backend": "warp"}, "sim_backend"),
                                        ({"instruction": "pick"}, "instruction"),
                                        ({"image_size": 3}, "image_size"),
                                        ({"state_key": "rgb"}, "state_key"),
                                        ({"sim_kwargs": [1]}, "sim_kwargs")])
def test_config_errors_name_the_key(cfg, match):
    with pytest.raises(ValueError, match=match):
        make(1, **cfg)


def test_an_unknown_task_is_named():
    from shared.envs import make_env
    with pytest.raises(ValueError, match="NoSuchTask-v9"):
        make_env("maniskill/NoSuchTask-v9", 1, {})


@pytest.mark.slow
@pytest.mark.parametrize("algo", ["ppo", "grpo"])
def test_trains_through_the_launcher(tmp_path, algo):
    """A short PushCube run: versions go up, success reaches the logs (train and eval). One actor (each
    ManiSkill process start-up builds a PhysX scene): 200 env steps a rollout, an update each."""
    run = tmp_path / "run"
    sets = ["actors.num_actors=1", "trainer.eval_freq=1600", "trainer.num_eval_episodes=4", "actors.num_envs=4",
            "trainer.buffer_size=50"]
    if algo == "grpo":
        sets += ["algorithm.name=grpo", "policy.name=actor_only", 'algorithm.cfg={"group_size": 2, "n_epochs": 2, "batch_size": 100, "reset_every_rollout": true, "truncate_at_first_done": true}']
    args = ["bash", str(ROOT / "launch" / "run_local.sh"), "--config", str(ROOT / "configs" / "maniskill_pushcube_ppo.json"),
            "--steps", "1600", "--out", str(run)]
    for s in sets:
        args += ["--set", s]
    p = subprocess.run(args, cwd=ROOT, capture_output=True, text=True, timeout=400, start_new_session=True)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    summary = json.loads((run / "summary.json").read_text())
    assert summary["env_steps"] >= 1600 and summary["exit_code"] == 0 and summary["malformed"] == 0
    metrics = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines() if x.strip()]
    versions = [m["version"] for m in metrics if "updates" in m]
    assert versions == sorted(versions) and versions[-1] >= 2
    assert any("train/success_rate" in m for m in metrics)
    evals = [m for m in metrics if "eval/success_rate" in m]
    assert evals and 0.0 <= evals[-1]["eval/success_rate"] <= 1.0


@pytest.mark.parametrize("terminate", [False, True])
def test_success_ends_the_episode_only_when_asked(monkeypatch, terminate):
    """ManiSkill's own step says success at step 2 of env 0 (and terminated): by default the episode
    goes on to the limit and counts as solved (success_once); with terminate_on_success it ends there."""
    from shared.envs import maniskill
    env = make(2, max_episode_steps=4, terminate_on_success=terminate)
    real = maniskill._CpuScenes.step
    calls = {"n": 0}

    def step(self, action):
        obs, reward, terminated, truncated, info = real(self, action)
        calls["n"] += 1
        hit = torch.tensor([calls["n"] == 2, False])
        return obs, reward, terminated | hit, truncated, {**info, "success": hit}

    try:
        env.reset(seed=[1, 2])
        monkeypatch.setattr(maniskill._CpuScenes, "step", step)
        outs = [env.step(torch.zeros(2, *env.spec.action.shape)) for _ in range(4)]
        if terminate:
            assert outs[1].terminated.tolist() == [True, False] and outs[1].episode_successes == [True]
            assert outs[3].truncated.tolist() == [False, True] and outs[3].episode_successes == [False]
        else:
            assert not any(o.terminated.any() for o in outs)
            assert outs[3].truncated.all() and outs[3].episode_successes == [True, False]
            assert outs[3].episode_lengths == [4, 4]
    finally:
        env.close()
