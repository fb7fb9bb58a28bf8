"""A multi-modal rollout (nested observation: rgb uint8, proprio float, instruction token ids) goes
through the actor's collector, the wire and the learner's buffer unchanged, never flattened or
converted to float before a model asks for it."""

from __future__ import annotations

import pytest
import torch
from tensordict import TensorDict
from torch import nn

from actors.rollout import Collector
from shared.rollout import rollout_template
from learner.buffer import CircularBuffer
from shared import keys, wire
from shared.envs.base import ActionSpec, EnvSpec, StepResult


class TinyReachEnv:
    """Batched, torch-native, multi-modal: an image, a proprioceptive vector and an instruction."""

    def __init__(self, num_envs: int, horizon: int = 5):
        self.num_envs, self.device, self.horizon = num_envs, torch.device("cpu"), horizon
        self.spec = EnvSpec(obs_shape=(), obs_dtype=torch.float32,
                            action=ActionSpec(kind="box", shape=(2,), low=(-1.0, -1.0), high=(1.0, 1.0)),
                            max_episode_steps=horizon,
                            obs_keys={"rgb": ((8, 8, 3), torch.uint8), "proprio": ((4,), torch.float32),
                                      "instruction": ((6,), torch.int64)})
        self.t = torch.zeros(num_envs, dtype=torch.int64)
        self.gen = torch.Generator()

    def _obs(self):
        n = self.num_envs
        return TensorDict({"rgb": torch.randint(0, 256, (n, 8, 8, 3), generator=self.gen, dtype=torch.uint8),
                           "proprio": torch.randn(n, 4, generator=self.gen),
                           "instruction": torch.randint(0, 1000, (n, 6), generator=self.gen)}, batch_size=[n])

    def reset(self, seed=None):
        if seed is not None:
            self.gen.manual_seed(seed if isinstance(seed, int) else seed[0])
        self.t.zero_()
        return self._obs()

    def step(self, action):
        self.t += 1
        truncated = self.t >= self.horizon
        final = self._obs()
        obs = final.clone()
        if truncated.any():
            obs[truncated] = self._obs()[truncated]
            self.t[truncated] = 0
        return StepResult(obs=obs, reward=-action.pow(2).sum(-1), terminated=torch.zeros_like(truncated),
                          truncated=truncated, final_obs=final, episode_returns=[0.0] * int(truncated.sum()),
                          episode_lengths=[self.horizon] * int(truncated.sum()))

    def close(self):
        pass


