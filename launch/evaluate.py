"""Evaluate a run's checkpoint (or the model it started from) on held-out episodes.

    python launch/evaluate.py RUN_DIR                          # the newest checkpoint, 1,000 episodes
    python launch/evaluate.py RUN_DIR --checkpoint best        # trainer.keep_best's choice
    python launch/evaluate.py RUN_DIR --checkpoint none        # the policy before training (the pretrained model)
    python launch/evaluate.py --config configs/vla_tokens_reach_grpo.json --checkpoint none \\
        --set policy.vla_config.model_path=benchmarks/pretrained/tokens_reach_intel
    python launch/evaluate.py RUN_DIR --episodes 2000 --json eval.json

The policy acts deterministically, as in the run's own evaluations, on ``--batch`` envs at a time;
batch k resets with seed ``--seed + k``. The default seed, ``trainer.seed + 2,000,003``, lies outside
the range the run's in-run evaluations draw from (``trainer.seed + 1,000,003 + count``), so a
checkpoint chosen on those (``--checkpoint best``) is measured here on episodes it was not chosen on.
Two checkpoints evaluated with the same seed play the same episodes.

The config is the run's own ``RUN_DIR/config.json`` (``--config`` replaces it, ``--set`` overrides
keys). A checkpoint trained on another frozen base (LoRA on a different ``vla_config.model_path``)
is refused, with both digests. Prints the success rate (where the env reports success) and the mean
return, each with a 95% interval, and per-batch figures.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from learner.checkpoint import list_checkpoints, load_checkpoint, load_policy_tensors_  # noqa: E402
from learner.evaluator import evaluate  # noqa: E402
from shared.config import Config, ConfigError, load_config  # noqa: E402
from shared.envs import check_env_config, make_env  # noqa: E402
from shared.instructions import instruction_tokenizer  # noqa: E402
from shared.policies import frozen_digest, make_policy  # noqa: E402

HELD_OUT = 2_000_003   # default seed offset: beyond the in-run evaluations' trainer.seed + 1,000,003 + count


class EvaluateError(Exception):
    """A run directory, config or checkpoint this script cannot use: the message says which and why."""


def resolve_checkpoint(run_dir: Path | None, which: str) -> Path | None:
    """``latest``, ``best``, ``none`` (no checkpoint: the policy as the config builds it) or a path."""
    if which == "none":
        return None
    if which in ("latest", "best"):
        if run_dir is None:
            raise EvaluateError(f"--checkpoint {which} needs a run directory")
        if which == "best":
            path = run_dir / "checkpoints" / "best.pt"
            if not path.is_file():
                raise EvaluateError(f"{path}: no best checkpoint (the run needs trainer.keep_best: true and one "
                                    f"evaluation)")
            return path
        found = list_checkpoints(run_dir / "checkpoints")
        if not found:
            raise EvaluateError(f"{run_dir / 'checkpoints'}: no checkpoint (ckpt_*.pt)")
        return found[-1]
    path = Path(which)
    if not path.is_file():
        raise EvaluateError(f"{path}: checkpoint file not found")
    return path


def load_policy_checkpoint(policy: torch.nn.Module, path: Path) -> dict:
    """Load a learner checkpoint (``ckpt_*.pt``) or ``best.pt`` into `policy`; returns the checkpoint.
    Refuses one trained on another frozen base."""
    try:
        state = load_checkpoint(path)
    except RuntimeError as e:
        raise EvaluateError(str(e)) from None
    if not isinstance(state, dict) or not isinstance(state.get("policy"), dict):
        raise EvaluateError(f"{path}: not a Tandem checkpoint (no 'policy' tensors)")
    saved = state.get("base_digest")
    if saved is not None and saved != (mine := frozen_digest(policy)):
        raise EvaluateError(f"{path} was trained on another base model (frozen weights digest {str(saved)[:16]}, "
                            f"this config's is {mine[:16]}): check policy.vla_config.model_path")
    try:
        load_policy_tensors_(policy, state["policy"])
    except Exception as e:
        raise EvaluateError(f"{path}: its policy tensors do not fit this config's policy: {e}") from None
    return state


def ci95(values: list[float]) -> float:
    """Half-width of the normal 95% interval of the mean."""
    n = len(values)
    if n < 2:
        return float("nan")
    mean = sum(values) / n
    var = sum((v - mean) ** 2 for v in values) / (n - 1)
    return 1.96 * math.sqrt(var / n)


def run_evaluation(cfg: Config, checkpoint: Path | None, episodes: int, batch: int, seed: int,
                   device: str = "cpu", say=print) -> dict:
    """Evaluate `checkpoint` (None: the untrained or pretrained policy) on `episodes` deterministic
    episodes, `batch` envs at a time, batch k reset with seed ``seed + k``. Returns the figures."""
    t0 = time.perf_counter()
    tokenizer = instruction_tokenizer(cfg)
    env = make_env(cfg.env.id, min(batch, episodes), cfg.env.cfg, device, tokenizer=tokenizer)
    try:
        policy = make_policy(cfg, env.spec, describe=True).to(device).eval()
        state = load_policy_checkpoint(policy, checkpoint) if checkpoint is not None else {}
        returns: list[float] = []
        successes: list[bool] = []
        lengths: list[int] = []
        per_batch = []
        k = 0
        while len(returns) < episodes:
            n = min(batch, episodes - len(returns))
            if n != env.num_envs:
                env.close()
                env = make_env(cfg.env.id, n, cfg.env.cfg, device, tokenizer=tokenizer)
            result = evaluate(policy, env, n, seed=seed + k)
            r, ln, s = result.returns, result.lengths, result.successes
            if not r:
                raise EvaluateError(f"batch {k} (seed {seed + k}) ended no episode within the env's step limit")
            returns += r
            lengths += ln
            successes += s
            row = {"seed": seed + k, "episodes": len(r), "return_mean": sum(r) / len(r)}
            if s:
                row["success_rate"] = sum(s) / len(s)
            per_batch.append(row)
            say(f"  batch {k}: seed {seed + k}, {len(r)} episodes, return {row['return_mean']:.3f}"
                + (f", success {100 * row['success_rate']:.1f}%" if s else ""))
            k += 1
    finally:
        env.close()
    out = {"checkpoint": str(checkpoint) if checkpoint is not None else None,
           "version": state.get("version"), "env_steps": state.get("env_steps"),
           "chosen_on": state.get("eval"), "env": cfg.env.id, "episodes": len(returns), "seed": seed,
           "batch": batch, "return_mean": sum(returns) / len(returns), "return_ci95": ci95(returns),
           "length_mean": sum(lengths) / len(lengths), "per_batch": per_batch,
           "wall_s": time.perf_counter() - t0}
    if len(successes) == len(returns):
        out["success_rate"] = sum(successes) / len(successes)
        out["success_ci95"] = ci95([float(x) for x in successes])
    return out


def main(argv: list[str] | None = None) -> int:
    import logging
    logging.basicConfig(level=logging.INFO, format="[evaluate] %(message)s")   # what the policy adapts, once
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("run_dir", nargs="?", type=Path, help="a run directory (config.json, checkpoints/)")
    ap.add_argument("--config", type=Path, help="config file (default: RUN_DIR/config.json)")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=JSON", help="override a config key")
    ap.add_argument("--checkpoint", default="latest", help="latest (default), best, none, or a checkpoint file")
    ap.add_argument("--episodes", type=int, default=1000)
    ap.add_argument("--batch", type=int, default=200, help="envs per batch (default 200)")
    ap.add_argument("--seed", type=int, default=None,
                    help=f"seed of the first batch (default trainer.seed + {HELD_OUT:,}: held-out episodes)")
    ap.add_argument("--device", default=None, help="where the envs and the policy run (default trainer.eval_device)")
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    ap.add_argument("--json", type=Path, help="also write the figures to this file")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    try:
        if args.episodes < 1 or args.batch < 1:
            raise EvaluateError("--episodes and --batch must be at least 1")
        config = args.config or (args.run_dir / "config.json" if args.run_dir is not None else None)
        if config is None:
            raise EvaluateError("give a run directory or --config")
        cfg = load_config(config, args.set)
        check_env_config(cfg)   # env.cfg's keys and values, the instruction tokenizer: one message, no traceback
        checkpoint = resolve_checkpoint(args.run_dir, args.checkpoint)
        seed = args.seed if args.seed is not None else cfg.trainer.seed + HELD_OUT
        print(f"[evaluate] {checkpoint or 'no checkpoint (the policy the config builds)'} | {cfg.env.id} | "
              f"{args.episodes} episodes, {args.batch} envs per batch, seeds {seed}..", flush=True)
        out = run_evaluation(cfg, checkpoint, args.episodes, args.batch, seed, args.device or cfg.trainer.eval_device,
                             say=lambda s: print(s, flush=True))
    except (EvaluateError, ConfigError) as e:
        print(f"[evaluate] error: {e}", file=sys.stderr)
        return 2
    line = (f"[evaluate] {out['episodes']} episodes: return {out['return_mean']:.3f} ± {out['return_ci95']:.3f}")
    if "success_rate" in out:
        line += f" | success {100 * out['success_rate']:.1f}% ± {100 * out['success_ci95']:.1f}"
    if out["version"] is not None:
        line += f" | version {out['version']} at {out['env_steps']} env steps"
    if out["chosen_on"]:
        c = out["chosen_on"]
        line += f" | chosen on {c['episodes']} episodes at seed {c['seed']} ({c['metric']} {c['score']:.4g})"
    print(line + f" | {out['wall_s']:.1f} s", flush=True)
    if args.json:
        args.json.write_text(json.dumps(out, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    from shared.teardown import exit_now
    exit_now(main())
