"""Running mean/std statistics. Observation statistics are buffers of the policy, so they travel
with the weights and are saved in checkpoints; only the learner updates them."""

from __future__ import annotations

import torch
from torch import nn


class RunningMeanStd(nn.Module):
    """Parallel (Chan et al.) running mean and variance over the leading dims, in float64."""

    def __init__(self, shape: tuple[int, ...] = (), epsilon: float = 1e-4):
        super().__init__()
        self.register_buffer("mean", torch.zeros(shape, dtype=torch.float64))
        self.register_buffer("var", torch.ones(shape, dtype=torch.float64))
        self.register_buffer("count", torch.tensor(epsilon, dtype=torch.float64))

    @torch.no_grad()
    def update(self, x: torch.Tensor) -> None:
        """Fold a batch ``[..., *shape]`` into the statistics."""
        x = x.reshape(-1, *self.mean.shape).to(torch.float64)
        batch_mean, batch_var, n = x.mean(0), x.var(0, unbiased=False), x.shape[0]
        delta = batch_mean - self.mean
        total = self.count + n
        self.mean += delta * n / total
        m2 = self.var * self.count + batch_var * n + delta.pow(2) * self.count * n / total
        self.var.copy_(m2 / total)
        self.count.fill_(total)

    @property
    def std(self) -> torch.Tensor:
        return self.var.sqrt()


class ObsNormalizer(RunningMeanStd):
    """``clip((x - mean) / sqrt(var + eps), -clip, clip)`` with running statistics."""

    def __init__(self, shape: tuple[int, ...], clip: float = 10.0, eps: float = 1e-8):
        super().__init__(shape)
        self.clip, self.eps = clip, eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        mean = self.mean.to(x.dtype)
        std = (self.var + self.eps).sqrt().to(x.dtype)
        return ((x - mean) / std).clamp(-self.clip, self.clip)


class RewardScaler:
    """Scales rewards by the running std of the discounted return (as SB3's VecNormalize).

    Lives on the learner only: rewards never reach a policy. One discounted-return accumulator per
    (actor, env), advanced as each actor's rollouts arrive, in order.
    """

    def __init__(self, gamma: float, clip: float = 10.0, eps: float = 1e-8):
        self.gamma, self.clip, self.eps = gamma, clip, eps
        self.stats = RunningMeanStd(())
        self._returns: dict[int, torch.Tensor] = {}

    def observe(self, actor: int, reward: torch.Tensor, done: torch.Tensor) -> None:
        """Advance actor `actor`'s accumulators over a ``[N, T]`` rollout and update the std."""
        ret = self._returns.get(actor)
        if ret is None or ret.shape != reward.shape[:1]:
            ret = torch.zeros(reward.shape[0], dtype=torch.float64)
        out = torch.empty(reward.shape, dtype=torch.float64)
        r, d = reward.to(torch.float64).cpu(), done.cpu()
        for t in range(reward.shape[1]):
            ret = ret * self.gamma + r[:, t]
            out[:, t] = ret
            ret = ret.masked_fill(d[:, t], 0.0)
        self._returns[actor] = ret
        self.stats.update(out)

    def std(self) -> float:
        """The divisor :meth:`scale` uses now."""
        return float((self.stats.var + self.eps).sqrt())

    def scale(self, reward: torch.Tensor) -> torch.Tensor:
        return self.scale_by(reward, self.std())

    def scale_by(self, reward: torch.Tensor, std: float) -> torch.Tensor:
        """Scale by a given std (a recorded one, when replaying)."""
        return (reward / std).clamp(-self.clip, self.clip)

    def state_dict(self) -> dict:
        return {"stats": self.stats.state_dict(), "returns": dict(self._returns)}

    def load_state_dict(self, state: dict) -> None:
        self.stats.load_state_dict(state["stats"])
        self._returns = {int(k): v for k, v in state["returns"].items()}
