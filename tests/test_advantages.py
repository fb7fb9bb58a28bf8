"""Unit tests for ``learner.advantages.compute_gae``.

The reference is TorchRL's ``generalized_advantage_estimate`` (DESIGN.md, "Advantages"). TorchRL wants
time on dim -2 with a trailing feature axis, so ``[N, T]`` inputs become ``[N, T, 1]`` at the call.
The hand-computed cases pin down the semantics that matter for bootstrapping: ``terminated`` drops
the bootstrap, ``done`` cuts the recursion, a truncated step bootstraps from ``next_value``.
"""

from __future__ import annotations

import pytest
import torch
from torchrl.objectives.value.functional import generalized_advantage_estimate

from learner.advantages import compute_gae

GAMMA, LAM = 0.9, 0.8


def _random_rollout(seed: int, n: int, t: int, dtype: torch.dtype, p_done: float = 0.3):
    """Random ``[n, t]`` inputs whose dones mix truncation (done & ~terminated) and termination."""
    g = torch.Generator().manual_seed(seed)
    reward, value, next_value = (torch.randn(n, t, generator=g, dtype=dtype) for _ in range(3))
    done = torch.rand(n, t, generator=g) < p_done
    terminated = done & (torch.rand(n, t, generator=g) < 0.5)
    return reward, value, next_value, terminated, done


def _torchrl_gae(reward, value, next_value, terminated, done, gamma, lam):
    """TorchRL's GAE on ``[N, T]`` inputs, converted to and from its ``[N, T, 1]`` layout."""
    adv, target = generalized_advantage_estimate(
        gamma, lam,
        state_value=value[..., None], next_state_value=next_value[..., None], reward=reward[..., None],
        done=done[..., None], terminated=terminated[..., None], time_dim=-2)
    return adv.squeeze(-1), target.squeeze(-1)


def _single_env(*rows, dtype=torch.float64):
    """Turn per-step Python lists into ``[1, T]`` tensors (bools stay bool)."""
    return [torch.tensor([row], dtype=torch.bool if isinstance(row[0], bool) else dtype) for row in rows]


# ---------------------------------------------------------------- reference implementation


# TorchRL multiplies gamma and lambda into an *integer* mask, so it rounds them to float32 even for
# float64 inputs (compute_gae keeps the input dtype). Gamma and lambda exactly representable in float32
# (dyadic) keep that rounding out of the comparison, which then holds at float64 tolerance.
REF_GAMMA, REF_LAM = 1 - 2 ** -7, 1 - 2 ** -4   # 0.9921875, 0.9375


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("n", [1, 4])
@pytest.mark.parametrize("t", [1, 7, 64])
@pytest.mark.parametrize("seed", range(3))
def test_matches_torchrl(seed, t, n, dtype):
    inputs = _random_rollout(seed, n, t, dtype)
    adv, target = compute_gae(*inputs, gamma=REF_GAMMA, lam=REF_LAM)
    ref_adv, ref_target = _torchrl_gae(*inputs, gamma=REF_GAMMA, lam=REF_LAM)
    assert adv.shape == target.shape == (n, t)
    assert adv.dtype == target.dtype == dtype
    torch.testing.assert_close(adv, ref_adv)
    torch.testing.assert_close(target, ref_target)


@pytest.mark.parametrize("seed", range(3))
def test_matches_torchrl_float32_with_usual_gamma_lambda(seed):
    """At float32 the rounding above is harmless, so the everyday (0.99, 0.95) matches too."""
    inputs = _random_rollout(seed, 4, 64, torch.float32)
    for got, ref in zip(compute_gae(*inputs, gamma=0.99, lam=0.95), _torchrl_gae(*inputs, gamma=0.99, lam=0.95)):
        torch.testing.assert_close(got, ref)


def test_random_inputs_mix_truncation_and_termination():
    """Guard for the reference test: its done patterns really contain both kinds of episode end."""
    _, _, _, terminated, done = _random_rollout(0, 4, 64, torch.float64)
    assert (done & terminated).any() and (done & ~terminated).any() and (~done).any()


