"""GRPO: critic-free policy optimisation with group-relative advantages, top to bottom.

An actor's envs are split into groups of ``group_size`` consecutive envs that start from identical
states. Two baselines (``GRPOConfig.baseline``):

- ``"step"``: for every env the discounted return-to-go within the rollout is computed; at each step
  it is normalised against the envs of its group that are still running at that step. Suits dense
  rewards, where returns-to-go at the same step compare like with like.
- ``"episode"``: outcome-level, as in the GRPO papers and their VLA descendants (SimpleVLA-RL,
  RL4VLA): each env's whole-episode return is normalised against its group's, and that one
  advantage is given to every step of the episode. Suits a 0/1 success reward: under ``"step"`` a
  failing env's steps after the last success in its group are compared only with other failures
  and get no advantage at all, so a policy that stalls learns nothing about where it stalls.

The update is
PPO's clipped ratio on the behaviour log-prob, plus an optional KL penalty to a frozen reference
policy (the initial weights: from scratch ``kl_coef = 0``, fine-tuning ~0.02).
"""

from __future__ import annotations

from typing import Callable

import torch
from tensordict import TensorDict, TensorDictBase
from torch import nn

from learner.fast_epochs import MinibatchStep, epochs_in_mode
from learner.minibatch import EpochHooks, log_ratio as clamped_log_ratio
from shared import keys
from shared.chunks import policy_fields, row_gamma
from shared.keys import MASK
from shared.config import GRPO_EPISODE_NEEDS_TRUNCATION, GRPOConfig


