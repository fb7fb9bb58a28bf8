"""``learner.compile`` (learner/fast_epochs.py) on the CPU: the sync-free step (``graph``: the
capture-ready step, uncaptured here; ``compile``: the loss through torch.compile) trains what the
eager loop trains, skips a non-finite minibatch without touching the weights or Adam's state, and
is chosen (or refused, with the reason) from the config. The CUDA graph itself is tested in
tests/test_cuda.py (``-m gpu``)."""

from __future__ import annotations

import math

import pytest
import torch

import learner.fast_epochs as fast_epochs
from learner.corrections import resolve
from learner.fast_epochs import MinibatchStep, resolve_mode
from learner.grpo import grpo_update
from learner.learner import make_optimizer
from learner.minibatch import EpochHooks
from learner.ppo import ppo_update
from learner.proximal import EWMAProximal
from shared import keys
from shared.config import GRPOConfig, PPOConfig
from tests.test_ppo import _actor_critic_batch

# PPO's loss takes one of these forms per correction: none normalises per minibatch; is, vtrace,
# appo and mask do not (mask adds a mask field); ewma weighs by its proximal policy.
LOSS_FORMS = {"none": (True, False, False), "is/vtrace/appo": (False, False, False), "mask": (False, True, False),
              "ewma": (False, False, True)}


@pytest.fixture(autouse=True)
def _no_cxx_build(monkeypatch):
    """torch.compile's inductor builds C++ (tens of seconds a graph on this CPU): the loss goes
    through AOT autograd without codegen here; one slow test below uses inductor itself."""
    monkeypatch.setattr(fast_epochs, "COMPILE_BACKEND", "aot_eager")
    torch._dynamo.reset()


def _fresh_compiler(mode):
    """Dynamo guards a compiled loss on its policy's identity: a test's next policy may be allocated
    where a freed one was, so each compiled run starts from an empty cache (a learner keeps one
    policy for its life)."""
    if mode == "compile":
        torch._dynamo.reset()


def _ppo_run(mode, form, n=300, n_epochs=3, batch_size=64, target_kl=None, poison=None):
    renormalize, with_mask, with_prox = LOSS_FORMS[form]
    _, policy, td = _actor_critic_batch(n, seed=3, with_mask=with_mask)
    if poison is not None:
        td[keys.ADVANTAGE][poison] = float("nan")
    cfg = resolve(PPOConfig(n_epochs=n_epochs, batch_size=batch_size, clip_vloss=True, max_grad_norm=0.5,
                            ent_coef=0.01, target_kl=target_kl, correction="ewma" if with_prox else "none"))
    opt = make_optimizer(policy, 1e-3, 1e-5)
    prox = EWMAProximal(policy, 0.9) if with_prox else None
    _fresh_compiler(mode)
    step = MinibatchStep(mode, policy, opt, cfg.max_grad_norm) if mode != "off" else None
    stats = ppo_update(policy, opt, td, cfg, torch.Generator().manual_seed(0), renormalize=renormalize,
                       proximal=prox, step=step)
    return policy, opt, stats, prox


def _assert_close_states(a, b, atol):
    for k in a:
        torch.testing.assert_close(a[k], b[k], atol=atol, rtol=0, msg=k)


@pytest.mark.parametrize("mode", ["graph", "compile"])
@pytest.mark.parametrize("form", list(LOSS_FORMS))
def test_one_optimiser_step_equals_eager(mode, form):
    """One minibatch, one step: the weights match eager to 1e-5 (graph: to the bit)."""
    p0, o0, s0, _ = _ppo_run("off", form, n=128, n_epochs=1, batch_size=128)
    p1, o1, s1, _ = _ppo_run(mode, form, n=128, n_epochs=1, batch_size=128)
    assert s0["steps"] == s1["steps"] == 1
    _assert_close_states(p0.state_dict(), p1.state_dict(), atol=0 if mode == "graph" else 1e-5)


