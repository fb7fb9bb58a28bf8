"""Off-policy corrections for stale rollouts: what the learner does with data acted by older weights,
one class per ``algorithm.cfg.correction``, chosen once per learner (:func:`make_correction`).

In ``vla`` mode an actor acts with weights that are already ``lag`` versions old when the learner
trains on its data. ``algorithm.cfg.correction`` picks what the learner does about it. Every
correction but ``none`` normalises the advantages once over the whole batch *before* any importance
weight (and not again per minibatch): normalising weighted advantages leaves a term
``mean x E_mu[grad log pi]`` in the gradient that is not zero when the ratio is taken against the
proximal policy, and it pushed Pendulum's ``log_std`` down at a lag of 1. ``rho_bar`` (the
importance-weight truncation) defaults per correction: 100 for ``is``, ``ewma`` and ``mask``
(Hilton et al.'s reference code), 1 for ``vtrace`` and ``appo`` (IMPALA, Sample Factory).

``none``
    Plain PPO: the clipped ratio pi/mu is taken against the behaviour log-prob mu (the policy that
    acted), GAE on the values, advantages normalised per minibatch (CleanRL). Use for on-policy data
    (``standard`` mode).
``is``
    Decoupled PPO (Hilton et al., 2021): the trust region is centred on the policy at the start of
    the update (the "proximal" policy pi_prox), and each sample's advantage is weighted by
    ``min(rho_bar, pi_prox / mu)``. With stale data, plain PPO's clip range is centred on an old
    policy that the current one may already be outside of: the gradient vanishes for those samples,
    or pushes the wrong way. Use for moderate lags (a few versions).
``vtrace``
    ``is`` with IMPALA's V-trace (Espeholt et al., 2018): value targets ``v_s``, traces cut by
    ``c = lambda min(c_bar, rho)``, and advantages ``min(rho_bar, rho_s) (r_s + gamma q_{s+1} - V(s_s))``.
    ``vtrace_advantage`` picks ``q_{s+1}``: ``gae`` (vtrace's default) ``(1 - lambda) V(s_{s+1}) + lambda
    v_{s+1}``, which makes the advantage GAE(lambda) exactly on on-policy data; ``impala``
    ``v_{s+1}``, IMPALA's own, a lambda-return one step on with no lambda at s. Corrects the value
    targets too, which GAE on stale data does not: use for large lags, or whenever the critic's
    targets matter more than the trust region. On stale data its targets and advantages are
    recomputed before every epoch from the live critic (``advantages_every`` epoch, its default
    there; the weights keep the proximal policy as their target).
``appo``
    Sample Factory's APPO (Petrenko et al., 2020): PPO's clip on pi/mu, anchored on the behaviour
    policy as in plain PPO, with V-trace value targets and V-trace advantages. The clip then also
    bounds how far an update moves from what acted; use when lags are large and uneven (several
    actors at different speeds), the setting Sample Factory built it for. As in Sample Factory
    (the defaults ``vtrace_advantage`` impala for appo, ``appo_rho_weight`` true), each advantage
    is also weighted by ``min(rho_bar, pi/mu)``; with the ratio pi/mu already in PPO's surrogate
    that weights every sample twice and damps the ones the policy has moved away from. Computed once
    at the start of the update, that weight is a trade-off: without it a task whose policy moves
    little per update gains, and one whose policy moves far (HalfCheetah) has seeds that collapse.
    So on stale data appo recomputes its targets, advantages and weight before every epoch from the
    live critic and policy (``advantages_every`` epoch, its default there; Sample Factory does it per
    minibatch), at one forward pass over the batch per epoch; where that costs return (HalfCheetah at
    moderate lag), set ``advantages_every: update``.
``ewma``
    Decoupled PPO whose proximal policy is an exponential moving average of past weights (Hilton et
    al., 2021, "Batch size-invariance for policy optimization"): clip against pi_ewma, weight by
    ``min(rho_bar, pi_ewma / mu)``. The anchor moves smoothly after every optimiser step instead of
    jumping once per update, so the trust region no longer depends on how much data one update
    takes. Use when the batch per update is large (many actors) or the lag varies a lot. It costs
    one more forward of the policy per minibatch (the proximal log-prob), cheap for an MLP and a
    full forward pass for a large model.
``mask``
    ``is``, plus RLinf's behaviour-weight filter: samples with ``pi_prox / mu`` outside
    ``[1 / mask_threshold, mask_threshold]`` take no part in the update (no gradient, counted in
    ``offpolicy/masked_frac``). Use when a few very stale or very unlikely samples dominate the
    update (large ``offpolicy/rho_max``), at the price of dropping their data.

``recompute_values`` recomputes V(s) with the current critic before GAE or V-trace (fresh values
for stale data), and with it every bootstrap value: inside a rollout the next step's value, and
after a truncation or the rollout's last step the value of ``bootstrap_observation``, which
vla-mode actors send (``actors/rollout.py``). ``trainer.max_policy_lag`` drops data older than that
many versions before any of this.

``trust``
    ``vtrace`` with a trust region that knows the data's age: with a mean lag L > 1 the update clips
    at ``clip_coef / L**p`` (around pi_k/mu, as vtrace does) and stops at the end of the epoch whose
    approximate KL to pi_k passes ``trust_kl / L**p`` (``p = trust_lag_power``: 0.5 by default, a
    move per version that adds up like a random walk's; 1 is GePPO's scaling, under which the versions
    between mu and the next policy move about as far together as one fresh update). At L <= 1 it is
    vtrace with ``target_kl = trust_kl``. Measured (docs/staleness.md): level
    with or above vtrace on Pendulum up to a lag of 16; on HalfCheetah at a lag of 8 every budget
    tried learns less than plain vtrace, since holding mu and pi_k close there leaves each version
    too small a move.

How each correction fares across lags, on Pendulum and HalfCheetah, is measured in docs/staleness.md.
"""

