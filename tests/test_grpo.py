"""GRPO: group-relative advantages by hand, identical group starts, the reference-KL term, config rules."""

from __future__ import annotations

import json
import math

import pytest
import torch
from tensordict import TensorDict

from actors.actor import Actor
from learner.grpo import MASK, grpo_advantages, grpo_loss, grpo_update
from learner.learner import Learner, ListPublisher
from runners.serial import SerialRunner
from shared import keys
from shared.config import ConfigError, GRPOConfig, config_from_dict, load_config
from tests.test_learner_component import CaptureSink, PublisherSource


def test_advantages_two_groups_by_hand():
    # group 0: envs 0, 1 (no episode ends); group 1: envs 2, 3
    reward = torch.tensor([[1.0, 1.0], [0.0, 1.0], [2.0, 0.0], [2.0, 0.0]])
    done = torch.zeros(4, 2, dtype=torch.bool)
    adv, mask = grpo_advantages(reward, done, group_size=2, gamma=0.5, eps=1e-8, truncate_at_first_done=True)
    # returns-to-go with gamma 0.5: env0 [1.5, 1], env1 [0.5, 1], env2 [2, 0], env3 [2, 0]
    # group 0 at t=0: mean 1, population std 0.5 -> +1, -1; at t=1 both 1 -> 0. Group 1 identical -> 0.
    assert mask.all()
    torch.testing.assert_close(adv, torch.tensor([[1.0, 0.0], [-1.0, 0.0], [0.0, 0.0], [0.0, 0.0]]),
                               rtol=1e-5, atol=1e-6)


def test_advantages_zero_when_group_identical():
    reward = torch.ones(4, 3)
    adv, _ = grpo_advantages(reward, torch.zeros(4, 3, dtype=torch.bool), 4, 0.9, 1e-8, True)
    assert torch.equal(adv, torch.zeros(4, 3))


def test_truncation_at_first_done_masks_and_renormalises_over_running_envs():
    # group of 3; env 0 ends at t=0, env 1 at t=1, env 2 runs on
    reward = torch.tensor([[1.0, 5.0, 5.0], [1.0, 1.0, 5.0], [1.0, 1.0, 1.0]])
    done = torch.tensor([[True, False, False], [False, True, False], [False, False, False]])
    adv, mask = grpo_advantages(reward, done, group_size=3, gamma=1.0, eps=1e-8, truncate_at_first_done=True)
    assert mask.tolist() == [[True, False, False], [True, True, False], [True, True, True]]
    # t=0 returns: env0 1 (ends), env1 2, env2 3 -> mean 2, pop. std sqrt(2/3)
    s = math.sqrt(2 / 3)
    torch.testing.assert_close(adv[:, 0], torch.tensor([-1 / s, 0.0, 1 / s]), rtol=1e-5, atol=1e-6)
    # t=1 running: env1 (return 1), env2 (return 2) -> mean 1.5, std 0.5 -> -1, +1; env0 masked to 0
    torch.testing.assert_close(adv[:, 1], torch.tensor([0.0, -1.0, 1.0]), rtol=1e-5, atol=1e-6)
    # t=2 only env2 runs: its own mean -> 0
    torch.testing.assert_close(adv[:, 2], torch.zeros(3))


def test_without_std_scaling_advantages_are_centred_returns():
    # the same group as above, Dr. GRPO style: centred over the running envs, not divided by the std
    reward = torch.tensor([[1.0, 5.0, 5.0], [1.0, 1.0, 5.0], [1.0, 1.0, 1.0]])
    done = torch.tensor([[True, False, False], [False, True, False], [False, False, False]])
    adv, mask = grpo_advantages(reward, done, group_size=3, gamma=1.0, eps=1e-8, truncate_at_first_done=True,
                                scale_by_std=False)
    torch.testing.assert_close(adv, torch.tensor([[-1.0, 0.0, 0.0], [0.0, -0.5, 0.0], [1.0, 0.5, 0.0]]))
    # a group whose returns differ only a little keeps small advantages (std scaling would make them +-1)
    adv, _ = grpo_advantages(torch.tensor([[1.0], [1.01]]), torch.zeros(2, 1, dtype=torch.bool), 2, 1.0, 1e-8,
                             True, scale_by_std=False)
    torch.testing.assert_close(adv[:, 0], torch.tensor([-0.005, 0.005]))


