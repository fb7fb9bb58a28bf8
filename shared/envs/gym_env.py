"""gymnasium envs as a :class:`~shared.envs.base.BatchedEnv`, stepped in-process.

All of an actor's envs live in its process: a process per env would pay for inter-process copies
and the cores an actor does not have.
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


def _is_number(v) -> bool:
    return isinstance(v, (int, float, np.number, np.bool_)) and not isinstance(v, str)


class GymBatchedEnv:
    """``num_envs`` copies of a gymnasium env, stepped one after the other in this process.

    The copies are built by ``gym.make_vec`` (same wrappers, same seeding: env i gets ``seed + i``),
    but stepped directly: ``SyncVectorEnv.step`` merges every env's info dict into arrays on every
    step, which costs a quarter of a MuJoCo env's step. Auto-reset is SAME_STEP: the step that ends
    an episode returns the reset observation, and its true last observation is ``final_obs``.
    """

    def __init__(self, env_id: str, num_envs: int, env_kwargs: dict | None = None, render: bool = False):
        kwargs = dict(env_kwargs or {})
        if render:
            kwargs.setdefault("render_mode", "rgb_array")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            self._env = gym.make_vec(env_id, num_envs=num_envs, vectorization_mode="sync",
                                     vector_kwargs={"autoreset_mode": gym.vector.AutoresetMode.SAME_STEP},
                                     **kwargs)
        self._envs = list(self._env.envs)
        self.num_envs = num_envs
        self.device = torch.device("cpu")
        self.spec = _spec_of(self._env)
        act = self.spec.action
        if act.kind == "box":
            self._low = np.asarray(act.low, dtype=np.float32).reshape(act.shape)
            self._high = np.asarray(act.high, dtype=np.float32).reshape(act.shape)
        obs_space = self._env.single_observation_space
        self._obs_buf = np.zeros((num_envs, *obs_space.shape), dtype=obs_space.dtype)
        self._ep_return = np.zeros(num_envs, dtype=np.float64)
        self._ep_length = np.zeros(num_envs, dtype=np.int64)
        self._reward_sums: list[dict[str, float]] = [{} for _ in range(num_envs)]   # this episode's, per env

    def _obs(self, obs: np.ndarray) -> torch.Tensor:
        # always a copy: the step buffer is overwritten by the next step
        return torch.from_numpy(np.asarray(obs)).to(self.spec.obs_dtype, copy=True)

    def reset(self, seed: int | list[int] | None = None) -> torch.Tensor:
        if seed is None or isinstance(seed, int):
            seeds = [None if seed is None else seed + i for i in range(self.num_envs)]
        else:
            seeds = list(seed)
            if len(seeds) != self.num_envs:
                raise ValueError(f"reset: {len(seeds)} seeds for {self.num_envs} envs")
        for i, (env, s) in enumerate(zip(self._envs, seeds)):
            self._obs_buf[i], _ = env.reset(seed=s)
        self._ep_return[:] = 0.0
        self._ep_length[:] = 0
        self._reward_sums = [{} for _ in range(self.num_envs)]
        return self._obs(self._obs_buf)

    def _episode_metrics(self, i: int, info: dict) -> dict[str, float]:
        """Env i's episode just ended with `info`: its numeric entries, and for reward components
        (``reward*`` keys) their sum over the episode."""
        sums = self._reward_sums[i]
        out = {k: (sums[k] if k in sums else float(v)) for k, v in info.items() if _is_number(v)}
        self._reward_sums[i] = {}
        return clean_metrics(out)

    partial_steps = True   # step(action, active): the envs not active are left as they are (action chunks)

    def step(self, action: torch.Tensor, active: torch.Tensor | None = None) -> StepResult:
        a = action.detach().cpu().numpy()
        live = None if active is None else active.detach().cpu().numpy().astype(bool)
        if self.spec.action.kind == "box":
            # The policy's Gaussian is unbounded; the env gets the clipped action (the rollout keeps
            # the sample, so its log-prob stays exact).
            a = np.clip(a, self._low, self._high)
        n = self.num_envs
        reward = np.zeros(n, dtype=np.float64)
        terminated = np.zeros(n, dtype=bool)
        truncated = np.zeros(n, dtype=bool)
        ended: list[tuple[int, np.ndarray, dict]] = []
        for i, env in enumerate(self._envs):
            if live is not None and not live[i]:
                continue
            obs, r, term, trunc, info = env.step(a[i])
            reward[i], terminated[i], truncated[i] = r, term, trunc
            sums = self._reward_sums[i]
            for k, v in info.items():   # reward components, summed over the episode
                if k.startswith("reward") and _is_number(v):
                    sums[k] = sums.get(k, 0.0) + float(v)
            if term or trunc:
                ended.append((i, obs, info))
                obs, _ = env.reset()
            self._obs_buf[i] = obs
        self._ep_return += reward
        self._ep_length += 1 if live is None else live
        obs_t = self._obs(self._obs_buf)
        final_obs = obs_t
        returns: list[float] = []
        lengths: list[int] = []
        metrics: list[dict[str, float]] = []
        if ended:
            final_obs = obs_t.clone()
            idx = [i for i, _, _ in ended]
            final_obs[idx] = self._obs(np.stack([o for _, o, _ in ended]))
            returns = self._ep_return[idx].tolist()
            lengths = self._ep_length[idx].tolist()
            self._ep_return[idx] = 0.0
            self._ep_length[idx] = 0
            metrics = [self._episode_metrics(i, info) for i, _, info in ended]
        return StepResult(obs=obs_t, reward=torch.from_numpy(reward.astype(np.float32)),
                          terminated=torch.from_numpy(terminated), truncated=torch.from_numpy(truncated),
                          final_obs=final_obs, episode_returns=returns, episode_lengths=lengths,
                          episode_metrics=metrics)

    def render_frames(self, indices: list[int]) -> list[np.ndarray]:
        """``[H, W, 3]`` uint8 frames of the envs at `indices` (built with ``render=True``); only
        those envs render (rendering all of them would cost ``num_envs`` times as much)."""
        frames = []
        for i in indices:
            frame = self._envs[i].render()
            if frame is None:
                raise RuntimeError(f"{self._envs[i].spec.id if self._envs[i].spec else 'env'}: render() "
                                   f"returned nothing (was it built with render_mode='rgb_array'?)")
            frames.append(np.asarray(frame))
        return frames

    def close(self) -> None:
        self._env.close()
