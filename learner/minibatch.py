"""The optimisation loop PPO and GRPO share: epochs of shuffled minibatches, gradient clipping,
early stop on approx-KL. Each algorithm keeps its own loss (``learner/ppo.py``, ``learner/grpo.py``)."""

from __future__ import annotations

import math
from concurrent.futures import Executor, wait
from dataclasses import dataclass
from typing import Callable

import torch
from tensordict import TensorDict, TensorDictBase
from torch import nn

LossFn = Callable[[TensorDictBase], dict[str, torch.Tensor]]

# Log-ratios are clamped to +-LOG_RATIO_MAX before exp: a behaviour log-prob far from the current
# policy's (a stale or buggy actor) then gives a large but finite ratio with no gradient through
# the clamp, instead of inf * 0 = NaN in the loss.
LOG_RATIO_MAX = 20.0


def log_ratio(new_log_prob: torch.Tensor, old_log_prob: torch.Tensor) -> torch.Tensor:
    """``log(pi_new / pi_old)``, computed in log space and clamped to ``+-LOG_RATIO_MAX``."""
    return (new_log_prob - old_log_prob).clamp(-LOG_RATIO_MAX, LOG_RATIO_MAX)


def _total(out: dict[str, torch.Tensor]) -> torch.Tensor:
    return sum(v for k, v in out.items() if k.startswith("loss_"))


def _backward(fn: LossFn, mb: TensorDictBase) -> dict[str, torch.Tensor]:
    """`fn`'s losses on `mb`, back-propagated here (the side thread); returned detached."""
    out = fn(mb)
    _total(out).backward()
    return {k: v.detach() for k, v in out.items()}


def _losses_backward(loss_fn: LossFn, mb: TensorDictBase, side_loss: tuple[Executor, LossFn] | None,
                     threaded: bool) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """`loss_fn`'s losses on `mb` and, with `side_loss`, the side loss's (on its executor's thread
    while this thread does `loss_fn`'s where `threaded`, else here after it), all back-propagated.
    Returns every loss and metric, and the total loss."""
    side = side_loss[0].submit(_backward, side_loss[1], mb) if threaded else None
    try:
        out = loss_fn(mb)
        loss = _total(out)
        loss.backward()
    finally:
        if side is not None:   # never leave the other thread writing gradients behind us
            wait([side])
    if side_loss is not None:
        side_out = side.result() if side is not None else _backward(side_loss[1], mb)
        out.update(side_out)
        loss = loss.detach() + _total(side_out)
    return out, loss


def _kl_exceeded(epoch_kl: list[torch.Tensor], target_kl: float | None,
                 sync_mean: Callable[[torch.Tensor], torch.Tensor] | None) -> bool:
    """Whether an epoch's mean approx-KL passed `target_kl` (the early stop)."""
    if target_kl is None or not epoch_kl:
        return False
    kl = torch.stack(epoch_kl).mean()
    if sync_mean is not None:      # several learner ranks stop together, on the mean over ranks
        kl = sync_mean(kl.detach().cpu().double())
    return float(kl) > target_kl


@dataclass
class EpochHooks:
    """What the epoch loop (:func:`run_epochs`) calls besides the loss, each optional.

    Attributes:
        sync_mean: the mean over learner ranks (DDP), for the early stop on approx-KL.
        after_step: called after every optimiser step taken (the EWMA proximal policy moves there).
        side_loss: ``(executor, fn)``, a second loss over parameters disjoint from `loss_fn`'s
            (PPO's critic), computed and back-propagated on the executor's thread while this thread
            does `loss_fn`'s. The gradients are the same as one backward of the sum; the norm, the
            clip and the step wait for both. With it, the result has ``side_share``: the share of
            minibatches whose side loss ran on the executor's thread.
        side_when: asked before each minibatch; where it says False the side loss runs on this
            thread instead, after `loss_fn`'s backward (the same gradients, bit for bit).
        should_stop: asked after every minibatch; True ends the update there (``stopped`` 1 in the
            result), so that a stop signal is not held up by the rest of a long update. The steps
            already taken stand, like an early stop on `target_kl` mid-epoch: no sample is used more
            often than in a full update. Never with several ranks: every rank must take the same steps.
        before_minibatch: called before each minibatch's forward pass (the learner sets its intra-op
            threads there: ``learner.torch_threads`` "idle").
        before_epoch: called before every epoch after the first; the fields it returns (the same
            keys and lengths) replace `fields` from that epoch on.
    """
    sync_mean: Callable[[torch.Tensor], torch.Tensor] | None = None
    after_step: Callable[[], None] | None = None
    side_loss: tuple[Executor, LossFn] | None = None
    side_when: Callable[[], bool] | None = None
    should_stop: Callable[[], bool] | None = None
    before_minibatch: Callable[[], None] | None = None
    before_epoch: Callable[[], dict[str, torch.Tensor]] | None = None