class TinyMultiModalPolicy(nn.Module):
    """Reads every modality in its own dtype; converts to float only inside the model."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(1000, 4)
        self.head = nn.Linear(3 + 4 + 4, 2)
        self.critic = nn.Linear(3 + 4 + 4, 1)
        self.log_std = nn.Parameter(torch.zeros(2))
        self.dtypes_seen = set()

    def _x(self, obs):
        self.dtypes_seen |= {obs["rgb"].dtype, obs["instruction"].dtype}
        img = obs["rgb"].float().mean(dim=(-3, -2)) / 255.0
        return torch.cat([img, obs["proprio"], self.embed(obs["instruction"]).mean(-2)], -1)

    def forward(self, td, deterministic=False):
        x = self._x(td[keys.OBS])
        dist = torch.distributions.Normal(self.head(x), self.log_std.exp())
        a = dist.mean if deterministic else dist.sample()
        td.set(keys.ACTION, a)
        td.set(keys.LOG_PROB, dist.log_prob(a).sum(-1))
        td.set(keys.VALUE, self.critic(x).squeeze(-1))
        return td

    def get_value(self, td):
        return self.critic(self._x(td[keys.OBS])).squeeze(-1)


def test_nested_rollout_through_collector_wire_and_buffer_unchanged():
    env = TinyReachEnv(num_envs=3)
    policy = TinyMultiModalPolicy()
    rollout, stats, _ = Collector(env, policy, num_steps=7, seed=0).collect(version=4)
    obs = rollout[keys.OBS]
    assert obs["rgb"].dtype == torch.uint8 and obs["rgb"].shape == (3, 7, 8, 8, 3)
    assert obs["instruction"].dtype == torch.int64 and obs["proprio"].dtype == torch.float32
    assert policy.dtypes_seen == {torch.uint8, torch.int64}
    assert rollout[keys.TRUNCATED][:, 4].all() and len(stats.episode_returns) == 3

    frames = wire.encode(rollout, kind="rollout", actor=0, seq=0)
    decoded, meta = wire.decode([bytes(f) for f in frames])
    assert (decoded == rollout).all()
    assert decoded[keys.OBS]["rgb"].dtype == torch.uint8

    template = rollout_template(env.spec, 3, 7)
    assert set(template[keys.OBS].keys()) == {"rgb", "proprio", "instruction"}
    buffer = CircularBuffer(2, template)
    buffer.put(decoded, {"seq": 0})
    taken = buffer.take(1)
    out = taken.data[0]
    assert (out == rollout).all()
    for k in ("rgb", "proprio", "instruction"):
        assert out[keys.OBS][k].dtype == rollout[keys.OBS][k].dtype
    # truncated steps bootstrap from the true final multi-modal observation
    assert torch.isfinite(out[keys.NEXT_VALUE]).all()


def test_nested_bootstrap_observation_through_collector_wire_and_template():
    """vla-mode PPO rollouts carry the observation each bootstrap needs, nested like the observation."""
    env = TinyReachEnv(num_envs=3)
    policy = TinyMultiModalPolicy()
    rollout, _, _ = Collector(env, policy, num_steps=7, seed=0, bootstrap_obs=True).collect(version=0)
    boot = rollout[keys.BOOTSTRAP_OBS]
    assert set(boot.keys()) == {"rgb", "proprio", "instruction"} and boot["rgb"].dtype == torch.uint8
    assert boot["rgb"][:, 4].any() and boot["rgb"][:, 6].any()      # truncated at step 4; the last step
    assert not boot["rgb"][:, :4].any() and not boot["rgb"][:, 5].any()
    with torch.no_grad():
        v = policy.get_value(TensorDict({keys.OBS: boot[:, 4]}, [3]))
    torch.testing.assert_close(rollout[keys.NEXT_VALUE][:, 4], v)
    decoded, _ = wire.decode([bytes(f) for f in wire.encode(rollout, kind="rollout", actor=0, seq=0)])
    assert (decoded == rollout).all()
    template = rollout_template(env.spec, 3, 7, with_bootstrap_obs=True)
    assert set(template.keys(include_nested=True, leaves_only=True)) == set(
        rollout.keys(include_nested=True, leaves_only=True))


def test_reach_task_needs_the_instruction_and_the_expert_solves_it():
    from shared.envs import make_env
    env = make_env("tandem/Reach-v0", 64)
    obs = env.reset(seed=3)
    assert obs["rgb"].dtype == torch.uint8 and obs["instruction"].dtype == torch.int64
    # the named target's colour is drawn in the image at the target's place
    successes = []
    for _ in range(40):
        step = env.step(env.expert_action())
        successes += step.episode_successes
    assert successes and all(successes)
    # identical seeds give identical starts (GRPO groups), different seeds differ
    a = env.reset(seed=[5, 5, 6] + [7] * 61)
    torch.testing.assert_close(a[0], a[1])
    assert not torch.equal(a["rgb"][0], a["rgb"][2]) or not torch.equal(a["proprio"][0], a["proprio"][2])


@pytest.mark.parametrize("group", [2, 3, 4, 6])
def test_reach_rotate_groups_share_the_scene_and_rotate_the_instruction(group):
    from shared.envs import make_env
    seeds = [s for s in (11, 12, 13, 14) for _ in range(group)]
    env = make_env("tandem/Reach-v0", len(seeds), {"group_goals": "rotate"})
    same = make_env("tandem/Reach-v0", len(seeds))
    obs, ref = env.reset(seed=seeds), same.reset(seed=seeds)
    # the scene (image, start) is what "same" gives; only the instruction differs
    torch.testing.assert_close(obs["rgb"], ref["rgb"])
    torch.testing.assert_close(obs["proprio"], ref["proprio"])
    goals = env.goal.view(4, group)
    assert torch.equal(goals[:, 0], same.goal.view(4, group)[:, 0])      # the first member keeps the seed's goal
    assert torch.equal(goals, (goals[:, :1] + torch.arange(group)) % 3)  # the others step through the targets
    assert torch.equal(obs["instruction"][:, 1], env.goal + 2)           # and are told so ("red" is token 2)
    assert (same.goal.view(4, group) == same.goal.view(4, group)[:, :1]).all()
    # an int seed (the evaluator's reset) is not affected
    a, b = make_env("tandem/Reach-v0", 32, {"group_goals": "rotate"}), make_env("tandem/Reach-v0", 32)
    torch.testing.assert_close(a.reset(seed=9), b.reset(seed=9))
    # the reward follows the rotated goal: the expert of each member reaches its own target
    successes = []
    for _ in range(40):
        successes += env.step(env.expert_action()).episode_successes
    assert len(successes) >= len(seeds) and all(successes)


def test_reach_rejects_an_unknown_group_goals():
    from shared.envs.reach import Reach
    with pytest.raises(ValueError, match="env.cfg.group_goals: expected one of 'same' \\| 'rotate', got 'mixed'"):
        Reach(4, group_goals="mixed")
