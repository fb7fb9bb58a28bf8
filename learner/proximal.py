"""The ``ewma`` correction's proximal policy: an exponential moving average of past weights
(Hilton et al., 2021, "Batch size-invariance for policy optimization")."""

from __future__ import annotations

import copy

import torch
from torch import nn


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
    def step(self, taken: torch.Tensor | None = None) -> None:
        """Move the average towards the live weights (call after each optimiser step). `taken`: a
        device flag, whether the step was taken (the sync-free loop of ``learner/fast_epochs.py``);
        where it is 0 the average stays."""
        names = list(self.tensors)
        avg, live = [self.tensors[n] for n in names], [self._live[n].detach() for n in names]
        # avg += w * (live - avg) in three ops, not _foreach_lerp_: that takes only a Python scalar (a
        # device weight would be read on the host, a sync that a CUDA graph capture refuses), and the
        # eager and sync-free loops must round alike.
        weight = 1.0 - self.decay if taken is None else taken.to(torch.float32) * (1.0 - self.decay)
        delta = torch._foreach_sub(live, avg)
        torch._foreach_mul_(delta, weight)
        torch._foreach_add_(avg, delta)

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
