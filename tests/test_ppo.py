"""PPO loss on hand-computed cases, and the minibatch schedule of an update."""

from __future__ import annotations

import math

import pytest
import torch
from tensordict import TensorDict
from torch import nn

from learner.minibatch import EpochHooks
from learner.ppo import ppo_loss, ppo_update
from shared import keys
from shared.config import PPOConfig


class FixedPolicy(nn.Module):
    """evaluate_actions returns given log-probs/entropy/values (as functions of a parameter)."""

    def __init__(self, logp, entropy, value):
        super().__init__()
        self.shift = nn.Parameter(torch.zeros(()))
        self.logp, self.entropy, self.value = logp, entropy, value
        self.seen: list[torch.Tensor] = []

    def evaluate_actions(self, td):
        self.seen.append(td[keys.OBS].clone())
        idx = td[keys.OBS].long()
        return self.logp[idx] + self.shift, self.entropy[idx], self.value[idx] + self.shift


def batch(old_logp, adv, value, target):
    n = len(old_logp)
    return TensorDict({keys.OBS: torch.arange(n, dtype=torch.float32), keys.ACTION: torch.zeros(n),
                       keys.LOG_PROB: torch.tensor(old_logp), keys.ADVANTAGE: torch.tensor(adv),
                       keys.VALUE: torch.tensor(value), keys.VALUE_TARGET: torch.tensor(target)}, [n])


def test_clipped_objective_by_hand():
    ratios = [1.5, 0.5, 1.1, 0.9]
    new = torch.log(torch.tensor(ratios))
    policy = FixedPolicy(new, torch.tensor([0.1, 0.2, 0.3, 0.4]), torch.tensor([1.0, 2.0, 3.0, 4.0]))
    cfg = PPOConfig(clip_coef=0.2, norm_adv=False, ent_coef=0.01, vf_coef=0.5)
    out = ppo_loss(policy, batch([0.0] * 4, [1.0, -1.0, 1.0, -1.0], [0.0] * 4, [2.0, 2.0, 2.0, 2.0]), cfg)
    # per sample: max(-A r, -A clip(r)):  A=1,r=1.5 -> -1.2;  A=-1,r=0.5 -> 0.8;  A=1,r=1.1 -> -1.1;  A=-1,r=.9 -> .9
    assert out["loss_policy"].item() == pytest.approx((-1.2 + 0.8 - 1.1 + 0.9) / 4)
    assert out["value_loss"].item() == pytest.approx(0.5 * (1 + 0 + 1 + 4) / 4)
    assert out["loss_value"].item() == pytest.approx(0.5 * out["value_loss"].item())
    assert out["loss_entropy"].item() == pytest.approx(-0.01 * 0.25)
    assert out["clip_frac"].item() == pytest.approx(0.5)
    kl = sum((r - 1) - math.log(r) for r in ratios) / 4
    assert out["approx_kl"].item() == pytest.approx(kl, rel=1e-5)


def test_advantage_normalisation_and_value_clipping():
    policy = FixedPolicy(torch.zeros(3), torch.zeros(3), torch.tensor([0.0, 1.0, 5.0]))
    cfg = PPOConfig(clip_coef=0.2, norm_adv=True, clip_vloss=True, ent_coef=0.0)
    out = ppo_loss(policy, batch([0.0] * 3, [1.0, 2.0, 3.0], [0.0, 0.0, 0.0], [0.0, 0.0, 0.0]), cfg)
    # ratio 1: loss is -mean(normalised advantage) = 0
    assert out["loss_policy"].item() == pytest.approx(0.0, abs=1e-6)
    # clipped values are 0, 0.2, 0.2 -> max((v-t)^2, (vc-t)^2) = 0, 1, 25
    assert out["value_loss"].item() == pytest.approx(0.5 * (0 + 1 + 25) / 3)


