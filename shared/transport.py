"""ZeroMQ sockets for both sides, framed by :mod:`shared.wire`. No pickle anywhere.

Learner: a PULL socket receives rollouts (and evaluation results); an XPUB socket publishes
weights. XPUB tells the learner when a subscriber joins, so a late actor gets the current weights
at once instead of waiting for the next update. Actors: PUSH and SUB.

Every socket here has a bounded linger and high-water marks, so closing never hangs and memory
stays bounded when one side outruns the other.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

import zmq
from tensordict import TensorDictBase

from shared import wire
from shared.files import write_json_atomic

LINGER_MS = 1000


def _socket(ctx: zmq.Context, kind: int, **opts: int) -> zmq.Socket:
    s = ctx.socket(kind)
    s.setsockopt(zmq.LINGER, LINGER_MS)
    for name, value in opts.items():
        s.setsockopt(getattr(zmq, name), value)
    return s


def bind(sock: zmq.Socket, host: str, port: int, advertise: str = "") -> str:
    """Bind ``tcp://host:port`` (port 0: a free one) and return the address actors should use:
    ``tcp://advertise:port``, or ``tcp://host:port`` when `advertise` is empty (``learner.advertise_host``:
    a bind address such as 0.0.0.0 is not one a peer can dial)."""
    if port:
        sock.bind(f"tcp://{host}:{port}")
    else:
        port = sock.bind_to_random_port(f"tcp://{host}")
    return f"tcp://{advertise or host}:{port}"


def write_endpoints(run_dir: Path, rollouts: str, weights: str, **extra: Any) -> Path:
    return write_json_atomic(Path(run_dir) / "endpoints.json",
                             {"rollouts": rollouts, "weights": weights, "pid": os.getpid(), **extra})


def read_endpoints(path: Path, timeout_s: float = 120.0) -> dict[str, str]:
    """Wait for ``endpoints.json`` (the learner writes it when its sockets are bound) and read it."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            data = json.loads(Path(path).read_text())
            out = {"rollouts": data["rollouts"], "weights": data["weights"]}
            if isinstance(data.get("rollouts_by_rank"), list) and data["rollouts_by_rank"]:
                out["rollouts_by_rank"] = [str(x) for x in data["rollouts_by_rank"]]
            if isinstance(data.get("rollout_ring"), str):   # actors.rollout_transport "ring"
                out["rollout_ring"] = data["rollout_ring"]
            return out
        except (FileNotFoundError, json.JSONDecodeError, KeyError):
            if time.monotonic() > deadline:
                raise TimeoutError(f"{path}: no learner endpoints after {timeout_s:.0f} s "
                                   f"(is the learner running with this run directory?)") from None
            time.sleep(0.05)


# Every message on the weights socket starts with a one-byte topic frame, then the wire frames:
# WEIGHTS_TOPIC for weights (the tensors), CONTROL_TOPIC for a header alone (stop, credits). A
# subscriber that needs no weights (an actor whose inference server takes them) subscribes to the
# control topic only, and the publisher never sends it the tensors (XPUB filters per subscriber).
WEIGHTS_TOPIC, CONTROL_TOPIC = b"w", b"c"


