"""The off-policy corrections inside the learner (learner/corrections.py, learner/ppo.py): advantages
normalised once per batch before any weight, recompute_values honoured for every correction, the
rho_bar defaults, APPO's targets, the EWMA proximal policy's update rule, masked samples, and
rollouts from before the bootstrap observation existed."""

from __future__ import annotations

import pytest
import torch
from tensordict import TensorDict

from learner.advantages import compute_gae
from learner.corrections import CORRECTIONS, CurrentPolicy, make_correction, resolve
from learner.minibatch import log_ratio
from learner.ppo import ppo_loss
from learner.proximal import EWMAProximal, ewma_decay_for
from learner.vtrace import vtrace
from shared import keys
from shared.keys import MASK
from shared.config import PPOConfig
from shared.policies import make_policy
from tests.test_staleness import _rollout, _vla_learner, _weights_after_stale_updates


def _stale_update(tmp_path, monkeypatch, lag=3, **algo):
    """A learner `lag` versions past a rollout acted by version 0; returns what ppo_update got."""
    import learner.ppo as ppo_module
    cfg, learner = _vla_learner(tmp_path, **algo)
    n, t = cfg.actors.num_envs, cfg.trainer.buffer_size
    td, meta = _rollout(cfg, learner, torch.zeros(n, t, dtype=torch.int64))
    for _ in range(lag):
        learner.ingest(td.clone(), meta)
        learner.update_once(*learner.take_batch(timeout_s=0))
    seen = {}
    real = ppo_module.ppo_update

    def spy(policy, optimizer, batch, cfg_, generator, **kwargs):
        seen["batch"], seen["kwargs"] = batch.clone(), kwargs
        return real(policy, optimizer, batch, cfg_, generator, **kwargs)

    with torch.no_grad():
        logp_now, _, v_now = learner.policy.evaluate_actions(td.reshape(-1))
    monkeypatch.setattr(ppo_module, "ppo_update", spy)
    learner.ingest(td.clone(), meta)
    stats = learner.update_once(*learner.take_batch(timeout_s=0))
    return cfg, learner, td, logp_now.view(n, t), v_now.view(n, t), seen, stats


def _norm(x):
    return (x - x.mean()) / (x.std() + 1e-8)


@pytest.mark.parametrize("correction", ["is", "mask", "ewma"])
def test_advantages_are_normalised_once_per_batch_before_the_weight(tmp_path, monkeypatch, correction):
    cfg, learner, td, logp_now, _, seen, _ = _stale_update(tmp_path, monkeypatch, correction=correction,
                                                           recompute_values=False)
    a = cfg.algorithm.cfg
    adv, _ = compute_gae(td[keys.REWARD], td[keys.VALUE], td[keys.NEXT_VALUE], td[keys.TERMINATED], td[keys.DONE],
                         a.gamma, a.gae_lambda)
    rho = log_ratio(logp_now, td[keys.LOG_PROB]).exp()
    weight = torch.ones_like(rho) if correction == "ewma" else rho.clamp(max=100.0)   # ewma weighs per minibatch
    torch.testing.assert_close(seen["batch"][keys.ADVANTAGE], _norm(adv) * weight)
    assert seen["kwargs"]["renormalize"] is False
    assert (seen["kwargs"]["proximal"] is not None) == (correction == "ewma")


@pytest.mark.parametrize("rho_weight", [True, False])
def test_appo_weights_its_advantage_by_the_truncated_ratio_only_when_asked(tmp_path, monkeypatch, rho_weight):
    cfg, _, td, logp_now, _, seen, _ = _stale_update(tmp_path, monkeypatch, correction="appo", recompute_values=False,
                                                     appo_rho_weight=rho_weight)
    a = cfg.algorithm.cfg
    _, adv, _ = vtrace(td[keys.LOG_PROB], logp_now, td[keys.REWARD], td[keys.VALUE], td[keys.NEXT_VALUE],
                       td[keys.TERMINATED], td[keys.DONE], a.gamma, 1.0, 1.0, a.gae_lambda, weighted=False,
                       advantage=resolve(a).vtrace_advantage)
    rho = log_ratio(logp_now, td[keys.LOG_PROB]).exp()
    expected = _norm(adv) * (rho.clamp(max=1.0) if rho_weight else 1.0)
    torch.testing.assert_close(seen["batch"][keys.ADVANTAGE], expected)
    torch.testing.assert_close(seen["batch"][keys.LOG_PROB], td[keys.LOG_PROB])   # the clip stays on mu
    assert bool((rho < 0.99).any())          # stale enough that the weight is not 1 everywhere


