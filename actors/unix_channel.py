"""Requests and replies between actors and their inference server on one host, over a Unix stream
socket (``actors.server_transport: "unix"``).

An inference server's requests are small and come once per env step, so their cost is the round trip.
ZeroMQ passes every message through an I/O thread on each side: a round trip wakes six threads, where
a Unix socket wakes two. On a loaded 2-core host a round trip took 240-340 us through ZeroMQ over
loopback and 100-120 us through a Unix socket (4 clients, one busy process beside them), and each
wake-up is CPU taken from the learner. The messages are the same wire frames (``shared/wire.py``);
only the transport differs. An actor that cannot open the socket file uses the server's ZeroMQ
socket, which stays open; CURVE is for that one: the Unix socket lives in a directory only this user
can enter. Both are for the actors of the server's own host (the ZeroMQ socket is bound to loopback,
127.0.0.1): actors on another host run a server of their own there, or local copies.

Framing on the stream: ``b"TDM1"``, the frame count (u32), each frame's length (u64), then the frames.
A peer that breaks it (bad magic, too many frames, a message over the size limit) is dropped: the stream
cannot be resynchronised. Both ends are non-blocking: a reply that does not fit the socket's buffer
waits in the connection's own queue (bounded), so a slow actor never stalls the server.
"""

from __future__ import annotations

import hashlib
import logging
import os
import select
import socket
import stat
import struct
import tempfile
import time
from pathlib import Path

import zmq

from shared.wire import MAX_TENSORS

log = logging.getLogger("tandem.unix_channel")

MAGIC = b"TDM1"
MAX_FRAMES = MAX_TENSORS + 1     # a header and its tensors (shared/wire.py)
_COUNT = struct.Struct("<4sI")
_LEN = struct.Struct("<Q")
SOCKET_BUFFER = 4 << 20          # bytes asked for (the kernel caps it at net.core.[rw]mem_max)
MAX_QUEUED_OUT = 64 << 20        # the server: bytes of replies queued for one slow actor; past this it is dropped
TAKE_PER_POLL = 64               # the server: messages taken from one connection per poll (the others get their turn)


class FramingError(Exception):
    """A peer's stream is not ours: it cannot be read on from here."""


def socket_path(run_dir: str | Path, server_id: int) -> Path:
    """Where server `server_id` of the run in `run_dir` listens: a private directory under the system's
    temporary one (a Unix socket path is limited to 107 bytes; run directories are often longer)."""
    tag = hashlib.sha1(str(Path(run_dir).resolve()).encode()).hexdigest()[:12]
    return Path(tempfile.gettempdir()) / f"tandem-{os.getuid()}-{tag}" / f"server_{server_id}.sock"


def encode(frames: list) -> list:
    """The buffers that carry `frames` (bytes-like) on the stream, header first."""
    views = [memoryview(getattr(f, "buffer", f)).cast("B") for f in frames]
    head = _COUNT.pack(MAGIC, len(views)) + b"".join(_LEN.pack(len(v)) for v in views)
    return [head, *views]