def test_without_truncation_returns_restart_after_episode_end():
    reward = torch.tensor([[1.0, 1.0, 1.0], [0.0, 0.0, 0.0]])
    done = torch.tensor([[False, True, False], [False, False, False]])
    adv, mask = grpo_advantages(reward, done, group_size=2, gamma=1.0, eps=0.0, truncate_at_first_done=False)
    assert mask.all()
    # env0 returns [2, 1, 1] (cut at t=1), env1 [0, 0, 0]: always above the group mean
    assert (adv[0] > 0).all() and (adv[1] < 0).all()


def test_episode_baseline_gives_each_env_its_outcome_at_every_step():
    # the group above: env 0 ends at t=0 (return 1), env 1 at t=1 (return 2), env 2 never (return 3)
    reward = torch.tensor([[1.0, 5.0, 5.0], [1.0, 1.0, 5.0], [1.0, 1.0, 1.0]])
    done = torch.tensor([[True, False, False], [False, True, False], [False, False, False]])
    adv, mask = grpo_advantages(reward, done, group_size=3, gamma=1.0, eps=1e-8, truncate_at_first_done=True,
                                baseline="episode")
    assert mask.tolist() == [[True, False, False], [True, True, False], [True, True, True]]
    s = math.sqrt(2 / 3)
    torch.testing.assert_close(adv, torch.tensor([[-1 / s, 0.0, 0.0], [0.0, 0.0, 0.0], [1 / s, 1 / s, 1 / s]]),
                               rtol=1e-5, atol=1e-6)


def test_episode_baseline_keeps_the_signal_on_a_failure_after_the_group_succeeded():
    # 0/1 success reward, group of 2: env 0 succeeds at t=1, env 1 fails (runs to the end). Under
    # "step" env 1's steps after t=1 are compared only with themselves (advantage 0); under
    # "episode" every one of its steps is below the group's outcome.
    reward = torch.tensor([[0.0, 1.0, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0]])
    done = torch.tensor([[False, True, False, False], [False, False, False, True]])
    step, _ = grpo_advantages(reward, done, 2, 1.0, 1e-8, True, baseline="step")
    ep, mask = grpo_advantages(reward, done, 2, 1.0, 1e-8, True, baseline="episode")
    assert step[1, 2:].abs().max() == 0
    torch.testing.assert_close(ep[1], torch.full((4,), -1.0))
    torch.testing.assert_close(ep[0], torch.tensor([1.0, 1.0, 0.0, 0.0]))
    assert mask.tolist() == [[True, True, False, False], [True, True, True, True]]
    # discounting: the faster of two successes ranks above the slower one
    fast_slow = torch.tensor([[1.0, 0.0], [0.0, 1.0]])
    ep, _ = grpo_advantages(fast_slow, fast_slow.bool(), 2, 0.9, 1e-8, True, baseline="episode")
    assert ep[0, 0] > 0 > ep[1, 0]


def test_episode_mean_weighs_every_env_equally():
    # 0/1 success, group of 2: env 0 succeeds at t=0 (1 step), env 1 fails over 3 steps. Episode
    # baseline: +1 / -1. Step-level mean: the failure's 3 steps outweigh the success's 1.
    # Episode mean: weights 1/1 and 1/3, rescaled by (4 steps / 2 envs) = 2.
    reward = torch.tensor([[1.0, 0.0, 0.0], [0.0, 0.0, 0.0]])
    done = torch.tensor([[True, False, False], [False, False, True]])
    adv, mask = grpo_advantages(reward, done, 2, 1.0, 1e-8, True, baseline="episode", loss_mean="episode")
    torch.testing.assert_close(adv, torch.tensor([[2.0, 0.0, 0.0], [-2 / 3, -2 / 3, -2 / 3]]))
    assert adv[mask].sum().abs() < 1e-6                     # the group's pushes balance
    assert adv[mask].abs().mean() == pytest.approx(1.0)     # the mean weight stays 1
    with pytest.raises(ValueError, match="loss_mean"):
        grpo_advantages(reward, done, 2, 1.0, 1e-8, True, loss_mean="token")


