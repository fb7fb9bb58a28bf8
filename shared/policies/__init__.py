"""Policies: TensorDict in, TensorDict out. ``make_policy`` is the one place a name becomes a class."""

from __future__ import annotations

import torch
from tensordict import TensorDict
from torch import nn

from shared.config import Config
from shared.envs.base import EnvSpec
from shared.policies.actor_critic import ActorCritic

# Distribution argument checks cost more than the MLPs they guard, on every step and minibatch;
# our policies build distributions from their own finite outputs.
torch.distributions.Distribution.set_default_validate_args(False)


def make_policy(cfg: Config, spec: EnvSpec) -> nn.Module:
    if cfg.policy.name == "actor_critic":
        return ActorCritic(spec, cfg.policy)
    if cfg.policy.name == "actor_only":
        return ActorCritic(spec, cfg.policy, with_critic=False)
    if cfg.policy.name == "vla":
        from shared.policies.vla import VLAPolicy, load_vla_model
        v = cfg.policy.vla_config
        return VLAPolicy(load_vla_model(v.model_path, v.model_class, v.model_config), v)
    raise ValueError(f"{cfg.source}: policy.name {cfg.policy.name!r} is not available")


def has_critic(policy: nn.Module) -> bool:
    return getattr(policy, "critic", None) is not None


def weights_td(policy: nn.Module) -> TensorDict:
    """Parameters and buffers (normaliser statistics included) as a nested TensorDict, detached.

    ``"actor.0.weight"`` becomes the key path ``("actor", "0", "weight")``.
    """
    return TensorDict({tuple(k.split(".")): v.detach() for k, v in policy.state_dict().items()}, batch_size=[])


def weights_digest(policy: nn.Module) -> str:
    """SHA-256 of every parameter and buffer, bit for bit (names included): equal digests, equal weights."""
    import hashlib
    h = hashlib.sha256()
    for name, t in sorted(policy.state_dict().items()):
        h.update(name.encode())
        h.update(t.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def load_weights_(policy: nn.Module, weights: TensorDict) -> None:
    """Copy ``weights`` (from :func:`weights_td`) into ``policy`` in place; raises on any mismatch."""
    state = {".".join(k if isinstance(k, tuple) else (k,)): v
             for k, v in weights.items(include_nested=True, leaves_only=True)}
    own = policy.state_dict()
    missing, unexpected = own.keys() - state.keys(), state.keys() - own.keys()
    if missing or unexpected:
        raise ValueError(f"weights do not match the policy: missing {sorted(missing)}, unexpected {sorted(unexpected)}")
    for k, v in state.items():
        if v.shape != own[k].shape or v.dtype != own[k].dtype:
            raise ValueError(f"weights {k!r}: got {v.dtype} {tuple(v.shape)}, policy has {own[k].dtype} "
                             f"{tuple(own[k].shape)}")
    with torch.no_grad():
        for k, v in state.items():
            own[k].copy_(v, non_blocking=True)