class _Stream:
    """One connection: its bytes in (assembled into messages) and out (queued when the socket is full)."""

    def __init__(self, sock: socket.socket, max_bytes: int, max_out: int | None = MAX_QUEUED_OUT):
        self.sock, self.max_bytes, self.max_out = sock, max_bytes, max_out
        self.inbuf = bytearray()
        self.out = bytearray()
        self.closed = False
        self._lengths: list[int] | None = None   # the frame lengths of the message at the head of inbuf

    def read(self) -> None:
        """Take what the socket has (non-blocking), at most 16 MiB a call (a peer that writes without
        end cannot keep the server here); sets `closed` at its end."""
        for _ in range(16):
            if self.closed:
                return
            try:
                data = self.sock.recv(1 << 20)
            except (BlockingIOError, InterruptedError):
                return
            except OSError:
                self.closed = True
                return
            if not data:
                self.closed = True
                return
            self.inbuf += data
            if len(data) < (1 << 20):
                return

    def message(self) -> list[memoryview] | None:
        """The next whole message received, as frames (each its own writable memory), or None."""
        if self._lengths is None:   # the head of the next message, parsed once however slowly its body comes
            if len(self.inbuf) < _COUNT.size:
                return None
            magic, n = _COUNT.unpack_from(self.inbuf)
            if magic != MAGIC or n < 1 or n > MAX_FRAMES:
                raise FramingError(f"not a Tandem stream (starts {bytes(self.inbuf[:8])!r})")
            if len(self.inbuf) < _COUNT.size + n * _LEN.size:
                return None
            lengths = [_LEN.unpack_from(self.inbuf, _COUNT.size + i * _LEN.size)[0] for i in range(n)]
            if sum(lengths) > self.max_bytes:
                raise FramingError(f"a message of {sum(lengths)} bytes, over the {self.max_bytes}-byte limit")
            self._lengths = lengths
        lengths = self._lengths
        head, total = _COUNT.size + len(lengths) * _LEN.size, sum(lengths)
        if len(self.inbuf) < head + total:
            return None
        self._lengths = None
        body = self.inbuf[head:head + total]   # a copy: its own memory, which the tensors alias
        del self.inbuf[:head + total]
        out, view, at = [], memoryview(body), 0
        for k in lengths:
            out.append(view[at:at + k])
            at += k
        return out

    def send(self, buffers: list) -> bool:
        """Queue a message and write what the socket takes; False when the peer is gone or too slow."""
        if self.closed:
            return False
        if not self.out:
            try:
                sent = self.sock.sendmsg(buffers)
            except (BlockingIOError, InterruptedError):
                sent = 0
            except OSError:
                self.closed = True
                return False
            if sent == sum(len(b) for b in buffers):   # encode's views are bytes: len is their size
                return True
            rest = memoryview(b"".join(buffers))[sent:]   # one copy of what is left, not two
        else:
            rest = b"".join(buffers)
        if self.max_out is not None and len(self.out) + len(rest) > self.max_out:
            self.closed = True
            return False
        self.out += rest
        return self.flush()

    def flush(self) -> bool:
        while self.out and not self.closed:
            try:
                sent = self.sock.send(self.out)
            except (BlockingIOError, InterruptedError):
                return True
            except OSError:
                self.closed = True
                return False
            del self.out[:sent]
        return not self.closed

    def close(self) -> None:
        self.closed = True
        try:
            self.sock.close()
        except OSError:
            pass


def _configure(sock: socket.socket) -> None:
    sock.setblocking(False)
    for opt in (socket.SO_SNDBUF, socket.SO_RCVBUF):
        try:
            sock.setsockopt(socket.SOL_SOCKET, opt, SOCKET_BUFFER)
        except OSError:
            pass


def private_dir(path: Path) -> None:
    """Make `path` a directory that only this user can enter, or raise OSError: it must be ours, a
    real directory (not a link someone else left at a predictable name) and mode 0700."""
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    st = os.lstat(path)
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid():
        raise PermissionError(f"{path} is not a directory of this user's")
    if stat.S_IMODE(st.st_mode) != 0o700:
        os.chmod(path, 0o700)


class Route(bytes):
    """A Unix connection's routing id, read as a ZeroMQ frame is (``.bytes``)."""

    @property
    def bytes(self) -> bytes:
        return bytes(self)


ROUTE_PREFIX = b"unix:"   # ZeroMQ's own routing ids start with a zero byte: never this


