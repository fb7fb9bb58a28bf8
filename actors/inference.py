"""``actors.inference: server``: one copy of the policy per device, acting for every actor on it.

With ``local`` (the default) each actor holds its own copy and runs its own forward pass. For a
large model that is the expensive way round: N copies in device memory, N contexts time-slicing one
GPU, and N calls a round where one batched call costs about the same. With ``server``:

- one :class:`InferenceServer` process per device of ``actors.devices`` holds the only acting copy;
  the actors on that device become env processes whose :class:`RemotePolicy` sends observations and
  receives actions, log-probs, values and the version that acted;
- the server gathers requests from all its actors into one forward pass: it waits at most
  ``actors.server_max_wait_ms`` after the first request (and at most half its recent time per
  batch: for a cheap policy, waiting costs more than batching gains), and stops gathering at
  ``actors.server_max_batch`` envs (0: all its actors' envs), so a slow or dead actor never holds a
  batch back for longer than that wait;
- it takes new weights between batches, never during one, through the same
  :class:`~actors.weights_loader.WeightsLoader` an actor uses (whole versions only, a restarted
  learner's versions, the frozen base checked); every reply carries the version that acted, which
  the collector stamps on that step, so per-sample versions, lag accounting, corrections and the
  staleness report see exactly what acted. An actor asks for a minimum version at the start of a
  rollout (``min_version``, with the learner life it counts in): in standard mode one newer than
  its last rollout's; under ``lag_policy: pace`` the newest the learner has announced, as a local
  actor loads it before a rollout, unless a study knob holds weights back (otherwise the server's
  load delay added a version of lag, past pace's bound). The server holds that request until it has
  such a version, or any version of another life (a resumed learner's); a paced request names the
  life its credit came from (``same_life``) and is held for that life's weights, for at most
  ``SAME_LIFE_WAIT_S`` (after a learner restart, a rollout acted with the old life's is dropped);
- requests and replies are :mod:`shared.wire` messages (no pickle); a malformed request is dropped
  and counted with its sender in the log (one of the server's own actors is told why), and the queue
  of requests waiting for a batch is bounded (``actors.server_queue``: a request past it is answered
  "busy" and its actor sends it again); CURVE applies to its socket where the run uses it;
- the server writes ``inference/server_<id>.json`` (endpoint and incarnation) in the run directory;
  a restarted server binds the same port when it can and writes a new incarnation, and an actor
  waiting on it re-sends its request to the new one.

With ``actors.server_splits`` k > 1 each actor steps its envs in k parts, each with its own request
in flight (:class:`RemotePolicy` ``submit``/``result``): the server answers one part while the actor
steps another (double-buffered sampling, ``actors/rollout.py``).

GRPO: a group is envs of one actor (of one part), so they are always in the same request and act
with the same version. ``lag_policy: pace`` and its credits stay with the actors (the learner counts rollouts).
"""

from __future__ import annotations

import json
import logging
import math
import os
import socket
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch
import zmq
from tensordict import TensorDict, TensorDictBase

from actors.unix_channel import ServerChannels, UnixDealer, socket_path
from shared import keys, wire
from shared.config import Config
from shared.envs.base import EnvSpec
from shared.files import write_json_atomic
from shared.policies import ids_out_of_bounds, observation_bounds
from shared.rollout import MAX_ABS_VALUE, rollout_template
from shared.transport import RESEND_AFTER_S

# A request that names its learner life (lag_policy pace after a learner restart) waits this long at
# most for that life's weights; the server asks the learner for them after RESEND_AFTER_S.
SAME_LIFE_WAIT_S = 2 * RESEND_AFTER_S

log = logging.getLogger("tandem.inference")

LOG_EVERY = 1000          # after the first 10, one refusal in this many is logged
ENDPOINT_CHECK_S = 1.0    # how often a waiting actor looks for a restarted server
WEIGHTS_LOOK_S = 0.005    # how often a server holding requests for a version looks for it
BUSY_RETRY_S = 0.05       # an actor whose request found the server's queue full sends it again after this
                          # (up to one poll, 50 ms, later)


class InferenceStopped(Exception):
    """The actor was asked to stop while it waited for the server."""


class InferenceRefused(Exception):
    """The server could not act on this actor's observations (its policy raised on them): the
    actor ends, as it would with ``local``, and the launcher starts it again with fresh envs."""


class InferenceUnavailable(Exception):
    """No reply from the inference server for the actor's learner timeout."""


def server_devices(cfg: Config) -> list[str]:
    """Each server's device, by server id: ``actors.devices`` without repeats, in order, each
    ``actors.servers_per_device`` times (launch/run_local.sh counts them the same way)."""
    k = cfg.actors.servers_per_device
    return [d for d in dict.fromkeys(cfg.actors.devices) for _ in range(k)]


def server_of(cfg: Config, actor_id: int) -> int:
    """The server that acts for actor `actor_id`: one of its device's, the actors of a device dealt
    out to its ``actors.servers_per_device`` servers in turn."""
    devices, k = cfg.actors.devices, cfg.actors.servers_per_device
    mine = devices[actor_id % len(devices)]
    first = list(dict.fromkeys(devices)).index(mine) * k
    turn = sum(1 for i in range(actor_id) if devices[i % len(devices)] == mine)
    return first + turn % k


def served_actors(cfg: Config, server_id: int) -> list[int]:
    return [i for i in range(cfg.actors.num_actors) if server_of(cfg, i) == server_id]


def endpoint_path(run_dir: str | Path, server_id: int) -> Path:
    return Path(run_dir) / "inference" / f"server_{server_id}.json"