@pytest.mark.parametrize("gamma, lam", [(REF_GAMMA, REF_LAM), (1.0, 1.0), (0.5, 0.0), (0.0, 0.75)])
def test_matches_torchrl_across_gamma_lambda(gamma, lam):
    inputs = _random_rollout(7, 4, 32, torch.float64)
    for got, ref in zip(compute_gae(*inputs, gamma=gamma, lam=lam), _torchrl_gae(*inputs, gamma=gamma, lam=lam)):
        torch.testing.assert_close(got, ref)


# ---------------------------------------------------------------- hand-computed cases

# Three steps of one env, gamma = 0.9, lam = 0.8 (gamma * lam = 0.72).
REWARD = [1.0, 2.0, 3.0]
VALUE = [0.5, 1.0, 1.5]
NEXT_VALUE = [1.0, 1.5, 7.0]


def test_termination_at_last_step_does_not_bootstrap():
    reward, value, next_value, terminated, done = _single_env(
        REWARD, VALUE, NEXT_VALUE, [False, False, True], [False, False, True])
    adv, target = compute_gae(reward, value, next_value, terminated, done, GAMMA, LAM)
    # delta = r + 0.9 * next_value * (1 - terminated) - value
    #   delta0 = 1 + 0.9 * 1.0 - 0.5 = 1.4;  delta1 = 2 + 0.9 * 1.5 - 1.0 = 2.35;  delta2 = 3 - 1.5 = 1.5
    # A2 = 1.5;  A1 = 2.35 + 0.72 * 1.5 = 3.43;  A0 = 1.4 + 0.72 * 3.43 = 3.8696
    expected = torch.tensor([[3.8696, 3.43, 1.5]], dtype=torch.float64)
    torch.testing.assert_close(adv, expected)
    torch.testing.assert_close(target, expected + value)


def test_truncation_at_last_step_bootstraps_from_next_value():
    reward, value, next_value, terminated, done = _single_env(
        REWARD, VALUE, NEXT_VALUE, [False, False, False], [False, False, True])
    adv, target = compute_gae(reward, value, next_value, terminated, done, GAMMA, LAM)
    # delta2 = 3 + 0.9 * 7.0 - 1.5 = 7.8 (the other deltas as above)
    # A2 = 7.8;  A1 = 2.35 + 0.72 * 7.8 = 7.966;  A0 = 1.4 + 0.72 * 7.966 = 7.13552
    expected = torch.tensor([[7.13552, 7.966, 7.8]], dtype=torch.float64)
    torch.testing.assert_close(adv, expected)
    torch.testing.assert_close(target, expected + value)


@pytest.mark.parametrize("terminated_at_boundary", [True, False], ids=["terminated", "truncated"])
def test_episode_end_mid_rollout_does_not_leak_advantage(terminated_at_boundary):
    """Steps before an episode end (at t=1) ignore everything after it; steps after it ignore everything before."""
    reward, value, next_value, _, _ = _random_rollout(3, 2, 6, torch.float64)
    done = torch.zeros(2, 6, dtype=torch.bool)
    done[:, 1] = True
    terminated = done if terminated_at_boundary else torch.zeros_like(done)
    adv, _ = compute_gae(reward, value, next_value, terminated, done, GAMMA, LAM)

    # Each episode on its own gives the same advantages as the whole rollout.
    first, _ = compute_gae(reward[:, :2], value[:, :2], next_value[:, :2], terminated[:, :2], done[:, :2], GAMMA, LAM)
    second, _ = compute_gae(reward[:, 2:], value[:, 2:], next_value[:, 2:], terminated[:, 2:], done[:, 2:], GAMMA, LAM)
    torch.testing.assert_close(adv, torch.cat([first, second], dim=1))

    # Perturbing the next episode leaves the first untouched (and the reverse).
    later = torch.arange(6) >= 2
    changed, _ = compute_gae(reward + later * 10.0, value - later * 3.0, next_value, terminated, done, GAMMA, LAM)
    torch.testing.assert_close(changed[:, :2], adv[:, :2], rtol=0, atol=0)
    assert not torch.allclose(changed[:, 2:], adv[:, 2:])
    changed, _ = compute_gae(reward + ~later * 10.0, value, next_value + ~later * 10.0, terminated, done, GAMMA, LAM)
    torch.testing.assert_close(changed[:, 2:], adv[:, 2:], rtol=0, atol=0)


