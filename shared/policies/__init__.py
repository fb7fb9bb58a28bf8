"""Policies: TensorDict in, TensorDict out. ``make_policy`` is the one place a name becomes a class."""

from __future__ import annotations

import contextlib

import torch
from tensordict import TensorDict
from torch import nn

from shared.config import Config
from shared.envs.base import EnvSpec
from shared.policies.actor_critic import ActorCritic

# Distribution argument checks cost more than the MLPs they guard, on every step and minibatch;
# our policies build distributions from their own finite outputs.
torch.distributions.Distribution.set_default_validate_args(False)


def make_policy(cfg: Config, spec: EnvSpec, describe: bool = False) -> nn.Module:
    """The configured policy, initialised from ``trainer.seed`` alone: the learner, every actor and
    the evaluator build bit-identical policies (a frozen, randomly initialised part never travels
    in weights messages, so it must agree everywhere). The caller's RNG state is left as it was.
    `describe`: log what a VLA adapter does to the env's inputs (one process of a run says it)."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(cfg.trainer.seed)
        policy = _build_policy(cfg, spec, describe)
    if getattr(policy, "chunk_size", 1) > 1:   # how its chunks are executed, wherever it acts (shared/chunks.py)
        policy.actions_per_call = cfg.actors.actions_per_call or policy.chunk_size
    return policy


def _build_policy(cfg: Config, spec: EnvSpec, describe: bool = False) -> nn.Module:
    if cfg.policy.name == "actor_critic":
        return ActorCritic(spec, cfg.policy)
    if cfg.policy.name == "actor_only":
        return ActorCritic(spec, cfg.policy, with_critic=False)
    if cfg.policy.name == "vla":
        return _build_vla(cfg, spec, describe)
    if cfg.policy.name == "flow_vla":
        from shared.policies.flow_policy import build_flow_policy
        return build_flow_policy(cfg, spec, describe)
    raise ValueError(f"{cfg.source}: policy.name {cfg.policy.name!r} is not available")


def _build_vla(cfg: Config, spec: EnvSpec, describe: bool) -> nn.Module:
    """A VLA policy, checked against the env (action size, instruction vocabulary), with what it adapts
    logged once."""
    import logging

    from shared.instructions import check_instruction_vocabulary
    from shared.policies.token_checkpoints import policy_copy
    from shared.policies.vla import VLALoadError, VLAPolicy, load_vla_model
    v = cfg.policy.vla_config
    h = cfg.policy.chunk_size
    model_config = v.model_config if h == 1 or "chunk_size" in v.model_config else {**v.model_config, "chunk_size": h}
    with contextlib.nullcontext() if describe else policy_copy():   # a fresh value head: said where it trains
        model = load_vla_model(v.model_path, v.model_class, model_config)
    if int(getattr(model, "chunk_size", 1) or 1) != h:
        raise VLALoadError(f"{cfg.source}: policy.chunk_size is {h}, but the model (vla_config.model_class "
                           f"{v.model_class}) returns {getattr(model, 'chunk_size', 1)} action(s) per call")
    action_dim = getattr(model, "action_dim", None)
    if spec is not None and isinstance(action_dim, int) and spec.action.kind == "box" and action_dim != spec.action.dim:
        raise VLALoadError(f"{cfg.source}: vla_config.model_config.action_dim is {action_dim} (model at "
                           f"{v.model_path!r}), env {cfg.env.id} takes {spec.action.dim}-dimensional actions")
    policy = VLAPolicy(model, v)
    check_instruction_vocabulary(cfg, spec, policy)
    if not describe:
        return policy
    log = logging.getLogger("tandem.vla")
    source = getattr(model, "source", None)
    if source:
        log.info("VLA: %s from %s (Tandem adapter files: %s)", source["backbone"], source["path"],
                 "read" if source["adapter_config"] else "none, settings from vla_config.model_config")
    for line in getattr(model, "adaptations", lambda _spec: [])(spec):
        log.info("VLA: %s", line)
    return policy


def has_critic(policy: nn.Module) -> bool:
    return getattr(policy, "critic", None) is not None


def observation_bounds(policy) -> dict[str, tuple[int, int]]:
    """The integer observation leaves the policy looks up (token ids), ``{name: (low, high)}`` with
    valid ids in ``[low, high)``; empty for a policy with none. An id outside reaches an embedding
    lookup, which on CUDA is a device-side assert that leaves the device unusable: the learner's
    intake and the inference server check these on the CPU, as messages arrive. The policy says it
    with an ``observation_bounds()`` method of its own or of its ``model`` (a VLA's adapter)."""
    for owner in (policy, getattr(policy, "model", None)):
        fn = getattr(owner, "observation_bounds", None)
        if callable(fn):
            return dict(fn())
    return {}


def ids_out_of_bounds(obs, bounds: dict[str, tuple[int, int]]) -> str | None:
    """What in `obs` (observation leaves by name: a TensorDict or a dict, on the CPU) lies outside
    `bounds`, or None."""
    for name, (low, high) in bounds.items():
        ids = obs.get(name, None)
        if ids is None or not ids.numel() or ids.dtype.is_floating_point:
            continue
        lo, hi = int(ids.min()), int(ids.max())
        if lo < low or hi >= high:
            return f"{name!r} holds ids from {lo} to {hi}, outside [{low}, {high}) (the policy's vocabulary)"
    return None


def published_state(policy: nn.Module) -> dict[str, torch.Tensor]:
    """What a weights message carries: every parameter that trains (``requires_grad``), each tensor
    once (a module registered under two names, such as a VLA whose value head is the model itself,
    counts once), plus the buffers the learner changes (normaliser statistics). A policy names those
    buffers with ``published_buffers()``; without it, every persistent buffer (those in its
    ``state_dict``) is published, and constant ones such as rotary tables are not. Frozen parameters
    (a pretrained base under LoRA, ``vla_config.freeze``) never travel: each process loads them from
    the same checkpoint, and :func:`frozen_digest` checks that they agree."""
    params = {n: p for n, p in policy.named_parameters() if p.requires_grad}
    buffers = dict(policy.named_buffers())
    pick = getattr(policy, "published_buffers", None)
    names = sorted(buffers.keys() & policy.state_dict().keys()) if pick is None else list(pick())
    return {**params, **{n: buffers[n] for n in names}}


def weights_td(policy: nn.Module) -> TensorDict:
    """:func:`published_state` as a nested TensorDict, detached.

    ``"actor.0.weight"`` becomes the key path ``("actor", "0", "weight")``.
    """
    return TensorDict({tuple(k.split(".")): v.detach() for k, v in published_state(policy).items()}, batch_size=[])


def frozen_digest(policy: nn.Module) -> str:
    """SHA-256 of everything that is not published (frozen parameters, constant buffers), names
    included: two processes whose digests agree act with the same base model."""
    import hashlib
    published = published_state(policy)
    h = hashlib.sha256()
    state = {**dict(policy.named_parameters()), **dict(policy.named_buffers())}
    for name in sorted(state.keys() - published.keys()):
        t = state[name].detach()
        h.update(name.encode())
        h.update(str((t.dtype, tuple(t.shape))).encode())
        h.update(t.cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def weights_digest(policy: nn.Module) -> str:
    """SHA-256 of every parameter and buffer, bit for bit (names included): equal digests, equal weights."""
    import hashlib
    h = hashlib.sha256()
    for name, t in sorted(policy.state_dict().items()):
        h.update(name.encode())
        h.update(t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())   # 0-dim too
    return h.hexdigest()


def load_weights_(policy: nn.Module, weights: TensorDict) -> None:
    """Copy ``weights`` (from :func:`weights_td`) into ``policy`` in place; raises on any mismatch,
    before anything is copied."""
    state = {".".join(k if isinstance(k, tuple) else (k,)): v
             for k, v in weights.items(include_nested=True, leaves_only=True)}
    own = published_state(policy)
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
