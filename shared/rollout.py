"""The rollout schema both sides agree on: what an actor fills and the learner expects, ``[N, T]``.

Keys are spelled in :mod:`shared.keys`; this module says which of them a run's rollouts carry and
with which shapes and dtypes (from the env's :class:`~shared.envs.base.EnvSpec`).
"""

from __future__ import annotations

import torch
from tensordict import TensorDict

from shared import keys
from shared.envs.base import EnvSpec


def sends_bootstrap_obs(cfg, with_value: bool) -> bool:
    """Whether this run's rollouts carry ``bootstrap_observation`` (``shared/keys.py``): PPO with a
    critic in vla mode, unless the config says never to recompute values. Only there can a sample
    be stale, and only there does the learner recompute bootstrap values. It costs up to a second
    copy of the observations on the wire (zeros where no bootstrap is needed)."""
    return (with_value and cfg.algorithm.name == "ppo" and cfg.trainer.buffer_type != "standard"
            and cfg.algorithm.cfg.recompute_values is not False)


def rollout_template(spec: EnvSpec, num_envs: int, num_steps: int, device: torch.device | str = "cpu",
                     pin_memory: bool = False, with_value: bool = True,
                     with_bootstrap_obs: bool = False) -> TensorDict:
    """An all-zero rollout ``[N, T]``: the schema actors fill and the learner expects.
    Without a critic (``with_value=False``) there is no ``value`` and no ``next_value``; with
    `with_bootstrap_obs` (:func:`sends_bootstrap_obs`) there is a ``bootstrap_observation``."""
    n, t = num_envs, num_steps
    act = spec.action
    act_shape = act.shape
    act_dtype = torch.int64 if act.kind == "discrete" else torch.float32

    def zero_obs():
        if spec.multimodal:
            return TensorDict({k: torch.zeros(n, t, *shape, dtype=dtype, device=device)
                               for k, (shape, dtype) in spec.obs_keys.items()}, batch_size=[n, t])
        return torch.zeros(n, t, *spec.obs_shape, dtype=spec.obs_dtype, device=device)

    tensors = {
        keys.OBS: zero_obs(),
        keys.ACTION: torch.zeros(n, t, *act_shape, dtype=act_dtype, device=device),
        keys.LOG_PROB: torch.zeros(n, t, device=device),
        keys.VALUE: torch.zeros(n, t, device=device),
        keys.NEXT_VALUE: torch.zeros(n, t, device=device),
        keys.REWARD: torch.zeros(n, t, device=device),
        keys.TERMINATED: torch.zeros(n, t, dtype=torch.bool, device=device),
        keys.TRUNCATED: torch.zeros(n, t, dtype=torch.bool, device=device),
        keys.DONE: torch.zeros(n, t, dtype=torch.bool, device=device),
        keys.POLICY_VERSION: torch.zeros(n, t, dtype=torch.int64, device=device),
    }
    if not with_value:
        del tensors[keys.VALUE], tensors[keys.NEXT_VALUE]
    if with_bootstrap_obs:
        tensors[keys.BOOTSTRAP_OBS] = zero_obs()
    if pin_memory:
        tensors = {k: v.pin_memory() for k, v in tensors.items()}
    return TensorDict(tensors, batch_size=[n, t])
