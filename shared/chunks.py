"""Action chunks: a policy call that returns H actions, of which the actor executes the first
``actors.actions_per_call``, one env step each.

A chunk policy says so with ``chunk_size = H`` (an int attribute, H > 1; absent or 1: one action per
call and no chunk dimension anywhere). Its forward pass writes

- ``action`` ``[*B, H, *action_shape]``, the whole chunk, and
- ``sample_log_prob`` ``[*B, H]``: the log-prob of each position's action (position h's share of
  the chunk's log-likelihood), so that the actor can sum the positions it executed;

and its ``evaluate_actions`` / ``action_log_prob`` read ``executed_actions`` ``[*B]`` from the
TensorDict and return log-probs ``[*B]`` over the executed positions only (:func:`executed_sum`).

A rollout row is one call (a macro step of 1..actions_per_call env steps): its reward is the
executed steps' rewards discounted within the chunk, ``sum_j gamma^j r_j``, and every return,
advantage and V-trace target discounts the row by ``gamma ** executed`` (:func:`row_gamma`): the
semi-Markov form of GAE, equal to step-wise GAE with lambda = 1 inside each chunk.
"""

from __future__ import annotations

import torch

from shared import keys


def chunk_size(policy) -> int:
    """H, the actions one call of `policy` returns (1: no chunk dimension)."""
    return int(getattr(policy, "chunk_size", 1) or 1)


def actions_per_call(cfg, policy) -> int:
    """How many of a chunk the actor executes: ``actors.actions_per_call`` (0: the whole chunk),
    checked against the policy's chunk size."""
    h, n = chunk_size(policy), int(cfg.actors.actions_per_call)
    if n == 0:
        return h
    if n > h:
        raise ValueError(f"{cfg.source}: actors.actions_per_call is {n}, but the policy returns chunks "
                         f"of {h} action{'s' if h > 1 else ''} (policy.chunk_size)")
    return n


def executed_mask(executed: torch.Tensor, horizon: int) -> torch.Tensor:
    """``[*B, H]`` bool: position h was executed (h < executed)."""
    pos = torch.arange(horizon, device=executed.device)
    return pos < executed.unsqueeze(-1)


def executed_sum(per_position: torch.Tensor, executed: torch.Tensor) -> torch.Tensor:
    """Sum of ``[*B, H]`` per-position terms over the executed positions: ``[*B]``."""
    mask = executed_mask(executed, per_position.shape[-1])
    return torch.where(mask, per_position, torch.zeros((), dtype=per_position.dtype,
                                                        device=per_position.device)).sum(-1)


def row_gamma(batch, gamma: float):
    """The discount of each row: ``gamma`` for one-action rows, ``gamma ** executed_actions``
    (a tensor shaped like the rows) for chunk rows."""
    if keys.EXECUTED not in batch.keys():
        return gamma
    return torch.pow(torch.as_tensor(gamma, dtype=torch.float32, device=batch[keys.EXECUTED].device),
                     batch[keys.EXECUTED].to(torch.float32))


def env_steps_of(rollout) -> int:
    """Env steps in a rollout: one per row, or the executed actions of chunk rows."""
    if keys.EXECUTED in rollout.keys():
        return int(rollout[keys.EXECUTED].sum())
    return rollout.numel()


def policy_fields(policy) -> tuple[str, ...]:
    """The rollout keys `policy`'s ``evaluate_actions`` reads besides the observation and the action:
    ``executed_actions`` for a chunk policy, and the extra tensors it declares (``rollout_extras()``)."""
    extras = getattr(policy, "rollout_extras", None)
    return ((keys.EXECUTED,) if chunk_size(policy) > 1 else ()) + (tuple(extras()) if callable(extras) else ())
