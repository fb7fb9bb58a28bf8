"""Weights and credits lost on the way are asked for again (shared/transport.py ``ask``).

ZeroMQ drops a message past a high-water mark without a word. An actor waiting for the version it
lost (standard mode), or for a credit (lag_policy pace), or an inference server holding a request for
a version it lost, asks the learner again every ``RESEND_AFTER_S`` of the wait; the learner re-sends
its newest weights to a subscriber holding an older version, and its newest credits, at most that often.
"""

from __future__ import annotations

import threading
import time

import pytest
import torch
import zmq
from hypothesis import given, settings
from hypothesis import strategies as st
from tensordict import TensorDict

import actors.actor as actor_mod
import shared.transport as transport
from actors.actor import Actor
from learner.learner import Learner, ListPublisher
from shared import keys
from shared.transport import WeightsPublisher, WeightsSubscriber, ask_topic, parse_ask
from tests.test_learner_component import CaptureSink, small_config


def _join(pub: WeightsPublisher, n: int) -> None:
    deadline = time.monotonic() + 10
    while pub.subscribers_seen < n:
        assert time.monotonic() < deadline, "the subscribers never joined"
        pub.serve_subscriptions()
        time.sleep(0.01)
    time.sleep(0.2)


def _versions(sub: WeightsSubscriber, wait_ms: int = 200) -> list[int]:
    return [m[1]["version"] for m in iter(lambda: sub.newest(wait_ms), None) if m[1].get("kind") == "weights"]


