"""Generalised advantage estimation on batch-first ``[N, T]`` rollouts (time on the last axis)."""

from __future__ import annotations

import torch


@torch.no_grad()
def compute_gae(reward: torch.Tensor, value: torch.Tensor, next_value: torch.Tensor,
                terminated: torch.Tensor, done: torch.Tensor, gamma: float | torch.Tensor, lam: float
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """GAE(gamma, lambda) with true bootstrapping.

    Args:
        reward, value: ``[N, T]``; ``value[:, t] = V(s_t)``.
        next_value: ``[N, T]``, ``V`` of the true state after step t. On a truncated step that is
            the final observation of the episode, not the auto-reset observation.
        terminated: ``[N, T]`` bool; a terminal step has no bootstrap (``next_value`` is ignored).
        done: ``[N, T]`` bool (terminated | truncated); the recursion does not cross it.
        gamma, lam: discount and GAE lambda. `gamma` may be ``[N, T]``, each row's own: an action-chunk
            row that executed m actions is discounted by ``gamma ** m`` (shared/chunks.py), the
            semi-Markov form of GAE.

    Returns:
        ``(advantage, value_target)``, both ``[N, T]``, with ``value_target = advantage + value``.
        Equal to TorchRL's ``generalized_advantage_estimate`` on the same inputs.
    """
    if not (reward.shape == value.shape == next_value.shape == terminated.shape == done.shape):
        raise ValueError(f"compute_gae: shapes differ: reward {tuple(reward.shape)}, value {tuple(value.shape)}, "
                         f"next_value {tuple(next_value.shape)}, terminated {tuple(terminated.shape)}, "
                         f"done {tuple(done.shape)}")
    not_terminated = (~terminated.bool()).to(value.dtype)
    not_done = (~done.bool()).to(value.dtype)
    delta = reward + gamma * next_value * not_terminated - value
    discount = gamma * lam * not_done
    advantage = torch.empty_like(delta)
    running = torch.zeros_like(delta[..., 0])
    for t in range(delta.shape[-1] - 1, -1, -1):
        running = delta[..., t] + discount[..., t] * running
        advantage[..., t] = running
    return advantage, advantage + value


@torch.no_grad()
def bootstrap_mask(terminated: torch.Tensor, done: torch.Tensor) -> torch.Tensor:
    """``[N, T]``: the steps whose ``V(s_{t+1})`` is not the next step's value in the rollout and is
    not zero: truncated steps (the final observation) and the last step unless it terminated."""
    last = torch.zeros_like(done, dtype=torch.bool)
    last[..., -1] = True
    return ~terminated.bool() & (done.bool() | last)


@torch.no_grad()
def current_values(value_now: torch.Tensor, next_value_sent: torch.Tensor, done: torch.Tensor,
                   bootstrap_now: torch.Tensor | None = None, terminated: torch.Tensor | None = None
                   ) -> torch.Tensor:
    """``V(s_{t+1})`` from the current critic's ``V(s_t)`` on ``[N, T]``: the next step's value
    inside the rollout. After a done step and after the last step (whose next observation is not in
    the rollout): `bootstrap_now` (the current critic on ``bootstrap_observation``) where given
    (with `terminated`, at :func:`bootstrap_mask`), else the actor's ``next_value``."""
    shifted = torch.cat([value_now[..., 1:], next_value_sent[..., -1:]], dim=-1)
    out = torch.where(done.bool(), next_value_sent, shifted)
    if bootstrap_now is not None:
        out = torch.where(bootstrap_mask(terminated, done), bootstrap_now, out)
    return out