def test_plain_ppo_still_normalises_per_minibatch(tmp_path, monkeypatch):
    _, _, _, _, _, seen, _ = _stale_update(tmp_path, monkeypatch, correction="none")
    assert seen["kwargs"]["renormalize"] is True and seen["kwargs"]["proximal"] is None


@pytest.mark.parametrize("correction", ["is", "vtrace", "appo"])
def test_recompute_values_false_is_honoured_by_every_correction(tmp_path, monkeypatch, correction):
    """The values and bootstraps are the acting critic's, the log-probs are the current policy's."""
    cfg, _, td, logp_now, _, seen, stats = _stale_update(tmp_path, monkeypatch, correction=correction,
                                                         recompute_values=False)
    a = cfg.algorithm.cfg
    assert "value_shift" not in stats
    assert keys.BOOTSTRAP_OBS not in td.keys()          # nothing to recompute from: the actors send none
    torch.testing.assert_close(seen["batch"][keys.VALUE], td[keys.VALUE])
    if correction == "is":
        expected = compute_gae(td[keys.REWARD], td[keys.VALUE], td[keys.NEXT_VALUE], td[keys.TERMINATED],
                               td[keys.DONE], a.gamma, a.gae_lambda)[1]
    else:
        expected = vtrace(td[keys.LOG_PROB], logp_now, td[keys.REWARD], td[keys.VALUE], td[keys.NEXT_VALUE],
                          td[keys.TERMINATED], td[keys.DONE], a.gamma, 1.0, 1.0, a.gae_lambda)[0]
    torch.testing.assert_close(seen["batch"][keys.VALUE_TARGET], expected)


def test_appo_targets_are_vtrace_and_its_clip_is_anchored_on_the_behaviour_policy(tmp_path):
    cfg, learner = _vla_learner(tmp_path, correction="vtrace")
    n, t = cfg.actors.num_envs, cfg.trainer.buffer_size
    td, meta = _rollout(cfg, learner, torch.zeros(n, t, dtype=torch.int64))
    for _ in range(3):                              # the rollout is now 3 versions old
        learner.ingest(td.clone(), meta)
        learner.update_once(*learner.take_batch(timeout_s=0))
    out, a = {}, cfg.algorithm.cfg
    a.vtrace_advantage = "gae"          # one advantage form for both (defaults differ per correction)
    for corr, weight in (("vtrace", True), ("appo", True), ("appo_unweighted", False)):
        a.correction, a.appo_rho_weight = corr.split("_")[0], weight
        correction = make_correction(a, CurrentPolicy(learner.policy, learner.device), learner.stats.count)
        flat = td.clone()
        stats, renormalize = correction(flat, flat[keys.REWARD], stale=True)
        out[corr] = (flat, stats, renormalize)
    (v, stats_v, renorm_v), (a, stats_a, renorm_a) = out["vtrace"], out["appo"]
    torch.testing.assert_close(a[keys.VALUE_TARGET], v[keys.VALUE_TARGET])
    torch.testing.assert_close(a[keys.ADVANTAGE], v[keys.ADVANTAGE])
    assert stats_a == stats_v and renorm_a is renorm_v is False
    # without appo_rho_weight: the same advantages but for the min(1, pi/mu) weight
    with torch.no_grad():
        logp_now, _, v_now = learner.policy.evaluate_actions(td.reshape(-1))
    rho = log_ratio(logp_now.view(n, t), td[keys.LOG_PROB]).exp()
    torch.testing.assert_close(out["appo_unweighted"][0][keys.ADVANTAGE] * rho.clamp(max=1.0), v[keys.ADVANTAGE])
    # APPO: PPO's ratio on pi/mu; V-trace's decoupled clip: on the policy at the start of the update
    torch.testing.assert_close(a[keys.LOG_PROB], td[keys.LOG_PROB])
    assert not torch.allclose(v[keys.LOG_PROB], td[keys.LOG_PROB])
    # and the targets are V-trace's on the current critic, with rho_bar = c_bar = 1
    torch.testing.assert_close(v[keys.LOG_PROB], logp_now.view(n, t))
    torch.testing.assert_close(v[keys.VALUE], v_now.view(n, t))


