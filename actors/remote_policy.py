"""The acting policy as a server-mode actor sees it (``actors.inference: server``).

:class:`RemotePolicy` sends the actor's observations to its device's inference server
(:mod:`actors.inference`) and waits for the actions, log-probs, values and the version that acted.
It reaches a server on its own host: through the server's Unix socket (:mod:`actors.unix_channel`)
where it can open it, else through its ZeroMQ socket (loopback). Several requests may be in flight at
once (``actors.server_splits``); a restarted server is found by its endpoint file's new incarnation
(:mod:`actors.inference_topology`) and gets every request in flight again.
"""

from __future__ import annotations

import logging
import socket
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
import zmq
from tensordict import TensorDict, TensorDictBase

from actors.inference_requests import is_int
from actors.inference_topology import layout_from_json, read_endpoint
from actors.unix_channel import UnixDealer
from shared import keys, wire

log = logging.getLogger("tandem.inference")

ENDPOINT_CHECK_S = 1.0    # how often a waiting actor looks for a restarted server
BUSY_RETRY_S = 0.05       # an actor whose request found the server's queue full sends it again after this
                          # (up to one poll, 50 ms, later)
MAX_IN_FLIGHT = 16        # an actor's requests in flight at once, at most (actors.server_splits' bound)


class InferenceStopped(Exception):
    """The actor was asked to stop while it waited for the server."""


class InferenceRefused(Exception):
    """The server could not act on this actor's observations (its policy raised on them): the
    actor ends, as it would with ``local``, and the launcher starts it again with fresh envs."""


class InferenceUnavailable(Exception):
    """No reply from the inference server for the actor's learner timeout."""


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
        path: the server's endpoint file (:func:`~actors.inference_topology.endpoint_path`).
        actor_id: ours.
        with_value: whether the policy has a critic (replies carry ``value``).
        should_stop: asked while waiting; True raises :class:`InferenceStopped`.
        timeout_s: seconds without any reply before :class:`InferenceUnavailable`.
        curve: a CurveClient, or None.
    """

    stamps_versions = True
    chunk_size, actions_per_call = 1, 1        # an action-chunk policy's, from the server's endpoint file
    extras: dict = {}

    def rollout_extras(self) -> dict:
        """The server's policy's extra rollout tensors (shared/chunks.py)."""
        return dict(self.extras)

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
                remote = cls(ctx, path, actor_id, with_value=bool(info.get("critic")),
                             base_digest=str(info.get("base_digest", "")), timeout_s=timeout_s, curve=curve)
                remote.chunk_size, remote.actions_per_call, remote.extras = layout_from_json(info.get("layout"))
                return remote
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
        p = self._pending.get(rid) if is_int(rid) else None
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
        if not (is_int(version) and version >= 0) or batch != [p.n] or any(len(k) != 1 for k in outs):
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
