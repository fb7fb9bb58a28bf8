"""V-trace targets and advantages against a direct loop, on-policy limits, and the learner's corrections."""

from __future__ import annotations

import math

import pytest
import torch

from learner.advantages import compute_gae
from learner.advantages import current_values
from learner.vtrace import vtrace


def _random_rollout(n=5, t=12, seed=0, p_term=0.1, p_trunc=0.08):
    g = torch.Generator().manual_seed(seed)
    reward = torch.randn(n, t, generator=g)
    value = torch.randn(n, t, generator=g)
    next_value = torch.randn(n, t, generator=g)
    u = torch.rand(n, t, generator=g)
    terminated = u < p_term
    truncated = (u >= p_term) & (u < p_term + p_trunc)
    mu = torch.randn(n, t, generator=g) * 0.5 - 1.0
    pi = mu + torch.randn(n, t, generator=g) * 0.7
    return mu, pi, reward, value, next_value, terminated, terminated | truncated


def _loop_reference(mu, pi, reward, value, next_value, terminated, done, gamma, rho_bar, c_bar, lam,
                    advantage="impala"):
    """The IMPALA definition, written out: v_s = V(x_s) + sum_t gamma^(t-s) (prod_{i<t} c_i) delta_t,
    the sum running to the episode's end or the rollout's end. The advantage's target at s+1 is
    v_{s+1} (impala) or (1 - lam) V(x_{s+1}) + lam v_{s+1} (gae)."""
    n, t_len = reward.shape
    vs = torch.zeros(n, t_len, dtype=torch.float64)
    adv = torch.zeros(n, t_len, dtype=torch.float64)
    for e in range(n):
        def boot(t):  # V(x_{t+1}) as the actor sent it; 0 after a terminal step
            return 0.0 if terminated[e, t] else float(next_value[e, t])

        def v_next(t):  # the value of x_{t+1} as V-trace sees it (the current critic = `value`)
            if done[e, t] or t == t_len - 1:
                return boot(t)
            return float(value[e, t + 1])

        rho = [math.exp(float(pi[e, t] - mu[e, t])) for t in range(t_len)]
        for s in range(t_len):
            total, coef = float(value[e, s]), 1.0
            for t in range(s, t_len):
                delta = min(rho_bar, rho[t]) * (float(reward[e, t]) + gamma * v_next(t) - float(value[e, t]))
                total += (gamma ** (t - s)) * coef * delta
                if done[e, t]:
                    break
                coef *= lam * min(c_bar, rho[t])
            vs[e, s] = total
        for s in range(t_len):
            nxt = boot(s) if (done[e, s] or s == t_len - 1) else float(vs[e, s + 1])
            if advantage == "gae":
                nxt = (1 - lam) * v_next(s) + lam * nxt
            adv[e, s] = min(rho_bar, rho[s]) * (float(reward[e, s]) + gamma * nxt - float(value[e, s]))
    return vs, adv


@pytest.mark.parametrize("rho_bar,c_bar,lam", [(1.0, 1.0, 1.0), (2.0, 0.9, 1.0), (1.0, 1.0, 0.95),
                                               (float("inf"), float("inf"), 1.0)])
