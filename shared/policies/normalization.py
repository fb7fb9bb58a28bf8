"""Running mean/std statistics. Observation statistics are buffers of the policy, so they travel
with the weights and are saved in checkpoints; only the learner updates them."""

from __future__ import annotations

import threading

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
    def update(self, x: torch.Tensor, all_reduce=None) -> None:
        """Fold a batch ``[..., *shape]`` into the statistics. With `all_reduce` (a function summing a
        tensor over learner ranks), the batch is the union of every rank's batch: the moments are
        combined exactly, so every rank ends with the same statistics."""
        x = x.reshape(-1, *self.mean.shape).to(torch.float64)
        n = float(x.shape[0])
        if all_reduce is None:
            batch_mean, batch_var = x.mean(0), x.var(0, unbiased=False)
        else:
            # moments about the current mean (the same on every rank): no cancellation when |mean| >> std
            d = x - self.mean
            sums = all_reduce(torch.stack([torch.full_like(self.mean, n), d.sum(0), d.pow(2).sum(0)]))
            n = float(sums[0].reshape(-1)[0])
            shift = sums[1] / n
            batch_mean = self.mean + shift
            batch_var = (sums[2] / n - shift.pow(2)).clamp(min=0.0)
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
        self._cache: tuple | None = None   # (key, mean, std) in the input's dtype and device

    def _moments(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # Acting calls this on every env step with statistics that change once per version: the
        # float64 -> float32 conversion is cached until an in-place update (the learner's update,
        # a weights load) bumps the buffers' version counters. A CUDA graph being captured
        # (learner.compile "graph") must read the statistics themselves, not a cached copy: they
        # change in place between its replays, and the copy would not.
        if x.is_cuda and torch.cuda.is_current_stream_capturing():
            return self.mean.to(x.dtype), (self.var + self.eps).sqrt().to(x.dtype)
        key = (self.mean._version, self.var._version, self.mean.data_ptr(), x.dtype, x.device)
        if self._cache is None or self._cache[0] != key:
            mean = self.mean.to(x.dtype)
            std = (self.var + self.eps).sqrt().to(x.dtype)
            self._cache = (key, mean, std)
        return self._cache[1], self._cache[2]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        mean, std = self._moments(x)
        return ((x - mean) / std).clamp(-self.clip, self.clip)


class RewardScaler:
    """Scales rewards by the running std of the discounted return (as SB3's VecNormalize).

    Lives on the learner only: rewards never reach a policy. One discounted-return accumulator per
    (actor, env), advanced as each actor's rollouts arrive, in order. The receiver thread calls
    :meth:`observe` while the main thread reads :meth:`std` and :meth:`state_dict`: a lock keeps
    each of them whole.
    """

    def __init__(self, gamma: float, clip: float = 10.0, eps: float = 1e-8):
        self.gamma, self.clip, self.eps = gamma, clip, eps
        self.stats = RunningMeanStd(())
        self._returns: dict[int, torch.Tensor] = {}
        self._lock = threading.Lock()

    def observe(self, actor: int, reward: torch.Tensor, done: torch.Tensor) -> None:
        """Advance actor `actor`'s accumulators over a ``[N, T]`` rollout and update the std."""
        r, d = reward.to(torch.float64).cpu(), done.cpu()
        out = torch.empty(reward.shape, dtype=torch.float64)
        with self._lock:
            ret = self._returns.get(actor)
            if ret is None or ret.shape != reward.shape[:1]:
                ret = torch.zeros(reward.shape[0], dtype=torch.float64)
            for t in range(reward.shape[1]):
                ret = ret * self.gamma + r[:, t]
                out[:, t] = ret
                ret = ret.masked_fill(d[:, t], 0.0)
            self._returns[actor] = ret
            self.stats.update(out)

    def std(self, all_reduce=None) -> float:
        """The divisor :meth:`scale` uses now. With `all_reduce` (a sum over learner ranks), the
        statistics of every rank's returns combined exactly, so all ranks scale alike."""
        with self._lock:
            c, m, v = self.stats.count.clone(), self.stats.mean.clone(), self.stats.var.clone()
        if all_reduce is None:
            return float((v + self.eps).sqrt())
        n, s1, s2 = all_reduce(torch.stack([c, c * m, c * (v + m * m)])).tolist()
        var = max(s2 / n - (s1 / n) ** 2, 0.0)
        return (var + self.eps) ** 0.5

    def scale(self, reward: torch.Tensor) -> torch.Tensor:
        return self.scale_by(reward, self.std())

    def scale_by(self, reward: torch.Tensor, std: float) -> torch.Tensor:
        """Scale by a given std (a recorded one, when replaying)."""
        return (reward / std).clamp(-self.clip, self.clip)

    def state_dict(self) -> dict:
        with self._lock:
            return {"stats": {k: v.clone() for k, v in self.stats.state_dict().items()},
                    "returns": {k: v.clone() for k, v in self._returns.items()}}

    def load_state_dict(self, state: dict) -> None:
        with self._lock:
            self.stats.load_state_dict(state["stats"])
            self._returns = {int(k): v for k, v in state["returns"].items()}