def test_lambda_one_gives_discounted_return_minus_value():
    reward, value, next_value, terminated, done = _random_rollout(5, 3, 9, torch.float64)
    # Within an episode next_value[t] is value[t + 1] (the same state); only at an episode end is it the
    # value of the true final state, which differs from value[t + 1] (the reset state of the next episode).
    next_value[:, :-1] = torch.where(done[:, :-1], next_value[:, :-1], value[:, 1:])
    # Discounted return, bootstrapped from next_value at the rollout end and at truncations, cut at every done.
    ret = torch.empty_like(reward)
    running = torch.zeros(3, dtype=torch.float64)
    for t in reversed(range(9)):
        bootstrap = torch.where(terminated[:, t], 0.0, next_value[:, t])
        running = reward[:, t] + GAMMA * torch.where(done[:, t] | (t == 8), bootstrap, running)
        ret[:, t] = running
    adv, target = compute_gae(reward, value, next_value, terminated, done, GAMMA, lam=1.0)
    torch.testing.assert_close(adv, ret - value)
    torch.testing.assert_close(target, ret)


def test_lambda_zero_gives_one_step_td_error():
    reward, value, next_value, terminated, done = _random_rollout(6, 3, 9, torch.float64)
    adv, target = compute_gae(reward, value, next_value, terminated, done, GAMMA, lam=0.0)
    td_error = reward + GAMMA * next_value * (~terminated) - value
    torch.testing.assert_close(adv, td_error)
    torch.testing.assert_close(target, td_error + value)


def test_truncation_differs_from_termination_by_discounted_bootstrap():
    """Same rewards; only the kind of episode end at step 2 differs. The gap is gamma * next_value there,
    carried back by (gamma * lam) per earlier step of the same episode, and zero after the boundary."""
    reward, value, next_value, _, _ = _random_rollout(8, 1, 5, torch.float64)
    done = torch.tensor([[False, False, True, False, False]])
    truncated_adv, _ = compute_gae(reward, value, next_value, torch.zeros_like(done), done, GAMMA, LAM)
    terminated_adv, _ = compute_gae(reward, value, next_value, done, done, GAMMA, LAM)
    gap = GAMMA * next_value[0, 2]
    expected = torch.stack([gap * (GAMMA * LAM) ** 2, gap * GAMMA * LAM, gap,
                            torch.zeros((), dtype=torch.float64), torch.zeros((), dtype=torch.float64)])[None]
    torch.testing.assert_close(truncated_adv - terminated_adv, expected)


# ---------------------------------------------------------------- validation


@pytest.mark.parametrize("wrong", ["reward", "value", "next_value", "terminated", "done"])
def test_mismatched_shapes_raise(wrong):
    inputs = dict(zip(["reward", "value", "next_value", "terminated", "done"], _random_rollout(0, 2, 5, torch.float64)))
    inputs[wrong] = inputs[wrong][:, :4]
    with pytest.raises(ValueError, match=rf"shapes differ.*{wrong} \(2, 4\)"):
        compute_gae(**inputs, gamma=GAMMA, lam=LAM)


def test_transposed_input_raises():
    """A time-first ``[T, N]`` tensor among batch-first ones is caught, not broadcast."""
    reward, value, next_value, terminated, done = _random_rollout(0, 2, 5, torch.float64)
    with pytest.raises(ValueError, match="shapes differ"):
        compute_gae(reward, value.T, next_value, terminated, done, GAMMA, LAM)
