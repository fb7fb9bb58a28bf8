"""Summarise one or more run directories: evaluation curve, lag, drops, per-actor data, learner wait.

    python launch/summarize.py outputs/cartpole_ppo/20261122-150000 [RUN_DIR ...] [--at 200000 500000]

Reads only ``metrics.jsonl``, ``versions.jsonl`` and ``summary.json`` (what every run writes), through
``shared/run_dir.py``: a truncated last line is skipped, any other malformed line is an error naming the
file and line (exit status 2, after the other runs are printed).
"""

from __future__ import annotations

import argparse
import sys
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from shared.run_dir import RunDir, RunDirError  # noqa: E402


def summarize(path: Path, at: list[int], threshold: float | None) -> str:
    run = RunDir(path)
    metrics = run.metrics(missing_ok=True)
    versions = run.versions(missing_ok=True)
    updates = [m for m in metrics if "loss/policy" in m]
    evals = [m for m in metrics if "eval/return_mean" in m]
    start = min((v["time"] for v in versions if v.get("event") == "publish"), default=None)
    out = [f"== {path}"]
    if evals:
        out.append("  env_steps   wall_s   eval_return")
        for e in evals:
            wall = e.get("wall_s", (e["time"] - start) if start else float("nan"))
            out.append(f"  {e['env_steps']:>9}  {wall:7.1f}   {e['eval/return_mean']:10.1f} ± {e.get('eval/return_std', 0):.1f}")
        for step in at:
            before = [e for e in evals if step * 0.95 <= e["env_steps"] <= step * 1.02]
            if before:
                e = before[-1]
                out.append(f"  at {step}: eval {e['eval/return_mean']:.1f} (env_steps {e['env_steps']}, "
                           f"wall {e.get('wall_s', float('nan')):.1f} s)")
        if threshold is not None:
            hit = next((e for e in evals if e["eval/return_mean"] >= threshold), None)
            out.append(f"  first eval >= {threshold}: " + (f"{hit['env_steps']} env steps, {hit.get('wall_s', float('nan')):.1f} s"
                                                          if hit else "never"))
    consumed = [v for v in versions if v.get("event") == "consume"]
    dropped = [v for v in versions if v.get("event") == "drop"]
    if consumed:
        lags = [v["lag"] for v in consumed]
        out.append(f"  consumed {len(consumed)} rollouts, lag mean {sum(lags) / len(lags):.2f} max {max(lags)}; "
                   f"per actor {dict(sorted(Counter(v['actor'] for v in consumed).items()))}")
    if dropped:
        out.append(f"  dropped {len(dropped)}: {dict(Counter(v.get('reason', '?') for v in dropped))}")
    if updates:
        wait = sum(u.get("perf/learner_wait_s", 0) for u in updates)
        upd = sum(u.get("perf/update_s", 0) for u in updates)
        out.append(f"  {len(updates)} updates: {upd:.1f} s updating, {wait:.1f} s waiting for data "
                   f"({100 * wait / max(wait + upd, 1e-9):.0f}% of the learner's time)")
    s = run.summary()
    if s is not None:
        out.append(f"  summary: {s.get('env_steps')} env steps, version {s.get('version')}, wall {s.get('wall_s', 0):.1f} s, "
                   f"exit {s.get('exit_code')}")
    return "\n".join(out)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("runs", nargs="+", type=Path)
    p.add_argument("--at", type=int, nargs="*", default=[], help="report the last evaluation at these env steps")
    p.add_argument("--threshold", type=float, help="report the first evaluation reaching this return")
    args = p.parse_args()
    status = 0
    for run in args.runs:
        try:
            print(summarize(run, args.at, args.threshold))
        except RunDirError as e:   # a missing directory, a malformed line (file:line): the other runs still print
            print(f"summarize.py: {e}", file=sys.stderr)
            status = 2
    return status


if __name__ == "__main__":
    sys.exit(main())
