"""IMPALA's V-trace (Espeholt et al., 2018): off-policy value targets and policy-gradient advantages.

The ``vtrace`` and ``appo`` corrections (``learner/corrections.py``) compute their targets with it.
"""

from __future__ import annotations

import torch

from learner.minibatch import log_ratio


@torch.no_grad()
def vtrace(behaviour_log_prob: torch.Tensor, target_log_prob: torch.Tensor, reward: torch.Tensor,
           value: torch.Tensor, next_value: torch.Tensor, terminated: torch.Tensor, done: torch.Tensor,
           gamma: float | torch.Tensor, rho_bar: float = 1.0, c_bar: float = 1.0, lam: float = 1.0, weighted: bool = True,
           advantage: str = "impala") -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
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
        gamma: discount; or ``[N, T]``, each row's own (``gamma ** executed`` for action chunks).
        rho_bar, c_bar: truncation levels (``float("inf")``: none).
        lam: c_t = lam * min(c_bar, rho_t).
        weighted: False returns the advantage without its ``min(rho_bar, rho_t)`` factor (the
            learner normalises it first, then weights it).
        advantage: ``"impala"``: IMPALA's ``r_t + gamma v_{t+1} - V(s_t)``, whose one-step target
            uses the whole trace at t+1 (on-policy: a lambda-return at t+1 with no lambda at t, more
            variance than GAE for lambda < 1). ``"gae"``: ``r_t + gamma ((1 - lam) V(s_{t+1}) +
            lam v_{t+1}) - V(s_t)``, the same mixture GAE takes, so that on on-policy data (rho = 1,
            c_bar >= 1) it is GAE(lam) exactly; off-policy it keeps V-trace's truncated traces.

    Returns:
        ``(vs, pg_advantage, rho)``: the V-trace targets ``v_s``, the advantages
        ``min(rho_bar, rho_t) (r_t + gamma q_{t+1} - V(s_t))`` with ``q_{t+1}`` per `advantage`
        (``v_{t+1}``, the bootstrap value after a done or the last step, or its mixture with
        ``V(s_{t+1})``), and the untruncated ratios ``rho_t = pi / mu``.
    """
    if advantage not in ("impala", "gae"):
        raise ValueError(f"vtrace: advantage must be 'impala' or 'gae', got {advantage!r}")
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
    trace = (gamma * c) if torch.is_tensor(gamma) else None
    for t in range(value.shape[-1] - 1, -1, -1):
        step = gamma * c[..., t] if trace is None else trace[..., t]
        acc = delta[..., t] + step * not_done[..., t] * acc
        vs_minus_v[..., t] = acc
    vs = value + vs_minus_v
    # v_{t+1}: the next step's target inside an episode; the bootstrap value after a done or at the end.
    vs_next = torch.cat([vs[..., 1:], boot[..., -1:]], dim=-1)
    vs_next = torch.where(done.bool(), boot, vs_next)
    if advantage == "gae":
        vs_next = (1.0 - lam) * boot + lam * vs_next
    pg_advantage = reward + gamma * vs_next - value
    return vs, (rho_t * pg_advantage if weighted else pg_advantage), rho