@pytest.mark.parametrize("mode", ["graph", "compile"])
@pytest.mark.parametrize("form", list(LOSS_FORMS))
def test_a_full_update_equals_eager(mode, form):
    """3 epochs of 5 minibatches (the last one short), with the early-stop bookkeeping: graph
    runs eager's kernels in eager's order, so its weights, Adam's state, the EWMA and the means are
    the same to the bit. compile fuses kernels: each step may round differently (~1e-7 relative),
    and 15 Adam steps at lr 1e-3 can carry that to ~1e-6 in the weights; 1e-5 bounds it."""
    p0, o0, s0, x0 = _ppo_run("off", form)
    p1, o1, s1, x1 = _ppo_run(mode, form)
    atol = 0 if mode == "graph" else 1e-5
    assert s0["steps"] == s1["steps"] == 15 and s0["epochs"] == s1["epochs"] == 3
    _assert_close_states(p0.state_dict(), p1.state_dict(), atol)
    for i in o0.state_dict()["state"]:
        _assert_close_states(o0.state_dict()["state"][i], o1.state_dict()["state"][i], atol)
    if x0 is not None:
        _assert_close_states(x0.state_dict(), x1.state_dict(), atol)
    for k in s0:
        assert s1[k] == pytest.approx(s0[k], rel=1e-4, abs=1e-6, nan_ok=True), k


@pytest.mark.parametrize("mode", ["off", "graph", "compile"])
def test_a_non_finite_minibatch_takes_no_step_in_every_mode(mode):
    """A NaN advantage in one minibatch: that step is skipped on the device (weights, Adam's
    moments and step count untouched), counted, left out of the means and of the EWMA's move."""
    policy0, opt0, _, prox0 = _ppo_run(mode, "ewma", n=128, n_epochs=1, batch_size=128)   # one clean step
    torch.manual_seed(0)
    _, policy, td = _actor_critic_batch(128, seed=3, with_mask=False)
    td[keys.ADVANTAGE][5] = float("nan")
    cfg = resolve(PPOConfig(n_epochs=1, batch_size=128, max_grad_norm=0.5, correction="ewma"))
    opt = make_optimizer(policy, 1e-3, 1e-5)
    prox = EWMAProximal(policy, 0.9)
    _fresh_compiler(mode)
    step = MinibatchStep(mode, policy, opt, 0.5) if mode != "off" else None
    before = {k: v.clone() for k, v in policy.state_dict().items()}
    prox_before = prox.state_dict()
    stats = ppo_update(policy, opt, td, cfg, torch.Generator().manual_seed(0), renormalize=False, proximal=prox,
                       step=step)
    assert stats["steps"] == 0 and stats["skipped_steps"] == 1
    _assert_close_states(before, policy.state_dict(), 0)
    _assert_close_states(prox_before, prox.state_dict(), 0)
    for state in opt.state_dict()["state"].values():   # never stepped: zero moments, step 0
        assert float(state["step"]) == 0 and not state["exp_avg"].any() and not state["exp_avg_sq"].any()
    # and the next clean minibatch steps as a fresh optimiser would
    td[keys.ADVANTAGE][5] = 0.0
    assert not math.isnan(stats.get("approx_kl", 0.0))


@pytest.mark.parametrize("mode", ["graph", "compile"])
def test_a_skipped_minibatch_among_taken_ones_matches_eager(mode):
    """Minibatches 2 and 4 of 5 hold a NaN: eager and the sync-free step skip the same ones and
    end with the same weights and the same means over the steps taken."""
    perm = torch.randperm(300, generator=torch.Generator().manual_seed(0))
    poison = torch.cat([perm[64:65], perm[192:193]])                  # one sample in minibatches 2 and 4 of epoch 1
    p0, _, s0, _ = _ppo_run("off", "is/vtrace/appo", n_epochs=1, poison=poison)
    p1, _, s1, _ = _ppo_run(mode, "is/vtrace/appo", n_epochs=1, poison=poison)
    assert s0["skipped_steps"] == s1["skipped_steps"] == 2 and s0["steps"] == s1["steps"] == 3
    _assert_close_states(p0.state_dict(), p1.state_dict(), 0 if mode == "graph" else 1e-5)
    for k in s0:
        assert s1[k] == pytest.approx(s0[k], rel=1e-4, abs=1e-6), k


