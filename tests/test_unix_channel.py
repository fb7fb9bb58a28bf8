"""actors.server_transport "unix": an inference server's actors on its host reach it over a Unix
stream socket (actors/unix_channel.py). Messages arrive whole and in order, whatever their size;
a peer that breaks the framing is dropped and counted, never the server; a reply to a gone actor is
undeliverable; an actor whose connection broke reconnects and sends its requests again; and a server
reached over it acts exactly as over ZeroMQ."""

from __future__ import annotations

import os
import socket
import time

import pytest
import zmq
from hypothesis import HealthCheck, given, settings, strategies as st

from actors.unix_channel import MAGIC, ServerChannels, UnixDealer, encode, socket_path
from shared import keys


@pytest.fixture
def channels(tmp_path):
    ctx = zmq.Context()
    router = ctx.socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    router.bind("tcp://127.0.0.1:*")
    broken = []
    ch = ServerChannels(router, socket_path(tmp_path, 0), max_bytes=64 << 20,
                        on_broken=lambda route, why: broken.append((route, why)))
    ch.broken_log = broken
    yield ch
    ch.close()
    ctx.term()


def _serve_one(ch: ServerChannels, timeout_s: float = 10.0, *writing: UnixDealer) -> list:
    """The next message at the server (the `writing` actors write the rest of theirs meanwhile)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for d in writing:
            d.poll(0)
        if ch.poll(20):
            return ch.recv_multipart()
    raise AssertionError("no message reached the server")


def _reply_of(dealer: UnixDealer, timeout_s: float = 5.0) -> list:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if dealer.poll(50):
            return dealer.recv_multipart()
    raise AssertionError("no reply reached the actor")


def test_the_socket_lives_in_a_private_directory_with_a_short_path(tmp_path):
    deep = tmp_path / ("x" * 200)
    path = socket_path(deep, 3)
    assert len(str(path)) < 100 and path.name == "server_3.sock"
    assert socket_path(deep, 3) == path and socket_path(tmp_path, 3) != path


def test_messages_arrive_whole_and_in_order_small_and_larger_than_the_socket_buffer(channels):
    assert oct(os.stat(channels.path.parent).st_mode & 0o777) == "0o700"
    dealer = UnixDealer(channels.path)
    try:
        big = os.urandom(24 << 20)          # larger than the socket buffers: written in many pieces
        sent = [[b"head-1", b"a" * 10], [b"head-2", big, b""], [b"head-3"]]
        for frames in sent:
            dealer.send_multipart(frames)
        got = [_serve_one(channels, 10.0, dealer) for _ in sent]
        routes = {bytes(g[0]) for g in got}
        assert len(routes) == 1 and next(iter(routes)).startswith(b"unix:")
        assert [[bytes(f) for f in g[1:]] for g in got] == sent
        for g in got:                        # replies go back on the connection the route names
            channels.send_multipart([g[0], b"re:" + bytes(g[1]), big[:1 << 20]])
        replies = [_reply_of(dealer) for _ in got]
        assert [bytes(r[0]) for r in replies] == [b"re:head-1", b"re:head-2", b"re:head-3"]
        assert all(bytes(r[1]) == big[:1 << 20] for r in replies)
        assert channels.accepted == 1
    finally:
        dealer.close()


def test_a_broken_stream_is_dropped_and_counted_and_the_others_are_served(channels):
    good = UnixDealer(channels.path)
    bad = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    bad.connect(str(channels.path))
    try:
        bad.sendall(b"GET / HTTP/1.1\r\n\r\n")
        good.send_multipart([b"still served"])
        got = _serve_one(channels)
        assert bytes(got[1]) == b"still served"
        deadline = time.monotonic() + 5
        while not channels.broken_log and time.monotonic() < deadline:
            channels.poll(20)
        assert len(channels.broken_log) == 1 and "not a Tandem stream" in channels.broken_log[0][1]
        assert len(channels.streams) == 1       # the bad peer is gone, the good one stays
        # a message over the limit is refused before its body is read
        over = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        over.connect(str(channels.path))
        over.sendall(b"".join(bytes(b) for b in encode([b""]))[:8] + (1 << 40).to_bytes(8, "little"))
        deadline = time.monotonic() + 5
        while len(channels.broken_log) < 2 and time.monotonic() < deadline:
            channels.poll(20)
        assert "over the" in channels.broken_log[1][1]
        over.close()
    finally:
        bad.close()
        good.close()


def test_a_reply_to_a_gone_actor_is_undeliverable_and_a_broken_dealer_says_so(channels):
    dealer = UnixDealer(channels.path)
    dealer.send_multipart([b"x"])
    route = _serve_one(channels)[0]
    dealer.close()
    with pytest.raises(zmq.ZMQError):
        for _ in range(50):                  # the close is seen at once or at the next poll
            channels.poll(10)
            channels.send_multipart([route, b"late"])
    other = UnixDealer(channels.path)
    other.send_multipart([b"y"])
    _serve_one(channels)
    channels.close()                         # the server goes: the actor's side sees its end
    deadline = time.monotonic() + 5
    while not other.broken and time.monotonic() < deadline:
        other.poll(20)
    assert other.broken
    with pytest.raises(zmq.ZMQError):
        other.send_multipart([b"z"])
    other.close()


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(st.binary(max_size=300), min_size=1, max_size=6))
def test_random_bytes_on_the_socket_never_stop_the_server(channels, chunks):
    """Whatever a peer writes, the server keeps serving the well-behaved actor; a stream that is not
    ours ends in on_broken (counted as malformed by the server), never in an exception here."""
    peer = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    peer.connect(str(channels.path))
    good = UnixDealer(channels.path)
    try:
        for c in chunks:
            try:
                peer.sendall(c)
            except OSError:
                break
        good.send_multipart([MAGIC, b"ok"])
        deadline = time.monotonic() + 5
        seen = None
        while seen is None and time.monotonic() < deadline:
            if channels.poll(20):
                msg = channels.recv_multipart()
                if [bytes(f) for f in msg[1:]] == [MAGIC, b"ok"]:
                    seen = msg
        assert seen is not None
    finally:
        peer.close()
        good.close()
        while channels.poll(20):             # what the peer's bytes made of whole messages
            channels.recv_multipart()


def test_an_actor_whose_unix_connection_broke_reconnects_and_sends_its_request_again(tmp_path):
    """(That a server over the Unix socket acts exactly as over ZeroMQ: tests/test_inference_server.py.)
    The connection breaks with a request to send: the actor reconnects and sends it on the new one."""
    from tests.test_inference_server import Served, _obs
    served = Served(tmp_path, unix=True)
    try:
        served.weights.publish(served.learner, 0)
        served.start()
        remote = served.remote(0)
        assert int(remote(_obs(4, seed=1))[keys.POLICY_VERSION][0]) == 0
        assert isinstance(remote.sock, UnixDealer)
        remote.sock.stream.sock.shutdown(socket.SHUT_RDWR)   # the connection breaks
        out = remote(_obs(4, seed=2))
        assert int(out[keys.POLICY_VERSION][0]) == 0 and served.sock.accepted == 2
        assert isinstance(remote.sock, UnixDealer) and not remote.sock.broken
    finally:
        served.close()


def test_a_zeromq_peer_that_names_itself_as_a_unix_connection_gets_nothing(channels):
    """A ROUTER routes replies by the id a peer chose: one choosing a Unix connection's id would have
    its replies sent down that connection. Such a message reaches the server without its body."""
    ctx = zmq.Context()
    dealer = ctx.socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.setsockopt(zmq.ROUTING_ID, b"unix:1")
    dealer.connect(channels.router.getsockopt(zmq.LAST_ENDPOINT).decode())
    try:
        dealer.send_multipart([b"header", b"body"])
        got = _serve_one(channels)
        assert [bytes(getattr(f, "bytes", f)) for f in got] == [b"unix:1"]
    finally:
        dealer.close()
        ctx.term()


def test_the_socket_directory_must_be_this_users_own_real_directory(tmp_path):
    """Its name is predictable: a link or a file left there is refused (the server then keeps its
    actors on ZeroMQ), and a directory of ours is made private."""
    from actors.unix_channel import private_dir
    target = tmp_path / "elsewhere"
    target.mkdir()
    (tmp_path / "link").symlink_to(target)
    with pytest.raises(OSError):
        private_dir(tmp_path / "link")
    (tmp_path / "file").write_text("x")
    with pytest.raises(OSError):
        private_dir(tmp_path / "file")
    ours = tmp_path / "ours"
    ours.mkdir(mode=0o755)
    private_dir(ours)
    assert oct(os.stat(ours).st_mode & 0o777) == "0o700"


def test_a_connection_that_sends_without_end_does_not_keep_the_others_waiting(channels):
    """A peer that has sent thousands of well-framed messages gets TAKE_PER_POLL of them a turn; a
    message that another actor sent after them is handed out within the next turn, not after all
    of the flood."""
    from actors.unix_channel import TAKE_PER_POLL
    flood, actor = UnixDealer(channels.path), UnixDealer(channels.path)
    try:
        n = 20 * TAKE_PER_POLL
        buffers = [b for _ in range(n) for b in encode([b"junk"])]
        flood.stream.sock.setblocking(True)
        flood.stream.sock.sendall(b"".join(bytes(b) for b in buffers))   # all of it in the server's socket buffer
        deadline = time.monotonic() + 5
        while channels.accepted < 2 and time.monotonic() < deadline:
            channels.poll(10)
        while not channels.ready and time.monotonic() < deadline:
            channels.poll(10)                                          # the flood's first turn
        actor.send_multipart([b"mine"])
        order = []
        while b"mine" not in order and time.monotonic() < deadline:
            if channels.poll(10):
                order.append(bytes(channels.recv_multipart()[1]))
        assert b"mine" in order and order.index(b"mine") <= 3 * TAKE_PER_POLL, len(order)
        rest = 0
        while rest < n - order.count(b"junk") and time.monotonic() < deadline:   # the flood is not lost
            if channels.poll(10):
                channels.recv_multipart()
                rest += 1
        assert rest == n - order.count(b"junk")
    finally:
        flood.close()
        actor.close()


def test_local_connections_that_keep_sending_do_not_hold_back_a_remote_actor(channels):
    """Messages over the Unix socket come first, but a ZeroMQ one (an actor on another host) waiting
    behind a turn's worth of them is handed out next."""
    from actors.unix_channel import TAKE_PER_POLL
    flood = UnixDealer(channels.path)
    ctx = zmq.Context()
    remote = ctx.socket(zmq.DEALER)
    remote.setsockopt(zmq.LINGER, 0)
    remote.connect(channels.router.getsockopt_string(zmq.LAST_ENDPOINT))
    try:
        n = 20 * TAKE_PER_POLL
        flood.stream.sock.setblocking(True)
        flood.stream.sock.sendall(b"".join(bytes(b) for _ in range(n) for b in encode([b"junk"])))
        deadline = time.monotonic() + 5
        while not channels.ready and time.monotonic() < deadline:
            channels.poll(10)
        remote.send_multipart([b"remote"])
        while not channels.router.getsockopt(zmq.EVENTS) & zmq.POLLIN and time.monotonic() < deadline:
            time.sleep(0.01)                                            # it has reached the server's socket
        order = []
        while b"remote" not in order and time.monotonic() < deadline:
            if channels.poll(10):
                order.append(bytes(channels.recv_multipart()[1]))
        assert b"remote" in order and order.index(b"remote") <= 2 * TAKE_PER_POLL, len(order)
    finally:
        flood.close()
        remote.close(linger=0)
        ctx.term()
