"""Compare off-policy corrections on identical data: replay recorded runs with each correction and
evaluate the final weights.

    launch/sweep_staleness.sh configs/pendulum_ppo.json --sync "1 4 16 32" --corrections none \\
        --seeds "1 2 3" --set trainer.record=true --out SWEEP
    python launch/replay_corrections.py SWEEP/sync*_none_s* --corrections "none is vtrace appo ewma mask" \\
        --episodes 20 --out SWEEP/replay

Each RUN must have been recorded (``--record``, or ``--set trainer.record=true``). For each run and
each correction, ``launch/replay.py`` retrains from fresh weights on exactly the batches the run's
learner trained on, in the same order and at the same lags (so the only difference is the
correction), and the final weights play ``--episodes`` deterministic episodes. Runs are grouped by
``actors.sync_every`` (the controlled lag); seeds within a group give mean ± std. Writes
``replay.md`` (a table: mean lag and final return per correction) and ``replay.json`` to ``--out``,
and prints the table. ``replay.json`` is rewritten after every result, and a later call with the same
``--out`` keeps its rows and replays only the (run, correction) pairs it lacks at the same
``--episodes`` and ``--eval-seed``: a long comparison survives an interruption, and another lag's
runs can be added to the same table.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "launch"))

import torch  # noqa: E402
from tensordict import TensorDict  # noqa: E402

import replay as replay_tool  # noqa: E402
from learner.corrections import CORRECTIONS  # noqa: E402  (the registry: every correction a config can name)
from learner.evaluator import evaluate  # noqa: E402
from shared import keys  # noqa: E402
from shared.config import ConfigError, load_config  # noqa: E402
from shared.envs import make_env  # noqa: E402
from shared.instructions import instruction_tokenizer  # noqa: E402
from shared.run_dir import RunDir, RunDirError  # noqa: E402


def record_mean_lag(run_dir: Path) -> float:
    """The mean lag of every sample the run trained on, from its record (version at the update
    minus the version that acted)."""
    run = RunDir(run_dir)
    total = count = 0
    for entry in run.record_index():
        versions = TensorDict.load_memmap(run.path / "record" / entry["dir"])[keys.POLICY_VERSION]
        total += float((entry["version"] - versions).double().sum())
        count += versions.numel()
    return total / max(count, 1)


def evaluate_final(learner, episodes: int, seed: int) -> float:
    cfg = learner.cfg
    env = make_env(cfg.env.id, episodes, cfg.env.cfg, "cpu", tokenizer=instruction_tokenizer(cfg))
    try:
        policy = learner.policy.to("cpu").eval()
        returns = evaluate(policy, env, episodes, seed).returns
    finally:
        env.close()
    return sum(returns) / len(returns)


def _mean_std(xs: list[float]) -> tuple[float, float]:
    m = sum(xs) / len(xs)
    return m, math.sqrt(sum((x - m) ** 2 for x in xs) / len(xs))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("runs", nargs="+", type=Path, help="recorded run directories")
    p.add_argument("--corrections", default=" ".join(CORRECTIONS))
    p.add_argument("--episodes", type=int, default=20, help="deterministic evaluation episodes per result")
    p.add_argument("--eval-seed", type=int, default=12345)
    p.add_argument("--set", dest="sets", action="append", default=[], metavar="KEY=VALUE",
                   help="further override for every replay (repeatable)")
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)
    corrections = args.corrections.split()
    unknown = [c for c in corrections if c not in CORRECTIONS]
    if unknown or not corrections:
        print(f"replay_corrections.py: --corrections: unknown {unknown} (choose from {', '.join(CORRECTIONS)})",
              file=sys.stderr)
        return 2
    if args.episodes < 1:
        print("replay_corrections.py: --episodes must be >= 1", file=sys.stderr)
        return 2
    try:
        rows = load_rows(args.out)
    except ValueError as e:
        print(f"replay_corrections.py: {e}", file=sys.stderr)
        return 2
    done = {(r["run"], r["correction"]) for r in rows
            if r.get("episodes") == args.episodes and r.get("eval_seed") == args.eval_seed}
    for run in args.runs:
        todo = [c for c in corrections if (str(run), c) not in done]
        if not todo:
            print(f"[replay] {run.name}: every correction done before, kept", flush=True)
            continue
        try:
            cfg = load_config(RunDir(run).require("config.json"))
            lag = record_mean_lag(run)
        except (ConfigError, RunDirError, OSError) as e:
            print(f"replay_corrections.py: {run}: {e}", file=sys.stderr)
            return 2
        for corr in todo:
            t0 = time.time()
            try:
                learner = replay_tool.replay(run, [f"algorithm.cfg.correction={corr}", *args.sets])
            except (ConfigError, RunDirError) as e:
                print(f"replay_corrections.py: {run}: {e}", file=sys.stderr)
                return 2
            ret = evaluate_final(learner, args.episodes, args.eval_seed)
            rows = [r for r in rows if (r["run"], r["correction"]) != (str(run), corr)]
            rows.append({"run": str(run), "sync_every": cfg.actors.sync_every, "seed": cfg.trainer.seed,
                         "mean_lag": lag, "correction": corr, "return": ret, "updates": learner.updates,
                         "replay_s": time.time() - t0, "episodes": args.episodes, "eval_seed": args.eval_seed})
            if args.out is not None:
                write_rows(args.out, rows)
            print(f"[replay] {run.name}: {corr:6s} lag {lag:5.2f}  return {ret:9.1f}  "
                  f"({learner.updates} updates, {time.time() - t0:.0f} s)", flush=True)
            del learner
    table = render([r for r in rows if r["correction"] in corrections and r.get("episodes") == args.episodes
                    and r.get("eval_seed") == args.eval_seed], corrections)
    print(table)
    if args.out is not None:
        write_rows(args.out, rows)
        (args.out / "replay.md").write_text(
            "# Corrections compared on identical data (launch/replay_corrections.py)\n\n"
            f"Final return of the replayed weights, {args.episodes} deterministic episodes, "
            "mean ± std over the seeds of each lag.\n\n" + table + "\n")
    return 0


def load_rows(out: Path | None) -> list[dict]:
    """The results an earlier call wrote to `out` (none without one)."""
    path = None if out is None else out / "replay.json"
    if path is None or not path.exists():
        return []
    try:
        rows = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"{path}: not a results file of this tool ({e}); move it away or choose another --out")
    need = {"run", "sync_every", "seed", "mean_lag", "correction", "return"}
    if not isinstance(rows, list) or not all(isinstance(r, dict) and need <= set(r) for r in rows):
        raise ValueError(f"{path}: not a results file of this tool (a list of rows with {sorted(need)}); "
                         "move it away or choose another --out")
    return rows


def write_rows(out: Path, rows: list[dict]) -> None:
    """``replay.json``, replaced whole (written aside, then renamed): an interruption leaves the last one."""
    out.mkdir(parents=True, exist_ok=True)
    tmp = out / "replay.json.tmp"
    tmp.write_text(json.dumps(rows, indent=1))
    tmp.replace(out / "replay.json")


def render(rows: list[dict], corrections: list[str]) -> str:
    groups: dict[int, list[dict]] = {}
    for r in rows:
        groups.setdefault(r["sync_every"], []).append(r)
    head = "| sync_every | mean lag | seeds | " + " | ".join(corrections) + " |"
    lines = [head, "|" + "---|" * 3 + "---:|" * len(corrections)]
    for k in sorted(groups):
        g = groups[k]
        lag = _mean_std([r["mean_lag"] for r in g if r["correction"] == corrections[0]])[0]
        seeds = sorted({r["seed"] for r in g})
        cells = []
        for c in corrections:
            xs = [r["return"] for r in g if r["correction"] == c]
            m, s = _mean_std(xs)
            cells.append(f"{m:.1f} ± {s:.1f}" if len(xs) > 1 else f"{m:.1f}")
        lines.append(f"| {k} | {lag:.2f} | {len(seeds)} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
