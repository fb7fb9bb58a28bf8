"""The optimisation loop PPO and GRPO share: epochs of shuffled minibatches, gradient clipping,
early stop on approx-KL. Each algorithm keeps its own loss (``learner/ppo.py``, ``learner/grpo.py``)."""

from __future__ import annotations

from typing import Callable

import torch
from tensordict import TensorDict, TensorDictBase
from torch import nn

LossFn = Callable[[TensorDictBase], dict[str, torch.Tensor]]


def run_epochs(policy: nn.Module, optimizer: torch.optim.Optimizer, fields: dict[str, torch.Tensor],
               loss_fn: LossFn, n_epochs: int, batch_size: int, max_grad_norm: float,
               target_kl: float | None, generator: torch.Generator,
               sync_mean: Callable[[torch.Tensor], torch.Tensor] | None = None) -> dict[str, float]:
    """`n_epochs` passes over the samples in `fields` (equal-length tensors), each sample used
    exactly once per pass, in minibatches drawn with `generator`.

    `loss_fn(minibatch)` returns a dict: keys starting with ``loss_`` are summed and minimised, the
    rest (``approx_kl`` among them) are only averaged for logging. Returns those means, plus
    ``grad_norm`` and ``epochs`` (fewer than `n_epochs` when `target_kl` stopped the update early).
    """
    n = next(iter(fields.values())).shape[0]
    device = next(iter(fields.values())).device
    params = [p for p in policy.parameters() if p.requires_grad]
    sums: dict[str, torch.Tensor] = {}   # kept on the device: no host sync per minibatch
    count = epochs = 0
    for _ in range(n_epochs):
        epochs += 1
        perm = torch.randperm(n, generator=generator).to(device)
        epoch_kl = []
        for start in range(0, n, batch_size):
            idx = perm[start:start + batch_size]
            # Index plain tensors: TensorDict indexing per minibatch costs more than a small MLP step.
            mb = TensorDict({k: v[idx] for k, v in fields.items()}, batch_size=[idx.numel()])
            out = loss_fn(mb)
            loss = sum(v for k, v in out.items() if k.startswith("loss_"))
            if not bool(torch.isfinite(loss)):  # before the step: the weights stay as they were
                raise FloatingPointError(f"non-finite loss {float(loss)} in epoch {epochs}, "
                                         f"minibatch {count} ({ {k: float(v) for k, v in out.items()} })")
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            out["grad_norm"] = (nn.utils.clip_grad_norm_(params, max_grad_norm) if max_grad_norm > 0
                                else torch.zeros((), device=device))
            optimizer.step()
            for k, v in out.items():
                sums[k] = sums[k] + v.detach() if k in sums else v.detach()
            epoch_kl.append(out["approx_kl"])
            count += 1
        if target_kl is not None and epoch_kl:
            kl = torch.stack(epoch_kl).mean()
            if sync_mean is not None:      # several learner ranks stop together, on the mean over ranks
                kl = sync_mean(kl.detach().cpu().double())
            if float(kl) > target_kl:
                break
    result = {k: float(v) / max(count, 1) for k, v in sums.items()}
    result["epochs"] = epochs
    return result