@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("advantage", ["impala", "gae"])
def test_vtrace_equals_loop_reference(rho_bar, c_bar, lam, seed, advantage):
    mu, pi, reward, value, next_value, terminated, done = _random_rollout(seed=seed)
    # inside the rollout V(x_{t+1}) is the next step's value: build next_value that way, as the learner does
    nv = current_values(value, next_value, done)
    vs, adv, rho = vtrace(mu, pi, reward, value, nv, terminated, done, 0.97, rho_bar, c_bar, lam, advantage=advantage)
    ref_vs, ref_adv = _loop_reference(mu, pi, reward, value, next_value, terminated, done, 0.97, rho_bar, c_bar, lam,
                                      advantage)
    torch.testing.assert_close(vs.double(), ref_vs, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(adv.double(), ref_adv, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(rho, (pi - mu).exp())


def test_truncation_bootstraps_and_termination_does_not():
    # one env, 3 steps: truncated after step 0 (bootstrap 10), terminated after step 2 (no bootstrap)
    z = torch.zeros(1, 3)
    reward = torch.tensor([[1.0, 1.0, 1.0]])
    next_value = torch.tensor([[10.0, 0.0, 99.0]])
    terminated = torch.tensor([[False, False, True]])
    done = torch.tensor([[True, False, True]])
    vs, adv, _ = vtrace(z, z, reward, z, current_values(z, next_value, done), terminated, done, 0.5)
    torch.testing.assert_close(vs, torch.tensor([[1.0 + 0.5 * 10.0, 1.0 + 0.5 * 1.0, 1.0]]))
    torch.testing.assert_close(adv, vs)   # V = 0 and on-policy: the advantages are the targets


@pytest.mark.parametrize("lam", [1.0, 0.9])
def test_on_policy_vtrace_is_gae_returns(lam):
    """With pi = mu and no truncation of the weights, V-trace targets are GAE(lambda)'s value
    targets: for lambda = 1, the bootstrapped discounted returns."""
    _, pi, reward, value, next_value, terminated, done = _random_rollout(seed=7, n=6, t=20)
    nv = current_values(value, next_value, done)
    vs, _, rho = vtrace(pi, pi, reward, value, nv, terminated, done, 0.99, float("inf"), float("inf"), lam)
    _, gae_target = compute_gae(reward, value, nv, terminated, done, 0.99, lam)
    assert torch.all(rho == 1)
    torch.testing.assert_close(vs, gae_target, rtol=1e-5, atol=1e-5)
    if lam == 1.0:  # and those are the discounted returns, bootstrapped at the end / on truncation
        ret = torch.zeros_like(reward)
        running = torch.where(terminated[:, -1], torch.zeros(6), nv[:, -1])
        for t in range(19, -1, -1):
            if t < 19:
                running = torch.where(done[:, t], torch.where(terminated[:, t], torch.zeros(6), nv[:, t]), running)
            running = reward[:, t] + 0.99 * running
            ret[:, t] = running
        torch.testing.assert_close(vs, ret, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("lam", [1.0, 0.9, 0.5])
def test_on_policy_gae_advantage_is_gae_and_impala_is_not(lam):
    """advantage="gae" is GAE(lambda) on on-policy data for every lambda; IMPALA's only at lambda = 1."""
    _, pi, reward, value, next_value, terminated, done = _random_rollout(seed=3, n=6, t=20)
    nv = current_values(value, next_value, done)
    gae_adv, _ = compute_gae(reward, value, nv, terminated, done, 0.99, lam)
    _, adv, _ = vtrace(pi, pi, reward, value, nv, terminated, done, 0.99, 1.0, 1.0, lam, advantage="gae")
    torch.testing.assert_close(adv, gae_adv, rtol=1e-5, atol=1e-5)
    _, impala, _ = vtrace(pi, pi, reward, value, nv, terminated, done, 0.99, 1.0, 1.0, lam)
    assert torch.allclose(impala, gae_adv, rtol=1e-5, atol=1e-5) == (lam == 1.0)


def test_unknown_advantage_is_an_error():
    a = torch.zeros(2, 3)
    with pytest.raises(ValueError, match="'impala' or 'gae'"):
        vtrace(a, a, a, a, a, a.bool(), a.bool(), 0.9, advantage="td")


def test_truncated_weights_cap_the_advantage_and_the_trace():
    # a very unlikely action under the behaviour policy: rho huge, capped at rho_bar
    mu = torch.full((1, 2), -5.0)
    pi = torch.zeros(1, 2)
    reward, value, nv = torch.ones(1, 2), torch.zeros(1, 2), torch.zeros(1, 2)
    no = torch.zeros(1, 2, dtype=torch.bool)
    vs, adv, rho = vtrace(mu, pi, reward, value, nv, no, no, 1.0, rho_bar=1.0, c_bar=1.0)
    assert float(rho.min()) > 100
    torch.testing.assert_close(vs, torch.tensor([[2.0, 1.0]]))   # each delta capped at 1, trace weight 1
    torch.testing.assert_close(adv, torch.tensor([[2.0, 1.0]]))


def test_shape_mismatch_is_an_error():
    a = torch.zeros(2, 3)
    with pytest.raises(ValueError, match="one shape"):
        vtrace(a, a, a, a, torch.zeros(2, 4), a.bool(), a.bool(), 0.9)