def test_rho_bar_defaults_per_correction():
    assert resolve(PPOConfig(correction="is")).rho_bar == 100.0
    assert resolve(PPOConfig(correction="ewma")).rho_bar == 100.0
    assert resolve(PPOConfig(correction="mask")).rho_bar == 100.0
    assert resolve(PPOConfig(correction="vtrace")).rho_bar == 1.0
    assert resolve(PPOConfig(correction="appo")).rho_bar == 1.0
    assert resolve(PPOConfig(correction="trust")).rho_bar == 1.0
    assert resolve(PPOConfig(correction="is", rho_bar=2.5)).rho_bar == 2.5


def test_vtrace_and_appo_defaults_are_the_measured_ones():
    assert resolve(PPOConfig(correction="vtrace")).vtrace_advantage == "gae"
    assert resolve(PPOConfig(correction="appo")).vtrace_advantage == "impala"
    assert resolve(PPOConfig(correction="appo", vtrace_advantage="gae")).vtrace_advantage == "gae"
    assert PPOConfig().appo_rho_weight is True
    # appo recomputes its advantages every epoch on stale data only: on fresh data it is plain PPO
    every = lambda name, stale, **kw: CORRECTIONS[name].advantages_every(PPOConfig(correction=name, **kw), stale)  # noqa: E731
    assert every("appo", True) == "epoch"
    assert every("appo", False) == "update"
    assert every("vtrace", True) == "epoch"
    assert every("vtrace", False) == "update"
    assert every("trust", True) == "epoch"
    assert every("is", True) == "update"
    assert every("is", False, advantages_every="epoch") == "epoch"
    assert every("appo", True, advantages_every="update") == "update"


def _tiny_policy():
    from tests.test_learner_component import small_config
    from shared.envs import make_env
    cfg = small_config()
    env = make_env("CartPole-v1", 4)
    policy = make_policy(cfg, env.spec)
    td = policy(TensorDict({keys.OBS: env.reset(seed=0)}, [4]))
    env.close()
    return policy, td


@pytest.mark.parametrize("frozen", [False, True], ids=["copy", "functional_call"])
def test_ewma_proximal_follows_its_update_rule(frozen):
    """Both ways of holding the average: a copy of the policy (nothing frozen) and the averaged
    trainable tensors bound over the live module (a frozen part, shared, as a VLA's base)."""
    policy, td = _tiny_policy()
    if frozen:
        policy.critic.requires_grad_(False)
    prox = EWMAProximal(policy, decay=0.75)
    assert (prox._shadow is None) == frozen
    names = [n for n, p in policy.named_parameters() if p.requires_grad]
    assert set(prox.tensors) == {f"policy.{n}" for n in names}
    expected = {n: p.detach().clone() for n, p in policy.named_parameters()}
    g = torch.Generator().manual_seed(0)
    for _ in range(3):
        with torch.no_grad():
            for n, p in policy.named_parameters():
                if p.requires_grad:
                    p.add_(torch.randn(p.shape, generator=g))
        prox.step()
        for n, p in policy.named_parameters():
            expected[n] = 0.75 * expected[n] + 0.25 * p.detach()
    for n in names:
        torch.testing.assert_close(prox.tensors[f"policy.{n}"], expected[n])
    # the normaliser statistics are the live policy's, moved after the average was made
    policy.update_normalizer(torch.randn(64, td[keys.OBS].shape[-1]) * 3 + 1)
    # its log-prob is the policy's own, evaluated with the averaged weights; the live ones untouched
    live = {n: p.detach().clone() for n, p in policy.named_parameters()}
    averaged = make_policy(*_cfg_spec())
    averaged.load_state_dict(policy.state_dict())
    with torch.no_grad():
        for n, p in averaged.named_parameters():
            p.copy_(expected[n])
        torch.testing.assert_close(prox.log_prob(td), averaged.evaluate_actions(td)[0])
        assert not torch.allclose(prox.log_prob(td), policy.evaluate_actions(td)[0])   # not the live weights
    for n, p in policy.named_parameters():
        assert torch.equal(p, live[n])
    # and it survives a checkpoint
    other = EWMAProximal(policy, decay=0.75)
    other.load_state_dict(prox.state_dict())
    for n in names:
        torch.testing.assert_close(other.tensors[f"policy.{n}"], expected[n])


