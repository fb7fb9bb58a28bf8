"""How throughput grows with actors and learner ranks, and how fast weights reach the actors.

    .venv/bin/python benchmarks/scaling.py [--config configs/halfcheetah_ppo.json] [--actors 1,2,4,8]
                                           [--ranks 1,2] [--steps 40960] [--weights-params 100M]
                                           [--json out.json] [--keep-runs DIR]

Part 1, in one run: for every (learner ranks, actors) pair (actors a multiple of ranks) the real
``launch/run_local.sh`` trains the config in ``vla`` mode for ``--steps`` env steps (evaluation and
checkpoints off, two rollouts per update whatever the number of actors, ranks on CPU with gloo:
``learner.devices = ["cpu"] * ranks``). Measured from the run's own logs, over the window from the
first rollout the learner received to the last:

- env steps/s: every env step the learner received (trained on, overwritten or dropped);
- learner samples/s: env steps the learner trained on.

Each is printed with its ratio to the 1-actor, 1-rank run of the same table. Ranks > 1 need
``actors`` to be a multiple of the ranks; other pairs are skipped.

Part 2: weight broadcast of a ``--weights-params`` bf16 policy to 2 local actors through the shared-
memory ring and through ZeroMQ (``benchmarks/weights_broadcast.py``), as bandwidth per actor and as a
ratio to a plain in-process memory copy of the same bytes measured in the same run.
"""

from __future__ import annotations

import argparse
import json
import shutil
import signal
import sys
import tempfile
from pathlib import Path

from _common import ROOT, BenchmarkError, finished_run, machine_info, raise_on_signal, run_launcher  # noqa: E402
from weights_broadcast import memcpy_seconds, parse_count, run_one  # noqa: E402


def measure(config: Path, ranks: int, actors: int, steps: int, run_dir: Path, timeout_s: float) -> dict:
    sets = ["trainer.buffer_type=async", "trainer.eval_freq=0", "trainer.save_freq=0",
            "trainer.rollouts_per_update=2", "trainer.buffer_capacity=8", "trainer.max_policy_lag=16"]
    if ranks > 1:
        sets.append("learner.devices=" + json.dumps(["cpu"] * ranks))
    args = ["--config", str(config), "--actors", str(actors), "--steps", str(steps)]
    for s in sets:
        args += ["--set", s]
    label = f"{ranks} rank(s) x {actors} actor(s)"
    wall, notes = run_launcher(args, run_dir, timeout_s, label)
    run, summary = finished_run(run_dir, label)
    rollouts = [e for r in range(ranks) for e in run.versions(("consume", "drop"), rank=r, missing_ok=True)]
    consumed = [e for e in rollouts if e["event"] == "consume"]
    received = [e.get("received") for e in rollouts if isinstance(e.get("received"), (int, float))]
    if len(received) < 2:
        raise BenchmarkError(f"{label}: too few rollouts logged in {run_dir}")
    window = max(received) - min(received)
    return {"ranks": ranks, "actors": actors, "wall_s": wall, "window_s": window,
            "env_sps": sum(e["env_steps"] for e in rollouts) / window,
            "learner_sps": sum(e["env_steps"] for e in consumed) / window,
            "updates": summary.get("updates"), "overwritten": summary.get("overwritten"),
            "dropped_lag": summary.get("dropped_lag"), "stop_notes": notes}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", type=Path, default=ROOT / "configs" / "halfcheetah_ppo.json")
    p.add_argument("--actors", default="1,2,4,8")
    p.add_argument("--ranks", default="1,2")
    p.add_argument("--steps", type=int, default=40960)
    p.add_argument("--timeout", type=float, default=600)
    p.add_argument("--weights-params", default="100M")
    p.add_argument("--json", type=Path, default=None)
    p.add_argument("--keep-runs", type=Path, default=None)
    args = p.parse_args()
    signal.signal(signal.SIGTERM, raise_on_signal)
    signal.signal(signal.SIGINT, raise_on_signal)
    info = machine_info()
    print(f"[scaling] {args.config.name}, {args.steps:,} env steps a run, vla mode | {info['cpus']} cpus", flush=True)
    base = Path(args.keep_runs) if args.keep_runs else Path(tempfile.mkdtemp(prefix="tandem-scaling-"))
    rows = []
    try:
        for ranks in [int(x) for x in args.ranks.split(",")]:
            for actors in [int(x) for x in args.actors.split(",")]:
                if actors % ranks:
                    continue
                row = measure(args.config, ranks, actors, args.steps, base / f"r{ranks}_a{actors}", args.timeout)
                rows.append(row)
                print(f"[scaling] {ranks} rank(s) x {actors} actor(s): {row['env_sps']:,.0f} env steps/s, "
                      f"{row['learner_sps']:,.0f} trained/s", flush=True)
    finally:
        if not args.keep_runs:
            shutil.rmtree(base, ignore_errors=True)
    ref = next((r for r in rows if r["ranks"] == 1 and r["actors"] == 1), rows[0])
    print(f"\n{'ranks':>5} {'actors':>6} {'env steps/s':>12} {'x 1x1':>6} {'trained/s':>10} {'x 1x1':>6} "
          f"{'overwritten':>11}")
    for r in rows:
        r["env_sps_ratio"], r["learner_sps_ratio"] = r["env_sps"] / ref["env_sps"], r["learner_sps"] / ref["learner_sps"]
        print(f"{r['ranks']:>5} {r['actors']:>6} {r['env_sps']:>12,.0f} {r['env_sps_ratio']:>6.2f} "
              f"{r['learner_sps']:>10,.0f} {r['learner_sps_ratio']:>6.2f} {r['overwritten']:>11}")
    params = parse_count(args.weights_params)
    base_s = memcpy_seconds(params, 3)
    nbytes = params * 2
    print(f"\nweights: {params / 1e6:,.0f}M bf16 parameters ({nbytes / 2**30:.2f} GiB) to 2 local actors; "
          f"memcpy {nbytes / base_s / 2**30:.2f} GiB/s")
    weights = []
    for transport in ("shm", "zmq"):
        r = run_one(params, 2, transport, 3)
        ratio = (nbytes / r["seconds"]) / (nbytes / base_s)
        weights.append({"transport": transport, "publish_to_use_s": r["seconds"], "ratio_vs_memcpy": ratio})
        print(f"  {transport}: publish-to-use {r['seconds'] * 1e3:.0f} ms, {nbytes / r['seconds'] / 2**30:.2f} GiB/s "
              f"per actor = {ratio:.2f} x memcpy")
    if args.json:
        args.json.write_text(json.dumps({"machine": info, "rows": rows, "weights": weights}, indent=1))
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except BenchmarkError as e:
        print(f"[scaling] {e}", file=sys.stderr)
        sys.exit(1)