class WeightsPublisher:
    """XPUB socket: publishes weights, re-sends the latest to every new subscriber.

    Once a control-only subscriber has joined, every weights message that carries per-actor credits
    (``consumed``) is followed by a control message with the credits and the learner's incarnation
    alone, so that such subscribers have them too (``lag_policy: "pace"``). The newest credits, from
    a weights message or a credit message, are kept and re-sent whenever anyone joins; the newest
    weights are re-sent only when a subscriber to the weights joins."""

    def __init__(self, ctx: zmq.Context, host: str, port: int = 0, curve: Any = None, advertise: str = ""):
        self.sock = _socket(ctx, zmq.XPUB, SNDHWM=8, XPUB_VERBOSE=1)
        if curve is not None:      # a shared.security.CurveServer
            curve.apply(self.sock)
        self.endpoint = bind(self.sock, host, port, advertise)
        self._last: list | None = None
        self._last_credit: list | None = None
        self.subscribers_seen = 0
        self.control_only_seen = False

    def publish(self, td: TensorDictBase, **meta: Any) -> None:
        self._last = [WEIGHTS_TOPIC, *wire.encode(td, **meta)]
        self.sock.send_multipart(self._last, copy=False)
        if "consumed" in meta:   # kept for control-only subscribers who join later, sent to those already here
            self._last_credit = self._control(kind="credit", consumed=meta["consumed"], version=meta.get("version"),
                                              incarnation=meta.get("incarnation"), time=meta.get("time"))
            if self.control_only_seen:
                self.sock.send_multipart(self._last_credit)

    def send_control(self, **meta: Any) -> None:
        frames = self._control(**meta)
        if meta.get("kind") == "credit":
            self._last_credit = frames
        self.sock.send_multipart(frames)

    @staticmethod
    def _control(**meta: Any) -> list:
        from tensordict import TensorDict
        return [CONTROL_TOPIC, *wire.encode(TensorDict({}, []), **meta)]

    def serve_subscriptions(self) -> int:
        """Handle pending subscribe events: re-send the newest weights if a subscriber to them joined,
        and the newest credits if anyone did."""
        joined, weights_joined = 0, False
        while self.sock.poll(0):
            msg = self.sock.recv()
            if msg[:1] == b"\x01":
                joined += 1
                if msg[1:] == CONTROL_TOPIC:
                    self.control_only_seen = True
                else:                         # b"" (everything) or the weights topic
                    weights_joined = True
        if weights_joined and self._last is not None:
            self.sock.send_multipart(self._last, copy=False)
        if joined and self._last_credit is not None:
            self.sock.send_multipart(self._last_credit)
        self.subscribers_seen += joined
        return joined

    def close(self) -> None:
        self.sock.close(linger=LINGER_MS)


class WeightsSubscriber:
    """SUB socket on the learner's weights; :meth:`newest` drains and keeps only the last message.
    `weights` False: control messages only (stop, credits), never the tensors."""

    def __init__(self, ctx: zmq.Context, endpoint: str, curve: Any = None, weights: bool = True):
        self.sock = _socket(ctx, zmq.SUB, RCVHWM=4)
        if curve is not None:      # a shared.security.CurveClient
            curve.apply(self.sock)
        self.sock.setsockopt(zmq.SUBSCRIBE, b"" if weights else CONTROL_TOPIC)
        self.sock.connect(endpoint)
        self.consumed: list | None = None
        self.consumed_from: str | None = None   # the learner incarnation that counted `consumed`
        # (version, incarnation): the newest version the learner has announced, by weights or credit
        self.announced: tuple[int, str | None] | None = None

    def newest(self, timeout_ms: int = 0) -> tuple[TensorDictBase, dict] | None:
        """The newest weights (or stop) message that arrived (waiting up to `timeout_ms` for the
        first), decoded; or None. Malformed messages are skipped (the learner is trusted, but a bug
        must not kill actors). The learner's per-actor ``consumed`` counts, carried by weights and
        ``credit`` messages, are kept in :attr:`consumed` (for ``lag_policy: "pace"``), and the newest
        version either names in :attr:`announced` (what a paced actor asks its inference server for)."""
        latest = None
        if not self.sock.poll(timeout_ms):
            return None
        while self.sock.poll(0):
            frames = self.sock.recv_multipart(copy=False)
            if len(frames) < 2 or frames[0].bytes not in (WEIGHTS_TOPIC, CONTROL_TOPIC):
                continue
            try:
                td, meta = wire.decode(frames[1:])
            except wire.WireError:
                continue
            inc = meta.get("incarnation")
            inc = inc if isinstance(inc, str) else None
            if isinstance(meta.get("consumed"), list):
                self.consumed, self.consumed_from = meta["consumed"], inc
            version = meta.get("version")
            if isinstance(version, int) and not isinstance(version, bool) and version >= 0:
                self.announced = (version, inc)
            if meta.get("kind") == "stop":
                return td, meta  # a stop request wins over any weights queued before it
            if meta.get("kind") == "credit":
                continue
            latest = (td, meta)
        return latest

    def close(self) -> None:
        self.sock.close(linger=0)