def _cfg_spec():
    from tests.test_learner_component import small_config
    from shared.envs import make_env
    env = make_env("CartPole-v1", 1)
    spec = env.spec
    env.close()
    return small_config(), spec


def test_ewma_default_decay_matches_plain_ppos_proximal_age():
    assert ewma_decay_for(32) == pytest.approx(16 / 17)
    d = ewma_decay_for(320)
    assert d / (1 - d) == pytest.approx(160)       # the average's centre of mass, in optimiser steps


def test_ewma_run_moves_the_average_every_optimiser_step(tmp_path, monkeypatch):
    cfg, learner, *_ , stats = _stale_update(tmp_path, monkeypatch, lag=1, correction="ewma")
    prox = learner.algorithm.correction.proximal
    assert prox is not None
    steps = cfg.algorithm.cfg.n_epochs * -(-cfg.actors.num_envs * cfg.trainer.buffer_size // cfg.algorithm.cfg.batch_size)
    assert prox.decay == pytest.approx(ewma_decay_for(steps))
    assert 0 < stats["prox_weight_mean"]
    live = dict(learner.policy.named_parameters())
    moved = [not torch.equal(t, live[n.removeprefix("policy.")]) for n, t in prox.tensors.items()]
    assert any(moved)                              # an average of past weights, not the live ones


def test_a_masked_sample_contributes_no_gradient():
    policy, td = _tiny_policy()
    cfg = PPOConfig(norm_adv=False)
    mb = td.detach().clone()
    g = torch.Generator().manual_seed(1)
    mb.set(keys.ADVANTAGE, torch.randn(4, generator=g))
    mb.set(keys.VALUE_TARGET, torch.randn(4, generator=g))
    mb.set(keys.LOG_PROB, mb[keys.LOG_PROB] + 0.3 * torch.randn(4, generator=g))
    keep = torch.tensor([True, False, True, False])

    def grads(batch):
        policy.zero_grad()
        out = ppo_loss(policy, batch, cfg)
        sum(v for k, v in out.items() if k.startswith("loss_")).backward()
        return {n: p.grad.clone() for n, p in policy.named_parameters()}

    masked = mb.clone()
    masked.set(MASK, keep)
    poisoned = masked.clone()                      # a NaN in a dropped sample changes nothing either
    poisoned[keys.ADVANTAGE][1] = float("nan")
    poisoned[keys.VALUE_TARGET][3] = float("inf")
    reference = grads(mb[keep])
    for batch in (masked, poisoned):
        got = grads(batch)
        for n in reference:
            torch.testing.assert_close(got[n], reference[n])


def test_mask_correction_drops_and_counts_samples_outside_the_band(tmp_path, monkeypatch):
    _, learner, td, logp_now, _, seen, stats = _stale_update(tmp_path, monkeypatch, correction="mask",
                                                             mask_threshold=1.05)
    rho = log_ratio(logp_now, td[keys.LOG_PROB]).exp()
    keep = (rho >= 1 / 1.05) & (rho <= 1.05)
    assert 0 < int((~keep).sum()) < keep.numel()   # the test can tell
    assert torch.equal(seen["batch"][MASK], keep)
    assert stats["masked_frac"] == pytest.approx(float((~keep).float().mean()))
    total = learner.counts["masked_samples"]      # over every update so far (the earlier ones masked too)
    assert total >= int((~keep).sum()) and learner.last_update_values["offpolicy/masked_samples_total"] == total


def test_a_rollout_without_a_bootstrap_observation_keeps_the_actors_bootstrap(tmp_path, monkeypatch):
    """Recordings from before ``bootstrap_observation`` existed still train (and replay): the bootstrap
    after a truncation or the last step is then the actor's next_value, as it used to be."""
    import learner.ppo as ppo_module
    from learner.advantages import current_values
    cfg, learner = _vla_learner(tmp_path, correction="is")
    n, t = cfg.actors.num_envs, cfg.trainer.buffer_size
    td, meta = _rollout(cfg, learner, torch.zeros(n, t, dtype=torch.int64))
    for _ in range(2):
        learner.ingest(td.clone(), meta)
        learner.update_once(*learner.take_batch(timeout_s=0))
    old = td.exclude(keys.BOOTSTRAP_OBS)
    with torch.no_grad():
        v_now = learner.policy.evaluate_actions(old.reshape(-1))[2].view(n, t)
    seen = {}
    real = ppo_module.ppo_update

    def spy(policy, optimizer, batch, cfg_, generator, **kwargs):
        seen["target"] = batch[keys.VALUE_TARGET].clone()
        return real(policy, optimizer, batch, cfg_, generator, **kwargs)

    monkeypatch.setattr(ppo_module, "ppo_update", spy)
    stats = learner.update_once(old.unsqueeze(0), [_info(meta, old)])
    a = cfg.algorithm.cfg
    expected = compute_gae(old[keys.REWARD], v_now, current_values(v_now, old[keys.NEXT_VALUE], old[keys.DONE]),
                           old[keys.TERMINATED], old[keys.DONE], a.gamma, a.gae_lambda)[1]
    torch.testing.assert_close(seen["target"], expected)
    assert "bootstrap_shift" not in stats and "value_shift" in stats


def _info(meta, td):
    versions = td[keys.POLICY_VERSION]
    uniq, counts = torch.unique(versions, return_counts=True)
    return {"actor": 0, "seq": meta.get("seq", 0), "policy_version": int(versions.min()),
            "policy_version_max": int(versions.max()), "env_steps": versions.numel(),
            "version_counts": list(zip(uniq.tolist(), counts.tolist())), "episodes": 0,
            "episode_length_mean": None, "received": None, "sent": None}


def test_before_epoch_replaces_the_fields_from_the_next_epoch_on():
    """run_epochs: the fields before_epoch returns are what the later epochs train on."""
    from learner.minibatch import EpochHooks, run_epochs
    n, seen, calls = 6, [], []
    lin = torch.nn.Linear(1, 1)

    def loss_fn(mb):
        seen.append(mb[keys.ADVANTAGE].clone())
        return {"loss_x": (lin(mb[keys.OBS]).squeeze(-1) * mb[keys.ADVANTAGE]).mean(), "approx_kl": torch.zeros(())}

    def before_epoch():
        calls.append(len(seen))
        return {keys.OBS: torch.ones(n, 1), keys.ADVANTAGE: torch.full((n,), float(len(calls) + 1))}

    fields = {keys.OBS: torch.ones(n, 1), keys.ADVANTAGE: torch.ones(n)}
    stats = run_epochs(lin, torch.optim.SGD(lin.parameters(), lr=0.0), fields, loss_fn, 3, 4, 0.5, None,
                       torch.Generator().manual_seed(0), EpochHooks(before_epoch=before_epoch))
    assert stats["epochs"] == 3 and calls == [2, 4]       # before epochs 2 and 3, never before the first
    assert [float(s.mean()) for s in seen] == [1.0, 1.0, 2.0, 2.0, 3.0, 3.0]


def _epoch_refreshing_learner(tmp_path, correction):
    """A 3-epoch learner with ``advantages_every: epoch`` after two updates on one version-0
    rollout, and that rollout: ingested again it is stale, so the next update refreshes."""
    cfg, learner = _vla_learner(tmp_path, correction=correction, advantages_every="epoch", n_epochs=3)
    n, t = cfg.actors.num_envs, cfg.trainer.buffer_size
    td, meta = _rollout(cfg, learner, torch.zeros(n, t, dtype=torch.int64))
    for _ in range(2):
        learner.ingest(td.clone(), meta)
        learner.update_once(*learner.take_batch(timeout_s=0))
    return cfg, learner, td, meta


@pytest.mark.parametrize("correction", ["appo", "vtrace", "is", "none"])
def test_advantages_every_epoch_recomputes_from_the_live_critic_and_keeps_the_anchor(tmp_path, monkeypatch,
                                                                                      correction):
    """advantages_every: epoch: one recomputation per later epoch, against the behaviour log-prob
    as it arrived, with the anchor of the ratio left as the first computation set it; appo's
    weights follow the live policy, is keeps the proximal one as its target."""
    from learner.corrections import Correction
    cfg, learner, td, meta = _epoch_refreshing_learner(tmp_path, correction)
    n, t = cfg.actors.num_envs, cfg.trainer.buffer_size
    calls = []
    real = Correction.__call__

    def spy(self, flat, reward, stale, behaviour=None):
        with torch.no_grad():
            logp, _, value = self.now.policy.evaluate_actions(flat.reshape(-1))
        anchor, boot = flat[keys.LOG_PROB].clone(), self.now.bootstraps(flat)
        out = real(self, flat, reward, stale, behaviour=behaviour)
        calls.append({"behaviour": behaviour, "reward": reward.clone(), "boot": boot, "anchor_before": anchor, "anchor_after": flat[keys.LOG_PROB].clone(),
                      "logp": logp.view(n, t), "value": value.view(n, t), "value_set": flat[keys.VALUE].clone(),
                      "adv": flat[keys.ADVANTAGE].clone()})
        return out

    monkeypatch.setattr(Correction, "__call__", spy)
    learner.ingest(td.clone(), meta)
    learner.update_once(*learner.take_batch(timeout_s=0))
    assert len(calls) == 3                                  # the update's start, then before epochs 2 and 3
    first, *later = calls
    assert first["behaviour"] is None
    for c in later:
        torch.testing.assert_close(c["behaviour"], td[keys.LOG_PROB])          # mu as it arrived
        torch.testing.assert_close(c["anchor_after"], first["anchor_after"])   # the clip's anchor stays
        torch.testing.assert_close(c["value_set"], c["value"])                 # the live critic's values
    assert not torch.allclose(later[0]["value"], first["value"])              # the critic did move
    assert not torch.allclose(later[0]["adv"], first["adv"])
    if correction == "appo":   # the weight min(1, pi/mu) with the live pi: recomputed by hand
        a = cfg.algorithm.cfg
        c = later[-1]
        from learner.advantages import current_values
        next_now = current_values(c["value"], td[keys.NEXT_VALUE], td[keys.DONE], c["boot"], td[keys.TERMINATED])
        _, adv, _ = vtrace(td[keys.LOG_PROB], c["logp"], c["reward"], c["value"], next_now,
                           td[keys.TERMINATED], td[keys.DONE], a.gamma, 1.0, 1.0, a.gae_lambda, weighted=False,
                           advantage=resolve(a).vtrace_advantage)
        rho = log_ratio(c["logp"], td[keys.LOG_PROB]).exp()
        torch.testing.assert_close(c["adv"], _norm(adv) * rho.clamp(max=1.0))


@pytest.mark.parametrize("correction", ["appo", "vtrace", "is", "mask"])
def test_advantages_every_epoch_runs_the_policy_only_where_its_log_prob_is_used(tmp_path, monkeypatch, correction):
    """On a refresh, is / vtrace / mask keep the proximal log-prob, so only the critic runs; appo's
    weights need the live policy's log-prob, so the whole policy runs."""
    from learner.corrections import CurrentPolicy
    _, learner, td, meta = _epoch_refreshing_learner(tmp_path, correction)
    seen = []
    for name in ("evaluate", "values"):
        real = getattr(CurrentPolicy, name)
        monkeypatch.setattr(CurrentPolicy, name,
                            lambda self, flat, _real=real, _name=name: seen.append(_name) or _real(self, flat))
    learner.ingest(td.clone(), meta)
    learner.update_once(*learner.take_batch(timeout_s=0))
    if correction == "appo":
        assert seen == ["evaluate"] * 3
    else:                                                   # the update's start, then the critic before epochs 2, 3
        assert seen == ["evaluate", "values", "values"]


def test_advantages_every_epoch_with_one_epoch_is_the_same_update(tmp_path):
    """With a single epoch there is nothing to refresh: the weights match the default bit for bit."""
    weights = []
    for every in ("update", "epoch"):
        cfg, learner = _vla_learner(tmp_path / every, correction="appo", advantages_every=every, n_epochs=1)
        weights.append(_weights_after_stale_updates(cfg, learner, 3))
    for k in weights[0]:
        assert torch.equal(weights[0][k], weights[1][k]), k


def test_importance_diagnostics_by_hand():
    """ESS, mean |log rho|, KL(mu || pi_k) by k3 and the clipped share on four fixed weights."""
    import math
    from learner.corrections import importance_diagnostics
    rho = [0.5, 1.0, 2.0, 4.0]
    d = importance_diagnostics(torch.tensor([math.log(r) for r in rho]), rho_bar=1.5)
    assert d["ess"] == pytest.approx(sum(rho) ** 2 / (4 * sum(r * r for r in rho)))       # 56.25 / 85 = 0.662
    assert d["log_ratio_abs"] == pytest.approx(sum(abs(math.log(r)) for r in rho) / 4, rel=1e-6)
    assert d["kl_behaviour"] == pytest.approx(sum(r - 1 - math.log(r) for r in rho) / 4, rel=1e-6)
    assert d["rho_clipped_frac"] == 0.5 and d["rho_max"] == pytest.approx(4.0) and d["rho_mean"] == pytest.approx(1.875)
    fresh = importance_diagnostics(torch.zeros(8), rho_bar=1.0)
    assert fresh["ess"] == pytest.approx(1.0) and fresh["kl_behaviour"] == 0.0 and fresh["log_ratio_abs"] == 0.0


def test_trust_clips_around_pi_k_over_mu_and_shrinks_with_the_lag(tmp_path, monkeypatch):
    """``trust`` on a rollout 3 versions old: the ratio's anchor is pi_k (the policy when the
    update starts), so the clip on pi/mu is centred on pi_k/mu; with trust_lag_power 1 the update
    trains with clip_coef / 3 and stops at trust_kl / 3; the targets and advantages are vtrace's."""
    cfg, learner, td, logp_now, v_now, seen, stats = _stale_update(tmp_path, monkeypatch, lag=3, correction="trust",
                                                                   trust_kl=0.06, trust_lag_power=1.0)
    batch = seen["batch"]
    torch.testing.assert_close(batch[keys.LOG_PROB].view_as(logp_now), logp_now)      # the anchor: pi_k, not mu
    assert not torch.allclose(batch[keys.LOG_PROB].view_as(logp_now), td[keys.LOG_PROB])
    a = cfg.algorithm.cfg
    assert stats["trust_clip"] == pytest.approx(a.clip_coef / 3) and stats["trust_kl"] == pytest.approx(0.02)
    assert resolve(a).rho_bar == 1.0 and CORRECTIONS["trust"].advantages_every(a, stale=True) == "epoch"
    # in pi/mu terms the clip band is pi_k/mu x [1 - eps, 1 + eps]: a sample the update moved to
    # exactly the band's edge is not clipped, one just beyond it is
    from learner.corrections import TrustRegion
    upd = TrustRegion.update_config(a, 3.0)
    mb = TensorDict({keys.ADVANTAGE: torch.ones(2), keys.LOG_PROB: torch.zeros(2)}, [2])
    eps = upd.clip_coef
    new_logp = torch.log(torch.tensor([1 + eps * 0.999, 1 + eps * 1.001]))
    from learner.ppo import _policy_terms
    out = _policy_terms(mb, upd, False, mb[keys.ADVANTAGE], mb[keys.LOG_PROB], new_logp, torch.zeros(2))
    assert float(out["clip_frac"]) == 0.5
    fresh = TrustRegion.update_config(a, 0.7)     # at a mean lag of 1 or less: vtrace's clip
    assert fresh.clip_coef == a.clip_coef and fresh.target_kl == a.trust_kl
    from dataclasses import replace
    half = TrustRegion.update_config(replace(a, trust_lag_power=0.5), 4.0)   # divided by sqrt(4)
    assert half.clip_coef == pytest.approx(a.clip_coef / 2) and half.target_kl == pytest.approx(a.trust_kl / 2)
    fixed = TrustRegion.update_config(replace(a, trust_lag_power=0.0), 8.0)  # a fixed budget per version
    assert fixed.clip_coef == a.clip_coef and fixed.target_kl == a.trust_kl


def test_a_correction_added_through_the_registry_alone_is_configurable_and_trains(tmp_path, monkeypatch):
    """Adding a correction is one class and its registry entry: the config accepts its name, its
    defaults fill the config's nulls, and the learner trains with it; nothing else changes."""
    from learner.corrections import ImportanceSampling, register

    class HalvedIS(ImportanceSampling):
        """A toy: ``is`` whose weighted advantages are halved, with its own rho_bar default."""
        name = "toy_halved_is"
        defaults = {"rho_bar": 3.0, "vtrace_advantage": "gae"}

        def weight(self, adv, rho, rho_bar):
            return 0.5 * super().weight(adv, rho, rho_bar)

    register(HalvedIS)
    try:
        cfg, learner, td, logp_now, _, seen, stats = _stale_update(tmp_path, monkeypatch, correction=HalvedIS.name,
                                                                   recompute_values=False)
        assert type(learner.algorithm.correction) is HalvedIS and learner.algorithm.cfg.rho_bar == 3.0
        a = cfg.algorithm.cfg
        adv, _ = compute_gae(td[keys.REWARD], td[keys.VALUE], td[keys.NEXT_VALUE], td[keys.TERMINATED],
                             td[keys.DONE], a.gamma, a.gae_lambda)
        rho = log_ratio(logp_now, td[keys.LOG_PROB]).exp()
        torch.testing.assert_close(seen["batch"][keys.ADVANTAGE], 0.5 * _norm(adv) * rho.clamp(max=3.0))
        torch.testing.assert_close(seen["batch"][keys.LOG_PROB], logp_now)     # decoupled, as is: clip on pi_k
        assert learner.updates == 4 and stats                                    # three before, then this one
    finally:
        CORRECTIONS.pop(HalvedIS.name)
    with pytest.raises(Exception, match="toy_halved_is"):                 # gone with its registry entry
        _stale_update(tmp_path / "after", monkeypatch, correction=HalvedIS.name)


def test_a_corrections_checkpoint_state_round_trips_under_its_own_key_and_old_checkpoints_still_load(tmp_path,
                                                                                                 monkeypatch):
    """ewma's moving average is saved under state["correction"] (it cannot overwrite the learner's own
    keys), restored by load_state_dict; a checkpoint written before that kept it at the top level."""
    _, learner, *_ = _stale_update(tmp_path, monkeypatch, lag=1, correction="ewma")
    state = learner.algorithm.state_dict()
    assert state["correction"]["name"] == "ewma" and "ewma" not in state
    saved = {k: v.clone() for k, v in learner.algorithm.correction.proximal.state_dict().items()}
    for legacy in (False, True):
        fresh = learner.algorithm.correction.proximal
        for t in fresh.tensors.values():
            t.zero_()
        learner.algorithm.load_state_dict({"ewma": saved} if legacy else state)
        for k, v in learner.algorithm.correction.proximal.state_dict().items():
            torch.testing.assert_close(v, saved[k])