def _asks_seen(pub: WeightsPublisher, n: int, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while pub.asks["asks"] < n:
        assert time.monotonic() < deadline, f"the ask never reached the publisher: {pub.asks}"
        pub.serve_subscriptions()
        time.sleep(0.005)


def _serve_until(pub: WeightsPublisher, sub: WeightsSubscriber, timeout_s: float = 5.0):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        pub.serve_subscriptions()
        msg = sub.newest(20)
        if msg is not None:
            return msg
    return None


def test_a_subscriber_that_lost_the_newest_weights_gets_them_by_asking(monkeypatch):
    """A real loss: a subscriber not read while 60 versions go out keeps only what its queues held,
    not the newest. Asking with the version it holds has the newest re-sent; asking while holding the
    newest re-sends no weights; asks are answered at most every RESEND_AFTER_S."""
    monkeypatch.setattr(transport, "RESEND_AFTER_S", 0.3)
    ctx = zmq.Context()
    pub = WeightsPublisher(ctx, "127.0.0.1")
    sub = WeightsSubscriber(ctx, pub.endpoint)
    try:
        _join(pub, 1)
        last = 60
        for v in range(1, last + 1):   # nobody reads meanwhile
            pub.publish(TensorDict({"w": torch.full((1 << 20,), float(v))}, []), kind="weights", version=v,
                        incarnation="L1", consumed=[v], time=float(v))
            time.sleep(0.02)
        time.sleep(0.5)
        held = max(_versions(sub))
        assert held < last, "nothing was dropped: the test needs a real loss"
        sub.ask(held, "L1")
        time.sleep(0.35)                       # past RESEND_AFTER_S since the publication
        got = _serve_until(pub, sub)
        assert got is not None and got[1]["version"] == last and got[0]["w"][0].item() == last
        assert pub.asks == {"asks": 1, "malformed": 0, "weights_resent": 1}
        # holding the newest: the ask is answered (credits), but the weights are not sent again
        time.sleep(0.35)
        sub.ask(last, "L1")
        _asks_seen(pub, 2)
        assert _versions(sub, 300) == [] and pub.asks == {"asks": 2, "malformed": 0, "weights_resent": 1}
        # another learner life's version 99 is older than nothing here: re-sent (a new life's versions restart)
        time.sleep(0.35)
        sub.ask(99, "OTHERLIFE")
        got = _serve_until(pub, sub)
        assert got is not None and got[1]["version"] == last and pub.asks["weights_resent"] == 2
        # an ask inside RESEND_AFTER_S of the last answer waits for the window, then is answered
        monkeypatch.setattr(transport, "RESEND_AFTER_S", 1.0)   # a window a loaded machine cannot miss
        sub.ask(0, "L1")
        _asks_seen(pub, 4)
        assert pub.asks["weights_resent"] == 2
        got = _serve_until(pub, sub)
        assert got is not None and got[1]["version"] == last and pub.asks["weights_resent"] == 3
    finally:
        sub.close()
        pub.close()
        ctx.term()


def test_an_ask_sent_while_the_weights_were_on_the_way_resends_nothing(monkeypatch):
    """An ask queued while the learner was in an update, read just after it published the next version,
    is not a loss: the weights are re-sent only when published at least RESEND_AFTER_S ago."""
    monkeypatch.setattr(transport, "RESEND_AFTER_S", 2.0)
    ctx = zmq.Context()
    pub = WeightsPublisher(ctx, "127.0.0.1")
    sub = WeightsSubscriber(ctx, pub.endpoint)
    try:
        _join(pub, 1)
        sub.ask(-1, "L1")                      # waiting for version 0 ...
        time.sleep(0.2)
        pub.publish(TensorDict({"w": torch.zeros(4)}, []), kind="weights", version=0, incarnation="L1")
        assert _versions(sub) == [0]
        pub.serve_subscriptions()              # ... the ask is read after the publication
        assert _versions(sub) == [] and pub.asks == {"asks": 1, "malformed": 0, "weights_resent": 0}
    finally:
        sub.close()
        pub.close()
        ctx.term()


def test_malformed_asks_are_counted_and_ignored(monkeypatch):
    monkeypatch.setattr(transport, "RESEND_AFTER_S", 0.0)
    ctx = zmq.Context()
    pub = WeightsPublisher(ctx, "127.0.0.1")
    raw = ctx.socket(zmq.XSUB)                 # a peer writing subscriptions by hand
    raw.setsockopt(zmq.LINGER, 0)
    raw.connect(pub.endpoint)
    try:
        pub.publish(TensorDict({"w": torch.zeros(4)}, []), kind="weights", version=3, incarnation="L1")
        bad = [b"w?", b"w?abc", b"w?-2", b"w?+1", b"w? 1", b"w?1 ", b"w?1 a b", b"w?1 " + b"x" * 65,
               b"w?\xff\xfe", b"w?" + b"9" * 19]
        for topic in bad:
            raw.send(b"\x01" + topic)
        deadline = time.monotonic() + 5
        while pub.asks["asks"] < len(bad):
            assert time.monotonic() < deadline, f"asks seen: {pub.asks}"
            pub.serve_subscriptions()
            time.sleep(0.01)
        assert pub.asks == {"asks": len(bad), "malformed": len(bad), "weights_resent": 0}
        assert pub.subscribers_seen == 0       # none was taken for a subscriber joining
    finally:
        raw.close()
        pub.close()
        ctx.term()


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=100))
def test_parse_ask_never_raises_and_reads_only_what_ask_topic_writes(payload):
    held = parse_ask(payload)
    if held is not None:
        version, incarnation = held
        assert version >= -1 and ask_topic(version, incarnation) == transport.ASK_WEIGHTS + payload


@given(st.integers(-1, 10**17), st.one_of(st.none(), st.text(alphabet="0123456789abcdef", min_size=1, max_size=16)))
def test_ask_topic_round_trips(version, incarnation):
    assert parse_ask(ask_topic(version, incarnation)[len(transport.ASK_WEIGHTS):]) == (version, incarnation)


class LosingSource:
    """A learner's weights as an actor's subscriber sees them when one message was lost: `lost`
    arrives only once the actor has asked for it again."""

    def __init__(self, first, lost):
        self.pending, self.lost, self.asks = [first], lost, []
        self.consumed = self.consumed_from = None

    def newest(self, timeout_ms=0):
        if not self.pending:
            time.sleep(timeout_ms / 1000)
            return None
        td, meta = self.pending.pop()
        return td.clone(), dict(meta)

    def ask(self, version, incarnation, weights=True):
        self.asks.append((version, incarnation, weights))
        self.pending.append(self.lost)