class ServerChannels:
    """The server's side: its ZeroMQ ROUTER and a Unix listener, read and written as one ROUTER
    (``poll``, ``recv_multipart``, ``send_multipart``, ``close``). A message from a Unix connection
    comes as ``[route, *frames]`` with a route of its own; a reply to that route goes back on it.

    Args:
        router: the server's ZeroMQ ROUTER (on loopback: this host's actors without the Unix socket, CURVE).
        path: where to listen (:func:`socket_path`); its directory is made private to this user.
        max_bytes: the largest request (the server's :class:`RequestChecker` limit).
        on_broken: called with (route, why) when a peer's stream breaks the framing (it is dropped).
    """

    def __init__(self, router: zmq.Socket, path: Path, max_bytes: int, on_broken=None):
        self.router, self.path, self.max_bytes = router, Path(path), max_bytes
        self.on_broken = on_broken or (lambda route, why: None)
        private_dir(self.path.parent)
        try:
            self.path.unlink()            # a dead incarnation's socket file
        except FileNotFoundError:
            pass
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            self.listener.bind(str(self.path))
        except OSError:
            self.listener.close()
            raise
        self.listener.listen(256)
        self.listener.setblocking(False)
        self.streams: dict[bytes, _Stream] = {}
        self.by_fd: dict[int, bytes] = {}
        self.ready: list[list] = []        # whole messages received, not handed out yet
        self._next = 0
        self._poller = zmq.Poller()
        self._poller.register(self.router, zmq.POLLIN)
        self._poller.register(self.listener.fileno(), zmq.POLLIN)
        self._writing: set[bytes] = set()  # routes registered for POLLOUT (a reply queued)
        self._backlog: set[bytes] = set()  # routes whose received bytes may hold more whole messages
        self._since_router = 0             # Unix messages handed out since the last ZeroMQ one
        self.accepted = 0                  # connections taken, over the server's life
        self._accept_paused_until = 0.0    # out of file descriptors: the listener rests a second

    # -------------------------------------------------------------- the ROUTER's interface
    def poll(self, timeout_ms: int = 0) -> bool:
        if self.ready:
            return True
        if self._accept_paused_until and time.monotonic() >= self._accept_paused_until:
            self._poller.register(self.listener.fileno(), zmq.POLLIN)
            self._accept_paused_until = 0.0
        for route in [r for r in self._writing if not self.streams[r].out]:
            self._poller.register(self.streams[route].sock.fileno(), zmq.POLLIN)
            self._writing.discard(route)
        backlog = list(self._backlog)       # their turn comes after the others have had theirs
        events = dict(self._poller.poll(0 if backlog else timeout_ms))
        router_ready = bool(events.pop(self.router, 0))
        for fd, ev in events.items():
            if fd == self.listener.fileno():
                self._accept()
                continue
            route = self.by_fd.get(fd)
            if route is None:
                continue
            s = self.streams[route]
            if ev & zmq.POLLOUT:
                s.flush()
            if ev & zmq.POLLIN and route not in self._backlog:   # a connection with a backlog reads no more
                s.read()
                self._collect(route, s)
            if ev & zmq.POLLERR:
                s.closed = True
            if s.closed:
                self._drop(route)
        for route in backlog:               # what a connection sent beyond its last turn: another turn's worth
            s = self.streams.get(route)
            if s is None:
                continue
            self._collect(route, s)
            if s.closed:
                self._drop(route)
        return bool(self.ready) or router_ready

    def recv_multipart(self, copy: bool = False) -> list:
        # Unix messages first, but after a turn's worth of them a waiting ZeroMQ one (an actor on ZeroMQ):
        # local connections that keep sending cannot hold them back
        if self.ready and (self._since_router < TAKE_PER_POLL or not self.router.getsockopt(zmq.EVENTS) & zmq.POLLIN):
            self._since_router += 1
            return self.ready.pop(0)
        self._since_router = 0
        frames = self.router.recv_multipart(copy=copy)
        route = getattr(frames[0], "bytes", frames[0])
        if route.startswith(ROUTE_PREFIX):   # a ZeroMQ peer naming itself as a Unix one: its replies would go astray
            return [frames[0]]                # without its body: the server's check counts it as malformed
        return frames

    def send_multipart(self, frames: list, flags: int = 0) -> None:
        route = bytes(getattr(frames[0], "bytes", frames[0]))
        if not route.startswith(ROUTE_PREFIX):
            self.router.send_multipart(frames, flags=flags)
            return
        s = self.streams.get(route)
        if s is None or not s.send(encode(frames[1:])):
            if s is not None:
                self._drop(route)
            raise zmq.ZMQError(zmq.EHOSTUNREACH, "the actor's Unix connection is closed")
        if s.out and route not in self._writing:     # the rest goes when the socket has room
            self._poller.register(s.sock.fileno(), zmq.POLLIN | zmq.POLLOUT)
            self._writing.add(route)

    def close(self, linger: int = 0) -> None:
        for route in list(self.streams):
            self._drop(route)
        self.listener.close()
        try:
            self.path.unlink()
            self.path.parent.rmdir()        # when no other server of the run is in it
        except OSError:
            pass
        self.router.close(linger=linger)

    # -------------------------------------------------------------- connections
    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as e:   # EMFILE and the like: the listener stays readable; do not spin on it
                log.warning("inference server: cannot take a connection on %s (%s); trying again in 1 s",
                            self.path, e)
                self._poller.unregister(self.listener.fileno())
                self._accept_paused_until = time.monotonic() + 1.0
                return
            _configure(conn)
            self._next += 1
            self.accepted += 1
            route = Route(ROUTE_PREFIX + str(self._next).encode())
            self.streams[route] = _Stream(conn, self.max_bytes)
            self.by_fd[conn.fileno()] = route
            self._poller.register(conn.fileno(), zmq.POLLIN)

    def _collect(self, route: bytes, s: _Stream) -> None:
        """Take up to :data:`TAKE_PER_POLL` whole messages of connection `route`; with more left, it
        waits for its next turn (a peer that sends without end cannot keep the others waiting)."""
        self._backlog.discard(route)
        try:
            for _ in range(TAKE_PER_POLL):
                msg = s.message()
                if msg is None:
                    return
                self.ready.append([route, *msg])
            self._backlog.add(route)
        except FramingError as e:
            self.on_broken(route, str(e))
            s.closed = True

    def _drop(self, route: bytes) -> None:
        s = self.streams.pop(route, None)
        self._writing.discard(route)
        self._backlog.discard(route)
        if s is not None:
            fd = s.sock.fileno()
            self.by_fd.pop(fd, None)
            try:
                self._poller.unregister(fd)
            except KeyError:
                pass
            s.close()


