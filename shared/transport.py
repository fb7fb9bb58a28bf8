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
import re
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
# A subscriber that has waited RESEND_AFTER_S for what the learner should have sent it asks again, by
# a subscription no message matches (ZeroMQ drops messages past a high-water mark, silently):
# ASK_WEIGHTS + b"<version> <incarnation>" (what it holds) has the newest weights re-sent if they are
# newer or of another learner life, and the newest credits; ASK_CREDIT has the credits alone re-sent.
# The learner answers asks at most every RESEND_AFTER_S (weights may be gigabytes, and every weights
# subscriber gets them), and never with weights it published under RESEND_AFTER_S ago (an ask sent
# while they were on the way is not a loss).
ASK_WEIGHTS, ASK_CREDIT = b"w?", b"c?"
RESEND_AFTER_S = 5.0
_ASK = re.compile(rb"(-1|0|[1-9][0-9]{0,17})(?: ([!-~]{1,64}))?")


def parse_ask(payload: bytes) -> tuple[int, str | None] | None:
    """``b"<version> <incarnation>"`` of an :data:`ASK_WEIGHTS` subscription, or None if malformed."""
    m = _ASK.fullmatch(payload)
    if m is None:
        return None
    return int(m.group(1)), (m.group(2).decode("ascii") if m.group(2) else None)


def ask_topic(version: int, incarnation: str | None) -> bytes:
    """The :data:`ASK_WEIGHTS` subscription of a subscriber holding `version` of learner life `incarnation`."""
    named = incarnation is not None and 0 < len(incarnation) <= 64 and all("!" <= c <= "~" for c in incarnation)
    return ASK_WEIGHTS + str(max(-1, int(version))).encode() + (b" " + incarnation.encode() if named else b"")


