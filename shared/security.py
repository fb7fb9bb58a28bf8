"""ZeroMQ CURVE authentication and encryption for runs across hosts.

With ``learner.curve_secret_key`` set, both learner sockets (rollouts PULL, weights XPUB) are CURVE
servers: every byte is encrypted, and a ZAP handler admits only clients whose public key is in
``learner.curve_authorized_keys`` (a directory of public certificate files). A peer without a key,
or with a key not listed, cannot complete the handshake: it can neither push rollouts nor receive
weights, and each refusal is counted and logged with the peer's address and key.

Actors (``actors.curve_secret_key``, ``actors.curve_server_key``) are CURVE clients. The evaluator,
a child of the learner on the same host, gets an in-memory key pair the learner admits.

Key files are ZeroMQ certificates (the ZPL format ``zmq.auth`` reads). ``launch/make_keys.py``
writes them; secret files are created with mode 0600 and refused if others can read them.
"""

from __future__ import annotations

import logging
import os
import stat
import threading
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

import zmq
import zmq.auth
from zmq.auth.thread import ThreadAuthenticator

log = logging.getLogger("tandem.security")


class KeyFileError(ValueError):
    """A key file is missing, unreadable, too open, or not a CURVE certificate; names the path."""


def _write_cert(path: Path, public: bytes, secret: bytes | None) -> None:
    """Write a ZPL certificate. Secret files get mode 0600 from creation (no window where others
    could read them)."""
    lines = [f"#   ****  Tandem CURVE {'secret' if secret else 'public'} key, "
             f"{datetime.now(timezone.utc).isoformat(timespec='seconds')}  ****",
             "#   ZeroMQ CURVE " + ("secret certificate: keep it private" if secret else "public certificate"),
             "", "metadata", "curve", f'    public-key = "{public.decode()}"']
    if secret is not None:
        lines.append(f'    secret-key = "{secret.decode()}"')
    data = ("\n".join(lines) + "\n").encode()
    mode = 0o600 if secret is not None else 0o644
    tmp = path.with_name(path.name + ".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
    try:
        os.fchmod(fd, mode)   # whatever the umask
        os.write(fd, data)
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, path)


def generate_keypair(directory: str | Path, name: str) -> tuple[Path, Path]:
    """Create ``name.key`` (public) and ``name.key_secret`` (0600) in `directory`."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    public, secret = zmq.curve_keypair()
    pub_path, sec_path = directory / f"{name}.key", directory / f"{name}.key_secret"
    _write_cert(sec_path, public, secret)
    _write_cert(pub_path, public, None)
    return pub_path, sec_path


def load_public(path: str | Path, what: str) -> bytes:
    path = Path(path)
    try:
        public, _ = zmq.auth.load_certificate(path)
    except (OSError, ValueError) as e:
        raise KeyFileError(f"{what} {str(path)!r}: cannot read a CURVE public key: {e}") from e
    if not public:
        raise KeyFileError(f"{what} {str(path)!r}: no public-key in the file")
    return public


def load_secret(path: str | Path, what: str) -> tuple[bytes, bytes]:
    """(public, secret) from a secret certificate; refuses files that group or others can read."""
    path = Path(path)
    try:
        mode = path.stat().st_mode
    except OSError as e:
        raise KeyFileError(f"{what} {str(path)!r}: {e.strerror or e}") from e
    if mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise KeyFileError(f"{what} {str(path)!r}: secret key file is readable by others (mode "
                        f"{stat.S_IMODE(mode):o}); run: chmod 600 {path}")
    try:
        public, secret = zmq.auth.load_certificate(path)
    except (OSError, ValueError) as e:
        raise KeyFileError(f"{what} {str(path)!r}: cannot read a CURVE certificate: {e}") from e
    if not secret:
        raise KeyFileError(f"{what} {str(path)!r}: no secret-key in the file (is it the public .key?)")
    return public, secret


def load_authorized(directory: str | Path, what: str) -> set[bytes]:
    """The public keys of every ``*.key`` certificate in `directory`."""
    directory = Path(directory)
    if not directory.is_dir():
        raise KeyFileError(f"{what} {str(directory)!r}: not a directory of public keys")
    keys = {load_public(p, what) for p in sorted(directory.glob("*.key"))}
    if not keys:
        raise KeyFileError(f"{what} {str(directory)!r}: no *.key public key files (nobody could connect)")
    return keys


@dataclass
class CurveClient:
    """Client keys, applied to a socket before it connects."""
    public: bytes
    secret: bytes
    server_public: bytes

    def apply(self, sock: zmq.Socket) -> None:
        sock.curve_publickey = self.public
        sock.curve_secretkey = self.secret
        sock.curve_serverkey = self.server_public

    def to_strings(self) -> dict[str, str]:
        return {"public": self.public.decode(), "secret": self.secret.decode(),
                "server_public": self.server_public.decode()}

    @classmethod
    def from_strings(cls, d: dict[str, str]) -> CurveClient:
        return cls(d["public"].encode(), d["secret"].encode(), d["server_public"].encode())


class CurveServer:
    """The learner's side: server keys, and a ZAP authenticator that admits listed client keys."""

    def __init__(self, public: bytes, secret: bytes, authorized: set[bytes]):
        self.public, self.secret = public, secret
        self._allowed = set(authorized)
        self._lock = threading.Lock()
        self.refused = 0
        self._auth: ThreadAuthenticator | None = None

    # ZAP credentials provider interface
    def callback(self, domain: str, key: bytes) -> bool:
        with self._lock:
            ok = key in self._allowed
            if not ok:
                self.refused += 1
                n = self.refused
        if not ok and (n <= 10 or n % 1000 == 0):
            log.warning("refused CURVE client #%d with unknown public key %s", n, key.decode(errors="replace"))
        return ok

    def start(self, ctx: zmq.Context) -> None:
        self._auth = ThreadAuthenticator(ctx, log=logging.getLogger("tandem.zap"))
        self._auth.start()
        self._auth.configure_curve_callback(domain="*", credentials_provider=self)

    def stop(self) -> None:
        if self._auth is not None:
            self._auth.stop()
            self._auth = None

    def apply(self, sock: zmq.Socket) -> None:
        """Make `sock` a CURVE server (before bind)."""
        sock.curve_server = True
        sock.curve_publickey = self.public
        sock.curve_secretkey = self.secret

    def client_for_child(self) -> CurveClient:
        """A fresh key pair admitted by this server, for a process the learner starts itself."""
        public, secret = zmq.curve_keypair()
        with self._lock:
            self._allowed.add(public)
        return CurveClient(public, secret, self.public)


def server_from_config(cfg) -> CurveServer | None:
    le = cfg.learner
    if not le.curve_secret_key:
        return None
    public, secret = load_secret(le.curve_secret_key, f"{cfg.source}: learner.curve_secret_key")
    authorized = load_authorized(le.curve_authorized_keys, f"{cfg.source}: learner.curve_authorized_keys")
    return CurveServer(public, secret, authorized)


def client_from_config(cfg) -> CurveClient | None:
    a = cfg.actors
    if not a.curve_secret_key:
        return None
    public, secret = load_secret(a.curve_secret_key, f"{cfg.source}: actors.curve_secret_key")
    server = load_public(a.curve_server_key, f"{cfg.source}: actors.curve_server_key")
    return CurveClient(public, secret, server)