class UnixDealer:
    """An actor's side: one connection to its server's Unix socket, read and written as a ZeroMQ
    DEALER is by :class:`~actors.remote_policy.RemotePolicy` (``send_multipart``, ``poll``,
    ``recv_multipart``, ``close``). `broken` is set when the server has gone (it is then reconnected)."""

    def __init__(self, path: Path, max_bytes: int = 1 << 30):
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(2.0)
        try:
            sock.connect(str(path))
        except OSError:
            sock.close()
            raise
        _configure(sock)
        self.stream = _Stream(sock, max_bytes, max_out=None)   # its own requests, a few in flight at most
        self._ready: list[list] = []
        self._fd = sock.fileno()
        self._io = select.poll()
        self._io.register(self._fd, select.POLLIN)

    @property
    def broken(self) -> bool:
        return self.stream.closed

    def send_multipart(self, frames: list, flags: int = 0) -> None:
        """Queue a request; what the socket does not take at once goes out in :meth:`poll`."""
        if not self.stream.send(encode(frames)):
            raise zmq.ZMQError(zmq.ENOTCONN, "the inference server's Unix connection is closed")

    def poll(self, timeout_ms: int = 0) -> bool:
        """Whether a whole reply is here, waiting up to `timeout_ms` for one (and writing the rest
        of a request the socket could not take at once)."""
        if self._ready:
            return True
        self._take()
        if not self._ready and self.stream.closed:   # reconnected at the caller's next look; wait as asked
            time.sleep(max(0, timeout_ms) / 1000)
            return False
        deadline = time.monotonic() + max(0, timeout_ms) / 1000
        while not self._ready and not self.stream.closed:
            writing = bool(self.stream.out)
            self._io.modify(self._fd, select.POLLIN | (select.POLLOUT if writing else 0))
            events = self._io.poll(max(0.0, deadline - time.monotonic()) * 1000)
            for _, ev in events:
                if ev & select.POLLOUT:
                    self.stream.flush()
                if ev & (select.POLLIN | select.POLLHUP | select.POLLERR):
                    self.stream.read()
                    self._take()
            if not events or time.monotonic() >= deadline:
                break
        return bool(self._ready)

    def _take(self) -> None:
        try:
            while (msg := self.stream.message()) is not None:
                self._ready.append(msg)
        except FramingError:
            self.stream.closed = True

    def recv_multipart(self, copy: bool = False) -> list:
        if not self._ready and not self.poll(0):
            raise zmq.Again("no whole reply yet")
        return self._ready.pop(0)

    def close(self, linger: int = 0) -> None:
        self.stream.close()
