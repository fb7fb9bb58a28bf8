"""Torch-native batched simulators: the state and every tensor they return stay on the env's device
(initial states are drawn on the CPU and copied there, so that a seed is the same episode everywhere).

These implement :class:`~shared.envs.base.BatchedEnv` directly in torch, the way GPU simulators
(Isaac Lab, MuJoCo Warp, ManiSkill) hand tensors to the policy. ``Pendulum`` mirrors gymnasium's
``Pendulum-v1`` dynamics and is the reference for the protocol; it runs on CPU and CUDA.
"""

from __future__ import annotations

import math

import torch

from shared.envs.base import ActionSpec, EnvSpec, StepResult


class TorchPendulum:
    """Batched ``Pendulum-v1`` (swing up, 200-step time limit) in torch."""

    max_speed, max_torque, dt, g, m, l = 8.0, 2.0, 0.05, 10.0, 1.0, 1.0

    def __init__(self, num_envs: int, device: str | torch.device = "cpu", max_episode_steps: int = 200):
        self.num_envs = num_envs
        self.device = torch.device(device)
        self.max_episode_steps = max_episode_steps
        self.spec = EnvSpec(obs_shape=(3,), obs_dtype=torch.float32,
                            action=ActionSpec(kind="box", shape=(1,), low=(-2.0,), high=(2.0,)),
                            max_episode_steps=max_episode_steps)
        # Initial states are drawn on the CPU and copied to the device, so that a seed is the same
        # episode on every device (a CUDA generator's stream differs from the CPU's).
        self._gen = torch.Generator()
        self._theta = torch.zeros(num_envs, device=self.device)
        self._theta_dot = torch.zeros(num_envs, device=self.device)
        self._t = torch.zeros(num_envs, dtype=torch.int64, device=self.device)
        self._ep_return = torch.zeros(num_envs, dtype=torch.float64, device=self.device)

    def _obs(self) -> torch.Tensor:
        return torch.stack([self._theta.cos(), self._theta.sin(), self._theta_dot], dim=-1)

    def _reset_where(self, mask: torch.Tensor) -> None:
        n = int(mask.sum())
        if n:
            self._theta[mask] = ((torch.rand(n, generator=self._gen) * 2 - 1) * math.pi).to(self.device)
            self._theta_dot[mask] = (torch.rand(n, generator=self._gen) * 2 - 1).to(self.device)
            self._t[mask] = 0
            self._ep_return[mask] = 0.0

    def reset(self, seed: int | list[int] | None = None) -> torch.Tensor:
        if isinstance(seed, list):
            if len(seed) != self.num_envs:
                raise ValueError(f"reset: {len(seed)} seeds for {self.num_envs} envs")
            for s in sorted(set(seed)):  # envs with the same seed get the same initial state
                mask = torch.tensor([x == s for x in seed], device=self.device)
                self._gen.manual_seed(s)
                theta = ((torch.rand(1, generator=self._gen) * 2 - 1) * math.pi).to(self.device)
                theta_dot = (torch.rand(1, generator=self._gen) * 2 - 1).to(self.device)
                self._theta[mask], self._theta_dot[mask] = theta, theta_dot
            self._t.zero_()
            self._ep_return.zero_()
            return self._obs()
        if seed is not None:
            self._gen.manual_seed(seed)
        self._reset_where(torch.ones(self.num_envs, dtype=torch.bool, device=self.device))
        return self._obs()

    def step(self, action: torch.Tensor) -> StepResult:
        u = action.reshape(self.num_envs).to(self.device).clamp(-self.max_torque, self.max_torque)
        th, thdot = self._theta, self._theta_dot
        angle = (th + math.pi) % (2 * math.pi) - math.pi
        cost = angle ** 2 + 0.1 * thdot ** 2 + 0.001 * u ** 2
        thdot = (thdot + (3 * self.g / (2 * self.l) * th.sin() + 3.0 / (self.m * self.l ** 2) * u) * self.dt)
        thdot = thdot.clamp(-self.max_speed, self.max_speed)
        self._theta = th + thdot * self.dt
        self._theta_dot = thdot
        self._t += 1
        reward = -cost
        self._ep_return += reward
        truncated = self._t >= self.max_episode_steps
        terminated = torch.zeros_like(truncated)
        final_obs = self._obs()
        returns: list[float] = []
        lengths: list[int] = []
        if bool(truncated.any()):
            returns = self._ep_return[truncated].tolist()
            lengths = self._t[truncated].tolist()
            self._reset_where(truncated)
            obs = self._obs()
        else:
            obs = final_obs
        return StepResult(obs=obs, reward=reward.float(), terminated=terminated, truncated=truncated,
                          final_obs=final_obs, episode_returns=returns, episode_lengths=lengths)

    def close(self) -> None:
        pass


def _reach(**kwargs):
    from shared.envs.reach import Reach
    return Reach(**kwargs)


def _reach_spec(**kwargs):
    from shared.envs.reach import Reach
    return Reach.spec_for(**kwargs)


def _mjwarp_half_cheetah(**kwargs):
    from shared.envs.mjwarp import MJWarpHalfCheetah
    return MJWarpHalfCheetah(**kwargs)


def _mjwarp_half_cheetah_spec(**kwargs):
    from shared.envs.mjwarp import MJWarpHalfCheetah
    return MJWarpHalfCheetah.spec_for(**kwargs)


_REGISTRY = {"Pendulum-v0": TorchPendulum, "Reach-v0": _reach, "MJWarpHalfCheetah-v0": _mjwarp_half_cheetah}
# Envs whose spec is known without building the simulator (the others build one env on the CPU for it).
_SPECS = {"MJWarpHalfCheetah-v0": _mjwarp_half_cheetah_spec, "Reach-v0": _reach_spec}
# Envs that can give their instructions as text (they take a tokenizer).
_TEXT = {"Reach-v0"}


def torch_env_spec(name: str, kwargs: dict):
    """The spec of ``tandem/<name>`` with `kwargs`, or None where only a built env can tell it."""
    return _SPECS[name](**kwargs) if name in _SPECS else None


def make_torch_env(name: str, num_envs: int, kwargs: dict, device: str | torch.device, tokenizer=None):
    """``tandem/<name>``; `tokenizer` (``shared/instructions.py``) goes to the envs that can give text
    instructions."""
    if name not in _REGISTRY:
        raise ValueError(f"unknown torch-native env 'tandem/{name}' (known: "
                         f"{', '.join('tandem/' + k for k in _REGISTRY)})")
    extra = {"tokenizer": tokenizer} if tokenizer is not None and name in _TEXT else {}
    return _REGISTRY[name](num_envs=num_envs, device=device, **kwargs, **extra)
