"""gymnasium vector envs as a :class:`~shared.envs.base.BatchedEnv`, stepped in-process.

One ``SyncVectorEnv`` per actor: on a 2-core machine a process per env is 3-7x slower. The vector
env runs in gymnasium's SAME_STEP auto-reset mode, so the step that ends an episode returns the
reset observation and the true final observation arrives in ``info["final_obs"]``.
"""

from __future__ import annotations

import warnings

import gymnasium as gym
import numpy as np
import torch

from shared.envs.base import ActionSpec, EnvSpec, StepResult
from shared.metrics import clean_metrics


def _spec_of(env: gym.vector.VectorEnv) -> EnvSpec:
    obs_space, act_space = env.single_observation_space, env.single_action_space
    if not isinstance(obs_space, gym.spaces.Box):
        raise ValueError(f"observation space {obs_space} is not supported by the gymnasium adapter (need Box)")
    if isinstance(act_space, gym.spaces.Discrete):
        action = ActionSpec(kind="discrete", shape=(), n=int(act_space.n))
    elif isinstance(act_space, gym.spaces.Box):
        action = ActionSpec(kind="box", shape=tuple(act_space.shape),
                            low=tuple(float(x) for x in act_space.low.reshape(-1)),
                            high=tuple(float(x) for x in act_space.high.reshape(-1)))
    else:
        raise ValueError(f"action space {act_space} is not supported (need Discrete or Box)")
    obs_dtype = torch.float32 if np.issubdtype(obs_space.dtype, np.floating) else torch.from_numpy(
        np.zeros((), dtype=obs_space.dtype)).dtype
    max_steps = env.spec.max_episode_steps if env.spec is not None else None
    return EnvSpec(obs_shape=tuple(obs_space.shape), obs_dtype=obs_dtype, action=action,
                   max_episode_steps=max_steps)


class GymBatchedEnv:
    """``num_envs`` copies of a gymnasium env in one ``SyncVectorEnv``."""

    def __init__(self, env_id: str, num_envs: int, env_kwargs: dict | None = None, render: bool = False):
        kwargs = dict(env_kwargs or {})
        if render:
            kwargs.setdefault("render_mode", "rgb_array")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            self._env = gym.make_vec(env_id, num_envs=num_envs, vectorization_mode="sync",
                                     vector_kwargs={"autoreset_mode": gym.vector.AutoresetMode.SAME_STEP},
                                     **kwargs)
        self.num_envs = num_envs
        self.device = torch.device("cpu")
        self.spec = _spec_of(self._env)
        act = self.spec.action
        if act.kind == "box":
            self._low = np.asarray(act.low, dtype=np.float32).reshape(act.shape)
            self._high = np.asarray(act.high, dtype=np.float32).reshape(act.shape)
        self._ep_return = np.zeros(num_envs, dtype=np.float64)
        self._ep_length = np.zeros(num_envs, dtype=np.int64)
        self._reward_sums: dict[str, np.ndarray] = {}   # per reward component, per env, this episode

    def _obs(self, obs: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(np.asarray(obs)).to(self.spec.obs_dtype)

    def reset(self, seed: int | list[int] | None = None) -> torch.Tensor:
        obs, _ = self._env.reset(seed=seed)
        self._ep_return[:] = 0.0
        self._ep_length[:] = 0
        self._reward_sums = {}
        return self._obs(obs)

    def _step_info(self, info: dict, done: np.ndarray) -> dict[str, np.ndarray]:
        """This step's numeric per-env info entries ``{key: [N]}`` (NaN where an env did not report
        it): the step's own info, which for envs that just ended is ``final_info`` (SAME_STEP
        auto-reset puts the reset info in ``info``)."""
        n = self.num_envs
        out: dict[str, np.ndarray] = {}
        final = info.get("final_info") if done.any() else None
        for src, rows in ((info, ~done), (final, done)):
            if not isinstance(src, dict):
                continue
            for k, v in src.items():
                if k.startswith("_") or k in ("final_obs", "final_info") or not isinstance(v, np.ndarray):
                    continue
                if v.shape != (n,) or not (np.issubdtype(v.dtype, np.number) or v.dtype == bool):
                    continue
                mask = src.get("_" + k, np.ones(n, dtype=bool)) & rows
                col = out.setdefault(k, np.full(n, np.nan))
                col[mask] = v[mask].astype(np.float64)
        return out

    def _metrics(self, info: dict, done: np.ndarray) -> list[dict[str, float]]:
        """Per ended episode: the final step's numeric info entries, and for reward components
        (``reward*`` keys) their sum over the episode. On a step where no episode ends only the
        reward components are accumulated (this runs in the actor's step loop)."""
        if not done.any():
            for k, v in info.items():
                if (k.startswith("reward") and isinstance(v, np.ndarray) and v.shape == (self.num_envs,)
                        and np.issubdtype(v.dtype, np.number)):
                    acc = self._reward_sums.setdefault(k, np.zeros(self.num_envs))
                    mask = info.get("_" + k)
                    acc += np.where(mask, v, 0.0) if isinstance(mask, np.ndarray) else v
            return []
        step = self._step_info(info, done)
        for k, v in step.items():
            if k.startswith("reward"):
                acc = self._reward_sums.setdefault(k, np.zeros(self.num_envs))
                acc += np.nan_to_num(v)
        out = []
        for i in np.flatnonzero(done):
            m = {k: (self._reward_sums[k][i] if k in self._reward_sums else v[i]) for k, v in step.items()
                 if not np.isnan(v[i])}
            out.append(clean_metrics(m))
            for acc in self._reward_sums.values():
                acc[i] = 0.0
        return out

    def step(self, action: torch.Tensor) -> StepResult:
        a = action.detach().cpu().numpy()
        if self.spec.action.kind == "box":
            # The policy's Gaussian is unbounded; the env gets the clipped action (the rollout keeps
            # the sample, so its log-prob stays exact).
            a = np.clip(a, self._low, self._high)
        obs, reward, terminated, truncated, info = self._env.step(a)
        done = terminated | truncated
        self._ep_return += reward
        self._ep_length += 1
        obs_t = self._obs(obs)
        final_obs = obs_t
        returns: list[float] = []
        lengths: list[int] = []
        metrics = self._metrics(info, done)
        if done.any():
            final_obs = obs_t.clone()
            idx = np.flatnonzero(done)
            final = info["final_obs"]
            final_obs[idx] = self._obs(np.stack([final[i] for i in idx]))
            returns = self._ep_return[idx].tolist()
            lengths = self._ep_length[idx].tolist()
            self._ep_return[idx] = 0.0
            self._ep_length[idx] = 0
        return StepResult(obs=obs_t, reward=torch.from_numpy(reward.astype(np.float32)),
                          terminated=torch.from_numpy(terminated.astype(bool)),
                          truncated=torch.from_numpy(truncated.astype(bool)),
                          final_obs=final_obs, episode_returns=returns, episode_lengths=lengths,
                          episode_metrics=metrics)

    def render_frames(self, indices: list[int]) -> list[np.ndarray]:
        """``[H, W, 3]`` uint8 frames of the envs at `indices` (built with ``render=True``); only
        those envs render (rendering all of them would cost ``num_envs`` times as much)."""
        frames = []
        for i in indices:
            frame = self._env.envs[i].render()
            if frame is None:
                raise RuntimeError(f"{self._env.envs[i].spec.id if self._env.envs[i].spec else 'env'}: render() "
                                   f"returned nothing (was it built with render_mode='rgb_array'?)")
            frames.append(np.asarray(frame))
        return frames

    def close(self) -> None:
        self._env.close()