def test_episode_options_keep_groups_apart():
    # two groups of 2 with different outcomes: each is normalised on its own, and the episode mean
    # weighs by each env's own length (steps: 1, 3 | 2, 3; 9 in all over 4 envs)
    reward = torch.tensor([[1.0, 0.0, 0.0], [0.0, 0.0, 0.0], [0.0, 1.0, 0.0], [0.0, 0.0, 0.0]])
    done = torch.tensor([[True, False, False], [False, False, True], [False, True, False], [False, False, True]])
    adv, mask = grpo_advantages(reward, done, 2, 1.0, 1e-8, True, baseline="episode", loss_mean="episode")
    w = 9 / 4
    expect = torch.tensor([[w, 0, 0], [-w / 3, -w / 3, -w / 3], [w / 2, w / 2, 0], [-w / 3, -w / 3, -w / 3]])
    torch.testing.assert_close(adv, expect)
    # the step baseline with the episode mean: the step advantages, each env weighed by 1 / its length
    step, _ = grpo_advantages(reward, done, 2, 1.0, 1e-8, True)
    both, _ = grpo_advantages(reward, done, 2, 1.0, 1e-8, True, loss_mean="episode")
    torch.testing.assert_close(both, step * w / mask.sum(1, keepdim=True))


def test_episode_baseline_needs_truncation_at_first_done():
    with pytest.raises(ValueError, match="truncate_at_first_done"):
        grpo_advantages(torch.zeros(2, 2), torch.zeros(2, 2, dtype=torch.bool), 2, 0.9, 1e-8, False,
                        baseline="episode")
    with pytest.raises(ValueError, match="loss_mean='episode' needs truncate_at_first_done"):
        grpo_advantages(torch.zeros(2, 2), torch.zeros(2, 2, dtype=torch.bool), 2, 0.9, 1e-8, False,
                        loss_mean="episode")
    with pytest.raises(ValueError, match="baseline"):
        grpo_advantages(torch.zeros(2, 2), torch.zeros(2, 2, dtype=torch.bool), 2, 0.9, 1e-8, True,
                        baseline="trajectory")


def test_group_size_must_divide_envs():
    with pytest.raises(ValueError, match="multiple of group_size"):
        grpo_advantages(torch.zeros(3, 2), torch.zeros(3, 2, dtype=torch.bool), 2, 0.9, 1e-8, True)


class _Policy(torch.nn.Module):
    def __init__(self, logp):
        super().__init__()
        self.shift = torch.nn.Parameter(torch.zeros(()))
        self.logp = logp

    def evaluate_actions(self, td):
        return self.logp[td[keys.OBS].long()] + self.shift, torch.zeros(td.shape[0]), None


def test_reference_kl_term():
    logp, ref = torch.log(torch.tensor([0.5, 0.2])), torch.log(torch.tensor([0.25, 0.4]))
    mb = TensorDict({keys.OBS: torch.arange(2.0), keys.ACTION: torch.zeros(2), keys.LOG_PROB: logp.clone(),
                     keys.ADVANTAGE: torch.zeros(2), "ref_log_prob": ref}, [2])
    out = grpo_loss(_Policy(logp), mb, GRPOConfig(kl_coef=0.1))
    d = ref - logp
    expected = (d.exp() - d - 1).mean()
    assert out["kl_ref"].item() == pytest.approx(expected.item())
    assert out["loss_kl"].item() == pytest.approx(0.1 * expected.item())
    assert "loss_kl" not in grpo_loss(_Policy(logp), mb, GRPOConfig(kl_coef=0.0))


