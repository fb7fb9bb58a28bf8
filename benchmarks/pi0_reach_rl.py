"""π0 fine-tuned with RL on tandem/Reach-v0: the success the cloned model starts from and the success
after RL, on the same held-out episodes, for runs of ``configs/pi0_reach_ppo.json`` (Flow-Noise PPO) and
``configs/pi0_reach_grpo.json`` (Flow-SDE GRPO) started from ``launch/pretrain_pi0_reach.py``'s checkpoint.

For each run directory it runs ``launch/evaluate.py`` three times on the same held-out episodes (the
evaluator's default held-out seed, 200 episodes): ``--checkpoint none`` (the cloned model the run started
from), ``--checkpoint latest`` (the run's final weights) and ``--checkpoint best`` (the weights
``trainer.keep_best`` chose on the run's own periodic evaluations, which play other episodes); and it reads from the run's own
``metrics.jsonl`` the wall time at which its periodic evaluations first reached a success rate (the
``--target``, linearly interpolated between evaluations)::

    .venv/bin/python benchmarks/pi0_reach_rl.py outputs/pi0_rl/* --json docs/results/pi0_reach_rl.json \\
        --date ... --machine ... --command ...

Run directories are named ``<algorithm>_<mode>_s<seed>`` (e.g. ``ppo_async_s1``); a mode may carry a tag
after a dash (``ppo_async-is_s1``) to keep two groups of one mode apart, which the table tells apart by
the runs' correction and flow method (their ``config.json``).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from launch.staleness_runs import eval_points, first_crossing, load_run  # noqa: E402


# README's headline row: PPO in async mode with its default correction, and GRPO
HEADLINE = [{"rank": 7, "label": "π0 fine-tuned with RL (Reach toy)",
             "text": "Flow-Noise PPO adds {0} points of success to a behaviour-cloned tiny π0 (2 seeds, 200 held-out "
                     "episodes each, 200k env steps, async mode); Flow-SDE GRPO {1} (3 seeds)",
             "values": [{"match": {"algorithm": "ppo", "mode": "async", "correction": "trust"}, "key": "gain",
                         "agg": "mean", "fmt": "+.1f"},
                        {"match": {"algorithm": "grpo", "mode": "async", "method": "Flow-SDE, noise_level 0.7"},
                         "key": "gain", "agg": "mean", "fmt": "+.1f"}]}]


def _evaluate(run_dir: Path, checkpoint: str, episodes: int) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "eval.json"
        subprocess.run([sys.executable, str(ROOT / "launch" / "evaluate.py"), str(run_dir), "--checkpoint", checkpoint,
                        "--episodes", str(episodes), "--threads", "1", "--json", str(out)], check=True, cwd=ROOT)
        return json.loads(out.read_text())


def _time_to(run_dir: Path, target: float) -> float | None:
    """Seconds from the run's start until its periodic evaluations first reached `target` success: the
    staleness report's crossing (``staleness_runs.first_crossing``: interpolated between evaluations, at
    the time the evaluated version was published)."""
    crossing = first_crossing(eval_points(load_run(run_dir), "eval/success_rate"), target)
    return None if crossing is None else crossing.wall_s


def record(run_dir: Path, episodes: int, target: float) -> dict[str, Any]:
    algorithm, mode, seed = run_dir.name.split("_")
    mode = mode.split("-")[0]   # "async-is": a second async group, told apart by its correction
    config = json.loads((run_dir / "config.json").read_text())
    correction = config["algorithm"]["cfg"].get("correction") or "–"
    flow = config["policy"]["flow_config"]
    method = (f"Flow-SDE, noise_level {flow['noise_level']:g}" if flow.get("method") == "sde" else
              f"Flow-Noise, std {flow['noise_std_min']:g}-{flow['noise_std_max']:g}")
    start, end = _evaluate(run_dir, "none", episodes), _evaluate(run_dir, "latest", episodes)
    best = _evaluate(run_dir, "best", episodes)
    summary = json.loads((run_dir / "summary.json").read_text())
    return {"algorithm": algorithm, "mode": mode, "correction": correction, "method": method,
            "seed": int(seed.lstrip("s")),
            "cloned": 100 * start["success_rate"], "fine_tuned": 100 * end["success_rate"],
            "gain": 100 * (end["success_rate"] - start["success_rate"]), "held_out_seed": end["seed"],
            "best": 100 * best["success_rate"], "gain_best": 100 * (best["success_rate"] - start["success_rate"]),
            "best_version": best["version"],
            "env_steps": end["env_steps"], "wall_s": summary.get("wall_s"), "time_to_target": _time_to(run_dir, target)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("runs", type=Path, nargs="+")
    p.add_argument("--json", type=Path, required=True)
    p.add_argument("--episodes", type=int, default=200)
    p.add_argument("--target", type=float, default=0.6, help="success rate whose wall time is reported")
    p.add_argument("--date", required=True)
    p.add_argument("--machine", required=True)
    p.add_argument("--command", required=True)
    p.add_argument("--note", action="append", default=[])
    args = p.parse_args(argv)
    records = [record(r, args.episodes, args.target) for r in args.runs]
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    group_by = ["algorithm", "mode", "correction", "method"]
    groups = sorted({tuple(r[k] for k in group_by) for r in records})
    reference = next((g for g in groups if g[:2] == ("ppo", "standard")), None)

    def reached(group: tuple[str, ...] | None) -> bool:
        return group is not None and any(r["time_to_target"] is not None for r in records
                                         if tuple(r[k] for k in group_by) == group)
    doc = {"title": "π0 fine-tuned with RL on Reach: success before and after, on held-out episodes",
           "question": "How many points of success does RL add to a behaviour-cloned flow-matching π0 (Flow-Noise "
                       "PPO, Flow-SDE GRPO) within 200k env steps, and how long does it take in async and in "
                       "standard mode?",
           "date": args.date, "machine": args.machine, "command": args.command, "commit": commit,
           "source": "launch/evaluate.py --checkpoint none / latest / best on each run directory (200 held-out episodes, "
                     "the same for all three), and the runs' metrics.jsonl (benchmarks/pi0_reach_rl.py)",
           "records": records, "group_by": group_by,
           "columns": [{"key": "seed", "label": "seeds", "agg": "count", "fmt": "d"},
                       {"key": "cloned", "label": "cloned success %", "agg": "mean", "fmt": ".1f"},
                       {"key": "fine_tuned", "label": "after RL %", "agg": "mean", "fmt": ".1f"},
                       {"key": "fine_tuned", "label": "after RL, per seed", "agg": "list", "fmt": ".1f"},
                       {"key": "gain", "label": "points added", "agg": "mean_sd", "fmt": ".1f"},
                       {"key": "best", "label": "best kept %", "agg": "mean", "fmt": ".1f"},
                       {"key": "gain_best", "label": "points added, best kept", "agg": "mean_sd", "fmt": ".1f"},
                       {"key": "env_steps", "label": "env steps", "agg": "mean", "fmt": ".0f"},
                       {"key": "wall_s", "label": "run wall s", "agg": "mean", "fmt": ".0f"},
                       {"key": "time_to_target", "label": f"wall s to {100 * args.target:.0f}% (periodic evals)",
                        "agg": "mean", "fmt": ".0f"}],
           "ratios": [{"label": f"{g[0]} {g[1]} ({g[2] if g[0] == 'ppo' else g[3]}): wall s to "
                                f"{100 * args.target:.0f}% / ppo standard's",
                       "key": "time_to_target", "agg": "mean", "numerator": dict(zip(group_by, g)),
                       "denominator": dict(zip(group_by, reference))}
                      for g in groups if g != reference and reached(g) and reached(reference)],
           "notes": args.note, "headline": HEADLINE}
    args.json.write_text(json.dumps(doc, indent=1) + "\n")
    for r in records:
        print(r)
    print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