from __future__ import annotations

from typing import Callable

import torch
from tensordict import TensorDict, TensorDictBase
from torch import nn

from learner.advantages import bootstrap_mask, compute_gae, current_values
from learner.minibatch import log_ratio
from learner.vtrace import vtrace
from shared import keys
from shared.config import PPOConfig


class CurrentPolicy:
    """The learner's policy and critic as they are now, evaluated without gradients on ``[B, T]``
    data (in chunks, so a large batch does not hold one huge activation)."""

    def __init__(self, policy: nn.Module, device: torch.device, chunk: int = 16384):
        self.policy, self.device, self.chunk = policy, device, chunk

    @torch.no_grad()
    def evaluate(self, flat: TensorDictBase) -> tuple[torch.Tensor, torch.Tensor]:
        """The log-prob of the taken actions and V(s)."""
        self.policy.eval()
        b = flat.reshape(-1)
        logps, values = [], []
        for start in range(0, b.shape[0], self.chunk):
            logp, _, value = self.policy.evaluate_actions(b[start:start + self.chunk])
            logps.append(logp)
            values.append(value)
        self.policy.train()
        return torch.cat(logps).view(flat.shape), torch.cat(values).view(flat.shape)

    @torch.no_grad()
    def values(self, flat: TensorDictBase) -> torch.Tensor:
        """V(s) alone (for a separate critic, one network's forward pass instead of two)."""
        self.policy.eval()
        b = flat.reshape(-1)
        values = []
        for start in range(0, b.shape[0], self.chunk):
            part = b[start:start + self.chunk]
            values.append(self.policy.get_value(TensorDict({keys.OBS: part[keys.OBS]}, batch_size=part.shape)))
        self.policy.train()
        return torch.cat(values).view(flat.shape)

    @torch.no_grad()
    def bootstraps(self, flat: TensorDictBase) -> torch.Tensor | None:
        """V on ``bootstrap_observation``, only where a bootstrap is needed (zeros elsewhere); None
        when the rollouts carry no such observation."""
        if keys.BOOTSTRAP_OBS not in flat.keys():
            return None
        need = bootstrap_mask(flat[keys.TERMINATED], flat[keys.DONE])
        out = torch.zeros(flat.shape, device=self.device)
        if bool(need.any()):
            self.policy.eval()
            obs = flat[keys.BOOTSTRAP_OBS][need]
            out[need] = self.policy.get_value(TensorDict({keys.OBS: obs}, batch_size=[int(need.sum())]))
            self.policy.train()
        return out


@torch.no_grad()
def importance_diagnostics(log_rho: torch.Tensor, rho_bar: float) -> dict[str, float]:
    """How far the data's behaviour policy mu is from the policy the update starts from (pi_k), from
    the log importance weights ``log(pi_k / mu)`` of the batch's samples. What to watch for staleness
    collapse coming (VCPO: the effective sample size predicts it):

    - ``ess``: the effective sample size of the weights as a share of the batch,
      ``(sum rho)^2 / (N sum rho^2)``: 1 when pi_k = mu, small when a few samples carry the weight;
    - ``log_ratio_abs``: the mean ``|log(pi_k / mu)|``;
    - ``kl_behaviour``: KL(mu || pi_k), estimated on mu's samples by ``mean(rho - 1 - log rho)`` (k3);
    - ``rho_mean``, ``rho_max``, ``rho_clipped_frac`` (the share above `rho_bar`).
    """
    rho = log_rho.exp().double()
    n = rho.numel()
    return {"ess": float(rho.sum() ** 2 / (n * (rho ** 2).sum())), "log_ratio_abs": float(log_rho.abs().mean()),
            "kl_behaviour": float((rho - 1 - log_rho.double()).mean()), "rho_mean": float(rho.mean()),
            "rho_max": float(rho.max()), "rho_clipped_frac": float((rho > rho_bar).double().mean())}


