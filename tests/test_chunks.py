"""Action chunks (shared/chunks.py): a policy call returns H actions, the actor executes the first
``actions_per_call``, and one rollout row is one call (a macro step)."""

from __future__ import annotations

import math

import pytest
import torch
from tensordict import TensorDict

from actors.rollout import Collector, execute_chunk
from learner.advantages import compute_gae
from learner.evaluator import evaluate
from learner.learner import Learner, ListPublisher, RejectedMessage
from shared import keys
from shared.chunks import env_steps_of, executed_sum, row_gamma
from shared.config import config_from_dict
from shared.envs.base import StepResult
from shared.envs.reach import Reach
from shared.envs.torch_envs import TorchPendulum
from shared.policies import make_policy
from tests.test_learner_component import CaptureSink, PublisherSource


class Scripted:
    """N envs whose episode ends are scripted: env i's episode ends (terminated, or truncated where
    `truncate`) on its steps listed in `ends[i]`, counted over its own steps. Reward of a step: 1 +
    the step count (so every executed step is visible in the sum). The observation is the env's own
    step count; after an end it resets to 1000 + the count (its next episode's first observation)."""

    def __init__(self, ends: list[set[int]], partial: bool, truncate: bool = False):
        self.ends, self.partial_steps, self.truncate = ends, partial, truncate
        self.num_envs = len(ends)
        self.count = torch.zeros(self.num_envs, dtype=torch.int64)
        self.obs = torch.zeros(self.num_envs, 1)
        self.actions: list[list[float]] = [[] for _ in ends]

    def step(self, action: torch.Tensor, active: torch.Tensor | None = None) -> StepResult:
        live = torch.ones(self.num_envs, dtype=torch.bool) if active is None else active
        reward = torch.zeros(self.num_envs)
        end = torch.zeros(self.num_envs, dtype=torch.bool)
        final = self.obs.clone()
        for i in range(self.num_envs):
            if not live[i]:
                continue
            self.actions[i].append(float(action[i, 0]))
            self.count[i] += 1
            reward[i] = 1.0 + float(self.count[i])
            final[i] = float(self.count[i])
            end[i] = int(self.count[i]) in self.ends[i]
            self.obs[i] = 1000.0 + float(self.count[i]) if end[i] else float(self.count[i])
        zeros = torch.zeros_like(end)
        n_end = int(end.sum())
        return StepResult(obs=self.obs.clone(), reward=reward, terminated=zeros if self.truncate else end,
                          truncated=end if self.truncate else zeros, final_obs=final,
                          episode_returns=[0.0] * n_end, episode_lengths=[1] * n_end)


def chunk_of(n_envs: int, h: int) -> torch.Tensor:
    """Actions that name their position: env i's action h is 10 i + h."""
    return (10 * torch.arange(n_envs)[:, None] + torch.arange(h)[None, :]).float().unsqueeze(-1)


@pytest.mark.parametrize("partial", [True, False])
def test_a_done_in_mid_chunk_stops_that_envs_chunk(partial):
    gamma = 0.9
    env = Scripted([{2}, set(), {5}], partial=partial)
    macro, executed = execute_chunk(env, chunk_of(3, 5), n=4, gamma=gamma)
    if partial:   # env 0 stops after its 2nd action; the others run on to 4
        assert executed.tolist() == [2, 4, 4]
        assert env.actions == [[0.0, 1.0], [10.0, 11.0, 12.0, 13.0], [20.0, 21.0, 22.0, 23.0]]
    else:         # the call ends for every env where env 0's episode ended
        assert executed.tolist() == [2, 2, 2]
        assert env.actions == [[0.0, 1.0], [10.0, 11.0], [20.0, 21.0]]
    for i, m in enumerate(executed.tolist()):   # rewards 2, 3, 4, ... discounted within the chunk
        assert macro.reward[i].item() == pytest.approx(sum(gamma ** j * (2 + j) for j in range(m)))
    assert macro.terminated.tolist() == [True, False, False]
    assert macro.final_obs[0].item() == 2.0      # the true last observation of env 0's episode
    assert macro.obs[0].item() == 1002.0         # the next call acts on its next episode's first


