"""Off-policy corrections for stale rollouts: truncated importance weights and V-trace.

In ``vla`` mode an actor acts with weights that are already ``lag`` versions old when the learner
trains on its data. ``algorithm.cfg.correction`` picks what the learner does about it:

``none``
    Plain PPO: the clipped ratio is taken against the behaviour log-prob (the policy that acted),
    advantages are GAE on the values the actor computed. Right for on-policy data (``standard``
    mode) and for small lags (about 1-2 versions), where PPO's ratio already is the importance weight.
``is``
    Decoupled PPO (Hilton et al., 2021): the trust region is centred on the *current* policy at the
    start of the update (the "proximal" policy), and each sample's advantage is weighted by the
    truncated importance weight ``min(rho_bar, pi_prox / mu)``. With stale data, plain PPO's clip
    range is centred on an old policy that the current one may already be outside of: the gradient
    vanishes for those samples, or pushes the wrong way. Use for moderate lags.
``vtrace``
    IMPALA's V-trace (Espeholt et al., 2018) on top of ``is``: the current critic recomputes V(s),
    the value targets are the V-trace targets ``v_s`` and the advantages
    ``rho_s (r_s + gamma v_{s+1} - V(s_s))``. Corrects the value targets too, which GAE on stale
    data does not: use for large lags (many versions), or whenever the critic matters.

``recompute_values`` recomputes V(s) with the current critic before GAE for ``none`` / ``is``
(fresh values for stale data, no importance weights in the targets).
``trainer.max_policy_lag`` drops data older than that many versions before any of this.

V(s_{t+1}) inside a rollout is the current critic's value of the next observation. Where the
next observation is not in the rollout (after a truncated step, and after the rollout's last step)
the bootstrap value is the one the actor sent (``next_value``, computed on the true final
observation), since the observation itself is not sent.
"""

from __future__ import annotations

import torch

from learner.minibatch import log_ratio


@torch.no_grad()
def vtrace(behaviour_log_prob: torch.Tensor, target_log_prob: torch.Tensor, reward: torch.Tensor,
           value: torch.Tensor, next_value: torch.Tensor, terminated: torch.Tensor, done: torch.Tensor,
           gamma: float, rho_bar: float = 1.0, c_bar: float = 1.0, lam: float = 1.0
           ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """V-trace targets and policy-gradient advantages on ``[N, T]`` rollouts (time on the last axis).

    Args:
        behaviour_log_prob: ``log mu(a_t | s_t)``, the policy that acted.
        target_log_prob: ``log pi(a_t | s_t)``, the policy being evaluated (the current one).
        reward: ``r_t``.
        value: ``V(s_t)`` under the current critic.
        next_value: ``V(s_{t+1})`` of the true state after step t (the final observation on
            truncation); ignored where ``terminated``.
        terminated: no bootstrap after this step.
        done: terminated | truncated; the traces stop here.
        gamma: discount.
        rho_bar, c_bar: truncation levels (``float("inf")``: none).
        lam: c_t = lam * min(c_bar, rho_t).

    Returns:
        ``(vs, pg_advantage, rho)``: the V-trace targets ``v_s``, the advantages
        ``min(rho_bar, rho_t) (r_t + gamma v_{t+1} - V(s_t))`` (with ``v_{t+1}`` the bootstrap value
        after a done or the last step), and the untruncated ratios ``rho_t = pi / mu``.
    """
    shapes = {tuple(x.shape) for x in (behaviour_log_prob, target_log_prob, reward, value, next_value,
                                       terminated, done)}
    if len(shapes) != 1:
        raise ValueError(f"vtrace: all inputs must have one shape [N, T], got {sorted(shapes)}")
    rho = log_ratio(target_log_prob, behaviour_log_prob).exp()
    rho_t = rho.clamp(max=rho_bar)
    c = lam * rho.clamp(max=c_bar)
    not_terminated = (~terminated.bool()).to(value.dtype)
    not_done = (~done.bool()).to(value.dtype)
    boot = next_value * not_terminated                         # V(s_{t+1}), 0 after a terminal step
    delta = rho_t * (reward + gamma * boot - value)
    acc = torch.zeros_like(value[..., 0])
    vs_minus_v = torch.empty_like(value)
    for t in range(value.shape[-1] - 1, -1, -1):
        acc = delta[..., t] + gamma * c[..., t] * not_done[..., t] * acc
        vs_minus_v[..., t] = acc
    vs = value + vs_minus_v
    # v_{t+1}: the next step's target inside an episode; the bootstrap value after a done or at the end.
    vs_next = torch.cat([vs[..., 1:], boot[..., -1:]], dim=-1)
    vs_next = torch.where(done.bool(), boot, vs_next)
    pg_advantage = rho_t * (reward + gamma * vs_next - value)
    return vs, pg_advantage, rho


@torch.no_grad()
def current_values(value_now: torch.Tensor, next_value_sent: torch.Tensor, done: torch.Tensor
                   ) -> torch.Tensor:
    """``V(s_{t+1})`` from the current critic's ``V(s_t)`` on ``[N, T]``: the next step's value
    inside the rollout, the actor's ``next_value`` after a done step and after the last step
    (whose observation is not in the rollout)."""
    shifted = torch.cat([value_now[..., 1:], next_value_sent[..., -1:]], dim=-1)
    return torch.where(done.bool(), next_value_sent, shifted)