class DrainingSubscriber:
    """A :class:`WeightsSubscriber` emptied by a thread of its own, for a holder that may not look at
    it for seconds (an inference server in a long forward pass). ZeroMQ drops new messages once a
    subscriber's queues are full, and the learner's credits alone can fill them in a few seconds: a
    weights message dropped so is a version the holder never loads, and the actors that asked for
    it (lag_policy pace, standard mode) would wait for it until their timeout. Here the socket is
    read as messages come; :meth:`newest` hands over the newest weights message (a stop wins), as
    :meth:`WeightsSubscriber.newest` does for what queued since the last call. The socket belongs to
    the thread until :meth:`close`.

    Decoding happens in the thread too (``wire.decode`` views the frames; nothing is loaded here).
    """

    def __init__(self, sub: WeightsSubscriber, poll_ms: int = 50):
        import threading
        self.sub, self.poll_ms = sub, poll_ms
        self._lock = threading.Lock()
        self._ready = threading.Condition(self._lock)
        self._msg: tuple[TensorDictBase, dict] | None = None
        self._error: BaseException | None = None   # what ended the thread: raised to the holder
        self._closing = threading.Event()
        self._thread = threading.Thread(target=self._run, name="weights-drain", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            while not self._closing.is_set():
                msg = self.sub.newest(self.poll_ms)
                if msg is None:
                    continue
                with self._ready:
                    if self._msg is None or self._msg[1].get("kind") != "stop":   # a stop is never replaced
                        self._msg = msg
                    self._ready.notify_all()
        except BaseException as e:   # the socket failed: the holder must hear of it, not wait for weights
            with self._ready:
                self._error = e
                self._ready.notify_all()

    def newest(self, timeout_ms: int = 0) -> tuple[TensorDictBase, dict] | None:
        """The newest message since the last call (a stop stays), or None; raises what ended the thread."""
        with self._ready:
            if self._msg is None and self._error is None and timeout_ms > 0:
                self._ready.wait(timeout_ms / 1000)
            if self._error is not None and self._msg is None:
                raise RuntimeError(f"the weights socket's reader failed: {self._error!r}") from self._error
            msg = self._msg
            if msg is not None and msg[1].get("kind") != "stop":
                self._msg = None
            return msg

    def close(self) -> bool:
        """Stop the thread (within one poll). True when it has stopped: the socket is then the
        caller's to close (while it runs, closing it from another thread is not safe)."""
        self._closing.set()
        self._thread.join(timeout=5)
        return not self._thread.is_alive()


class RolloutPusher:
    """PUSH socket to the learner. Sends without copying and tracks when ZeroMQ is done with the
    memory, so the caller never overwrites a rollout that is still being sent."""

    def __init__(self, ctx: zmq.Context, endpoint: str, hwm: int = 4, curve: Any = None):
        self.sock = _socket(ctx, zmq.PUSH, SNDHWM=hwm)
        if curve is not None:      # a shared.security.CurveClient
            curve.apply(self.sock)
        self.sock.connect(endpoint)

    def send(self, frames: list, timeout_ms: int) -> zmq.MessageTracker | None:
        """Send, waiting at most `timeout_ms` for room in the queue. Returns the tracker, or None
        if the queue stayed full (the learner is gone or far behind)."""
        if not self.sock.poll(timeout_ms, zmq.POLLOUT):
            return None
        return self.sock.send_multipart(frames, copy=False, track=True)

    def close(self) -> None:
        self.sock.close(linger=LINGER_MS)
