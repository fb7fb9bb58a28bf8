"""Off-policy corrections for stale rollouts: what the learner does with data acted by older weights,
one class per ``algorithm.cfg.correction``, chosen once per learner (:func:`make_correction`).

What each correction does, when to use which, and what was measured: docs/staleness.md
("Corrections"). This module is the only place that knows the corrections by name: each class owns
its defaults (:attr:`Correction.defaults`: ``rho_bar``, ``vtrace_advantage``; when its advantages
are recomputed, :attr:`Correction.refresh_when_stale`) and its per-update behaviour (EWMA's moving
average, trust's per-update clip). Adding one is a subclass registered with :func:`register`
(docs/architecture.md, "Extending Tandem", shows it).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Callable, ClassVar

import torch
from tensordict import TensorDict, TensorDictBase
from torch import nn

from learner.advantages import bootstrap_mask, compute_gae, current_values
from learner.minibatch import log_ratio
from learner.proximal import EWMAProximal, ewma_decay_for
from learner.vtrace import vtrace
from shared import keys
from shared.chunks import row_gamma
from shared.config import Config, PPOConfig, add_rule


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
    def log_probs(self, flat: TensorDictBase) -> torch.Tensor:
        """The log-prob of the taken actions alone, no critic (``action_log_prob`` where the policy has
        one): what the drift ratio (learner/drift.py) measures, apart from the correction's own passes."""
        self.policy.eval()
        b = flat.reshape(-1)
        only = getattr(self.policy, "action_log_prob", None)
        logps = [only(part) if only is not None else self.policy.evaluate_actions(part)[0]
                 for part in (b[start:start + self.chunk] for start in range(0, b.shape[0], self.chunk))]
        self.policy.train()
        return torch.cat(logps).view(flat.shape)

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
    and :meth:`targets`, :meth:`weight` and :meth:`select`, and what it does per update by
    :attr:`proximal`, :meth:`for_update` and its state.

    Attributes:
        name: its ``algorithm.cfg.correction`` value (the registry's key).
        plain: PPO's own advantages, normalised per minibatch; every other correction normalises
            once per batch, before any importance weight.
        decoupled: clip PPO's ratio against the policy at the start of the update (the proximal
            policy), not the behaviour policy mu.
        weighted: weight each advantage by ``min(rho_bar, pi / mu)``, after normalising once per batch.
        defaults: the values of ``algorithm.cfg`` fields left ``null`` (see :meth:`resolve`).
        refresh_when_stale: with ``advantages_every: null``, recompute the advantages before every
            epoch of an update whose batch holds stale samples.
        proximal: what the ratio is clipped against per minibatch, where that is not a fixed log-prob
            (``ewma``'s moving average), else None.
    """
    name = "none"
    plain = True
    decoupled = False
    weighted = False
    defaults: ClassVar[dict[str, object]] = {"rho_bar": 100.0, "vtrace_advantage": "gae"}
    refresh_when_stale = False
    proximal: EWMAProximal | None = None

    def __init__(self, cfg: PPOConfig, now: CurrentPolicy, count: Callable[[str, int], None],
                 steps_per_update: int = 1, compiled: bool = False):
        """`cfg`: ``algorithm.cfg`` (its ``null`` fields take this correction's :attr:`defaults`);
        `steps_per_update`: optimiser steps in one update; `compiled`: the update runs through
        ``learner.compile``'s captured step (a per-update value must then live in a device tensor)."""
        self.cfg, self.now, self.count = self.resolve(cfg), now, count

    @classmethod
    def resolve(cls, cfg: PPOConfig) -> PPOConfig:
        """`cfg` with this correction's :attr:`defaults` in place of the fields left ``null``."""
        return replace(cfg, **{k: v for k, v in cls.defaults.items() if getattr(cfg, k) is None})

    @classmethod
    def advantages_every(cls, cfg: PPOConfig, stale: bool) -> str:
        """When advantages are computed in an update whose batch is `stale` or not: ``update`` or ``epoch``."""
        if cfg.advantages_every is not None:
            return cfg.advantages_every
        return "epoch" if cls.refresh_when_stale and stale else "update"

    def for_update(self, mean_lag: float) -> tuple[PPOConfig, dict[str, float]]:
        """The PPO settings of one update whose samples are `mean_lag` versions old on average, and
        what to log of them; the configured ones here."""
        return self.cfg, {}

    def state_dict(self) -> dict:
        """What a resume needs of this correction, merged into the algorithm's checkpoint state."""
        return {}

    def load_state_dict(self, state: dict) -> None:
        pass

    def recomputes(self, stale: bool) -> bool:
        """Whether V(s) and the bootstraps come from the current critic this update."""
        return stale if self.cfg.recompute_values is None else self.cfg.recompute_values

    def refreshes(self, stale: bool) -> bool:
        """Whether the advantages are computed again before every epoch after the first."""
        return self.advantages_every(self.cfg, stale) == "epoch" and (not self.plain or self.recomputes(stale))

    def targets(self, mu, logp_now, reward, value, next_value, terminated, done, rho_bar):
        """``(advantage, value_target)``: GAE here."""
        return compute_gae(reward, value, next_value, terminated, done, self.gamma_rows, self.cfg.gae_lambda)

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
        # each row's discount: gamma, or gamma ** executed for action-chunk rows (shared/chunks.py)
        self.gamma_rows = row_gamma(flat, a.gamma)
        value, next_value = flat[keys.VALUE], flat[keys.NEXT_VALUE]
        terminated, done = flat[keys.TERMINATED], flat[keys.DONE]
        recompute = self.recomputes(stale)       # stale samples carry a stale critic's values
        plain = self.plain
        if plain and not recompute:
            adv, target = compute_gae(reward, value, next_value, terminated, done, self.gamma_rows, a.gae_lambda)
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
        rho_bar = a.rho_bar
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


CORRECTIONS: dict[str, type[Correction]] = {}


def register(cls: type[Correction]) -> type[Correction]:
    """Make `cls` choosable as ``algorithm.cfg.correction: cls.name`` (a class decorator)."""
    if not cls.name or cls.name in CORRECTIONS and CORRECTIONS[cls.name] is not cls:
        raise ValueError(f"correction name {cls.name!r} is empty or taken by {CORRECTIONS.get(cls.name)}")
    CORRECTIONS[cls.name] = cls
    return cls


register(Correction)


@register
class ImportanceSampling(Correction):
    """``is``: decoupled PPO, advantages weighted by ``min(rho_bar, pi_prox / mu)``."""
    name, plain, decoupled, weighted = "is", False, True, True


@register
class VTrace(ImportanceSampling):
    """``vtrace``: ``is`` with V-trace value targets and advantages, recomputed every epoch on stale data."""
    name = "vtrace"
    defaults = {"rho_bar": 1.0, "vtrace_advantage": "gae"}
    refresh_when_stale = True

    def targets(self, mu, logp_now, reward, value, next_value, terminated, done, rho_bar):
        a = self.cfg
        lam = a.gae_lambda if a.vtrace_lambda is None else a.vtrace_lambda
        target, adv, _ = vtrace(mu, logp_now, reward, value, next_value, terminated, done, self.gamma_rows, rho_bar,
                                a.c_bar, lam, weighted=False, advantage=a.vtrace_advantage)
        return adv, target


@register
class APPO(VTrace):
    """``appo``: PPO's clip on pi/mu with V-trace targets and IMPALA's advantages; the extra weight
    ``min(rho_bar, pi/mu)`` only with ``appo_rho_weight``."""
    name, decoupled = "appo", False
    defaults = {"rho_bar": 1.0, "vtrace_advantage": "impala"}

    @property
    def weighted(self) -> bool:
        return self.cfg.appo_rho_weight


@register
class EWMA(Correction):
    """``ewma``: decoupled PPO against an exponential moving average of past weights; the weight
    ``min(rho_bar, pi_ewma / mu)`` is taken per minibatch (``learner/proximal.py``)."""
    name, plain = "ewma", False

    def __init__(self, cfg: PPOConfig, now: CurrentPolicy, count: Callable[[str, int], None],
                 steps_per_update: int = 1, compiled: bool = False):
        super().__init__(cfg, now, count, steps_per_update, compiled)
        self.decay = cfg.ewma_decay if cfg.ewma_decay is not None else ewma_decay_for(steps_per_update)
        self.proximal = EWMAProximal(now.policy, self.decay)

    def state_dict(self) -> dict:
        return {"ewma": self.proximal.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        if state.get("ewma") is not None:
            self.proximal.load_state_dict(state["ewma"])
        else:   # a checkpoint from a run without ewma: the average starts at the resumed weights
            self.proximal = EWMAProximal(self.now.policy, self.decay)


@register
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


@register
class TrustRegion(VTrace):
    """``trust``: ``vtrace`` whose clip and per-update KL budget shrink with the batch's mean lag L:
    ``clip_coef / L**p`` and ``trust_kl / L**p`` (``p = trust_lag_power``; GePPO's age-scaled clip,
    Queeney et al. 2021, at p = 1)."""
    name = "trust"

    def __init__(self, cfg: PPOConfig, now: CurrentPolicy, count: Callable[[str, int], None],
                 steps_per_update: int = 1, compiled: bool = False):
        super().__init__(cfg, now, count, steps_per_update, compiled)
        # Under learner.compile the clip changes every update, so the loss reads it from a device
        # tensor filled in place (as the learning rate is), never a constant baked into the compiled
        # code or the captured graph. The KL budget is read on the host.
        self._clip = torch.tensor(float(cfg.clip_coef), device=now.device) if compiled else None

    @staticmethod
    def update_config(cfg: PPOConfig, mean_lag: float) -> PPOConfig:
        """The PPO settings of one update whose samples are `mean_lag` versions old on average."""
        scale = max(1.0, mean_lag) ** cfg.trust_lag_power
        return replace(cfg, clip_coef=cfg.clip_coef / scale, target_kl=cfg.trust_kl / scale)

    def for_update(self, mean_lag: float) -> tuple[PPOConfig, dict[str, float]]:
        cfg = self.update_config(self.cfg, mean_lag)
        stats = {"trust_clip": cfg.clip_coef, "trust_kl": cfg.target_kl}
        if self._clip is not None:
            self._clip.fill_(cfg.clip_coef)
            cfg = replace(cfg, clip_coef=self._clip)
        return cfg, stats


def recommended(buffer_type: str) -> str:
    """The correction a config gets when it names none: docs/corrections.md's recommendation for the
    mode (on-policy data needs no correction)."""
    return Correction.name if buffer_type == "standard" else TrustRegion.name


def correction_class(name: str | None) -> type[Correction]:
    """The registered correction called `name` (None, a PPOConfig built outside a run's config: plain
    PPO); KeyError naming the choices otherwise."""
    if name is None:
        return Correction
    if name not in CORRECTIONS:
        raise KeyError(f"unknown correction {name!r}; choose from {', '.join(CORRECTIONS)}")
    return CORRECTIONS[name]


def resolve(cfg: PPOConfig) -> PPOConfig:
    """`cfg` with its correction's defaults filled in (``rho_bar``, ``vtrace_advantage``)."""
    return correction_class(cfg.correction).resolve(cfg)


def make_correction(cfg: PPOConfig, now: CurrentPolicy, count: Callable[[str, int], None],
                    steps_per_update: int = 1, compiled: bool = False) -> Correction:
    """The correction ``cfg.correction`` names, chosen once per learner."""
    return correction_class(cfg.correction)(cfg, now, count, steps_per_update, compiled)


@add_rule
def correction_rule(cfg: Config) -> list[str]:
    """``algorithm.cfg.correction`` at load: null becomes the mode's recommended correction, and a name
    must be in the registry. The learner applies it again to a config built in code (never loaded)."""
    alg = cfg.algorithm.cfg
    if not isinstance(alg, PPOConfig):
        return []
    if alg.correction is None:
        alg.correction = recommended(cfg.trainer.buffer_type)
    if alg.correction not in CORRECTIONS:
        return [f"algorithm.cfg.correction: {alg.correction!r} is not a correction; choose from "
                f"{', '.join(map(repr, CORRECTIONS))}"]
    return []
