"""Off-policy corrections for stale rollouts: what the learner does with data acted by older weights.

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

How each correction fares across lags, on Pendulum and HalfCheetah, is measured in docs/staleness.md.
"""

from __future__ import annotations

import copy

import torch
from torch import nn

from learner.minibatch import log_ratio


@torch.no_grad()
def vtrace(behaviour_log_prob: torch.Tensor, target_log_prob: torch.Tensor, reward: torch.Tensor,
           value: torch.Tensor, next_value: torch.Tensor, terminated: torch.Tensor, done: torch.Tensor,
           gamma: float, rho_bar: float = 1.0, c_bar: float = 1.0, lam: float = 1.0, weighted: bool = True,
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
        gamma: discount.
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
    for t in range(value.shape[-1] - 1, -1, -1):
        acc = delta[..., t] + gamma * c[..., t] * not_done[..., t] * acc
        vs_minus_v[..., t] = acc
    vs = value + vs_minus_v
    # v_{t+1}: the next step's target inside an episode; the bootstrap value after a done or at the end.
    vs_next = torch.cat([vs[..., 1:], boot[..., -1:]], dim=-1)
    vs_next = torch.where(done.bool(), boot, vs_next)
    if advantage == "gae":
        vs_next = (1.0 - lam) * boot + lam * vs_next
    pg_advantage = reward + gamma * vs_next - value
    return vs, (rho_t * pg_advantage if weighted else pg_advantage), rho


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


class _EvaluateActions(nn.Module):
    """The policy's log-prob of ``td["action"]`` as a module's forward, for ``torch.func.functional_call``:
    ``policy.action_log_prob`` where the policy has it (no entropy, no critic: for an MLP actor-critic
    about half of ``evaluate_actions``'s work), else ``policy.evaluate_actions(td)[0]``."""

    def __init__(self, policy: nn.Module):
        super().__init__()
        self.policy = policy
        self._log_prob_only = hasattr(policy, "action_log_prob")

    def forward(self, td):
        if self._log_prob_only:
            return self.policy.action_log_prob(td)
        return self.policy.evaluate_actions(td)[0]


class EWMAProximal:
    """The ``ewma`` correction's proximal policy: an exponential moving average of the trainable
    weights, ``prox <- decay * prox + (1 - decay) * weights`` after every optimiser step.

    Only the trainable tensors are averaged (a frozen VLA base is shared, never copied); the log-prob
    under the averaged weights is the policy's own ``evaluate_actions`` run through
    ``torch.func.functional_call``, so the live weights are never touched.
    """

    def __init__(self, policy: nn.Module, decay: float):
        if not 0 <= decay < 1:
            raise ValueError(f"EWMAProximal: decay must be in [0, 1), got {decay}")
        self.policy, self.decay = policy, decay
        self._live = {f"policy.{n}": p for n, p in policy.named_parameters() if p.requires_grad}
        self._shadow: nn.Module | None = None
        if all(p.requires_grad for p in policy.parameters()):
            # Nothing frozen to share: a copy of the policy holds the average as its own weights, so the
            # proximal pass is a plain forward (functional_call re-binds every tensor on every call:
            # twice the time for an MLP). Its buffers (normaliser statistics) are the live policy's own
            # tensors, so it normalises exactly as the live policy does.
            shadow = copy.deepcopy(policy).requires_grad_(False)
            live_buffers = dict(policy.named_buffers())
            for name, _ in list(shadow.named_buffers()):
                owner, _, leaf = name.rpartition(".")
                (shadow.get_submodule(owner) if owner else shadow)._buffers[leaf] = live_buffers[name]
            self._shadow = shadow
            self.tensors = {f"policy.{n}": p for n, p in shadow.named_parameters()}
        else:
            self.tensors = {n: p.detach().clone() for n, p in self._live.items()}
        self._wrapper = _EvaluateActions(self._shadow if self._shadow is not None else policy)

    @torch.no_grad()
    def step(self) -> None:
        """Move the average towards the live weights (call after each optimiser step)."""
        names = list(self.tensors)
        torch._foreach_lerp_([self.tensors[n] for n in names], [self._live[n].detach() for n in names],
                             1.0 - self.decay)

    @torch.no_grad()
    def log_prob(self, td) -> torch.Tensor:
        if self._shadow is not None:
            self._shadow.eval()
            return self._wrapper(td)
        was_training = self.policy.training
        self.policy.eval()
        try:
            return torch.func.functional_call(self._wrapper, self.tensors, (td,), strict=False)
        finally:
            self.policy.train(was_training)

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {n: t.clone() for n, t in self.tensors.items()}

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        if set(state) != set(self.tensors):
            raise ValueError(f"EWMAProximal: the saved average has tensors {sorted(set(state) ^ set(self.tensors))} "
                             f"that this policy's trainable ones do not match")
        for n, t in state.items():
            self.tensors[n].copy_(t)


def ewma_decay_for(steps_per_update: int) -> float:
    """The default decay: the average's centre of mass ``decay / (1 - decay)`` steps back equals
    the mean age of plain PPO's proximal policy over one update, half its optimiser steps."""
    age = max(steps_per_update, 1) / 2
    return age / (1 + age)
