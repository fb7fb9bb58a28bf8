"""``python -m actors --config C --actor-id I [--run-dir D] [--endpoints F]``: one actor process."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from shared.config import ConfigError
from shared.envs.options import load_process_config
from shared.transport import read_endpoints


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m actors", description=__doc__)
    p.add_argument("--config", required=True, help="JSON config file")
    p.add_argument("--actor-id", type=int, required=True, help="0..num_actors-1")
    p.add_argument("--run-dir", type=Path, help="run directory of the learner (reads endpoints.json there, unless "
                   "--endpoints says where; the inference servers' files and emulated devices' locks are there)")
    p.add_argument("--endpoints", type=Path, help="path of the learner's endpoints.json (another host: copy it)")
    p.add_argument("--device", help="override the device (default: actors.devices[id %% len])")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="override a config key, e.g. --set actors.num_envs=16 (repeatable)")
    p.add_argument("--learner-timeout", type=float, default=120.0,
                   help="seconds without the learner before exiting (default 120)")
    args = p.parse_args(argv)
    cfg = load_process_config(args.config, args.set, f"[actor {args.actor_id}] %(message)s")
    if cfg is None:
        return 2
    if not 0 <= args.actor_id < cfg.actors.num_actors:
        print(f"--actor-id {args.actor_id}: must be in 0..{cfg.actors.num_actors - 1} (actors.num_actors in "
              f"{args.config})", file=sys.stderr)
        return 2
    path = args.endpoints or (args.run_dir / "endpoints.json" if args.run_dir else None)
    if path is None:
        print("give --run-dir or --endpoints so the actor can find the learner", file=sys.stderr)
        return 2
    try:
        endpoints = read_endpoints(path, timeout_s=args.learner_timeout)
    except TimeoutError as e:
        print(e, file=sys.stderr)
        return 1
    from actors.actor import run_actor_process
    from shared.security import KeyFileError
    from shared.wire import WireError
    try:
        return run_actor_process(cfg, args.actor_id, endpoints, device=args.device,
                                 learner_timeout_s=args.learner_timeout, lock_dir=args.run_dir or path.parent)
    except (KeyFileError, ConfigError) as e:
        print(f"actor {args.actor_id}: {e}", file=sys.stderr)
        return 2
    except WireError as e:   # actors.rollout_transport "ring": no ring, or not this run's (shared/rollout_ring.py)
        print(f"actor {args.actor_id}: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    from shared.teardown import exit_now
    exit_now(main())