class Correction:
    """``none``: plain PPO. The base of every correction, which sets ``advantage`` and
    ``value_target`` on a batch in :meth:`__call__`; a subclass says what differs by its attributes
    and :meth:`targets`, :meth:`weight` and :meth:`select`.

    Attributes:
        decoupled: clip PPO's ratio against the policy at the start of the update (the proximal
            policy), not the behaviour policy mu.
        weighted: weight each advantage by ``min(rho_bar, pi / mu)``, after normalising once per batch.
    """
    name = "none"
    decoupled = False
    weighted = False

    def __init__(self, cfg: PPOConfig, now: CurrentPolicy, count: Callable[[str, int], None]):
        self.cfg, self.now, self.count = cfg, now, count

    def recomputes(self, stale: bool) -> bool:
        """Whether V(s) and the bootstraps come from the current critic this update."""
        return stale if self.cfg.recompute_values is None else self.cfg.recompute_values

    def refreshes(self, stale: bool) -> bool:
        """Whether the advantages are computed again before every epoch after the first."""
        return self.cfg.advantages_every_for(stale) == "epoch" and (self.name != "none" or self.recomputes(stale))

    def targets(self, mu, logp_now, reward, value, next_value, terminated, done, rho_bar):
        """``(advantage, value_target)``: GAE here."""
        return compute_gae(reward, value, next_value, terminated, done, self.cfg.gamma, self.cfg.gae_lambda)

    def weight(self, adv: torch.Tensor, rho: torch.Tensor, rho_bar: float) -> torch.Tensor:
        return adv * rho.clamp(max=rho_bar) if self.weighted else adv

    def select(self, flat: TensorDictBase, rho: torch.Tensor) -> dict[str, float]:
        """Drop samples from the update (a ``mask`` on `flat`); none here."""
        return {}

    def __call__(self, flat: TensorDictBase, reward: torch.Tensor, stale: bool,
                 behaviour: torch.Tensor | None = None) -> tuple[dict[str, float], bool]:
        """Set advantages and value targets on `flat` ``[B, T]``; `stale`: some samples were acted
        by an older version. Returns diagnostics for the log, and whether PPO should still normalise
        advantages per minibatch (plain PPO) or not (a correction normalised them once, before
        weighting).

        `behaviour` (``advantages_every: epoch``, every epoch after the first): the behaviour
        log-prob mu as the batch arrived. The advantages, targets and values are recomputed from the
        live critic, and for ``appo`` the weights pi/mu from the live policy (decoupled corrections
        keep the proximal policy as their target); the anchor in ``log_prob`` and the ``mask``
        correction's choice stay as the first call set them."""
        a = self.cfg
        refresh = behaviour is not None
        value, next_value = flat[keys.VALUE], flat[keys.NEXT_VALUE]
        terminated, done = flat[keys.TERMINATED], flat[keys.DONE]
        recompute = self.recomputes(stale)       # stale samples carry a stale critic's values
        plain = self.name == "none"
        if plain and not recompute:
            adv, target = compute_gae(reward, value, next_value, terminated, done, a.gamma, a.gae_lambda)
            flat.set(keys.ADVANTAGE, adv)
            flat.set(keys.VALUE_TARGET, target)
            return {}, True
        mu = behaviour if refresh else flat[keys.LOG_PROB]
        if refresh and self.decoupled:   # the target is the proximal policy: only the critic is live
            logp_now = flat[keys.LOG_PROB]
            value_now = self.now.values(flat) if recompute else value
        else:
            logp_now, value_now = self.now.evaluate(flat)
        out: dict[str, float] = {}
        next_now = next_value
        if recompute:
            next_now = self._recomputed_next(flat, value, value_now, out)
        else:
            value_now = value
        rho_bar = a.rho_bar_for()
        adv, target = self.targets(mu, logp_now, reward, value_now, next_now, terminated, done, rho_bar)
        flat.set(keys.VALUE_TARGET, target)
        flat.set(keys.VALUE, value_now)          # value clipping (clip_vloss) around the critic the targets used
        if plain:
            flat.set(keys.ADVANTAGE, adv)
            return out, True
        if a.norm_adv and adv.numel() > 1:       # once per batch, before any importance weight
            adv = (adv - adv.mean()) / (adv.std() + 1e-8)
        log_rho = log_ratio(logp_now, mu)
        rho = log_rho.exp()
        flat.set(keys.ADVANTAGE, self.weight(adv, rho, rho_bar))
        if refresh:
            return out, False
        if self.decoupled:                       # clip the ratio against the policy at the start of this update
            flat.set(keys.LOG_PROB, logp_now)
        out.update(self.select(flat, rho))
        out.update(importance_diagnostics(log_rho, rho_bar))
        return out, False

    def _recomputed_next(self, flat, value, value_now, out: dict[str, float]) -> torch.Tensor:
        """``V(s_{t+1})`` from the current critic (and its shift from the actor's, for the log)."""
        terminated, done, next_value = flat[keys.TERMINATED], flat[keys.DONE], flat[keys.NEXT_VALUE]
        boot = self.now.bootstraps(flat)
        out["value_shift"] = float((value_now - value).abs().mean())
        if boot is not None:
            need = bootstrap_mask(terminated, done)
            out["bootstrap_shift"] = float((boot - next_value)[need].abs().mean()) if bool(need.any()) else 0.0
        return current_values(value_now, next_value, done, boot, terminated)