def test_an_episode_ending_on_the_chunks_last_action_and_a_truncation():
    env = Scripted([{3}, {1}], partial=True, truncate=True)
    macro, executed = execute_chunk(env, chunk_of(2, 3), n=3, gamma=0.5)
    assert executed.tolist() == [3, 1]
    assert macro.truncated.tolist() == [True, True] and not macro.terminated.any()
    assert macro.final_obs[:, 0].tolist() == [3.0, 1.0]
    assert macro.reward.tolist() == [2 + 0.5 * 3 + 0.25 * 4, 2.0]


def test_macro_step_gae_equals_a_computation_by_hand_truncation_included():
    gamma, lam = 0.9, 0.8
    # one env, 4 calls: executed 3, 2 (truncated: bootstraps from its final observation's value), 3, 1
    executed = torch.tensor([[3, 2, 3, 1]])
    reward = torch.tensor([[1.0, 2.0, -1.0, 0.5]])
    value = torch.tensor([[0.3, 0.1, 0.7, 0.2]])
    next_value = torch.tensor([[0.1, 5.0, 0.2, 0.9]])   # V(final obs) at the truncation, V(next) elsewhere
    truncated = torch.tensor([[False, True, False, False]])
    terminated = torch.zeros_like(truncated)
    batch = TensorDict({keys.EXECUTED: executed}, batch_size=[1, 4])
    adv, target = compute_gae(reward, value, next_value, terminated, truncated, row_gamma(batch, gamma), lam)
    # by hand, backwards: the semi-Markov recursion with gamma^m per row
    g = [gamma ** m for m in (3, 2, 3, 1)]
    d3 = 0.5 + g[3] * 0.9 - 0.2
    d2 = -1.0 + g[2] * 0.2 - 0.7
    d1 = 2.0 + g[1] * 5.0 - 0.1          # truncated: bootstrap, and the recursion stops here
    d0 = 1.0 + g[0] * 0.1 - 0.3
    a3 = d3
    a2 = d2 + g[2] * lam * a3
    a1 = d1
    a0 = d0 + g[0] * lam * a1
    assert adv[0].tolist() == pytest.approx([a0, a1, a2, a3], abs=1e-6)
    assert target[0].tolist() == pytest.approx([a0 + 0.3, a1 + 0.1, a2 + 0.7, a3 + 0.2], abs=1e-6)


def chunk_config(env_id: str = "Pendulum-v1", h: int = 4, n: int = 3, **over):
    raw = {"trainer": {"seed": 1, "total_steps": 4_000, "buffer_size": 8, "buffer_type": "standard",
                       "eval_freq": 0, "save_freq": 0},
           "actors": {"num_actors": 1, "num_envs": 4, "actions_per_call": n},
           "env": {"id": env_id},
           "policy": {"chunk_size": h, "actor": {"network_cfg": {"hidden_sizes": [16]}},
                      "critic": {"network_cfg": {"hidden_sizes": [16]}}},
           "algorithm": {"cfg": {"n_epochs": 2, "batch_size": 16, "gamma": 0.9}}}
    for k, v in over.items():
        raw[k] = {**raw.get(k, {}), **v}
    return config_from_dict(raw, source="test")


def test_the_gaussian_policys_learner_log_prob_covers_the_executed_positions_only():
    cfg = chunk_config()
    env = TorchPendulum(5)
    policy = make_policy(cfg, env.spec)
    td = policy(TensorDict({keys.OBS: env.reset(seed=0)}, batch_size=[5]))
    assert td[keys.ACTION].shape == (5, 4, 1) and td[keys.LOG_PROB].shape == (5, 4)
    executed = torch.tensor([1, 2, 3, 4, 2])
    td[keys.EXECUTED] = executed
    logp, entropy, _ = policy.evaluate_actions(td)
    mean = policy.actor(policy._features(td[keys.OBS])).view(5, 4, 1).double()
    std = policy.log_std.exp().view(4, 1).double()
    normal = torch.distributions.Normal(mean, std)
    per_pos = normal.log_prob(td[keys.ACTION].double()).sum(-1)
    expected = [per_pos[i, :m].sum().item() for i, m in enumerate(executed.tolist())]
    assert logp.tolist() == pytest.approx(expected, abs=1e-4)
    assert executed_sum(td[keys.LOG_PROB], executed).tolist() == pytest.approx(expected, abs=1e-4)
    ent = [normal.entropy()[i, :m].sum().item() for i, m in enumerate(executed.tolist())]
    assert entropy.tolist() == pytest.approx(ent, abs=1e-5)


