"""PPO (clipped surrogate, value loss, entropy bonus), CleanRL-style, top to bottom, and :class:`PPO`,
the algorithm object the learner holds.

Input is a batch of rollouts that already carry ``advantage`` and ``value_target``. The minibatch
order comes from the learner's own ``torch.Generator``, so an update is a pure function of
(weights, optimiser state, data, generator state): the equivalence test relies on it.
"""

from __future__ import annotations

import logging

from concurrent.futures import Executor
from dataclasses import replace
from typing import Callable

import torch
from tensordict import TensorDictBase
from torch import nn

from learner.corrections import CurrentPolicy, make_correction
from learner.drift import DriftMeter
from learner.fast_epochs import MinibatchStep, epochs_in_mode
from learner.minibatch import EpochHooks, log_ratio as clamped_log_ratio
from learner.proximal import EWMAProximal
from shared import keys
from shared.chunks import policy_fields
from shared.keys import MASK
from shared.config import PPOConfig
from shared.policies.normalization import RewardScaler

log = logging.getLogger("tandem.learner")


def _mean(x: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """The mean over the samples the mask keeps (all without one); a dropped sample's term is
    replaced by 0 with ``where`` (not multiplied), so even a NaN there gives no gradient."""
    if mask is None:
        return x.mean()
    return torch.where(mask, x, torch.zeros((), dtype=x.dtype, device=x.device)).sum() / mask.sum().clamp(min=1)


def ppo_loss(policy: nn.Module, mb: TensorDictBase, cfg: PPOConfig, renormalize: bool = True,
             proximal: Callable[[TensorDictBase], torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
    """Losses and diagnostics on one minibatch ``[B]``. Keys starting with ``loss_`` are summed.

    `renormalize`: normalise the advantages over this minibatch (plain PPO; the off-policy
    corrections normalise once per batch instead). `proximal` (the ``ewma`` correction): the
    proximal policy's log-prob of the minibatch's actions; the clip is then centred on it and each
    advantage weighted by ``min(cfg.rho_bar, pi_prox / mu)`` (`cfg` resolved by the correction,
    ``learner.corrections.resolve``). A ``mask`` in the minibatch drops samples.
    """
    adv, anchor, out = _policy_inputs(mb, cfg, proximal)   # before the live forward: no graph yet
    new_logp, entropy, new_value = policy.evaluate_actions(mb)
    out.update(_policy_terms(mb, cfg, renormalize, adv, anchor, new_logp, entropy))
    out.update(_value_terms(mb, cfg, new_value))
    return out


def ppo_actor_loss(policy: nn.Module, mb: TensorDictBase, cfg: PPOConfig, renormalize: bool = True,
                   proximal: Callable[[TensorDictBase], torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
    """:func:`ppo_loss`'s policy and entropy terms alone, from ``policy.evaluate_actor`` (no critic)."""
    adv, anchor, out = _policy_inputs(mb, cfg, proximal)
    new_logp, entropy = policy.evaluate_actor(mb)
    out.update(_policy_terms(mb, cfg, renormalize, adv, anchor, new_logp, entropy))
    return out


def ppo_critic_loss(policy: nn.Module, mb: TensorDictBase, cfg: PPOConfig) -> dict[str, torch.Tensor]:
    """:func:`ppo_loss`'s value terms alone, from ``policy.get_value``."""
    return _value_terms(mb, cfg, policy.get_value(mb))


def _policy_inputs(mb: TensorDictBase, cfg: PPOConfig, proximal) -> tuple[torch.Tensor, torch.Tensor, dict]:
    """The advantages and the log-prob the ratio is taken against (the proximal policy's, weighted
    by ``min(rho_bar, pi_prox / mu)``, with `proximal`; else the behaviour log-prob)."""
    adv, anchor, out = mb[keys.ADVANTAGE], mb[keys.LOG_PROB], {}
    if proximal is not None:
        prox = proximal(mb)
        if cfg.rho_bar is None:
            raise ValueError("ppo_loss: a proximal policy needs cfg.rho_bar (learner.corrections.resolve fills it)")
        weight = clamped_log_ratio(prox, mb[keys.LOG_PROB]).exp().clamp(max=cfg.rho_bar)
        adv, anchor = adv * weight, prox
        out["prox_weight_mean"] = weight.mean()
    return adv, anchor, out


def _policy_terms(mb: TensorDictBase, cfg: PPOConfig, renormalize: bool, adv: torch.Tensor, anchor: torch.Tensor,
                  new_logp: torch.Tensor, entropy: torch.Tensor) -> dict[str, torch.Tensor]:
    mask = mb.get(MASK, None)
    if mask is not None:   # a dropped sample's inputs must not reach the graph either (NaN x 0 = NaN)
        adv = torch.where(mask, adv, torch.zeros_like(adv))
    log_ratio = clamped_log_ratio(new_logp, anchor)
    ratio = log_ratio.exp()
    if renormalize and cfg.norm_adv and adv.numel() > 1:
        adv = (adv - adv.mean()) / (adv.std() + 1e-8)
    pg_loss = _mean(torch.max(-adv * ratio, -adv * ratio.clamp(1 - cfg.clip_coef, 1 + cfg.clip_coef)), mask)
    ent = _mean(entropy, mask)
    with torch.no_grad():
        approx_kl = _mean((ratio - 1) - log_ratio, mask)          # Schulman's k3 estimator
        clip_frac = _mean(((ratio - 1).abs() > cfg.clip_coef).float(), mask)
    return {"loss_policy": pg_loss, "loss_entropy": -cfg.ent_coef * ent, "entropy": ent.detach(),
            "approx_kl": approx_kl, "clip_frac": clip_frac}


def _value_terms(mb: TensorDictBase, cfg: PPOConfig, new_value: torch.Tensor) -> dict[str, torch.Tensor]:
    mask = mb.get(MASK, None)
    target = mb[keys.VALUE_TARGET]
    if mask is not None:
        target = torch.where(mask, target, torch.zeros_like(target))
    if cfg.clip_vloss:
        old_value = mb[keys.VALUE]
        clipped = old_value + (new_value - old_value).clamp(-cfg.clip_coef, cfg.clip_coef)
        v_loss = 0.5 * _mean(torch.max((new_value - target) ** 2, (clipped - target) ** 2), mask)
    else:
        v_loss = 0.5 * _mean((new_value - target) ** 2, mask)
    return {"loss_value": cfg.vf_coef * v_loss, "value_loss": v_loss.detach()}


def ppo_update(policy: nn.Module, optimizer: torch.optim.Optimizer, batch: TensorDictBase, cfg: PPOConfig,
               generator: torch.Generator, hooks: EpochHooks | None = None, renormalize: bool = True,
               proximal: EWMAProximal | None = None, critic_thread: Executor | None = None,
               refresh: Callable[[], object] | None = None, step: MinibatchStep | None = None) -> dict[str, float]:
    """``n_epochs`` passes of shuffled minibatches over `batch` (any batch shape; flattened here).

    Every sample is used exactly once per epoch. Returns the mean of each diagnostic over the
    minibatches, plus ``epochs`` (fewer than ``n_epochs`` when ``target_kl`` stopped early).
    `hooks`: the epoch loop's (:class:`learner.minibatch.EpochHooks`: ``sync_mean``,
    ``should_stop``, ``before_minibatch``, ``side_when``); this function adds its own ``after_step``,
    ``side_loss`` and ``before_epoch``. `renormalize` and `proximal`: see :func:`ppo_loss`; the EWMA
    moves after every optimiser step. `critic_thread` (a policy with ``evaluate_actor`` and
    ``get_value`` over disjoint parameters): each minibatch's value loss is computed and
    back-propagated on that thread while this one does the policy loss; the gradients, and so the
    update, are the same as without it (``hooks.side_when`` False: that minibatch's value loss runs
    on this thread; ``side_share`` in the result: the share that ran on `critic_thread`).
    `refresh`: called before every epoch after the first; it rewrites fields of `batch`
    (``advantages_every: epoch``), which that epoch then trains on. `step`: the learner's
    ``learner.compile`` step (``learner/fast_epochs.py``); None runs the eager loop.
    """
    def read_fields() -> dict[str, torch.Tensor]:
        b = batch.reshape(-1)
        return {k: b.get(k) for k in (keys.OBS, keys.ACTION, keys.LOG_PROB, keys.VALUE, keys.ADVANTAGE,
                                      keys.VALUE_TARGET, MASK, *policy_fields(policy)) if k in b.keys()}

    def refreshed() -> dict[str, torch.Tensor]:
        refresh()
        return read_fields()

    fields = read_fields()
    prox_fn = proximal.log_prob if proximal is not None else None
    if step is not None:
        loss_fn = step.loss_for(("ppo", renormalize), lambda: lambda mb: ppo_loss(policy, mb, cfg, renormalize, prox_fn))
        side = None
    elif critic_thread is not None:
        loss_fn = lambda mb: ppo_actor_loss(policy, mb, cfg, renormalize, prox_fn)  # noqa: E731
        side = (critic_thread, lambda mb: ppo_critic_loss(policy, mb, cfg))
    else:
        loss_fn, side = (lambda mb: ppo_loss(policy, mb, cfg, renormalize, prox_fn)), None  # noqa: E731
    given = hooks if hooks is not None else EpochHooks()
    hooks = replace(given, after_step=proximal.step if proximal is not None else None, side_loss=side,
                    before_epoch=refreshed if refresh is not None else None)
    result = epochs_in_mode(step, policy, optimizer, fields, loss_fn, cfg.n_epochs, cfg.batch_size,
                            cfg.max_grad_norm, cfg.target_kl, generator, hooks)
    b = batch.reshape(-1)
    with torch.no_grad():
        y, v = b[keys.VALUE_TARGET], b[keys.VALUE]
        var_y = y.var()
        result["explained_variance"] = float(1 - (y - v).var() / var_y) if var_y > 0 else float("nan")
    return result


class PPO:
    """PPO as the learner runs it: :meth:`prepare` sets a batch's advantages and value targets
    with the configured off-policy correction (``learner/corrections.py``), :meth:`update` trains on
    it, and :meth:`state_dict` holds what a resume needs besides the policy and the optimiser.

    Args:
        cfg: ``algorithm.cfg``.
        policy, optimizer, generator: the learner's (the generator orders the minibatches).
        device: the learner's device.
        steps_per_update: optimiser steps in one update (a correction's default, e.g. ``ewma``'s decay).
        count: ``count(name, n)`` adds to a run counter (e.g. the samples a correction dropped).
        critic_thread: an executor for the value loss (``learner.critic_thread``), or None.
        step: the ``learner.compile`` minibatch step (``learner/fast_epochs.py``), or None (eager).
    """
    name = "ppo"

    def __init__(self, cfg: PPOConfig, policy: nn.Module, optimizer: torch.optim.Optimizer,
                 generator: torch.Generator, device: torch.device, steps_per_update: int,
                 count: Callable[[str, int], None], critic_thread: Executor | None = None,
                 step: MinibatchStep | None = None):
        self.cfg, self.policy, self.optimizer, self.generator = cfg, policy, optimizer, generator
        self.critic_thread, self.step = critic_thread, step
        self.correction = make_correction(cfg, CurrentPolicy(policy, device), count, steps_per_update,
                                          compiled=step is not None)
        self.cfg = self.correction.cfg           # with the correction's defaults filled in
        self.drift = (DriftMeter(self.correction.now.log_probs, cfg.drift_samples)
                      if cfg.drift_samples else None)   # the drift ratio's log
        self.reward_scaler = RewardScaler(cfg.gamma) if cfg.normalize_reward else None
        self._renormalize, self._refresh = True, None
        self._update_cfg = self.cfg              # this update's settings (the trust correction's change per update)

    def observe(self, actor: int, reward: torch.Tensor, done: torch.Tensor) -> None:
        """A received rollout's rewards (any thread): the reward scaler's running statistics."""
        if self.reward_scaler is not None:
            self.reward_scaler.observe(actor, reward, done)

    def reward_std(self, all_reduce=None) -> float | None:
        """The std this update will scale rewards by (None: rewards are not scaled)."""
        return self.reward_scaler.std(all_reduce) if self.reward_scaler is not None else None

    def prepare(self, batch: TensorDictBase, lags: torch.Tensor, reward_std: float | None = None) -> dict[str, float]:
        """Advantages and value targets on `batch` ``[B, T]``, whose samples are `lags` versions old."""
        reward = batch[keys.REWARD]
        if self.reward_scaler is not None:
            reward = self.reward_scaler.scale_by(reward, reward_std)
        stale = bool(lags.max() > 0)
        drift = self.drift.measure(batch, lags) if self.drift else {}  # first: a decoupled correction rewrites the behaviour log-probs
        self._refresh = None
        if self.correction.refreshes(stale):
            mu = batch[keys.LOG_PROB].clone()
            self._refresh = lambda: self.correction(batch, reward, stale, behaviour=mu)  # noqa: E731
        stats, self._renormalize = self.correction(batch, reward, stale)
        self._update_cfg, per_update = self.correction.for_update(float(lags.float().mean()))
        stats.update(per_update)
        stats.update(drift)
        return stats

    def update(self, batch: TensorDictBase, policy: nn.Module, hooks: EpochHooks) -> dict[str, float]:
        """The epochs over a prepared `batch`; `policy` is the learner's, or its DDP wrapper."""
        return ppo_update(policy, self.optimizer, batch, self._update_cfg, self.generator, hooks=hooks,
                          renormalize=self._renormalize, proximal=self.correction.proximal, critic_thread=self.critic_thread,
                          refresh=self._refresh, step=self.step)

    def state_dict(self) -> dict:
        """The reward scaler's statistics and, under its own key, what the correction keeps."""
        return {"reward_scaler": self.reward_scaler.state_dict() if self.reward_scaler else None,
                "correction": {"name": self.correction.name, "state": self.correction.state_dict()}}

    def load_state_dict(self, state: dict) -> None:
        saved = state.get("correction")
        # a checkpoint from before corrections had their own key kept theirs at the top level
        self.correction.load_state_dict(saved["state"] if isinstance(saved, dict) and "state" in saved else state)
        if self.reward_scaler is not None and state.get("reward_scaler") is not None:
            self.reward_scaler.load_state_dict(state["reward_scaler"])