@torch.no_grad()
def grpo_advantages(reward: torch.Tensor, done: torch.Tensor, group_size: int, gamma: float | torch.Tensor, eps: float,
                    truncate_at_first_done: bool, scale_by_std: bool = True,
                    baseline: str = "step", loss_mean: str = "step") -> tuple[torch.Tensor, torch.Tensor]:
    """Group-relative advantages.

    Args:
        reward, done: ``[B, T]``; rows ``g * group_size ... (g + 1) * group_size - 1`` are group g.
        group_size: envs per group (B must be a multiple).
        gamma: discount of the step-wise return-to-go (cut at every episode end); or ``[B, T]``, each
            row's own (``gamma ** executed`` for action-chunk rows, shared/chunks.py).
        eps: added to the within-group standard deviation.
        truncate_at_first_done: mask out every step after an env's first episode end.
        scale_by_std: divide the centred returns by the group's standard deviation (+ eps).
        baseline: ``"step"`` (returns-to-go against the group's running envs at each step) or
            ``"episode"`` (each env's return from step 0 to its first episode end, or to the end of
            the rollout if none ends, against its group's; needs `truncate_at_first_done`).
        loss_mean: ``"step"``: every unmasked step weighs the same in the loss (DAPO's token-level
            mean). ``"episode"``: every env's steps weigh 1 / (its unmasked steps), rescaled so the
            mean weight stays 1: each env weighs the same whatever its length (the original GRPO's
            per-sequence mean). The weight is folded into the advantage, which the clipped
            objective scales linearly.

    Returns:
        ``(advantage, mask)``, both ``[B, T]``; advantage is 0 where mask is False.
    """
    b, t_len = reward.shape
    if b % group_size:
        raise ValueError(f"grpo_advantages: {b} envs are not a multiple of group_size {group_size}")
    if baseline not in ("step", "episode"):
        raise ValueError(f"grpo_advantages: baseline={baseline!r} is not 'step' or 'episode'")
    if loss_mean not in ("step", "episode"):
        raise ValueError(f"grpo_advantages: loss_mean={loss_mean!r} is not 'step' or 'episode'")
    why = GRPO_EPISODE_NEEDS_TRUNCATION
    for name, value in (("baseline", baseline), ("loss_mean", loss_mean)):
        if value == "episode" and not truncate_at_first_done:
            raise ValueError(f"grpo_advantages: {name}='episode' needs truncate_at_first_done ({why[name]})")
    done = done.bool()
    ret = torch.empty_like(reward)
    running = torch.zeros_like(reward[:, 0])
    for t in range(t_len - 1, -1, -1):
        g = gamma[:, t] if torch.is_tensor(gamma) else gamma
        running = reward[:, t] + g * running * (~done[:, t])
        ret[:, t] = running
    if truncate_at_first_done:
        ended_before = done.long().cumsum(1) - done.long()       # episode ends strictly before t
        mask = ended_before == 0
    else:
        mask = torch.ones_like(done)
    if baseline == "episode":   # one outcome per env (ret[:, 0] stops at the first episode end)
        ret = ret[:, :1].expand(b, t_len)
        mask_for_stats = torch.zeros_like(mask)
        mask_for_stats[:, 0] = True
    else:
        mask_for_stats = mask
    g = ret.reshape(b // group_size, group_size, t_len)
    m = mask_for_stats.view(b // group_size, group_size, t_len).to(ret.dtype)
    n = m.sum(1, keepdim=True).clamp(min=1.0)
    mean = (g * m).sum(1, keepdim=True) / n
    adv = g - mean
    if scale_by_std:
        std = (((g - mean) ** 2 * m).sum(1, keepdim=True) / n).sqrt()
        adv = adv / (std + eps)
    if baseline == "episode":   # the step-0 statistics, given to every step the env takes part in
        adv = adv[..., :1].expand_as(adv)
    adv = (adv * mask.view_as(adv).to(ret.dtype)).reshape(b, t_len)
    if loss_mean == "episode":
        steps = mask.sum(1, keepdim=True).float()          # >= 1: step 0 is always unmasked
        adv = adv * (steps.sum() / b) / steps
    return adv, mask


DYNAMIC_SAMPLING_TOL = 1e-6


@torch.no_grad()
def informative_groups(reward: torch.Tensor, done: torch.Tensor, cfg: GRPOConfig) -> torch.Tensor:
    """Dynamic sampling: for each group of `reward`/`done` ``[B, T]``, whether to keep it (bool
    ``[B // group_size]``). By default, whether its members' outcomes differ: some step the group
    takes part in has a non-zero advantage before scaling (the returns the baseline compares are not
    all within :data:`DYNAMIC_SAMPLING_TOL`); a group that fails this has zero advantage at every step.
    With a band (``dynamic_sampling_min_accuracy`` / ``_max_accuracy`` other than 0 and 1), whether
    its success rate is strictly inside it, a member having succeeded when its return up to its first
    episode end is positive."""
    lo, hi = cfg.dynamic_sampling_min_accuracy, cfg.dynamic_sampling_max_accuracy
    if (lo, hi) != (0.0, 1.0):
        first = (done.long().cumsum(1) - done.long()) == 0          # up to and with the first episode end
        success = ((reward * first).sum(1) > 0).float()              # [B]
        rate = success.reshape(-1, cfg.group_size).mean(1)
        return (rate > lo) & (rate < hi)
    adv, mask = grpo_advantages(reward, done, cfg.group_size, cfg.gamma, cfg.eps, cfg.truncate_at_first_done,
                                scale_by_std=False, baseline=cfg.baseline, loss_mean="step")
    spread = (adv.abs() * mask).reshape(-1, cfg.group_size * adv.shape[1]).amax(1)
    return spread > DYNAMIC_SAMPLING_TOL


def grpo_loss(policy: nn.Module, mb: TensorDictBase, cfg: GRPOConfig) -> dict[str, torch.Tensor]:
    """Losses and diagnostics on one minibatch ``[B]`` of unmasked samples."""
    new_logp, entropy, _ = policy.evaluate_actions(mb)
    log_ratio = clamped_log_ratio(new_logp, mb[keys.LOG_PROB])
    ratio = log_ratio.exp()
    adv = mb[keys.ADVANTAGE]
    high = cfg.clip_coef if cfg.clip_coef_high is None else cfg.clip_coef_high
    pg_loss = torch.max(-adv * ratio, -adv * ratio.clamp(1 - cfg.clip_coef, 1 + high)).mean()
    ent = entropy.mean()
    out = {"loss_policy": pg_loss, "loss_entropy": -cfg.ent_coef * ent, "entropy": ent.detach()}
    if cfg.kl_coef > 0:
        d = clamped_log_ratio(mb["ref_log_prob"], new_logp)
        kl = (d.exp() - d - 1).mean()                         # k3 estimator of KL(policy || reference)
        out["loss_kl"] = cfg.kl_coef * kl
        out["kl_ref"] = kl.detach()
    with torch.no_grad():
        out["approx_kl"] = ((ratio - 1) - log_ratio).mean()
        out["clip_frac"] = ((ratio < 1 - cfg.clip_coef) | (ratio > 1 + high)).float().mean()
    return out


def grpo_update(policy: nn.Module, ref_policy: nn.Module | None, optimizer: torch.optim.Optimizer,
                batch: TensorDictBase, cfg: GRPOConfig, generator: torch.Generator,
                hooks: EpochHooks | None = None, step: MinibatchStep | None = None) -> dict[str, float]:
    """``n_epochs`` passes of shuffled minibatches over the unmasked steps of `batch` (``[B, T]``
    with ``advantage`` and ``mask``). `hooks`: see :class:`learner.minibatch.EpochHooks`; `step`:
    the ``learner.compile`` step (``learner/fast_epochs.py``), None for the eager loop."""
    b = batch.reshape(-1)
    keep = b[MASK].nonzero().squeeze(-1)
    fields = {k: b.get(k)[keep] for k in (keys.OBS, keys.ACTION, keys.LOG_PROB, keys.ADVANTAGE, *policy_fields(policy))}
    n = keep.numel()
    if ref_policy is not None and cfg.kl_coef > 0:
        with torch.no_grad():
            fields["ref_log_prob"] = ref_policy.evaluate_actions(TensorDict(fields, batch_size=[n]))[0]
    if step is not None:
        loss_fn = step.loss_for(("grpo",), lambda: lambda mb: grpo_loss(policy, mb, cfg))
    else:
        loss_fn = lambda mb: grpo_loss(policy, mb, cfg)  # noqa: E731
    result = epochs_in_mode(step, policy, optimizer, fields, loss_fn, cfg.n_epochs, cfg.batch_size,
                            cfg.max_grad_norm, cfg.target_kl, generator, hooks)
    result["samples"] = n
    return result


class GRPO:
    """GRPO as the learner runs it (the same interface as :class:`learner.ppo.PPO`): group-relative
    advantages in :meth:`prepare`, the clipped update in :meth:`update`, and the frozen reference
    policy of the KL penalty in :meth:`state_dict`.

    Args:
        cfg: ``algorithm.cfg``.
        policy, optimizer, generator: the learner's (the generator orders the minibatches).
        make_reference: builds a fresh policy of the same architecture (for the KL reference).
        step: the ``learner.compile`` minibatch step, or None (eager).
    """
    name = "grpo"

    def __init__(self, cfg: GRPOConfig, policy: nn.Module, optimizer: torch.optim.Optimizer,
                 generator: torch.Generator, make_reference: Callable[[], nn.Module],
                 step: MinibatchStep | None = None):
        self.cfg, self.optimizer, self.generator, self.step = cfg, optimizer, generator, step
        # The KL penalty pulls towards the initial (e.g. pretrained) weights, frozen here.
        self.ref_policy = None
        if cfg.kl_coef > 0:
            self.ref_policy = make_reference().eval().requires_grad_(False)
            self.ref_policy.load_state_dict(policy.state_dict())

    def observe(self, actor: int, reward: torch.Tensor, done: torch.Tensor) -> None:
        """GRPO keeps no running reward statistics."""

    def reward_std(self, all_reduce=None) -> None:
        return None

    def prepare(self, batch: TensorDictBase, lags: torch.Tensor, reward_std: float | None = None) -> dict[str, float]:
        """Group-relative advantages and the mask of the steps that take part, on `batch` ``[B, T]``."""
        c = self.cfg
        adv, mask = grpo_advantages(batch[keys.REWARD], batch[keys.DONE], c.group_size, row_gamma(batch, c.gamma), c.eps,
                                    c.truncate_at_first_done, c.scale_by_std, baseline=c.baseline,
                                    loss_mean=c.loss_mean)
        out = {}
        if c.dynamic_sampling:   # the groups whose outcomes all agree reach neither the loss nor its mean
            keep = informative_groups(batch[keys.REWARD], batch[keys.DONE], c)
            rows = keep.repeat_interleave(c.group_size).unsqueeze(1)
            mask = mask & rows
            adv = adv * rows
            out = {"groups_kept": float(keep.sum()), "groups_dropped": float((~keep).sum())}
        batch.set(keys.ADVANTAGE, adv)
        batch.set(MASK, mask)
        return out

    def update(self, batch: TensorDictBase, policy: nn.Module, hooks: EpochHooks) -> dict[str, float]:
        return grpo_update(policy, self.ref_policy, self.optimizer, batch, self.cfg, self.generator, hooks,
                           step=self.step)

    def state_dict(self) -> dict:
        return {"ref_policy": self.ref_policy.state_dict() if self.ref_policy is not None else None}

    def load_state_dict(self, state: dict) -> None:
        if self.ref_policy is not None and state.get("ref_policy") is not None:
            self.ref_policy.load_state_dict(state["ref_policy"])