class ImportanceSampling(Correction):
    """``is``: decoupled PPO, advantages weighted by ``min(rho_bar, pi_prox / mu)``."""
    name, decoupled, weighted = "is", True, True


class VTrace(ImportanceSampling):
    """``vtrace``: ``is`` with V-trace value targets and advantages."""
    name = "vtrace"

    def targets(self, mu, logp_now, reward, value, next_value, terminated, done, rho_bar):
        a = self.cfg
        lam = a.gae_lambda if a.vtrace_lambda is None else a.vtrace_lambda
        target, adv, _ = vtrace(mu, logp_now, reward, value, next_value, terminated, done, a.gamma, rho_bar,
                                a.c_bar, lam, weighted=False, advantage=a.vtrace_advantage_for())
        return adv, target


class APPO(VTrace):
    """``appo``: PPO's clip on pi/mu with V-trace targets and advantages; the extra weight
    ``min(rho_bar, pi/mu)`` only with ``appo_rho_weight``."""
    name, decoupled = "appo", False

    @property
    def weighted(self) -> bool:
        return self.cfg.appo_rho_weight


class TrustRegion(VTrace):
    """``trust``: ``vtrace`` whose clip and per-update move shrink with the batch's mean lag
    (:meth:`update_config`): a batch acted L versions ago is trained with ``clip_coef / L`` and stops
    once its KL to pi_k passes ``trust_kl / L``, so the L versions between mu and the next policy
    move about as far together as one update on fresh data (GePPO's age-scaled clip, Queeney et al.
    2021; the per-version budget of AReaL's and M2PO's stale training)."""
    name = "trust"

    @staticmethod
    def update_config(cfg: PPOConfig, mean_lag: float) -> PPOConfig:
        """The PPO settings of one update whose samples are `mean_lag` versions old on average."""
        from dataclasses import replace
        scale = max(1.0, mean_lag) ** cfg.trust_lag_power
        return replace(cfg, clip_coef=cfg.clip_coef / scale, target_kl=cfg.trust_kl / scale)


class EWMA(Correction):
    """``ewma``: normalised once per batch; the weight against the moving average is PPO's, per
    minibatch (``learner/proximal.py``)."""
    name = "ewma"


class Mask(ImportanceSampling):
    """``mask``: ``is``, with the samples whose ``pi_prox / mu`` lies outside
    ``[1 / mask_threshold, mask_threshold]`` left out of the update."""
    name = "mask"

    def select(self, flat: TensorDictBase, rho: torch.Tensor) -> dict[str, float]:
        t = self.cfg.mask_threshold
        keep = (rho >= 1.0 / t) & (rho <= t)
        flat.set(keys.MASK, keep)
        masked = int((~keep).sum())
        self.count("masked_samples", masked)
        return {"masked_frac": masked / keep.numel()}


CORRECTIONS: dict[str, type[Correction]] = {c.name: c for c in (Correction, ImportanceSampling, VTrace, APPO,
                                                                 EWMA, Mask, TrustRegion)}


def make_correction(cfg: PPOConfig, now: CurrentPolicy, count: Callable[[str, int], None]) -> Correction:
    """The correction ``cfg.correction`` names, chosen once per learner."""
    return CORRECTIONS[cfg.correction](cfg, now, count)