def read_endpoint(path: Path) -> dict | None:
    """``{"endpoint", "incarnation"}`` from a server's file, or None while there is none (or it is
    not a file a server of ours wrote)."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    if not (isinstance(data, dict) and isinstance(data.get("endpoint"), str)
            and isinstance(data.get("incarnation"), str)):
        return None
    return data


# ---------------------------------------------------------------------------------------- requests
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
    same_life: bool = False          # act only with weights of that life (for at most SAME_LIFE_WAIT_S)
    arrived: float = field(default_factory=time.perf_counter)


def _is_int(x: Any) -> bool:
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
        if not (_is_int(actor) and actor in self.actors):
            raise wire.WireError(f"request from actor {actor!r}, not one this server acts for "
                                 f"({sorted(self.actors)})")
        if not _is_int(rid):
            raise wire.WireError(f"request without an integer 'id' (got {rid!r})")
        try:   # from here on, one of our actors' requests: a WireError names it, and the server tells it why
            min_version = meta.get("min_version", -1)
            if not _is_int(min_version) or min_version < -1:
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


# ---------------------------------------------------------------------------------------- server
class InferenceServer:
    """The acting copy for the actors on one device, batched across them.

    Args:
        cfg: the run's config.
        server_id: which device of :func:`server_devices`.
        policy: the acting copy (on its device, eval mode), possibly wrapped by the emulated latency.
        loader: its :class:`~actors.weights_loader.WeightsLoader`.
        weights: the learner's weights socket (``newest(timeout_ms)``).
        sock: a bound ROUTER socket.
        spec: the env's spec (the request schema).
        stop: set to end :meth:`run`.
        writer: a TensorBoard SummaryWriter, or None.
        progress: where the server keeps its TensorBoard step (batches served by every incarnation
            of this server in the run, :func:`read_progress`), so a restarted server's curves go on
            from where the last one logged instead of starting again at 0; or None.
        expire_s: a request not served after this long is dropped (``expired``): its actor has stopped
            waiting for the reply (the actors' learner timeout).
    """

    def __init__(self, cfg: Config, server_id: int, policy, loader, weights, sock: zmq.Socket, spec: EnvSpec,
                 stop, writer=None, expire_s: float = 120.0, progress: Path | None = None):
        a = cfg.actors
        self.cfg, self.server_id, self.policy, self.loader = cfg, server_id, policy, loader
        self.weights, self.sock, self.stop, self.writer = weights, sock, stop, writer
        self.actors = served_actors(cfg, server_id)
        self.max_batch = a.server_max_batch or a.num_envs * max(1, len(self.actors))
        self.max_wait_s = a.server_max_wait_ms / 1000.0
        # Waiting for more requests pays only while it is short next to a forward pass: the wait is
        # also bounded by half the recent time per batch (a cheap policy then serves what is there).
        self.forward_ema_s = self.max_wait_s * 2
        self.max_queue = a.server_queue
        self.checker = RequestChecker(spec, a.num_envs, self.actors, observation_bounds(policy))
        self.waiting: list[Request] = []        # checked, not served yet (bounded by max_queue)
        # refused: malformed, busy (the queue was full: its actor sends it again), undeliverable (the reply could not be sent),
        # failed (the policy raised on it), expired (waited longer than its actor waits for a reply)
        self.counts = {"requests": 0, "replies": 0, "batches": 0, "envs": 0, "malformed": 0, "busy": 0,
                       "undeliverable": 0, "failed": 0, "expired": 0, "asked": 0}
        self._next_ask = 0.0    # asks the learner again for weights a request waits for (_maybe_ask)
        self.forward_total_s = 0.0   # serving batches, over this incarnation's life
        self.expire_s = expire_s
        self._next_expiry = time.monotonic() + 1.0
        self._window = {"batches": 0, "envs": 0, "requests": 0, "forward_s": 0.0, "max_envs": 0}
        self._last_log = time.monotonic()
        self.stopped_by_learner = False
        self.progress = progress
        self.step_base = read_progress(progress) if progress is not None else 0
        self.failed = False

    # -------------------------------------------------------------- the loop
    def run(self) -> int:
        while not self.stop.is_set():
            if not self._take_weights():
                break
            self._receive(timeout_s=0.1 if not self._ready() else 0.0)
            self._maybe_ask()
            batch = self._batch()
            if batch:
                self._serve(batch)
            self._maybe_log()
        return 1 if self.failed else 0

    def _take_weights(self) -> bool:
        """Between batches: queue what the learner published, load what is due. False on stop."""
        while True:
            msg = self.weights.newest(0)
            if msg is None:
                break
            if msg[1].get("kind") == "stop":
                if msg[1].get("who") == "actors":   # the learner's end of run: actors stop, so do we
                    log.info("inference server %d: the learner stopped the run", self.server_id)
                self.stopped_by_learner = True
                self.stop.set()
                return False
            self.loader.offer(msg)
        if self.loader.load_due() == "refused_base":
            self.failed = True
            self.stop.set()
            return False
        return True

    def _maybe_ask(self) -> None:
        """A request has waited :data:`~shared.transport.RESEND_AFTER_S` for a version we lack: ask the
        learner again for its newest weights (ZeroMQ may have dropped the message at a high-water
        mark), then again every as long while one waits so."""
        now = time.perf_counter()
        if now < self._next_ask or not hasattr(self.weights, "ask"):
            return
        if any(now - r.arrived >= RESEND_AFTER_S and not self._servable(r) for r in self.waiting):
            self.weights.ask(*self.loader.newest_received())
            self.counts["asked"] += 1
            self._next_ask = now + RESEND_AFTER_S

    def _ready(self) -> bool:
        return any(self._servable(r) for r in self.waiting)

    def _servable(self, r: Request) -> bool:
        """Weights are loaded, whole, and new enough for the request: a version of the learner life
        its ``min_version`` came from at least that, or any version of another life (a restarted
        learner resumes at its checkpoint's, lower, version: standard mode acts with it at once)."""
        if self.loader.torn or self.loader.version < 0:
            return False
        other_life = r.incarnation is not None and r.incarnation != self.loader.incarnation
        if other_life and r.same_life:
            # a paced actor names the life its credit came from: after a learner restart, the new one,
            # whose weights are on their way (acted with the old life's, its rollout would be dropped).
            # A life the learner has moved on from (its credit reached the actor before the new one's)
            # is served at once; a newer one is waited for, but not for ever.
            lives = getattr(self.weights, "lives", None) or []
            if r.incarnation in lives and r.incarnation != lives[-1]:
                return True
            return time.perf_counter() - r.arrived >= SAME_LIFE_WAIT_S
        return other_life or self.loader.version >= r.min_version

    def _receive(self, timeout_s: float) -> None:
        """Take requests off the socket: wait up to `timeout_s` for the first; after a servable one
        is waiting, go on for at most ``server_max_wait_ms`` from its arrival, until the batch is full
        (``server_max_batch`` envs, or a request from every served actor). While requests are held for
        weights, return within :data:`WEIGHTS_LOOK_S` (the weights come on another thread)."""
        deadline = time.perf_counter() + timeout_s
        while True:
            now = time.perf_counter()
            servable = [r for r in self.waiting if self._servable(r)]
            envs = sum(r.n for r in servable)
            # full: the most envs a batch takes, or a request from every actor (with server_splits an
            # actor's other parts come only after it has stepped the envs this batch acts for)
            if envs >= self.max_batch or len({r.actor for r in servable}) >= len(self.actors):
                return
            if servable:
                deadline = min(r.arrived for r in servable) + min(self.max_wait_s, 0.5 * self.forward_ema_s)
            elif self.waiting:   # held for weights, which come on the subscriber's thread: look again soon
                deadline = min(deadline, now + WEIGHTS_LOOK_S)
            remaining = deadline - now
            # ZeroMQ waits in whole milliseconds: under half of one left, take what has arrived and
            # serve (polling with 0 until the deadline spun a core, taken from the learner on a small host)
            wait_ms = round(remaining * 1000) if remaining >= 0.0005 else 0
            if not self.sock.poll(wait_ms):
                if wait_ms == 0 or time.perf_counter() >= deadline:
                    return
                continue
            for _ in range(self.max_queue):   # bounded: a flood of requests cannot keep batches from going out
                if not self.sock.poll(0):
                    break
                self._take(self.sock.recv_multipart(copy=False))
            if time.perf_counter() >= deadline:
                return

    def _take(self, frames: list) -> None:
        route, body = frames[0].bytes, frames[1:]
        self.counts["requests"] += 1
        try:
            req = self.checker.check(route, body)
        except wire.WireError as e:
            self._refuse("malformed", route, str(e))
            rid = getattr(e, "rid", None)
            if rid is not None:   # one of our actors' requests, bad by its observations: tell it, not wait
                self._reply_error(route, rid, f"the request was refused: {e}")
            return
        except Exception as e:   # decode promises WireError only: a bug on bad input must not end the server
            self._refuse("malformed", route, f"{type(e).__name__}: {e}")
            return
        if len(self.waiting) >= self.max_queue:
            self._refuse("busy", route, f"{len(self.waiting)} requests wait already (actors.server_queue)")
            self._reply_busy(route, req.rid)
            return
        self.waiting.append(req)

    def _refuse(self, what: str, route: bytes, why: str) -> None:
        self.counts[what] += 1
        n = self.counts[what]
        if n <= 10 or n % LOG_EVERY == 0:
            log.warning("inference server %d: dropped %s request #%d from %s: %s", self.server_id, what, n,
                        route.hex()[:16], why[:300])

    def _expire(self) -> None:
        """Drop the requests that waited longer than their actors wait for a reply (a version that never
        comes); looked at once a second."""
        now = time.monotonic()
        if now < self._next_expiry:
            return
        self._next_expiry = now + 1.0
        oldest = time.perf_counter() - self.expire_s
        for r in [r for r in self.waiting if r.arrived < oldest]:
            self._refuse("expired", r.route, f"actor {r.actor}'s request {r.rid} waited {self.expire_s:.0f} s "
                         f"(min_version {r.min_version}, the server has v{self.loader.version})")
        self.waiting = [r for r in self.waiting if r.arrived >= oldest]

    def _batch(self) -> list[Request]:
        """The requests to serve now, oldest first, at most `max_batch` envs (one request at least)."""
        self._expire()
        out, envs = [], 0
        for r in self.waiting:
            if self._servable(r) and (not out or envs + r.n <= self.max_batch):
                out.append(r)
                envs += r.n
        taken = {id(r) for r in out}
        self.waiting = [r for r in self.waiting if id(r) not in taken]
        return out

    @torch.inference_mode()
    def _serve(self, batch: list[Request]) -> None:
        """One forward pass for the act requests and one value pass for the value requests; every
        reply carries the version that acted (the loader's: nothing loads during this)."""
        version, incarnation, received = self.loader.version, self.loader.incarnation, self.loader.received_at
        t0 = time.perf_counter()
        envs = sum(r.n for r in batch)
        self.counts["batches"] += 1          # before any reply: whoever has a reply sees its batch counted
        self.counts["envs"] += envs
        meta = {"version": version, "incarnation": incarnation, "received": received}
        for kind in ("act", "value"):
            reqs = [r for r in batch if r.kind == kind]
            if not reqs:
                continue
            try:
                outs = self._forward(kind, reqs)
            except Exception as e:   # what one actor's observations did to the policy must not end the server
                self._isolate(kind, reqs, e, meta)
                continue
            self._reply(reqs, outs, meta)
        w = self._window
        w["batches"] += 1
        w["envs"] += envs
        w["requests"] += len(batch)
        w["max_envs"] = max(w["max_envs"], envs)
        took = time.perf_counter() - t0
        w["forward_s"] += took
        self.forward_total_s += took
        self.forward_ema_s += 0.1 * (took - self.forward_ema_s)

    def _forward(self, kind: str, reqs: list[Request]) -> dict[str, torch.Tensor]:
        obs = torch.cat([r.obs for r in reqs]).to(self.loader.device)
        td = TensorDict({keys.OBS: obs}, batch_size=[obs.shape[0]])
        if kind == "act":
            out = self.policy(td)
            outs = {k: out[k] for k in (keys.ACTION, keys.LOG_PROB, keys.VALUE) if k in out.keys()}
        else:
            outs = {keys.VALUE: self.policy.get_value(td)}
        return {k: v.cpu() for k, v in outs.items()}

    def _reply(self, reqs: list[Request], outs: dict[str, torch.Tensor], meta: dict) -> None:
        start = 0
        for r in reqs:
            part = [((k,), v[start:start + r.n]) for k, v in outs.items()]
            start += r.n
            self._send(r, wire.encode_leaves([r.n], part, kind="reply", id=r.rid, **meta))

    def _send(self, r: Request, frames: list) -> None:
        try:
            self.sock.send_multipart([r.route, *frames], flags=zmq.NOBLOCK)
            self.counts["replies"] += 1
        except zmq.ZMQError as e:   # its queue is full or it is gone: never block the others
            self._refuse("undeliverable", r.route, f"its reply could not be sent ({e})")

    def _isolate(self, kind: str, reqs: list[Request], error: Exception, meta: dict) -> None:
        """The policy raised on a batch (observations it cannot act on: out of its vocabulary, huge
        values that give NaN probabilities, ...): serve each request alone, and refuse the ones that
        fail alone, with an error reply (their actor ends, as it would acting locally, and the
        launcher restarts it). A device left unusable (a CUDA assert is sticky) ends the server, so
        the launcher starts a fresh one."""
        self._device_usable(error, reqs)
        for i, r in enumerate(reqs):
            try:
                outs = self._forward(kind, [r]) if len(reqs) > 1 else None
            except Exception as e:
                self._device_usable(e, reqs[i:])
                error, outs = e, None
            if outs is not None:
                self._reply([r], outs, meta)
                continue
            why = f"the policy failed on its observations: {type(error).__name__}: {error}"[:500]
            self._refuse("failed", r.route, f"actor {r.actor}, request {r.rid}: {why}")
            self._reply_error(r.route, r.rid, why)

    def _reply_busy(self, route: bytes, rid: int) -> None:
        """Tell an actor its request found the queue full: it sends it again after a pause
        (:data:`BUSY_RETRY_S`) instead of waiting for a reply that cannot come."""
        try:
            self.sock.send_multipart([route, *wire.encode_leaves([0], [], kind="busy", id=rid)], flags=zmq.NOBLOCK)
        except zmq.ZMQError:   # the actor is gone or its queue is full: its request is counted already
            pass

    def _reply_error(self, route: bytes, rid: int, why: str) -> None:
        try:
            self.sock.send_multipart([route, *wire.encode_leaves([0], [], kind="error", id=rid, why=why[:500])],
                                     flags=zmq.NOBLOCK)
        except zmq.ZMQError:   # the actor is gone or its queue is full: its request is counted already
            pass

    def _device_usable(self, error: Exception, reqs: list[Request]) -> None:
        """Raise `error` (the server ends, and the launcher starts a new one) when the device it came
        from cannot run anything more: a CUDA assert is sticky. The requests `reqs` of the batch that
        failed get an error reply first: which of them did it cannot be told on a dead device, and an
        actor left waiting would send its request again to the next server, and end that one too."""
        if self.loader.device.type != "cuda":
            return
        try:
            torch.cuda.synchronize(self.loader.device)
        except Exception:
            log.error("inference server %d: the device failed and stays unusable (%s: %s); refusing the %d "
                      "requests of the batch and exiting for a restart", self.server_id, type(error).__name__,
                      error, len(reqs))
            why = (f"the inference server's device failed on a batch with this request "
                   f"({type(error).__name__}: {error})")[:500]
            for r in reqs:
                self._refuse("failed", r.route, f"actor {r.actor}, request {r.rid}: {why}")
                self._reply_error(r.route, r.rid, why)
            raise error

    def _maybe_log(self) -> None:
        now = time.monotonic()
        if now - self._last_log < self.cfg.trainer.log_interval_s:
            return
        w, c = self._window, self.counts
        b = max(1, w["batches"])
        line = {"batches": w["batches"], "batch_envs_mean": w["envs"] / b, "batch_envs_max": w["max_envs"],
                "batch_requests_mean": w["requests"] / b, "forward_ms_mean": 1000 * w["forward_s"] / b,
                "busy_frac": w["forward_s"] / max(1e-9, now - self._last_log), "version": self.loader.version,
                "malformed": c["malformed"], "busy": c["busy"], "undeliverable": c["undeliverable"],
                "failed": c["failed"], "expired": c["expired"], "asked_learner": c["asked"],
                # the wait in force: server_max_wait_ms, or half the recent time per batch if less
                "wait_ms": 1000 * min(self.max_wait_s, 0.5 * self.forward_ema_s)}
        log.info("inference server %d: v%d | %d batches, %.1f envs (max %d of %d) from %.1f requests each, "
                 "%.1f ms per batch, busy %.0f%%, waits up to %.1f ms | dropped %d malformed, %d busy, "
                 "%d undeliverable, %d failed, %d expired", self.server_id, line["version"], line["batches"],
                 line["batch_envs_mean"], line["batch_envs_max"], self.max_batch, line["batch_requests_mean"],
                 line["forward_ms_mean"], 100 * line["busy_frac"], line["wait_ms"], line["malformed"], line["busy"],
                 line["undeliverable"], line["failed"], line["expired"])
        if self.writer is not None:
            step = self.step_base + c["batches"]
            if self.progress is not None:
                try:
                    write_json_atomic(self.progress, {"batches": step})
                except OSError as e:   # only the next incarnation's TensorBoard step depends on it
                    log.warning("inference server %d: cannot write %s (%s); a restart's TensorBoard steps "
                                "will start again at 0", self.server_id, self.progress, e)
                    self.progress = None
            for k, v in line.items():
                self.writer.add_scalar(f"inference{self.server_id}/{k}", v, step)
            self.writer.add_scalar(f"inference{self.server_id}/max_batch", self.max_batch, step)
            self.writer.add_scalar(f"inference{self.server_id}/max_wait_ms", 1000 * self.max_wait_s, step)
        self._window = {"batches": 0, "envs": 0, "requests": 0, "forward_s": 0.0, "max_envs": 0}
        self._last_log = now


# ---------------------------------------------------------------------------------------- actors' side
MAX_IN_FLIGHT = 16        # an actor's requests in flight at once, at most (actors.server_splits' bound)


@dataclass
class _Pending:
    """A request in flight: what it asked, its frames (sent again to a restarted server), by when
    its reply must come, and the server incarnation that has it."""
    kind: str
    n: int
    frames: list
    deadline: float
    sent_to: str | None = None
    not_before: float = 0.0      # the server was busy: not sent again before this (time.monotonic)


class RemotePolicy:
    """The acting policy as an actor sees it with ``actors.inference: server``: each call sends the
    observations to the server and waits for the reply. What the collector needs of a policy:
    ``__call__(td)`` (with ``policy_version`` per env in the result: the version that acted),
    ``get_value(td)``, ``critic`` and ``device``.

    Args:
        ctx: the actor's ZeroMQ context.
        path: the server's endpoint file (:func:`endpoint_path`).
        actor_id: ours.
        with_value: whether the policy has a critic (replies carry ``value``).
        should_stop: asked while waiting; True raises :class:`InferenceStopped`.
        timeout_s: seconds without any reply before :class:`InferenceUnavailable`.
        curve: a CurveClient, or None.
    """

    stamps_versions = True

    def __init__(self, ctx: zmq.Context, path: Path, actor_id: int, with_value: bool, base_digest: str = "",
                 should_stop: Callable[[], bool] = lambda: False, timeout_s: float = 120.0, curve=None):
        self.ctx, self.path, self.actor_id = ctx, Path(path), actor_id
        self.critic = True if with_value else None
        self.base_digest = base_digest           # the server's frozen base: stamped on our rollouts
        self.synced: list[list] = []             # [[version, received at the server, first acted]]
        self.device = torch.device("cpu")
        self.should_stop, self.timeout_s, self.curve = should_stop, timeout_s, curve
        self.sock: zmq.Socket | None = None
        self.server: dict | None = None         # the endpoint file we are connected by
        self.min_version = -1                    # asked of the next act request only
        self.min_incarnation: str | None = None  # the learner life of min_version (None: our last reply's)
        self.version, self.incarnation, self.received_at = -1, None, 0.0
        self._rid = 0
        self._pending: dict[int, _Pending] = {}  # requests sent (or to send), not answered yet
        self._ready: dict[int, tuple] = {}      # answered, not taken by result() yet
        self._next_check = 0.0                   # when to look at the endpoint file again
        self.busy_replies = 0                    # requests the server's full queue sent back (sent again)

    @classmethod
    def connect(cls, ctx: zmq.Context, path: Path, actor_id: int, timeout_s: float, curve=None,
                stop=None) -> RemotePolicy | None:
        """Wait (up to `timeout_s`, or until `stop` is set: None) for the server's endpoint file, and
        a RemotePolicy for it (whether the policy has a critic and its base digest come from there)."""
        deadline = time.monotonic() + timeout_s
        while True:
            info = read_endpoint(Path(path))
            if info is not None:
                return cls(ctx, path, actor_id, with_value=bool(info.get("critic")),
                           base_digest=str(info.get("base_digest", "")), timeout_s=timeout_s, curve=curve)
            if stop is not None and stop.is_set():
                return None
            if time.monotonic() > deadline:
                raise TimeoutError(f"{path}: no inference server after {timeout_s:.0f} s (actors.inference "
                                   f"\"server\": does the launcher start it?)")
            time.sleep(0.05)

    def __call__(self, td: TensorDictBase) -> TensorDict:
        return self.result(self.submit("act", td))

    def get_value(self, td: TensorDictBase) -> torch.Tensor:
        return self.result(self.submit("value", td))[keys.VALUE]

    def parameters(self):   # the collector asks where the policy runs: on the server, outputs come to us here
        yield torch.empty(0)

    # -------------------------------------------------------------- requests in flight
    def submit(self, kind: str, td: TensorDictBase) -> int:
        """Send a request ("act" or "value") for the observations in `td` without waiting for its
        reply; returns its id for :meth:`result`. Several may be in flight (``actors.server_splits``):
        replies are kept until asked for, and all of them are sent again to a restarted server."""
        self._rid += 1
        rid = self._rid
        obs = td.get(keys.OBS)
        leaves = ([((keys.OBS, *(k if isinstance(k, tuple) else (k,))), v)
                   for k, v in obs.items(include_nested=True, leaves_only=True)]
                  if isinstance(obs, TensorDictBase) else [((keys.OBS,), obs)])
        meta = {"kind": kind, "actor": self.actor_id, "id": rid}
        if kind == "act" and self.min_version >= 0:
            meta["min_version"] = self.min_version
            incarnation = self.min_incarnation or self.incarnation   # the life min_version counts in
            if incarnation is not None:
                meta["incarnation"] = incarnation
            if self.min_incarnation is not None:   # the learner's life now: wait for its weights
                meta["same_life"] = True
        frames = wire.encode_leaves([td.batch_size[0]], leaves, **meta)   # the codec copies device tensors to the CPU
        self._pending[rid] = _Pending(kind, td.batch_size[0], frames, time.monotonic() + self.timeout_s)
        self._send_pending()
        return rid

    def result(self, rid: int) -> TensorDict:
        """The reply to request `rid` (:meth:`submit`), waiting for it: ``action``, ``log_prob``
        (``value`` with a critic) and ``policy_version`` per env for "act", ``value`` for "value".
        Raises :class:`InferenceStopped` when `should_stop` says so while waiting,
        :class:`InferenceUnavailable` after `timeout_s` without its reply, and
        :class:`InferenceRefused` when the server's policy failed on these observations."""
        while rid not in self._ready:
            if rid not in self._pending:
                raise KeyError(f"request {rid}: not in flight (already taken, or cancelled)")
            if self.should_stop():
                raise InferenceStopped()
            self._send_pending()
            if time.monotonic() > self._pending[rid].deadline:
                raise InferenceUnavailable(f"no reply from the inference server ({self.path}) for "
                                           f"{self.timeout_s:.0f} s")
            if self.sock is not None and self.sock.poll(50):
                self._take_reply(self.sock.recv_multipart(copy=False))
        out, kind = self._ready.pop(rid)
        if kind == "error":
            raise InferenceRefused(f"the inference server ({self.path}) could not act on request {rid}: {out}")
        if kind == "act":
            self.min_version, self.min_incarnation = -1, None   # asked of a rollout's first requests only
        return out

    def cancel(self) -> None:
        """Forget every request in flight: replies that come for them later are dropped."""
        self._pending.clear()
        self._ready.clear()

    def _send_pending(self) -> None:
        """(Re)connect to a (re)started server when its endpoint file says so, and send every
        request in flight that this incarnation of the server has not had yet."""
        now = time.monotonic()
        if now >= self._next_check or self.sock is None:   # a broken Unix connection too: at most once a check
            self._next_check = now + ENDPOINT_CHECK_S
            info = read_endpoint(self.path)
            if info is not None and (self.server is None or info["incarnation"] != self.server["incarnation"]
                                     or getattr(self.sock, "broken", False)):
                self._connect(info)
        if self.sock is None:
            return
        for p in self._pending.values():
            if p.sent_to != self.server["incarnation"] and p.not_before <= now:
                try:
                    self.sock.send_multipart(p.frames, flags=zmq.NOBLOCK)
                    p.sent_to = self.server["incarnation"]
                except zmq.Again:
                    return
                except zmq.ZMQError:
                    if not getattr(self.sock, "broken", False):
                        raise
                    return               # the Unix connection broke: reconnected at the next check

    def _take_reply(self, reply: list) -> None:
        """Check a reply and keep it for its request; a reply to no request in flight (sent before a
        restart, or cancelled) is dropped."""
        try:
            batch, outs, rmeta = wire.decode_leaves(reply)
        except wire.WireError as e:
            log.warning("actor %d: a malformed reply from the inference server: %s", self.actor_id, e)
            return
        rid = rmeta.get("id")
        p = self._pending.get(rid) if _is_int(rid) else None
        if p is None:
            return
        if rmeta.get("kind") == "busy":   # the server's queue was full: send it again after a pause
            p.sent_to, p.not_before = None, time.monotonic() + BUSY_RETRY_S
            self.busy_replies += 1
            return
        if rmeta.get("kind") == "error":
            why = rmeta.get("why")
            del self._pending[rid]
            self._ready[rid] = (why[:500] if isinstance(why, str) else "no reason given", "error")
            return
        version = rmeta.get("version")
        if not (_is_int(version) and version >= 0) or batch != [p.n] or any(len(k) != 1 for k in outs):
            log.warning("actor %d: a reply without a valid version, of the wrong size or nested", self.actor_id)
            return
        del self._pending[rid]
        # the tensors alias the received frames, which are ours alone (no copy needed)
        out = TensorDict({k[0]: t for k, t in outs.items()}, batch_size=[p.n])
        if p.kind == "act":
            incarnation = rmeta.get("incarnation") if isinstance(rmeta.get("incarnation"), str) else None
            received = rmeta.get("received")
            received = float(received) if isinstance(received, (int, float)) else time.time()
            if version != self.version or incarnation != self.incarnation:   # the first action with it
                self.synced.append([version, received, time.time()])
            self.version, self.incarnation, self.received_at = version, incarnation, received
            out.set(keys.POLICY_VERSION, torch.full((p.n,), version, dtype=torch.int64))
        self._ready[rid] = (out, p.kind)

    # -------------------------------------------------------------- the connection
    def _connect(self, info: dict) -> None:
        if self.sock is not None:
            self.sock.close(linger=0)
        for p in self._pending.values():   # a new connection has had none of them
            p.sent_to = None
        self.server = info
        unix = info.get("unix")
        if isinstance(unix, str) and info.get("host") == socket.gethostname():
            try:   # the server on this host: its Unix socket (actors/unix_channel.py), else its ZeroMQ one
                self.sock = UnixDealer(Path(unix))
                return
            except OSError as e:
                log.info("actor %d: the inference server's Unix socket %s refused (%s); using %s",
                         self.actor_id, unix, e, info["endpoint"])
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.SNDHWM, 4 + MAX_IN_FLIGHT)
        self.sock.setsockopt(zmq.RCVHWM, 4 + MAX_IN_FLIGHT)
        if self.curve is not None:
            self.curve.apply(self.sock)
        self.sock.connect(info["endpoint"])

    def close(self) -> None:
        if self.sock is not None:
            self.sock.close(linger=0)
            self.sock = None


# ---------------------------------------------------------------------------------------- the process
def bind_router(ctx: zmq.Context, host: str, path: Path, curve=None, max_bytes: int | None = None
                ) -> tuple[zmq.Socket, str]:
    """A ROUTER socket for the server, on the port of the previous incarnation when it is free.
    `max_bytes`: the largest frame a request can hold (:attr:`RequestChecker.max_bytes`); ZeroMQ
    disconnects a peer that sends more before any of it is buffered whole."""
    from shared.transport import bind
    sock = ctx.socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 0)
    if max_bytes is not None:   # set before the bind: every connection, however early, has the limit
        sock.setsockopt(zmq.MAXMSGSIZE, max_bytes)
    sock.setsockopt(zmq.ROUTER_MANDATORY, 1)    # an unroutable reply raises instead of vanishing
    sock.setsockopt(zmq.SNDHWM, 64)
    sock.setsockopt(zmq.RCVHWM, 256)
    if curve is not None:
        curve.apply(sock)
    old = read_endpoint(path)
    if old is not None:
        try:
            port = int(old["endpoint"].rsplit(":", 1)[1])
            return sock, bind(sock, host, port)
        except (ValueError, zmq.ZMQError):
            pass
    return sock, bind(sock, host, 0)