@pytest.mark.parametrize("env_cls", [Reach, TorchPendulum])
def test_the_collector_records_one_row_per_call_and_counts_env_steps(env_cls):
    """Reach steps a subset of its envs (an env whose episode ended waits); Pendulum cannot (the call
    ends for every env there)."""
    env = env_cls(6) if env_cls is Reach else env_cls(6, max_episode_steps=10)
    spec_id = "tandem/Reach-v0" if env_cls is Reach else "Pendulum-v1"
    cfg = chunk_config(spec_id, h=5, n=4, policy={"name": "actor_critic"})
    if env_cls is Reach:   # a flat-vector MLP cannot read Reach's images: a tiny stand-in policy
        policy = _FlatReachPolicy(h=5)
    else:
        policy = make_policy(cfg, env.spec)
    versions = iter(range(10, 100))
    col = Collector(env, policy, num_steps=30, seed=0, actions_per_call=4, gamma=0.9)
    td, stats, _ = col.collect(version=9, refresh=lambda: next(versions))
    executed = td[keys.EXECUTED]
    assert td[keys.ACTION].shape[:3] == (6, 30, 5)
    assert int(executed.min()) >= 1 and int(executed.max()) <= 4
    assert col.env_steps == int(executed.sum()) == env_steps_of(td) > 6 * 30
    # the version that acted is recorded per call: row t acted with the t-th version handed out
    assert td[keys.POLICY_VERSION][0].tolist() == list(range(9, 39))
    assert (td[keys.POLICY_VERSION] == td[keys.POLICY_VERSION][:1]).all()
    done_rows = td[keys.DONE]
    if env_cls is TorchPendulum:   # its episodes end every 10 steps, on every env at once: 4 + 4 + 2
        assert executed[0, :6].tolist() == [4, 4, 2, 4, 4, 2]
        assert done_rows[0, :6].tolist() == [False, False, True, False, False, True]
    else:
        assert bool((executed[done_rows] < 4).any()) or bool(done_rows.any())
        assert (executed[~done_rows] == 4).all()      # only an ended episode cuts a chunk short
    assert len(stats.episode_returns) == int(done_rows.sum())


class _FlatReachPolicy(torch.nn.Module):
    """Reach's expert-ish chunk policy for collector tests: acts on proprio only."""
    def __init__(self, h: int):
        super().__init__()
        self.chunk_size = h
        self.lin = torch.nn.Linear(4, 2 * h)
        self.critic = torch.nn.Linear(4, 1)

    def forward(self, td, deterministic: bool = False):
        x = td[keys.OBS]["proprio"]
        mean = self.lin(x).view(-1, self.chunk_size, 2)
        td[keys.ACTION] = mean + 0.5 * torch.randn_like(mean)
        td[keys.LOG_PROB] = torch.zeros(x.shape[0], self.chunk_size)
        td[keys.VALUE] = self.critic(x).squeeze(-1)
        return td

    def get_value(self, td):
        return self.critic(td[keys.OBS]["proprio"]).squeeze(-1)


def test_the_evaluator_executes_chunks_and_calls_again_after_an_episode_ends():
    class Counting(torch.nn.Module):
        chunk_size, actions_per_call = 4, 3

        def __init__(self):
            super().__init__()
            self.calls = 0

        def forward(self, td, deterministic=False):
            self.calls += 1
            td[keys.ACTION] = torch.zeros(td.shape[0], 4, 1)
            return td

    env, policy = TorchPendulum(2, max_episode_steps=10), Counting()
    result = evaluate(policy, env, 2, seed=0)
    assert result.lengths == [10, 10]
    assert policy.calls == math.ceil(10 / 3)


def test_the_learner_trains_on_chunk_rows_and_counts_env_steps():
    from actors.actor import Actor
    cfg = chunk_config("CartPole-v1", h=4, n=2)
    pub = ListPublisher()
    learner = Learner(cfg, run_dir=None, publisher=pub)
    learner.publish()
    sink = CaptureSink()
    actor = Actor(cfg, 0, PublisherSource(pub), sink)
    assert actor.step_once()
    td, meta = sink.messages[-1]
    assert meta["env_steps"] == int(td[keys.EXECUTED].sum()) > td.numel()
    bad = td.clone()
    bad[keys.EXECUTED][0, 0] = 5      # more than the chunk holds
    with pytest.raises(RejectedMessage, match="executed_actions"):
        learner.ingest(bad, meta)
    learner.ingest(td, meta)
    assert learner.env_steps == meta["env_steps"]
    batch = learner.take_batch(timeout_s=0)
    learner.update_once(*batch)
    assert learner.updates == 1 and learner.env_steps_trained == meta["env_steps"]


