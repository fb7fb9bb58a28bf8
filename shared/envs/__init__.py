"""Env adapters: gymnasium vector envs and torch-native batched simulators, one protocol."""

from __future__ import annotations

import torch

from shared.envs.base import ActionSpec, BatchedEnv, EnvSpec, StepResult
from shared.envs.options import EnvConfigError, check_env_config, env_options

TORCH_NATIVE_PREFIX = "tandem/"
MANISKILL_PREFIX = "maniskill/"   # ManiSkill3 tasks (shared/envs/maniskill.py; launch/setup_maniskill.sh)


def make_env(env_id: str, num_envs: int, env_kwargs: dict | None = None,
             device: str | torch.device = "cpu", render: bool = False, tokenizer=None) -> BatchedEnv:
    """Build ``num_envs`` envs of ``env_id`` as one :class:`BatchedEnv`.

    ``tandem/<Name>`` ids are torch-native batched simulators that run on ``device``;
    ``maniskill/<EnvId>`` is a ManiSkill3 task (CPU or GPU PhysX); anything else
    is a gymnasium id stepped on the CPU (``device`` then only says where the policy runs).
    `render`: build the envs able to render frames (``render_frames(indices)``, evaluation
    videos); torch-native envs that can render always can.
    `tokenizer`: the model's instruction tokenizer (``shared/instructions.py``), for envs configured to
    give text instructions; envs that give none ignore it.

    Raises:
        EnvConfigError: `env_kwargs` that the env's declared options (``shared/envs/options.py``) refuse.
    """
    env_options(env_id, env_kwargs)
    if env_id.startswith(TORCH_NATIVE_PREFIX):
        from shared.envs.torch_envs import make_torch_env
        return make_torch_env(env_id[len(TORCH_NATIVE_PREFIX):], num_envs, env_kwargs or {}, device, tokenizer)
    if env_id.startswith(MANISKILL_PREFIX):
        from shared.envs.maniskill import make_maniskill_env
        return make_maniskill_env(env_id[len(MANISKILL_PREFIX):], num_envs, env_kwargs or {}, device, render,
                                  tokenizer)
    from shared.envs.gym_env import GymBatchedEnv
    return GymBatchedEnv(env_id, num_envs, env_kwargs, render=render)


def env_spec(env_id: str, env_kwargs: dict | None = None) -> EnvSpec:
    """The :class:`EnvSpec` of ``env_id``: from the env's description where it has one (a GPU
    simulator is then not built at all), else from one env built on the CPU and closed.

    Raises:
        EnvConfigError: `env_kwargs` that the env's declared options (``shared/envs/options.py``) refuse.
    """
    env_options(env_id, env_kwargs)
    if env_id.startswith(TORCH_NATIVE_PREFIX):
        from shared.envs.torch_envs import torch_env_spec
        spec = torch_env_spec(env_id[len(TORCH_NATIVE_PREFIX):], env_kwargs or {})
        if spec is not None:
            return spec
    from shared.instructions import ShapeOnlyTokenizer, text_instructions
    # only the shapes matter here: text instructions need no tokenizer (the learner never loads one)
    shapes_only = {"tokenizer": ShapeOnlyTokenizer()} if text_instructions(env_kwargs) else {}
    env = make_env(env_id, 1, env_kwargs, "cpu", **shapes_only)
    try:
        return env.spec
    finally:
        env.close()


__all__ = ["ActionSpec", "BatchedEnv", "EnvConfigError", "EnvSpec", "StepResult", "check_env_config", "env_spec",
           "make_env"]