def test_a_standard_mode_actor_that_lost_a_version_asks_again_instead_of_timing_out(monkeypatch):
    monkeypatch.setattr(actor_mod, "RESEND_AFTER_S", 0.3)
    cfg = small_config()                       # standard mode: after each rollout the actor waits for a newer version
    learner = Learner(cfg, run_dir=None, publisher=ListPublisher())
    learner.publish()
    first = learner.publisher.published[-1]
    learner.version = 1
    learner.publish()
    source = LosingSource(first, learner.publisher.published[-1])
    actor = Actor(cfg, 0, source, CaptureSink(), learner_timeout_s=5.0)
    assert actor.step_once() and actor.version == 0
    t0 = time.monotonic()
    assert actor.step_once(), "the actor gave up waiting for the version it lost"
    assert actor.version == 1 and not actor.failed and 0.25 < time.monotonic() - t0 < 3.0
    assert source.asks == [(0, learner.incarnation, True)]


def test_a_paced_actor_that_lost_its_credit_asks_again(monkeypatch):
    """lag_policy pace: the learner sends a credit only when its counts change, so a lost one was
    waited for until the actor's timeout. The actor asks; the learner re-sends its newest credits."""
    monkeypatch.setattr(actor_mod, "RESEND_AFTER_S", 0.3)
    cfg = small_config(buffer_type="vla", lag_policy="pace", max_policy_lag=1)
    learner = Learner(cfg, run_dir=None, publisher=ListPublisher())
    learner.publish()
    first = learner.publisher.published[-1]

    class CreditSource(LosingSource):
        def newest(self, timeout_ms=0):   # as WeightsSubscriber.newest: credits update `consumed` only
            msg = super().newest(timeout_ms)
            if msg is not None and isinstance(msg[1].get("consumed"), list):
                self.consumed, self.consumed_from = msg[1]["consumed"], msg[1]["incarnation"]
            return None if msg is not None and msg[1]["kind"] == "credit" else msg
    actor = Actor(cfg, 0, None, CaptureSink(), learner_timeout_s=5.0)
    credit = (TensorDict({}, []), {"kind": "credit", "consumed": [actor.credits.max_inflight],
                                   "incarnation": learner.incarnation, "version": 0})
    actor.weights = source = CreditSource(first, credit)
    for _ in range(actor.credits.max_inflight):
        assert actor.step_once()
    t0 = time.monotonic()
    assert actor.step_once(), "the actor gave up waiting for the credit it lost"
    assert not actor.failed and 0.25 < time.monotonic() - t0 < 3.0
    assert source.asks == [(0, learner.incarnation, False)]      # a credit wait asks for the credits alone