def test_update_uses_every_sample_once_per_epoch():
    n = 10
    policy = FixedPolicy(torch.zeros(n), torch.zeros(n), torch.zeros(n))
    cfg = PPOConfig(n_epochs=3, batch_size=4, learning_rate=1e-3)
    opt = torch.optim.SGD(policy.parameters(), lr=0.0)
    stats = ppo_update(policy, opt, batch([0.0] * n, [1.0] * n, [0.0] * n, [0.0] * n), cfg,
                       torch.Generator().manual_seed(0))
    assert stats["epochs"] == 3
    assert len(policy.seen) == 3 * 3                      # minibatches of 4, 4, 2 per epoch
    for e in range(3):
        ids = torch.cat(policy.seen[3 * e:3 * e + 3]).long().sort().values
        assert torch.equal(ids, torch.arange(n))


def test_target_kl_stops_epochs_early():
    n = 8
    policy = FixedPolicy(torch.full((n,), 1.0), torch.zeros(n), torch.zeros(n))   # ratio e: kl ~ 0.72
    cfg = PPOConfig(n_epochs=5, batch_size=8, target_kl=0.1)
    stats = ppo_update(policy, torch.optim.SGD(policy.parameters(), lr=0.0), batch([0.0] * n, [1.0] * n,
                       [0.0] * n, [0.0] * n), cfg, torch.Generator().manual_seed(0))
    assert stats["epochs"] == 1


def test_stop_request_cuts_the_update_short_between_minibatches():
    """A stop signal during a long update: the steps already taken stand, the rest are not taken,
    and no sample is seen more often than its epochs allow (issue: a SIGINT during a 7 s GRPO
    update outlived the launcher's 10 s grace)."""
    n = 10
    asked = []

    def stop_on_fifth_ask() -> bool:
        asked.append(1)
        return len(asked) >= 5

    policy = FixedPolicy(torch.zeros(n), torch.zeros(n), torch.zeros(n))
    cfg = PPOConfig(n_epochs=3, batch_size=4, learning_rate=1e-3)
    stats = ppo_update(policy, torch.optim.SGD(policy.parameters(), lr=0.0),
                       batch([0.0] * n, [1.0] * n, [0.0] * n, [0.0] * n), cfg, torch.Generator().manual_seed(0),
                       EpochHooks(should_stop=stop_on_fifth_ask))
    # asked before every minibatch but the first: minibatches 2..6 -> the 6th is never taken
    assert len(policy.seen) == 5 and stats["steps"] == 5
    assert stats["stopped"] == 1 and stats["epochs"] == 2
    assert torch.equal(torch.cat(policy.seen[:3]).long().sort().values, torch.arange(n))   # epoch 1 whole
    assert len(torch.cat(policy.seen[3:]).long().unique()) == 8                             # epoch 2: 8 distinct

    never = FixedPolicy(torch.zeros(n), torch.zeros(n), torch.zeros(n))
    stats = ppo_update(never, torch.optim.SGD(never.parameters(), lr=0.0),
                       batch([0.0] * n, [1.0] * n, [0.0] * n, [0.0] * n), cfg, torch.Generator().manual_seed(0),
                       EpochHooks(should_stop=lambda: False))
    assert stats["stopped"] == 0 and stats["epochs"] == 3 and len(never.seen) == 9


def _actor_critic_batch(n: int, seed: int, with_mask: bool):
    from shared.config import load_config
    from shared.envs.base import ActionSpec, EnvSpec
    from shared.policies import make_policy
    g = torch.Generator().manual_seed(seed)
    cfg = load_config("configs/halfcheetah_ppo.json", ["policy.actor.network_cfg.hidden_sizes=[32,32]",
                                                       "policy.critic.network_cfg.hidden_sizes=[32,32]"])
    spec = EnvSpec(obs_shape=(17,), obs_dtype=torch.float32, action=ActionSpec(kind="box", shape=(6,), low=(-1.0,) * 6, high=(1.0,) * 6))
    torch.manual_seed(seed)
    policy = make_policy(cfg, spec)
    policy.update_normalizer(torch.randn(64, 17, generator=g) * 3 + 1)
    td = TensorDict({keys.OBS: torch.randn(n, 17, generator=g), keys.ACTION: torch.randn(n, 6, generator=g) * 0.3,
                     keys.LOG_PROB: torch.randn(n, generator=g) - 2, keys.ADVANTAGE: torch.randn(n, generator=g),
                     keys.VALUE: torch.randn(n, generator=g), keys.VALUE_TARGET: torch.randn(n, generator=g)}, [n])
    if with_mask:
        from shared.keys import MASK
        td.set(MASK, torch.rand(n, generator=g) > 0.3)
    return cfg, policy, td


