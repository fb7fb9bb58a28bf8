"""The inference server's protocol, and the checks every request passes before it is batched.

Requests and replies are :mod:`shared.wire` messages (no pickle), ``[route, *frames]`` on the server's
ROUTER (or its Unix socket, :mod:`actors.unix_channel`). A request's meta:

- ``kind``: "act" (actions, log-probs, values where the policy has a critic) or "value" (values only);
- ``actor``: the sender's actor id, one the server acts for; ``id``: an int the reply repeats;
- ``min_version`` (optional, act only): the oldest weight version the request may be acted by, with
  ``incarnation``, the learner life that version counts in, and ``same_life`` (lag_policy pace after
  a learner restart): act only with that life's weights, for a while at most.

The observations are the env's, for 1..``actors.num_envs`` envs. A reply's kind is "reply" (the
outputs, with the ``version``, ``incarnation`` and ``received`` time of the weights that acted),
"busy" (the server's queue was full: the actor sends the request again) or "error" (``why``: the
policy could not act on these observations, or the request was refused).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Any

from tensordict import TensorDict, TensorDictBase

from shared import keys, wire
from shared.envs.base import EnvSpec
from shared.policies import ids_out_of_bounds
from shared.rollout import MAX_ABS_VALUE, rollout_template


@dataclass
class Request:
    """One decoded, checked request: `n` envs' observations from actor `actor`."""
    route: bytes
    actor: int
    rid: int
    kind: str                      # "act" or "value"
    obs: Any                       # a tensor [n, ...] or a TensorDict [n] (multi-modal)
    n: int
    min_version: int = -1
    incarnation: str | None = None   # the learner life of min_version (versions of two lives do not compare)
    same_life: bool = False          # act only with weights of that life (for at most the server's SAME_LIFE_WAIT_S)
    arrived: float = field(default_factory=time.perf_counter)


def is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


class RequestChecker:
    """What a request must be: a wire message of kind "act" or "value" from an actor this server
    serves, observations exactly of the env's schema for 1..num_envs envs, finite and within
    +-``MAX_ABS_VALUE`` (as the learner's intake wants every rollout's floats). Checked on the
    decoded leaves: a TensorDict per request is built only for multi-modal observations."""

    def __init__(self, spec: EnvSpec, num_envs: int, actors: list[int],
                 obs_bounds: dict[str, tuple[int, int]] | None = None):
        self.num_envs, self.actors = num_envs, set(actors)
        self.obs_bounds = obs_bounds or {}   # the policy's token-id leaves (shared.policies.observation_bounds)
        one = rollout_template(spec, 1, 1, with_value=False)[keys.OBS][:, 0]
        self.nested = isinstance(one, TensorDictBase)
        obs_leaves = ({(keys.OBS, *(k if isinstance(k, tuple) else (k,))): v
                       for k, v in one.items(include_nested=True, leaves_only=True)}
                      if self.nested else {(keys.OBS,): one})
        self.expected = {path: (tuple(v.shape[1:]), v.dtype) for path, v in obs_leaves.items()}
        self.max_bytes = sum(math.prod(s) * d.itemsize for s, d in self.expected.values()) * num_envs + (1 << 20)

    def check(self, route: bytes, frames: list) -> Request:
        """The request in `frames`; raises :class:`wire.WireError` naming what is wrong."""
        batch, leaves, meta = wire.decode_leaves(frames, max_message_bytes=self.max_bytes)
        kind, actor, rid = meta.get("kind"), meta.get("actor"), meta.get("id")
        if kind not in ("act", "value"):
            raise wire.WireError(f"request of kind {kind!r}: the inference server takes 'act' or 'value'")
        if not (is_int(actor) and actor in self.actors):
            raise wire.WireError(f"request from actor {actor!r}, not one this server acts for "
                                 f"({sorted(self.actors)})")
        if not is_int(rid):
            raise wire.WireError(f"request without an integer 'id' (got {rid!r})")
        try:   # from here on, one of our actors' requests: a WireError names it, and the server tells it why
            min_version = meta.get("min_version", -1)
            if not is_int(min_version) or min_version < -1:
                raise wire.WireError(f"'min_version' must be an int >= -1, got {str(min_version)[:40]!r}")
            incarnation = meta.get("incarnation")
            if incarnation is not None and not (isinstance(incarnation, str) and len(incarnation) <= 128):
                raise wire.WireError(f"'incarnation' must be a string of at most 128 characters, got "
                                     f"{str(incarnation)[:40]!r}")
            same_life = meta.get("same_life", False)
            if not isinstance(same_life, bool):
                raise wire.WireError(f"'same_life' must be true or false, got {str(same_life)[:40]!r}")
            req = self._check_body(route, actor, rid, kind, min_version, incarnation, batch, leaves)
            req.same_life = same_life and incarnation is not None
            return req
        except wire.WireError as e:
            e.rid = rid      # one of our actors' requests: the server tells it why
            raise

    def _check_body(self, route, actor, rid, kind, min_version, incarnation, batch, leaves) -> Request:
        if len(batch) != 1 or not 1 <= batch[0] <= self.num_envs:
            raise wire.WireError(f"batch size {batch}: must be [n] with 1 <= n <= {self.num_envs} "
                                 f"(actors.num_envs)")
        n = batch[0]
        tops = {p[0] for p in leaves}
        if tops != {keys.OBS}:
            raise wire.WireError(f"a request carries only {keys.OBS!r}, got {sorted(tops)}")
        got = {path: (tuple(t.shape[1:]), t.dtype) for path, t in leaves.items()}
        if got != self.expected:
            raise wire.WireError(f"observation {_describe(got)} does not match the env's {_describe(self.expected)}")
        for path, t in leaves.items():
            if t.dtype.is_floating_point and t.numel():
                top = float(t.abs().max())       # NaN propagates through max
                if not math.isfinite(top):
                    raise wire.WireError(f"observation {'/'.join(path[1:]) or 'obs'} holds NaN or inf")
                if top > MAX_ABS_VALUE:
                    raise wire.WireError(f"observation {'/'.join(path[1:]) or 'obs'} holds values beyond "
                                         f"+-{MAX_ABS_VALUE:g}")
        if self.nested:
            obs = TensorDict({}, batch_size=[n])
            for path, t in leaves.items():
                obs.set(path[1:] if len(path) > 2 else path[1], t)
            bad = ids_out_of_bounds(obs, self.obs_bounds)
            if bad:
                raise wire.WireError(f"observation {bad}")
        else:
            obs = leaves[(keys.OBS,)]
        return Request(route, actor, rid, kind, obs, n, min_version, incarnation)   # aliases the frame, ours alone


def _describe(entries: dict) -> str:
    return ", ".join(f"{'/'.join(k[1:]) or 'obs'}: {d} {list(s)}"
                     for k, (s, d) in sorted(entries.items(), key=lambda e: str(e[0])))


def busy_reply(rid: int) -> list:
    """The reply to request `rid` when the server's queue is full: its actor sends the request again
    after a pause (:data:`~actors.remote_policy.BUSY_RETRY_S`) instead of waiting for a reply that
    cannot come."""
    return wire.encode_leaves([0], [], kind="busy", id=rid)


def error_reply(rid: int, why: str) -> list:
    """The reply to request `rid` when the server will not act on it, and `why` (500 characters at most)."""
    return wire.encode_leaves([0], [], kind="error", id=rid, why=why[:500])
