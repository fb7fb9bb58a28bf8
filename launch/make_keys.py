"""Generate the CURVE key pairs for a run across hosts.

    python launch/make_keys.py KEYS_DIR [--clients host-a host-b ...]

writes, in KEYS_DIR:

- ``learner.key_secret`` (mode 0600): the learner's secret certificate -- stays on the learner host;
- ``learner.key``: its public certificate -- copy it to every actor host;
- ``<client>.key_secret`` (mode 0600) for each client (default: one, ``actors``) -- copy each to its
  actor host only;
- ``authorized/<client>.key``: the clients' public certificates -- the learner admits these and no one else.

Then set, in the config (or with ``--set``)::

    "learner": {"host": "0.0.0.0", "curve_secret_key": "KEYS_DIR/learner.key_secret",
                "curve_authorized_keys": "KEYS_DIR/authorized"},
    "actors":  {"curve_secret_key": "KEYS_DIR/<client>.key_secret", "curve_server_key": "KEYS_DIR/learner.key"}

An existing key file is never overwritten (use a new directory to rotate keys). To revoke a client,
delete its file from ``authorized/`` and restart the learner.
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from shared.security import generate_keypair  # noqa: E402


def make_keys(keys_dir: Path, clients: list[str]) -> list[Path]:
    """Create the learner's and each client's key pair; returns the files written."""
    bad = [c for c in clients if not re.fullmatch(r"[A-Za-z0-9_.-]+", c) or c == "learner"]
    if bad:
        raise ValueError(f"client names must be [A-Za-z0-9_.-]+ and not 'learner': {bad}")
    if len(set(clients)) != len(clients):
        raise ValueError(f"client names repeat: {clients}")
    names = ["learner", *clients]
    existing = [p for n in names for p in (keys_dir / f"{n}.key", keys_dir / f"{n}.key_secret") if p.exists()]
    if existing:
        raise FileExistsError(f"{existing[0]}: exists; key files are never overwritten (use a new directory)")
    written = []
    for name in names:
        pub, sec = generate_keypair(keys_dir, name)
        written += [pub, sec]
        if name != "learner":
            authorized = keys_dir / "authorized"
            authorized.mkdir(exist_ok=True)
            (authorized / pub.name).write_bytes(pub.read_bytes())
            written.append(authorized / pub.name)
    return written


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("keys_dir", type=Path)
    p.add_argument("--clients", nargs="+", default=["actors"], help="one key pair per name (default: actors)")
    args = p.parse_args(argv)
    try:
        written = make_keys(args.keys_dir, args.clients)
    except (ValueError, FileExistsError) as e:
        print(f"make_keys.py: {e}", file=sys.stderr)
        return 2
    for path in written:
        print(path)
    d = args.keys_dir
    print(f"\nlearner: --set learner.curve_secret_key={d}/learner.key_secret "
          f"--set learner.curve_authorized_keys={d}/authorized")
    print(f"actors:  --set actors.curve_secret_key={d}/{args.clients[0]}.key_secret "
          f"--set actors.curve_server_key={d}/learner.key")
    return 0


if __name__ == "__main__":
    sys.exit(main())
