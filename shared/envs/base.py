"""The batched-env protocol every actor steps, and the specs both processes agree on.

A :class:`BatchedEnv` owns ``num_envs`` environments and returns torch tensors on its own
``device``: gymnasium vector envs convert from numpy (CPU); torch-native batched simulators
(``tandem/...`` ids) keep everything on the actor's device until the rollout is sent.

On the step where an episode ends, ``obs`` is already the first observation of the next episode
(auto-reset); ``final_obs`` holds the true last observation of the finished episode there, which
is what truncated steps bootstrap from.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, NamedTuple, Protocol, runtime_checkable

import torch


@dataclass(frozen=True)
class ActionSpec:
    kind: Literal["discrete", "box"]
    shape: tuple[int, ...]            # () for discrete
    n: int = 0                        # number of actions (discrete)
    low: tuple[float, ...] = ()       # bounds (box), flattened
    high: tuple[float, ...] = ()

    @property
    def dim(self) -> int:
        """Size of the policy head: n for discrete, prod(shape) for box."""
        if self.kind == "discrete":
            return self.n
        out = 1
        for s in self.shape:
            out *= s
        return out


@dataclass(frozen=True)
class EnvSpec:
    """What a policy and a rollout need to know about an env (one env, no batch dim).

    A flat observation is one tensor of ``obs_shape`` / ``obs_dtype``. A multi-modal observation is
    a TensorDict whose leaves ``obs_keys`` lists as ``{name: (shape, dtype)}`` (e.g. ``rgb`` uint8
    ``(H, W, 3)``, ``proprio`` float32, ``instruction`` int64 token ids); it travels through actors,
    the wire and the buffer in those dtypes, unflattened.
    """
    obs_shape: tuple[int, ...]
    obs_dtype: torch.dtype
    action: ActionSpec
    max_episode_steps: int | None = None
    obs_keys: dict[str, tuple[tuple[int, ...], torch.dtype]] = field(default_factory=dict)
    extra: dict = field(default_factory=dict, compare=False)

    @property
    def multimodal(self) -> bool:
        return bool(self.obs_keys)


class StepResult(NamedTuple):
    obs: torch.Tensor                # [N, *obs] next observation (reset obs where an episode ended);
                                     # a TensorDict [N] for a multi-modal env
    reward: torch.Tensor             # [N] float32
    terminated: torch.Tensor         # [N] bool
    truncated: torch.Tensor          # [N] bool
    final_obs: torch.Tensor          # [N, *obs] true last observation where done, else == obs
    episode_returns: list[float]     # episodes that ended on this step (undiscounted, raw reward)
    episode_lengths: list[int]
    episode_successes: list[bool] | tuple = ()   # for tasks that define success, per ended episode
    episode_metrics: list[dict[str, float]] | tuple = ()   # per ended episode, shared/metrics.py bounds


@runtime_checkable
class BatchedEnv(Protocol):
    num_envs: int
    spec: EnvSpec
    device: torch.device

    def reset(self, seed: int | list[int] | None = None) -> torch.Tensor:
        """Reset every env; returns ``[N, *obs]``. Env i is seeded ``seed + i`` for an int, ``seed[i]``
        for a list (envs given the same seed start from the same state)."""
        ...

    def step(self, action: torch.Tensor) -> StepResult:
        """Step every env with ``action`` (``[N, *action]``, as sampled; the env clips to its bounds)."""
        ...

    def close(self) -> None: ...