def test_clip_higher_widens_only_the_upper_bound():
    """clip_coef_high: ratios are clipped to [1 - clip_coef, 1 + clip_coef_high]; by hand, with the
    policy's log-probs moved to ratios 0.7, 1.25 and 1.4 on positive and negative advantages."""
    new = torch.log(torch.tensor([0.7, 1.25, 1.4, 0.7, 1.25, 1.4]))
    old = torch.zeros(6)
    adv = torch.tensor([1.0, 1.0, 1.0, -1.0, -1.0, -1.0])
    mb = TensorDict({keys.OBS: torch.arange(6.0), keys.ACTION: torch.zeros(6), keys.LOG_PROB: old,
                     keys.ADVANTAGE: adv}, [6])

    def by_hand(low, high):
        r = new.exp()
        return torch.max(-adv * r, -adv * r.clamp(1 - low, 1 + high)).mean().item()

    sym = grpo_loss(_Policy(new), mb, GRPOConfig(clip_coef=0.2))
    wide = grpo_loss(_Policy(new), mb, GRPOConfig(clip_coef=0.2, clip_coef_high=0.28))
    assert sym["loss_policy"].item() == pytest.approx(by_hand(0.2, 0.2))
    assert wide["loss_policy"].item() == pytest.approx(by_hand(0.2, 0.28))
    assert wide["loss_policy"].item() < sym["loss_policy"].item()      # 1.25 is no longer clipped up
    assert sym["clip_frac"].item() == pytest.approx(1.0) and wide["clip_frac"].item() == pytest.approx(4 / 6)
    # the gradient reaches the sample at 1.25 with a positive advantage only under clip-higher
    for cfg, flows in ((GRPOConfig(clip_coef=0.2), False), (GRPOConfig(clip_coef=0.2, clip_coef_high=0.28), True)):
        one = TensorDict({keys.OBS: torch.tensor([1.0]), keys.ACTION: torch.zeros(1), keys.LOG_PROB: torch.zeros(1),
                          keys.ADVANTAGE: torch.ones(1)}, [1])
        policy = _Policy(new)
        grpo_loss(policy, one, cfg)["loss_policy"].backward()
        assert (policy.shift.grad.abs().item() > 0) == flows


def test_update_only_trains_on_unmasked_steps():
    seen = []

    class Recording(_Policy):
        def evaluate_actions(self, td):
            seen.append(td[keys.OBS].clone())
            return super().evaluate_actions(td)

    n = 6
    batch = TensorDict({keys.OBS: torch.arange(float(n)).view(2, 3), keys.ACTION: torch.zeros(2, 3),
                        keys.LOG_PROB: torch.zeros(2, 3), keys.ADVANTAGE: torch.ones(2, 3),
                        MASK: torch.tensor([[True, False, True], [True, True, False]])}, [2, 3])
    pol = Recording(torch.zeros(n))
    stats = grpo_update(pol, None, torch.optim.SGD(pol.parameters(), lr=0.0), batch,
                        GRPOConfig(n_epochs=2, batch_size=10), torch.Generator().manual_seed(0))
    assert stats["samples"] == 4
    assert sorted(torch.cat(seen[:1]).tolist()) == [0.0, 2.0, 3.0, 4.0]


def grpo_config(**alg):
    return config_from_dict({
        "trainer": {"seed": 2, "buffer_size": 6, "buffer_type": "standard", "eval_freq": 0, "save_freq": 0},
        "actors": {"num_actors": 1, "num_envs": 4},
        "env": {"id": "Pendulum-v1"},
        "policy": {"name": "actor_only", "critic": None, "actor": {"network_cfg": {"hidden_sizes": [8]}}},
        "algorithm": {"name": "grpo", "cfg": {"group_size": 2, "batch_size": 8, **alg}},
    }, source="test")


@pytest.mark.parametrize("env_id", ["Pendulum-v1", "tandem/Pendulum-v0"])
def test_envs_of_a_group_start_from_identical_states(env_id):
    cfg = grpo_config()
    cfg.env.id = env_id
    pub = ListPublisher()
    learner = Learner(cfg, run_dir=None, publisher=pub)
    learner.publish()
    sink = CaptureSink()
    actor = Actor(cfg, 0, PublisherSource(pub), sink)
    firsts = []
    for _ in range(2):
        assert actor.step_once()
        td, _ = sink.messages[-1]
        assert keys.VALUE not in td.keys() and keys.NEXT_VALUE not in td.keys()
        first = td[keys.OBS][:, 0]
        torch.testing.assert_close(first[0], first[1])      # group 0
        torch.testing.assert_close(first[2], first[3])      # group 1
        assert not torch.allclose(first[0], first[2])       # groups differ
        firsts.append(first)
        learner.ingest(td, sink.messages[-1][1])
        learner.update_once(*learner.take_batch(timeout_s=0))
    assert not torch.allclose(firsts[0], firsts[1])         # a new seed per rollout
    assert learner.version == 2