def run_epochs(policy: nn.Module, optimizer: torch.optim.Optimizer, fields: dict[str, torch.Tensor],
               loss_fn: LossFn, n_epochs: int, batch_size: int, max_grad_norm: float,
               target_kl: float | None, generator: torch.Generator, hooks: EpochHooks | None = None
               ) -> dict[str, float]:
    """`n_epochs` passes over the samples in `fields` (equal-length tensors), each sample used
    exactly once per pass, in minibatches drawn with `generator`; the `hooks` are described at
    :class:`EpochHooks`.

    `loss_fn(minibatch)` returns a dict: keys starting with ``loss_`` are summed and minimised, the
    rest (``approx_kl`` among them) are only averaged for logging. Returns those means, plus
    ``grad_norm``, ``epochs`` (fewer than `n_epochs` when `target_kl` stopped the update early),
    ``steps`` (optimiser steps taken), ``stopped`` and ``skipped_steps``: a minibatch whose loss or
    gradient norm is not finite takes no optimiser step (the weights and Adam's moments stay as they
    were) and is left out of the means. With DDP the gradients are all-reduced in ``backward``, so
    every rank sees the same norm and skips the same steps.
    """
    h = hooks if hooks is not None else EpochHooks()
    sync_mean, after_step, side_loss, side_when = h.sync_mean, h.after_step, h.side_loss, h.side_when
    should_stop, before_minibatch, before_epoch = h.should_stop, h.before_minibatch, h.before_epoch
    n = next(iter(fields.values())).shape[0]
    device = next(iter(fields.values())).device
    params = [p for p in policy.parameters() if p.requires_grad]
    sums: dict[str, torch.Tensor] = {}   # kept on the device: no host sync per minibatch
    count = epochs = skipped = minibatches = on_side = 0
    stopped = False
    for epoch in range(n_epochs):
        if epoch and before_epoch is not None:
            fields = before_epoch()
        epochs += 1
        perm = torch.randperm(n, generator=generator).to(device)
        epoch_kl = []
        for start in range(0, n, batch_size):
            if should_stop is not None and minibatches and should_stop():
                stopped = True
                break
            idx = perm[start:start + batch_size]
            # Index plain tensors: TensorDict indexing per minibatch costs more than a small MLP step.
            mb = TensorDict({k: v[idx] for k, v in fields.items()}, batch_size=[idx.numel()])
            optimizer.zero_grad(set_to_none=True)
            if before_minibatch is not None:
                before_minibatch()
            minibatches += 1
            threaded = side_loss is not None and (side_when is None or side_when())
            on_side += threaded
            out, loss = _losses_backward(loss_fn, mb, side_loss, threaded)
            # the total norm (and clipping, when on); inf or NaN if any gradient is
            out["grad_norm"] = nn.utils.clip_grad_norm_(params, max_grad_norm if max_grad_norm > 0 else math.inf)
            if not bool(torch.isfinite(loss.detach() + out["grad_norm"])):   # one host sync per minibatch
                optimizer.zero_grad(set_to_none=True)
                skipped += 1
                continue
            optimizer.step()
            if after_step is not None:
                after_step()
            for k, v in out.items():
                sums[k] = sums[k] + v.detach() if k in sums else v.detach()
            epoch_kl.append(out["approx_kl"])
            count += 1
        if stopped or _kl_exceeded(epoch_kl, target_kl, sync_mean):
            break
    result = {k: float(v) / max(count, 1) for k, v in sums.items()}
    result.update(epochs=epochs, steps=count, skipped_steps=skipped, stopped=int(stopped))
    if side_loss is not None:
        result["side_share"] = on_side / max(minibatches, 1)
    return result