@pytest.mark.parametrize("correction,with_mask,clip_vloss,gated", [("none", False, False, False),
                                                                    ("ewma", False, True, False),
                                                                    ("is", True, False, False),
                                                                    ("ewma", True, True, True)])
def test_critic_thread_gives_the_same_update_to_the_last_bit(correction, with_mask, clip_vloss, gated):
    """learner.critic_thread: the value loss's backward on a second thread. Actor and critic share no
    parameter, so the weights, Adam's state and every diagnostic must equal the one-thread update's.
    `gated` ("idle"): the thread takes only some minibatches' value losses, the caller the others."""
    import itertools
    from concurrent.futures import ThreadPoolExecutor

    from learner.corrections import resolve
    from learner.learner import make_optimizer
    from learner.proximal import EWMAProximal
    results = []
    for threaded in (False, True):
        when = itertools.cycle([True, False, False]).__next__ if threaded and gated else None
        cfg, policy, td = _actor_critic_batch(300, seed=3, with_mask=with_mask)
        a = resolve(PPOConfig(n_epochs=3, batch_size=64, correction=correction, clip_vloss=clip_vloss,
                              max_grad_norm=0.5, ent_coef=0.01))
        opt = make_optimizer(policy, 1e-3, 1e-5)
        prox = EWMAProximal(policy, 0.9) if correction == "ewma" else None
        pool = ThreadPoolExecutor(1) if threaded else None
        try:
            stats = ppo_update(policy, opt, td, a, torch.Generator().manual_seed(0), renormalize=correction == "none",
                               proximal=prox, critic_thread=pool, hooks=EpochHooks(side_when=when))
        finally:
            if pool is not None:
                pool.shutdown()
        results.append((policy.state_dict(), opt.state_dict()["state"], stats))
    (w0, s0, d0), (w1, s1, d1) = results
    assert d0["steps"] == d1["steps"] == 15
    assert "side_share" not in d0 and d1.pop("side_share") == (5 / 15 if gated else 1.0)
    for k in w0:
        assert torch.equal(w0[k], w1[k]), k
    for i in s0:
        for k in s0[i]:
            assert torch.equal(s0[i][k], s1[i][k]), (i, k)
    assert set(d0) == set(d1)
    for k in d0:
        assert d0[k] == d1[k] or (math.isnan(d0[k]) and math.isnan(d1[k])), k


def test_critic_thread_does_its_half_on_another_thread():
    """The value loss really runs on the executor's thread, and the policy loss on the caller's."""
    import threading
    from concurrent.futures import ThreadPoolExecutor
    cfg, policy, td = _actor_critic_batch(128, seed=1, with_mask=False)
    seen = {"actor": set(), "critic": set()}
    evaluate_actor, get_value = policy.evaluate_actor, policy.get_value
    policy.evaluate_actor = lambda mb: (seen["actor"].add(threading.get_ident()), evaluate_actor(mb))[1]
    policy.get_value = lambda mb: (seen["critic"].add(threading.get_ident()), get_value(mb))[1]
    policy.evaluate_actions = None   # the split path must not call it
    pool = ThreadPoolExecutor(1)
    try:
        ppo_update(policy, torch.optim.Adam(policy.parameters()), td, PPOConfig(n_epochs=1, batch_size=64),
                   torch.Generator().manual_seed(0), critic_thread=pool)
    finally:
        pool.shutdown()
    assert seen["actor"] == {threading.get_ident()}
    assert len(seen["critic"]) == 1 and seen["critic"] != seen["actor"]