class WeightsPublisher:
    """XPUB socket: publishes weights, re-sends the latest to every new subscriber.

    Once a control-only subscriber has joined, every weights message that carries per-actor credits
    (``consumed``) is followed by a control message with the credits and the learner's incarnation
    alone, so that such subscribers have them too (``lag_policy: "pace"``). The newest credits, from
    a weights message or a credit message, are kept and re-sent whenever anyone joins; the newest
    weights are re-sent only when a subscriber to the weights joins, or when a subscriber asks for
    them holding an older version (:data:`ASK_WEIGHTS`: a weights message it lost)."""

    def __init__(self, ctx: zmq.Context, host: str, port: int = 0, curve: Any = None, advertise: str = ""):
        self.sock = _socket(ctx, zmq.XPUB, SNDHWM=8, XPUB_VERBOSE=1)
        if curve is not None:      # a shared.security.CurveServer
            curve.apply(self.sock)
        self.endpoint = bind(self.sock, host, port, advertise)
        self._last: list | None = None
        self._last_id: tuple[Any, Any] = (None, None)   # (version, incarnation) of _last
        self._last_credit: list | None = None
        self._resent_at = self._published_at = float("-inf")
        self._asked_weights = self._asked_credit = False   # asks not answered yet (answered at most every RESEND_AFTER_S)
        self.subscribers_seen = 0
        self.control_only_seen = False
        # asks (ASK_WEIGHTS, ASK_CREDIT) received, malformed ones among them, and weights re-sent for them
        self.asks = {"asks": 0, "malformed": 0, "weights_resent": 0}

    def publish(self, td: TensorDictBase, **meta: Any) -> None:
        self._last = [WEIGHTS_TOPIC, *wire.encode(td, **meta)]
        self._last_id = (meta.get("version"), meta.get("incarnation"))
        self._published_at = time.monotonic()
        self._asked_weights = False       # these are the newest: what was asked before is answered
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
        """Handle pending subscribe events: re-send the newest weights if a subscriber to them joined
        or asked for them holding an older version, and the newest credits if anyone joined or asked.
        Asks are answered at most every :data:`RESEND_AFTER_S`. Returns how many joined."""
        joined, weights_joined = 0, False
        while self.sock.poll(0):
            msg = self.sock.recv()
            if msg[:1] != b"\x01":              # an unsubscription
                continue
            topic = msg[1:]
            if topic.startswith(ASK_CREDIT):
                self.asks["asks"] += 1
                self._asked_credit = True
            elif topic.startswith(ASK_WEIGHTS):
                self.asks["asks"] += 1
                held = parse_ask(topic[len(ASK_WEIGHTS):])
                if held is None:
                    self.asks["malformed"] += 1
                    continue
                self._asked_credit = True
                self._asked_weights = self._asked_weights or self._older_than_last(*held)
            else:
                joined += 1
                if topic == CONTROL_TOPIC:
                    self.control_only_seen = True
                else:                             # b"" (everything) or the weights topic
                    weights_joined = True
        now = time.monotonic()
        due = (self._asked_credit or self._asked_weights) and now - self._resent_at >= RESEND_AFTER_S
        # weights published since the ask went out, or under RESEND_AFTER_S ago, answer it themselves
        weights_asked = due and self._asked_weights and now - self._published_at >= RESEND_AFTER_S
        if due:
            self._resent_at = now
            self._asked_credit = self._asked_weights = False
        if (weights_joined or weights_asked) and self._last is not None:
            self.sock.send_multipart(self._last, copy=False)    # to every weights subscriber: XPUB cannot pick one
            self.asks["weights_resent"] += not weights_joined
        if (joined or due) and self._last_credit is not None:
            self.sock.send_multipart(self._last_credit)
        self.subscribers_seen += joined
        return joined

    def _older_than_last(self, version: int, incarnation: str | None) -> bool:
        """A subscriber holding (`version`, `incarnation`) lacks the newest weights published."""
        last_version, last_incarnation = self._last_id
        if self._last is None or not isinstance(last_version, int):
            return False
        return (incarnation is not None and incarnation != last_incarnation) or version < last_version

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
        self.weights = weights
        self.asked = 0
        self.consumed: list | None = None
        self.consumed_from: str | None = None   # the learner incarnation that counted `consumed`
        # (version, incarnation): the newest version the learner has announced, by weights or credit
        self.announced: tuple[int, str | None] | None = None
        self.lives: list[str] = []   # the learner incarnations heard, oldest first (the last 16)

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
            if inc is not None and (not self.lives or self.lives[-1] != inc):
                self.lives = [x for x in self.lives if x != inc][-15:] + [inc]   # a new list: read from other threads
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

    def ask(self, version: int, incarnation: str | None, weights: bool = True) -> None:
        """Ask the learner again for what it should have sent by now: its newest weights if they are
        newer than (`version`, `incarnation`), the newest this subscriber has received, and its newest
        credits (`weights` False, or a control-only subscriber: the credits alone). ZeroMQ drops a
        message past a high-water mark without a word: this is how a subscriber that has waited long
        for a version or a credit gets one lost so. The learner answers between its updates (see
        :data:`RESEND_AFTER_S`); weights it re-sends go to every weights subscriber."""
        topic = ask_topic(version, incarnation) if self.weights and weights else ASK_CREDIT
        self.sock.setsockopt(zmq.SUBSCRIBE, topic)     # matches no message: only the learner reads it
        self.sock.setsockopt(zmq.UNSUBSCRIBE, topic)
        self.asked += 1

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
        self._ask: tuple | None = None   # ((version, incarnation), kwargs) for the thread, which owns the socket
        self._thread = threading.Thread(target=self._run, name="weights-drain", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            while not self._closing.is_set():
                with self._lock:
                    ask, self._ask = self._ask, None
                if ask is not None:
                    self.sub.ask(*ask[0], **ask[1])
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

    def ask(self, version: int, incarnation: str | None, weights: bool = True) -> None:
        """:meth:`WeightsSubscriber.ask`, sent by the thread within one poll."""
        with self._lock:
            self._ask = ((version, incarnation), {"weights": weights})

    @property
    def lives(self) -> list[str]:
        """:attr:`WeightsSubscriber.lives` (read from the thread's subscriber)."""
        return self.sub.lives

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