def test_a_learner_with_a_real_socket_answers_an_actor_that_lost_a_version(monkeypatch):
    """End to end over loopback: the learner's publisher and an actor's subscriber (the actor in a
    thread of its own); one weights message is lost (the publisher keeps it as its newest but never
    sends it, as ZeroMQ drops one); the learner's loop serves subscriptions; the actor's wait asks, and
    ends with the lost version instead of its timeout."""
    monkeypatch.setattr(actor_mod, "RESEND_AFTER_S", 0.3)
    monkeypatch.setattr(transport, "RESEND_AFTER_S", 0.3)
    cfg = small_config()
    ctx = zmq.Context()
    pub = WeightsPublisher(ctx, "127.0.0.1")
    learner = Learner(cfg, run_dir=None, publisher=pub)

    class DropNext:
        def __init__(self, sock):
            self.sock, self.drop = sock, False

        def send_multipart(self, frames, **kw):
            if self.drop:
                self.drop = False
                return None
            return self.sock.send_multipart(frames, **kw)

        def __getattr__(self, name):
            return getattr(self.sock, name)
    pub.sock = link = DropNext(pub.sock)
    first_done, done, out = threading.Event(), threading.Event(), {}

    def act():
        sub = WeightsSubscriber(ctx, pub.endpoint)
        try:
            actor = Actor(cfg, 0, sub, CaptureSink(), learner_timeout_s=10.0)
            out["first"] = actor.step_once() and actor.version
            first_done.set()
            t0 = time.monotonic()
            out["second"] = actor.step_once() and actor.version
            out["wait_s"], out["asked"] = time.monotonic() - t0, sub.asked
        finally:
            sub.close()
            first_done.set()
            done.set()
    thread = threading.Thread(target=act, daemon=True)
    try:
        learner.publish()
        thread.start()
        deadline = time.monotonic() + 20
        while not first_done.is_set() and time.monotonic() < deadline:
            pub.serve_subscriptions()
            time.sleep(0.01)
        assert out.get("first") == 0
        link.drop = True
        learner.version = 1
        learner.publish()                   # lost on the way
        while not done.is_set() and time.monotonic() < deadline:
            pub.serve_subscriptions()
            time.sleep(0.01)
        assert out.get("second") == 1, f"the actor did not get the version it lost: {out}"
        assert out["wait_s"] < 5.0 and out["asked"] >= 1 and pub.asks["weights_resent"] == 1
    finally:
        thread.join(timeout=15)
        pub.sock = link.sock
        pub.close()
        ctx.term()


def test_an_inference_server_that_lost_the_version_a_request_waits_for_asks_again(tmp_path, monkeypatch):
    """A paced actor asks its server for the version the learner announced; the server lost that
    weights message. It asks the learner again once a request has waited RESEND_AFTER_S, and serves it
    with the version asked for, instead of letting it expire at the actor's timeout."""
    import actors.inference_server as inference_server
    from tests.test_inference_server import Served, _obs
    monkeypatch.setattr(inference_server, "RESEND_AFTER_S", 0.3)
    served = Served(tmp_path)
    try:
        served.weights.publish(served.learner, 0)
        lost = []

        def ask(version, incarnation, weights=True):   # the learner re-sends its newest: version 1, lost before
            lost.append((version, incarnation))
            served.weights.publish(served.learner, 1)
        served.weights.ask = ask
        served.start()
        remote = served.remote(0, timeout_s=5.0)
        assert int(remote(_obs(4, seed=1))[keys.POLICY_VERSION][0]) == 0
        remote.min_version, remote.min_incarnation = 1, "L1"
        t0 = time.monotonic()
        got = remote(_obs(4, seed=2))
        assert int(got[keys.POLICY_VERSION][0]) == 1 and 0.25 < time.monotonic() - t0 < 3.0
        assert lost == [(0, "L1")] and served.server.counts["asked"] == 1
        assert served.server.counts["expired"] == 0
    finally:
        served.close()


def test_a_subscriber_keeps_the_learner_lives_it_has_heard_in_order():
    """An inference server tells an older learner life from a newer one by what its subscriber heard
    (a paced request naming an older life is served at once, a newer one waited for)."""
    ctx = zmq.Context()
    pub = WeightsPublisher(ctx, "127.0.0.1")
    sub = WeightsSubscriber(ctx, pub.endpoint)
    try:
        _join(pub, 1)
        pub.publish(TensorDict({"w": torch.zeros(2)}, []), kind="weights", version=5, incarnation="A")
        pub.send_control(kind="credit", consumed=[1], incarnation="B", version=0)
        pub.publish(TensorDict({"w": torch.zeros(2)}, []), kind="weights", version=1, incarnation="B")
        deadline = time.monotonic() + 5
        while (sub.lives, sub.announced) != (["A", "B"], (1, "B")) and time.monotonic() < deadline:
            sub.newest(50)      # the credit names life B before B's weights arrive: wait for both
        assert sub.lives == ["A", "B"] and sub.announced == (1, "B")
    finally:
        sub.close()
        pub.close()
        ctx.term()
