"""PPO update (clipped surrogate, value loss, entropy bonus), CleanRL-style, top to bottom.

Input is a batch of rollouts that already carry ``advantage`` and ``value_target``. The minibatch
order comes from the learner's own ``torch.Generator``, so an update is a pure function of
(weights, optimiser state, data, generator state): the equivalence test relies on it.
"""

from __future__ import annotations

import torch
from tensordict import TensorDict, TensorDictBase
from torch import nn

from shared import keys
from shared.config import PPOConfig


def ppo_loss(policy: nn.Module, mb: TensorDictBase, cfg: PPOConfig) -> dict[str, torch.Tensor]:
    """Losses and diagnostics on one minibatch ``[B]``. Keys starting with ``loss_`` are summed."""
    new_logp, entropy, new_value = policy.evaluate_actions(mb)
    log_ratio = new_logp - mb[keys.LOG_PROB]
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
               generator: torch.Generator) -> dict[str, float]:
    """``n_epochs`` passes of shuffled minibatches over `batch` (any batch shape; flattened here).

    Every sample is used exactly once per epoch. Returns the mean of each diagnostic over the
    minibatches, plus ``epochs`` (fewer than ``n_epochs`` when ``target_kl`` stopped early).
    """
    b = batch.reshape(-1)
    n = b.shape[0]
    # Index plain tensors: TensorDict indexing per minibatch costs more than a small MLP step.
    fields = {k: b.get(k) for k in (keys.OBS, keys.ACTION, keys.LOG_PROB, keys.VALUE, keys.ADVANTAGE,
                                    keys.VALUE_TARGET)}
    sums: dict[str, torch.Tensor] = {}   # kept on the device: no host sync per minibatch
    count = 0
    epochs = 0
    params = [p for p in policy.parameters() if p.requires_grad]
    for _ in range(cfg.n_epochs):
        epochs += 1
        perm = torch.randperm(n, generator=generator).to(b.device)
        epoch_kl = []
        for start in range(0, n, cfg.batch_size):
            idx = perm[start:start + cfg.batch_size]
            mb = TensorDict({k: v[idx] for k, v in fields.items()}, batch_size=[idx.numel()])
            out = ppo_loss(policy, mb, cfg)
            loss = out["loss_policy"] + out["loss_value"] + out["loss_entropy"]
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            grad_norm = nn.utils.clip_grad_norm_(params, cfg.max_grad_norm) if cfg.max_grad_norm > 0 else \
                torch.zeros(())
            optimizer.step()
            out["grad_norm"] = grad_norm
            for k, v in out.items():
                sums[k] = sums[k] + v.detach() if k in sums else v.detach()
            epoch_kl.append(out["approx_kl"])
            count += 1
        if cfg.target_kl is not None and float(torch.stack(epoch_kl).mean()) > cfg.target_kl:
            break
    result = {k: float(v) / count for k, v in sums.items()}
    result["epochs"] = epochs
    with torch.no_grad():
        y, v = b[keys.VALUE_TARGET], b[keys.VALUE]
        var_y = y.var()
        result["explained_variance"] = float(1 - (y - v).var() / var_y) if var_y > 0 else float("nan")
    return result