@pytest.mark.parametrize("mode", ["graph", "compile"])
def test_early_stop_on_target_kl_happens_at_the_same_epoch(mode):
    _, _, s0, _ = _ppo_run("off", "none", n_epochs=6, target_kl=1e-4)
    _, _, s1, _ = _ppo_run(mode, "none", n_epochs=6, target_kl=1e-4)
    assert s0["epochs"] == s1["epochs"] < 6


@pytest.mark.parametrize("mode", ["graph", "compile"])
def test_grpo_with_its_kl_reference_equals_eager(mode):
    from shared.policies import make_policy
    results = []
    for m in ("off", mode):
        _, policy, td = _actor_critic_batch(200, seed=5, with_mask=True)
        ref = make_policy(*_policy_cfg_spec()).requires_grad_(False)
        ref.load_state_dict(policy.state_dict())
        with torch.no_grad():
            for p in policy.parameters():
                p.add_(0.01)
        cfg = GRPOConfig(n_epochs=2, batch_size=48, kl_coef=0.05, max_grad_norm=0.5)
        opt = make_optimizer(policy, 1e-3, 1e-5)
        _fresh_compiler(m)
        step = MinibatchStep(m, policy, opt, cfg.max_grad_norm) if m != "off" else None
        batch = td.reshape(4, 50)
        stats = grpo_update(policy, ref, opt, batch, cfg, torch.Generator().manual_seed(0), step=step)
        results.append((policy.state_dict(), stats))
    (w0, s0), (w1, s1) = results
    assert s0["steps"] == s1["steps"] and s0["samples"] == s1["samples"]
    _assert_close_states(w0, w1, 0 if mode == "graph" else 1e-5)


def _policy_cfg_spec():
    from shared.config import load_config
    from shared.envs.base import ActionSpec, EnvSpec
    cfg = load_config("configs/halfcheetah_ppo.json", ["policy.actor.network_cfg.hidden_sizes=[32,32]",
                                                       "policy.critic.network_cfg.hidden_sizes=[32,32]"])
    return cfg, EnvSpec(obs_shape=(17,), obs_dtype=torch.float32,
                        action=ActionSpec(kind="box", shape=(6,), low=(-1.0,) * 6, high=(1.0,) * 6))


def test_the_step_keeps_its_loss_functions_and_a_side_loss_is_refused():
    _, policy, td = _actor_critic_batch(64, seed=1, with_mask=False)
    opt = make_optimizer(policy, 1e-3, 1e-5)
    step = MinibatchStep("graph", policy, opt, 0.5)
    made = []
    f1 = step.loss_for(("ppo", True), lambda: made.append(1) or (lambda mb: {}))
    f2 = step.loss_for(("ppo", True), lambda: made.append(2) or (lambda mb: {}))
    assert f1 is f2 and made == [1]
    fields = {k: td[k] for k in (keys.OBS, keys.ACTION)}
    with pytest.raises(ValueError, match="critic_thread"):
        step.run(fields, f1, 1, 64, None, torch.Generator(), EpochHooks(side_loss=(None, f1)))
    with pytest.raises(ValueError, match="fused"):
        MinibatchStep("graph", policy, torch.optim.Adam(policy.parameters()), 0.5)