def test_actions_per_call_beyond_the_chunk_is_a_config_error():
    with pytest.raises(ValueError, match="actors.actions_per_call"):
        chunk_config(h=4, n=5)


def test_the_token_vla_decodes_a_chunk_in_one_parallel_pass():
    from shared.policies.action_tokens import PaliGemmaActionTokenPolicy
    from shared.policies.vla import VLAPolicy
    from shared.config import VLAConfig
    torch.manual_seed(0)
    model = PaliGemmaActionTokenPolicy("tiny", action_dim=2, chunk_size=4)
    policy = VLAPolicy(model, VLAConfig(model_class="x"))
    env = Reach(3)
    td = policy(TensorDict({keys.OBS: env.reset(seed=0)}, batch_size=[3]))
    assert policy.chunk_size == 4
    assert td[keys.ACTION].shape == (3, 4, 2) and td[keys.LOG_PROB].shape == (3, 4)
    # the 8 action tokens come from one forward pass: its logits at the 8 placeholder positions
    dist = model.action_dist(td[keys.OBS])
    per_pos = dist.log_prob(td[keys.ACTION])
    assert torch.allclose(per_pos, td[keys.LOG_PROB], atol=1e-5)
    td[keys.EXECUTED] = torch.tensor([1, 3, 4])
    logp, entropy, value = policy.evaluate_actions(td)
    assert logp.tolist() == pytest.approx([per_pos[0, :1].sum().item(), per_pos[1, :3].sum().item(),
                                           per_pos[2].sum().item()], abs=1e-5)
    assert entropy.shape == (3,) and value.shape == (3,)
    with pytest.raises(ValueError, match="parallel"):
        PaliGemmaActionTokenPolicy("tiny", action_dim=2, chunk_size=4, decoding="autoregressive")


def test_every_correction_trains_pi0_on_stale_chunk_rows(tmp_path):
    """Flow-Noise π0 rows (chains, executed actions) through every off-policy correction: a second
    batch acted by the version before the learner's (lag 1) takes each correction's stale path, and
    the per-row versions survive into the lag accounting."""
    pytest.importorskip("transformers.models.pi0")
    from learner.corrections import CORRECTIONS
    from runners.serial import SerialRunner
    from tests.flow_vla_tiny import save_tiny_pi0
    save_tiny_pi0(tmp_path / "pi0")
    raw = {"trainer": {"total_steps": 64, "buffer_size": 4, "eval_freq": 0, "buffer_type": "async",
                       "max_policy_lag": 4},
           "env": {"id": "tandem/Reach-v0"}, "actors": {"num_actors": 1, "num_envs": 4, "actions_per_call": 3},
           "policy": {"name": "flow_vla", "flow_config": {"model_path": str(tmp_path / "pi0"), "lora": {"r": 4}}},
           "algorithm": {"name": "ppo", "cfg": {"batch_size": 8, "n_epochs": 1, "drift_samples": 8}}}
    rollouts = None
    for name in sorted(CORRECTIONS):
        cfg = config_from_dict({**raw, "algorithm": {"name": "ppo", "cfg": {**raw["algorithm"]["cfg"],
                                                                              "correction": name}}}, source="test")
        runner = SerialRunner(cfg, None, evaluate_every=0)
        try:
            if rollouts is None:   # both acted by version 0: the second is one version stale at the second update
                rollouts = []
                for _ in range(2):
                    rollout, meta = runner.collect()[0]
                    rollouts.append((rollout.clone(), meta))
            stats = []
            for i, (rollout, meta) in enumerate(rollouts):
                runner.learner.ingest(rollout.clone(), {**meta, "seq": i})
                stats += runner.train()
            assert runner.learner.version == 2 and len(stats) == 2, name
            # the second batch was stale: the off-policy figures and the drift ratio are measured on it
            assert {"kl_behaviour", "drift_ratio"} <= stats[1].keys() or name == "none", (name, sorted(stats[1]))
            assert math.isfinite(stats[1]["drift_ratio"]), name
            assert all(torch.isfinite(p).all() for p in runner.learner.policy.parameters()), name
        finally:
            runner.close()