def test_kl_reference_is_frozen_initial_policy_and_checkpointed(tmp_path):
    cfg = grpo_config(kl_coef=0.05)
    runner = SerialRunner(cfg, tmp_path)
    learner = runner.learner
    init = {k: v.clone() for k, v in learner.policy.state_dict().items()}
    for rollout, meta in runner.collect():
        learner.ingest(rollout, meta)
    stats, = runner.train()
    assert "kl_ref" in stats
    for k, v in learner.algorithm.ref_policy.state_dict().items():
        assert torch.equal(v, init[k])
    learner.save()
    resumed = Learner(cfg, run_dir=tmp_path, publisher=ListPublisher(), resume=True)
    for k, v in learner.algorithm.ref_policy.state_dict().items():
        assert torch.equal(resumed.algorithm.ref_policy.state_dict()[k], v)
    runner.close()


def test_bad_combinations_name_file_and_keys(tmp_path):
    raw = json.loads(open("configs/cartpole_grpo.json").read())
    raw["actors"]["num_envs"] = 12
    raw["policy"]["name"] = "actor_critic"
    raw["algorithm"]["cfg"].update(baseline="episode", loss_mean="episode", truncate_at_first_done=False)
    path = tmp_path / "grpo_bad.json"
    path.write_text(json.dumps(raw))
    with pytest.raises(ConfigError) as e:
        load_config(path)
    msg = str(e.value)
    assert "grpo_bad.json: actors.num_envs: 12 is not a multiple of algorithm.cfg.group_size (8)" in msg
    assert "grpo_bad.json: policy.name: GRPO is critic-free" in msg
    assert "grpo_bad.json: algorithm.cfg.baseline: \"episode\" needs algorithm.cfg.truncate_at_first_done" in msg
    assert "grpo_bad.json: algorithm.cfg.loss_mean: \"episode\" needs algorithm.cfg.truncate_at_first_done" in msg
    raw = json.loads(open("configs/cartpole_grpo.json").read())
    raw["algorithm"]["cfg"]["gae_lambda"] = 0.9                  # a PPO key under GRPO
    path.write_text(json.dumps(raw))
    with pytest.raises(ConfigError, match=r"grpo_bad\.json: algorithm\.cfg\.gae_lambda: unknown key"):
        load_config(path)


def _ds_config(**alg):
    return config_from_dict({
        "trainer": {"seed": 2, "buffer_size": 6, "buffer_type": "vla", "max_policy_lag": 4, "eval_freq": 0,
                    "save_freq": 0},
        "actors": {"num_actors": 1, "num_envs": 4},
        "env": {"id": "Pendulum-v1"},
        "policy": {"name": "actor_only", "critic": None, "actor": {"network_cfg": {"hidden_sizes": [8]}}},
        "algorithm": {"name": "grpo", "cfg": {"group_size": 2, "batch_size": 8, "dynamic_sampling": True, **alg}},
    }, source="test")


def test_informative_groups_are_those_whose_outcomes_differ():
    from learner.grpo import informative_groups
    cfg = GRPOConfig(group_size=2, baseline="episode", loss_mean="episode", gamma=1.0)
    reward = torch.tensor([[0., 1.], [0., 1.],      # group 0: both succeed at the same step
                           [0., 0.], [0., 0.],      # group 1: both fail
                           [0., 1.], [0., 0.]])     # group 2: one of each
    done = torch.tensor([[False, True], [False, True], [False, True], [False, True], [False, True], [False, True]])
    assert informative_groups(reward, done, cfg).tolist() == [False, False, True]
    cfg = GRPOConfig(group_size=2, gamma=0.9)        # baseline "step": returns-to-go compared at every step
    assert informative_groups(reward, done, cfg).tolist() == [False, False, True]