def test_modes_are_resolved_with_the_reason_for_a_fallback():
    cpu, cuda = torch.device("cpu"), torch.device("cuda:0")
    assert resolve_mode("auto", cpu, True) == ("off", None)
    assert resolve_mode("auto", cuda, True) == ("graph", None)
    assert resolve_mode("auto", cuda, False) == ("off", None)
    assert resolve_mode("auto", cuda, True, ranks=object()) == ("off", None)
    assert resolve_mode("compile", cpu, True) == ("compile", None)
    mode, why = resolve_mode("graph", cpu, True)
    assert mode == "graph" and "uncaptured" in why
    mode, why = resolve_mode("graph", cuda, False)
    assert mode == "off" and "cannot be captured" in why
    mode, why = resolve_mode("compile", cuda, True, ranks=object())
    assert mode == "off" and "DDP" in why


@pytest.mark.parametrize("correction", ["vtrace", "trust"])
def test_a_learner_in_graph_mode_trains_what_an_eager_learner_trains(tmp_path, correction):
    """The whole learner (vla mode, the correction refreshed before every epoch, annealed learning
    rate) with learner.compile "graph" on the CPU: the same weights as "off" after three updates.
    trust changes its clip with every update's lag: in graph mode the loss reads it from a device
    tensor (float32, where eager keeps the Python float), so the two agree to rounding, not bits."""
    from learner.learner import make_algorithm
    from tests.test_staleness import _vla_learner, _weights_after_stale_updates
    weights, clips = [], []
    for mode in ("off", "graph"):
        cfg, learner = _vla_learner(tmp_path / mode, correction=correction, advantages_every="epoch", n_epochs=3)
        cfg.learner.compile = mode   # read when the algorithm is made: rebuild it
        learner.algorithm = make_algorithm(cfg, learner.spec, learner.policy, learner.optimizer, learner.generator,
                                           learner.device, learner.k, learner.stats.count, learner.cpu)
        assert (learner.algorithm.step is None) == (mode == "off")
        weights.append(_weights_after_stale_updates(cfg, learner, 3))
        clips.append(learner.algorithm._update_cfg.clip_coef)
    if correction == "trust":
        assert torch.is_tensor(clips[1]) and float(clips[1]) == pytest.approx(clips[0])
        assert clips[0] < cfg.algorithm.cfg.clip_coef               # the lag shrank it
    _assert_close_states(weights[0], weights[1], 0 if correction == "vtrace" else 1e-5)


@pytest.mark.slow
def test_compile_with_inductor_equals_eager(monkeypatch):
    """The real compiler (C++ code generation): one full PPO update within the tolerance above."""
    monkeypatch.setattr(fast_epochs, "COMPILE_BACKEND", "inductor")
    p0, _, s0, _ = _ppo_run("off", "none", n_epochs=2)
    p1, _, s1, _ = _ppo_run("compile", "none", n_epochs=2)
    assert s0["steps"] == s1["steps"] == 10
    _assert_close_states(p0.state_dict(), p1.state_dict(), 1e-5)


def test_a_loss_that_cannot_be_compiled_runs_eagerly(monkeypatch, caplog):
    """No C++ compiler, or an op the compiler refuses: one line in the log, and the update is the
    eager one (the minibatch that met the failure took no step before it)."""
    def refuse(gm, example_inputs):
        raise RuntimeError("no C++ compiler on this machine")
    monkeypatch.setattr(fast_epochs, "COMPILE_BACKEND", refuse)
    p0, _, s0, _ = _ppo_run("off", "none", n_epochs=2)
    p1, _, s1, _ = _ppo_run("compile", "none", n_epochs=2)
    assert s0["steps"] == s1["steps"] == 10
    _assert_close_states(p0.state_dict(), p1.state_dict(), 0)
    assert caplog.text.count("could not be compiled") == 1 and "runs eagerly" in caplog.text


def test_config_refuses_compile_with_the_critic_thread():
    from shared.config import ConfigError, load_config
    with pytest.raises(ConfigError, match="learner.compile 'graph' and learner.critic_thread true"):
        load_config("configs/halfcheetah_ppo.json", ["learner.compile=graph", "learner.critic_thread=true"])

