"""PPO update (clipped surrogate, value loss, entropy bonus), CleanRL-style, top to bottom.

Input is a batch of rollouts that already carry ``advantage`` and ``value_target``. The minibatch
order comes from the learner's own ``torch.Generator``, so an update is a pure function of
(weights, optimiser state, data, generator state): the equivalence test relies on it.
"""

from __future__ import annotations

import torch
from tensordict import TensorDictBase
from torch import nn

from learner.minibatch import log_ratio as clamped_log_ratio, run_epochs
from shared import keys
from shared.config import PPOConfig


def ppo_loss(policy: nn.Module, mb: TensorDictBase, cfg: PPOConfig) -> dict[str, torch.Tensor]:
    """Losses and diagnostics on one minibatch ``[B]``. Keys starting with ``loss_`` are summed."""
    new_logp, entropy, new_value = policy.evaluate_actions(mb)
    log_ratio = clamped_log_ratio(new_logp, mb[keys.LOG_PROB])
    ratio = log_ratio.exp()
    adv = mb[keys.ADVANTAGE]
    if cfg.norm_adv and adv.numel() > 1:
        adv = (adv - adv.mean()) / (adv.std() + 1e-8)
    pg_loss = torch.max(-adv * ratio, -adv * ratio.clamp(1 - cfg.clip_coef, 1 + cfg.clip_coef)).mean()
    target = mb[keys.VALUE_TARGET]
    if cfg.clip_vloss:
        old_value = mb[keys.VALUE]
        clipped = old_value + (new_value - old_value).clamp(-cfg.clip_coef, cfg.clip_coef)
        v_loss = 0.5 * torch.max((new_value - target) ** 2, (clipped - target) ** 2).mean()
    else:
        v_loss = 0.5 * ((new_value - target) ** 2).mean()
    ent = entropy.mean()
    with torch.no_grad():
        approx_kl = ((ratio - 1) - log_ratio).mean()          # Schulman's k3 estimator
        clip_frac = ((ratio - 1).abs() > cfg.clip_coef).float().mean()
    return {"loss_policy": pg_loss, "loss_value": cfg.vf_coef * v_loss, "loss_entropy": -cfg.ent_coef * ent,
            "value_loss": v_loss.detach(), "entropy": ent.detach(), "approx_kl": approx_kl,
            "clip_frac": clip_frac}


def ppo_update(policy: nn.Module, optimizer: torch.optim.Optimizer, batch: TensorDictBase, cfg: PPOConfig,
               generator: torch.Generator, sync_mean=None) -> dict[str, float]:
    """``n_epochs`` passes of shuffled minibatches over `batch` (any batch shape; flattened here).

    Every sample is used exactly once per epoch. Returns the mean of each diagnostic over the
    minibatches, plus ``epochs`` (fewer than ``n_epochs`` when ``target_kl`` stopped early).
    """
    b = batch.reshape(-1)
    fields = {k: b.get(k) for k in (keys.OBS, keys.ACTION, keys.LOG_PROB, keys.VALUE, keys.ADVANTAGE,
                                    keys.VALUE_TARGET)}
    result = run_epochs(policy, optimizer, fields, lambda mb: ppo_loss(policy, mb, cfg), cfg.n_epochs,
                        cfg.batch_size, cfg.max_grad_norm, cfg.target_kl, generator, sync_mean)
    with torch.no_grad():
        y, v = b[keys.VALUE_TARGET], b[keys.VALUE]
        var_y = y.var()
        result["explained_variance"] = float(1 - (y - v).var() / var_y) if var_y > 0 else float("nan")
    return result