def write_endpoint(path: Path, endpoint: str, critic: bool, base_digest: str, unix: Path | None = None) -> str:
    """Announce a server to its actors (atomically); returns its new incarnation. `unix`: the Unix
    socket it also listens on (actors on this host use it)."""
    incarnation = uuid.uuid4().hex[:12]
    info = {"endpoint": endpoint, "incarnation": incarnation, "pid": os.getpid(), "critic": critic,
            "base_digest": base_digest}
    if unix is not None:
        info.update(unix=str(unix), host=socket.gethostname())
    write_json_atomic(path, info)
    return incarnation


def progress_path(run_dir: str | Path, server_id: int) -> Path:
    """Server `server_id`'s TensorBoard step across its incarnations (:class:`InferenceServer` ``progress``)."""
    return Path(run_dir) / "inference" / f"server_{server_id}.progress.json"


def read_progress(path: Path) -> int:
    """The batches an earlier incarnation logged (0 when there is none, or the file is not what we write)."""
    try:
        batches = json.loads(path.read_text()).get("batches")
    except (OSError, ValueError, AttributeError):
        return 0
    return batches if isinstance(batches, int) and not isinstance(batches, bool) and batches >= 0 else 0


def run_server_process(cfg: Config, server_id: int, run_dir: Path, learner_timeout_s: float = 120.0,
                       endpoints_path: Path | None = None, device: str | None = None) -> int:
    """Entry point of one inference server process: the policy on its device (`device`, else its
    entry of :func:`server_devices`), the learner's weights (from `endpoints_path`, else the run
    directory's endpoints.json), the actors' requests, until the learner ends the run (or SIGTERM)."""
    import signal
    import threading

    from actors.emulated_device import EmulatedInference
    from actors.weights_loader import WeightsLoader
    from shared.envs import env_spec
    from shared.instructions import instruction_tokenizer  # noqa: F401  (the VLA envs' import order)
    from shared.policies import frozen_digest, has_critic, make_policy
    from shared.security import client_from_config, server_from_config
    from shared.transport import DrainingSubscriber, WeightsSubscriber, read_endpoints

    torch.set_num_threads(cfg.actors.torch_threads)
    if cfg.actors.nice:   # an acting process like the actors it serves: the learner's update goes first
        os.nice(cfg.actors.nice)
    stop = threading.Event()
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    device = torch.device(device or server_devices(cfg)[server_id])
    torch.manual_seed(cfg.trainer.seed * 7919 + 104729 + server_id)
    endpoints = read_endpoints(endpoints_path or Path(run_dir) / "endpoints.json", timeout_s=learner_timeout_s)
    spec = env_spec(cfg.env.id, cfg.env.cfg)
    policy = make_policy(cfg, spec).to(device).eval()
    loader = WeightsLoader(policy, device, cfg.actors, frozen_digest(policy), f"inference server {server_id}")
    a = cfg.actors
    acting = (EmulatedInference(policy, a.inference_latency_s, per_env_s=a.inference_latency_per_env_s)
              if a.inference_latency_s or a.inference_latency_per_env_s else policy)
    curve_server, curve_client = server_from_config(cfg), client_from_config(cfg)
    ctx = zmq.Context()
    if curve_server is not None:
        curve_server.start(ctx)
    sub = WeightsSubscriber(ctx, endpoints["weights"], curve=curve_client)
    path = endpoint_path(run_dir, server_id)
    max_bytes = RequestChecker(spec, a.num_envs, []).max_bytes   # the bound the server's checker applies
    sock, endpoint = bind_router(ctx, "127.0.0.1", path, curve_server, max_bytes)
    writer = None
    try:
        from torch.utils.tensorboard import SummaryWriter
        writer = SummaryWriter(str(run_dir), filename_suffix=f".inference{server_id}")
    except Exception as e:   # TensorBoard is optional for the server: its progress lines still say it all
        log.warning("inference server %d: no TensorBoard events (%s)", server_id, e)
    # from here on, read while a forward pass runs: no weights message is dropped (the seconds before
    # hold no forward pass, and the first weights come again to a subscriber that joins)
    weights = DrainingSubscriber(sub)
    server = InferenceServer(cfg, server_id, acting, loader, weights, sock, spec, stop, writer, expire_s=learner_timeout_s,
                             progress=progress_path(run_dir, server_id))
    ended = False   # by its loop; else by an exception, whose last error replies must still go out
    try:   # from the Unix socket on: whatever fails, the finally below closes what was opened
        unix = None
        if a.server_transport == "unix":   # the actors on this host: a Unix socket (actors/unix_channel.py)
            try:
                channels = ServerChannels(sock, socket_path(run_dir, server_id), server.checker.max_bytes,
                                          on_broken=lambda route, why: server._refuse("malformed", route, why))
                sock = server.sock = channels
                unix = channels.path
            except OSError as e:   # a directory not ours, a path too long, ...: every actor on ZeroMQ
                log.warning("inference server %d: no Unix socket at %s (%s); the actors use %s", server_id,
                            socket_path(run_dir, server_id), e, endpoint)
        incarnation = write_endpoint(path, endpoint, has_critic(policy), loader.base_digest, unix)
        log.info("inference server %d on %s for actors %s at %s (incarnation %s): batches of up to %d envs, "
                 "%.1f ms wait", server_id, device, server.actors, endpoint, incarnation, server.max_batch,
                 1000 * server.max_wait_s)
        rc = server.run()
        ended = True
        return rc
    finally:
        b = max(1, server.counts["batches"])
        c = server.counts
        log.info("inference server %d: stopping after %d batches (%.1f envs from %.2f requests each, %.1f ms "
                 "per batch); requests "
                 "refused: %d malformed, %d busy (sent again), %d undeliverable, %d failed, %d expired; asked the learner again "
                 "for weights %d times", server_id, c["batches"], c["envs"] / b, c["replies"] / b,
                 1000 * server.forward_total_s / b, c["malformed"],
                 c["busy"], c["undeliverable"], c["failed"], c["expired"], c["asked"])
        if isinstance(sock, ServerChannels):
            log.info("inference server %d: %d actor connections over its Unix socket", server_id, sock.accepted)
        if device.type == "cuda":   # where the server's device memory goes: the caching allocator's peaks
            log.info("inference server %d: peak device memory %.0f MiB allocated, %.0f MiB reserved", server_id,
                     torch.cuda.max_memory_allocated(device) / 2**20, torch.cuda.max_memory_reserved(device) / 2**20)
        if writer is not None:
            writer.close()
        loader.close()
        drained = weights.close()
        if drained:
            sub.close()
        # a device left unusable refused its batch's requests just before the exception: ZeroMQ sends
        # them from its I/O thread, so give it half a second (the Unix socket's are in the kernel already)
        sock.close(linger=0 if ended else 500)
        if curve_server is not None:
            curve_server.stop()
        if drained:
            ctx.term()
        else:   # its reader is stuck in the socket: the process ends without waiting on it
            log.warning("inference server %d: the weights socket's reader did not stop", server_id)


