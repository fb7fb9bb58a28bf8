"""``python -m learner --config C [--run-dir D] [--resume] [--set KEY=VALUE ...]``: the learner process."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from shared.config import ConfigError
from shared.envs.options import load_process_config


def default_run_dir(cfg) -> Path:
    return Path(cfg.trainer.output_dir) / cfg.trainer.exp_name / time.strftime("%Y%m%d-%H%M%S")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m learner", description=__doc__)
    p.add_argument("--config", required=True, help="JSON config file")
    p.add_argument("--run-dir", type=Path, help="where logs and checkpoints go "
                   "(default: <output_dir>/<exp_name>/<date-time>)")
    p.add_argument("--resume", action="store_true",
                   help="continue from the newest intact checkpoint in --run-dir (damaged ones are skipped, named)")
    p.add_argument("--resume-from", type=Path, metavar="FILE",
                   help="continue from this checkpoint (of --run-dir's run, or another); no fallback if it is damaged")
    p.add_argument("--no-eval", action="store_true", help="do not start the evaluator process")
    p.add_argument("--discard", action="store_true",
                   help="benchmark: receive and count rollouts without training (transport cost alone)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="override a config key, e.g. --set trainer.total_steps=50000 (repeatable)")
    args = p.parse_args(argv)
    cfg = load_process_config(args.config, args.set, "[learner] %(message)s")
    if cfg is None:
        return 2
    if args.resume and args.run_dir is None:
        print("--resume needs --run-dir (the run to continue)", file=sys.stderr)
        return 2
    if args.resume_from is not None and not args.resume_from.is_file():
        print(f"--resume-from: {args.resume_from}: no such file", file=sys.stderr)
        return 2
    from learner.checkpoint import CheckpointError
    from learner.process import run_learner_process
    from shared.security import KeyFileError
    try:
        return run_learner_process(cfg, args.run_dir or default_run_dir(cfg), resume=args.resume_from or args.resume,
                                   evaluator=not args.no_eval, discard=args.discard)
    except (FileNotFoundError, KeyFileError, ConfigError, CheckpointError) as e:   # ConfigError: e.g. the model's vocabulary
        print(e, file=sys.stderr)
        return 2
    except OSError as e:   # the run directory cannot be written at start-up (a full disk, no permission)
        print(f"[learner] cannot write the run directory {e.filename or ''}: [Errno {e.errno}] {e.strerror}",
              file=sys.stderr)
        return 1


if __name__ == "__main__":
    from shared.teardown import exit_now
    exit_now(main())