def test_a_success_rate_band_keeps_the_groups_strictly_inside_it():
    """dynamic_sampling_min_accuracy / _max_accuracy 0.1 and 0.9 (SimpleVLA-RL's band) on groups of 16
    with a 0/1 success reward: 1 success in 16 (0.06) and 15 in 16 (0.94) are left out, though their
    outcomes differ; 2 in 16 (0.125) is kept. Only a member's first episode counts."""
    from learner.grpo import informative_groups
    g, t = 16, 4
    done = torch.zeros(3 * g, t, dtype=torch.bool)
    done[:, 1] = True                                    # every member's first episode ends at step 1
    reward = torch.zeros(3 * g, t)
    reward[0, 1] = 1.0                                   # group 0: one success
    reward[g:2 * g - 1, 1] = 1.0                         # group 1: fifteen
    reward[2 * g:2 * g + 2, 0] = 1.0                     # group 2: two
    reward[5, 3] = 1.0                                   # group 0, after a first episode: not counted
    band = GRPOConfig(group_size=g, dynamic_sampling_min_accuracy=0.1, dynamic_sampling_max_accuracy=0.9)
    assert informative_groups(reward, done, band).tolist() == [False, False, True]
    plain = GRPOConfig(group_size=g)                     # outcomes differ: all three
    assert informative_groups(reward, done, plain).tolist() == [True, True, True]


def test_a_success_rate_band_is_checked():
    with pytest.raises(ConfigError, match="dynamic sampling, which is off"):
        grpo_config(dynamic_sampling_min_accuracy=0.1)
    with pytest.raises(ConfigError, match="must be below dynamic_sampling_max_accuracy"):
        _ds_config(dynamic_sampling_min_accuracy=0.5, dynamic_sampling_max_accuracy=0.5)
    with pytest.raises(ConfigError, match="dynamic_sampling_max_accuracy"):
        _ds_config(dynamic_sampling_max_accuracy=1.5)
    assert _ds_config(dynamic_sampling_min_accuracy=0.1, dynamic_sampling_max_accuracy=0.9) is not None


def test_dynamic_sampling_keeps_identical_groups_out_and_the_batch_size(tmp_path):
    """Three rollouts of 2 groups each (k = 1: an update wants 2 groups that differ). The first and
    third have one such group each, the second none: it is dropped at once, and the update trains on
    the first and third with their identical groups masked out."""
    cfg = _ds_config()
    runner = SerialRunner(cfg, tmp_path)
    learner = runner.learner
    same = torch.zeros(6)
    differ = torch.arange(6, dtype=torch.float32)
    plans = [(same, differ), (same, same), (differ, same)]      # (group 0, group 1) rewards of env 0
    sent = []
    for g0, g1 in plans:
        (rollout, meta), = runner.collect()
        # a group that differs: its second env earns one more at every step
        reward = torch.stack([g0, g0 + (g0 is differ) * 1.0, g1, g1 + (g1 is differ) * 1.0])
        rollout[keys.REWARD] = reward
        rollout[keys.DONE] = torch.zeros_like(rollout[keys.DONE])
        rollout[keys.TERMINATED] = torch.zeros_like(rollout[keys.TERMINATED])
        rollout[keys.TRUNCATED] = torch.zeros_like(rollout[keys.TRUNCATED])
        learner.ingest(rollout, meta)
        sent.append(meta["seq"])
        if len(sent) == 1:   # one group short: held for the next rollout, and counted as finished for pacing
            assert learner.take_batch(timeout_s=0) is None and learner.finished_counts() == [1]
    assert learner.stats.counts["dropped_uninformative"] == 1
    data, infos = learner.take_batch(timeout_s=0)
    assert learner.finished_counts() == [1]          # the dropped one; the two taken are consumed by the update
    assert [i["seq"] for i in infos] == [sent[0], sent[2]] and [i["groups"] for i in infos] == [1, 1]
    flat = data.reshape(-1, data.shape[-1])
    stats = learner.algorithm.prepare(flat, torch.zeros(flat.numel()))
    mask = flat[MASK]
    assert stats == {"groups_kept": 2.0, "groups_dropped": 2.0}
    assert mask[[0, 1, 6, 7]].eq(False).all() and mask[[2, 3, 4, 5]].all()    # identical groups out, others in
    assert flat[keys.ADVANTAGE][~mask].eq(0).all()
    stats = learner.update_once(data, infos)
    assert stats["samples"] == 4 * cfg.trainer.buffer_size      # two groups of two envs
    runner.close()


def test_dynamic_sampling_needs_vla_mode():
    with pytest.raises(ConfigError, match="dynamic_sampling needs trainer.buffer_type"):
        grpo_config(dynamic_sampling=True)