def main(argv: list[str] | None = None) -> int:
    """``python -m actors.inference --config C --server-id S --run-dir D [--set K=V ...]``."""
    import argparse
    import sys

    from shared.config import ConfigError, load_config
    from shared.console import dump_stacks_on_signal
    p = argparse.ArgumentParser(prog="python -m actors.inference", description=main.__doc__)
    p.add_argument("--config", required=True)
    p.add_argument("--server-id", type=int, required=True, help="which server: index into server_devices (the distinct "
                   "actors.devices, each actors.servers_per_device times)")
    p.add_argument("--run-dir", type=Path, required=True, help="the run directory (the server's endpoint file "
                   "goes there, where its actors look for it)")
    p.add_argument("--endpoints", type=Path, help="the learner's endpoints.json (default: RUN_DIR/endpoints.json)")
    p.add_argument("--device", help="the device instead of the config's (a Ray bundle's GPU is cuda:0)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument("--learner-timeout", type=float, default=120.0)
    args = p.parse_args(argv)
    dump_stacks_on_signal()
    logging.basicConfig(level=logging.INFO, format=f"[inference {args.server_id}] %(message)s")
    try:
        cfg = load_config(args.config, args.set)
    except ConfigError as e:
        print(e, file=sys.stderr)
        return 2
    n = len(server_devices(cfg))
    if not 0 <= args.server_id < n:
        print(f"--server-id {args.server_id}: must be in 0..{n - 1} (the distinct actors.devices of {args.config}, "
              f"each actors.servers_per_device times)",
              file=sys.stderr)
        return 2
    try:
        return run_server_process(cfg, args.server_id, args.run_dir, args.learner_timeout, args.endpoints,
                                  args.device)
    except TimeoutError as e:
        print(e, file=sys.stderr)
        return 1


if __name__ == "__main__":
    from shared.teardown import exit_now
    exit_now(main())
