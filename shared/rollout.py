"""The rollout schema both sides agree on: what an actor fills and the learner expects, ``[N, T]``.

Keys are spelled in :mod:`shared.keys`; this module says which of them a run's rollouts carry and
with which shapes and dtypes (from the env's :class:`~shared.envs.base.EnvSpec`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, ClassVar

import numpy as np
import torch
from tensordict import TensorDict

from shared import keys
from shared.envs.base import EnvSpec

MAX_ABS_VALUE = 1e8   # larger floats from a peer are refused (rollouts, requests): they overflow float32 maths


def sends_bootstrap_obs(cfg, with_value: bool) -> bool:
    """Whether this run's rollouts carry ``bootstrap_observation`` (``shared/keys.py``): PPO with a
    critic in vla mode, unless the config says never to recompute values. Only there can a sample
    be stale, and only there does the learner recompute bootstrap values. It costs up to a second
    copy of the observations on the wire (zeros where no bootstrap is needed)."""
    return (with_value and cfg.algorithm.name == "ppo" and cfg.trainer.buffer_type != "standard"
            and cfg.algorithm.cfg.recompute_values is not False)


def policy_layout(policy) -> dict[str, Any]:
    """What `policy` adds to the rollout schema, as :func:`rollout_template`'s keyword arguments: its
    chunk size and the extra per-row tensors it declares (``rollout_extras()``; shared/chunks.py)."""
    from shared.chunks import chunk_size
    extras = getattr(policy, "rollout_extras", None)
    return {"chunk": chunk_size(policy), "extras": dict(extras()) if callable(extras) else {}}


def rollout_template(spec: EnvSpec, num_envs: int, num_steps: int, device: torch.device | str = "cpu",
                     pin_memory: bool = False, with_value: bool = True,
                     with_bootstrap_obs: bool = False, chunk: int = 1,
                     extras: dict[str, tuple[tuple[int, ...], torch.dtype]] | None = None) -> TensorDict:
    """An all-zero rollout ``[N, T]``: the schema actors fill and the learner expects.
    Without a critic (``with_value=False``) there is no ``value`` and no ``next_value``; with
    `with_bootstrap_obs` (:func:`sends_bootstrap_obs`) there is a ``bootstrap_observation``. An action-chunk
    policy (`chunk` H > 1, shared/chunks.py) has one row per call: ``action`` ``[N, T, H, *action]`` and
    ``executed_actions``; `extras` are the policy's own per-row tensors (:func:`policy_layout`)."""
    n, t = num_envs, num_steps
    act = spec.action
    act_shape = act.shape if chunk == 1 else (chunk, *act.shape)
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
    if chunk > 1:
        tensors[keys.EXECUTED] = torch.ones(n, t, dtype=torch.int64, device=device)
    for name, (shape, dtype) in (extras or {}).items():
        tensors[name] = torch.zeros(n, t, *shape, dtype=dtype, device=device)
    if not with_value:
        del tensors[keys.VALUE], tensors[keys.NEXT_VALUE]
    if with_bootstrap_obs:
        tensors[keys.BOOTSTRAP_OBS] = zero_obs()
    if pin_memory:
        tensors = {k: v.pin_memory() for k, v in tensors.items()}
    return TensorDict(tensors, batch_size=[n, t])


@dataclass
class RolloutMeta:
    """What travels with a rollout (the wire message's meta besides the tensors): who sent it, in
    which order, which weights acted, and the episodes it finished. The learner reads it in
    ``learner/ingest.py``; ``to_meta()`` is what ``wire.encode(rollout, **meta)`` and
    ``Learner.ingest(rollout, meta)`` take.

    Only ``actor`` and ``seq`` are required; a field left None is not sent.
    """
    actor: int
    """The actor's id, 0..num_actors-1."""
    seq: int
    """The actor's rollout counter: consecutive from 0 within an actor's life."""
    policy_version: int | None = None
    """The weights version that acted first in the rollout (every step records its own)."""
    env_steps: int | None = None
    """Env steps in the rollout (N x T)."""
    incarnation: str | None = None
    """The learner incarnation whose weights acted: rollouts of an earlier learner are refused."""
    base_digest: str | None = None
    """Digest of the frozen base the actor loaded: must be the learner's."""
    episode_returns: list[float] = field(default_factory=list)
    """Undiscounted returns of the episodes that ended in the rollout."""
    episode_lengths: list[int] = field(default_factory=list)
    """Their lengths, in env steps."""
    episode_successes: list[bool] | None = None
    """Their success, for tasks that define it."""
    episode_metrics: list[dict[str, float]] | None = None
    """The env's own per-episode figures (``shared/metrics.py`` bounds them)."""
    collect_s: float | None = None
    """Wall seconds the rollout took to collect."""
    collect_cpu_s: float | None = None
    """CPU seconds of the collecting thread (policy and env steps, not sleeps)."""
    inference_s: float | None = None
    """Of the wall seconds, those in the acting policy."""
    env_s: float | None = None
    """Of the wall seconds, those in env steps."""
    synced: list[list[float]] | None = None
    """[version, received, first acted] per weights version taken since the last rollout."""
    time: float | None = None
    """When it was sent (``time.time()``)."""

    KIND: ClassVar[str] = "rollout"

    @classmethod
    def of(cls, actor: int, seq: int, stats=None, **fields: Any) -> RolloutMeta:
        """The meta of a rollout collected with ``RolloutStats`` `stats` (episodes and timings)."""
        if stats is not None:
            fields = {"episode_returns": stats.episode_returns, "episode_lengths": stats.episode_lengths,
                      "episode_successes": stats.episode_successes, "episode_metrics": stats.episode_metrics[-1000:],
                      "collect_s": stats.collect_s, "collect_cpu_s": stats.collect_cpu_s,
                      "inference_s": stats.inference_s, "env_s": stats.env_s, **fields}
        return cls(actor=actor, seq=seq, **fields)

    def to_meta(self) -> dict[str, Any]:
        """``{"kind": "rollout", ...}``: the fields that are set."""
        # shallow: the episode lists go to the codec as they are, not deep-copied once per rollout
        values = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        return {"kind": self.KIND, **{k: v for k, v in values.items() if v is not None}}


def actor_seed(cfg, actor_id: int) -> int:
    """The seed actor `actor_id` seeds torch, its envs and its sampling with (distinct per actor and run)."""
    return cfg.trainer.seed * 100_003 + 1_000 * actor_id


def group_seeds(cfg, actor_id: int, seq: int) -> list[int] | None:
    """GRPO: one reset seed per env, shared within each group of ``group_size`` envs, new for every
    group, actor and rollout (with ``reset_every_rollout``; otherwise only at the first rollout).
    None where envs are not reset in groups."""
    alg = cfg.algorithm
    if alg.name != "grpo" or (seq > 0 and not alg.cfg.reset_every_rollout):
        return None
    gs = alg.cfg.group_size
    groups = cfg.actors.num_envs // gs
    seeds = [int(np.random.SeedSequence([cfg.trainer.seed, actor_id, seq, g]).generate_state(1)[0])
             for g in range(groups)]
    return [seeds[i // gs] for i in range(groups * gs)]
