"""In-flight weight updates at VLA-like acting speed: ``actors.weights_at: rollout`` against ``step``.

    .venv/bin/python benchmarks/inflight_latency.py [--config configs/cartpole_ppo.json] [--latency 0.03]
                     [--actors 4] [--num-envs 16] [--buffer-size 64] [--steps 100000] [--seeds 1,2,3]
                     [--max-lag 8] [--keep-runs DIR] [--png inflight_latency.png] [--json out.json]
                     [--set KEY=VALUE ...]

Every run is the real ``launch/run_local.sh`` (learner, evaluator and ``--actors`` actor processes on
loopback) in vla mode with ``trainer.lag_policy=pace``, the default that discards nothing. Each
acting call sleeps ``--latency`` seconds (``actors.inference_latency_s``: a large model's forward
pass; every actor has its own inference engine). The learner updates on every rollout
(``trainer.rollouts_per_update=1``), so while one actor collects its ``--buffer-size``-step rollout
the learner trains on the others' rollouts: a rollout spans about ``--actors`` updates.
``trainer.max_policy_lag`` (``--max-lag``, 8) is loose enough that pace holds neither setting back.

- ``rollout``: an actor takes new weights at its rollout boundaries only; every step of a rollout
  is acted by the version it started with.
- ``step``: an actor polls for newer weights between env steps and switches at once, so the later
  steps of a rollout are acted by newer versions.

The settings alternate within each seed (rollout, step, rollout, step, ...), so a slow stretch of
the machine hits both. Per run: the mean and p95 policy lag of the trained samples and the share
of rollouts acted by more than one version (from ``versions.jsonl``, as ``launch/staleness.py``
computes them), env steps/s over the training window (first rollout received to last),
and the final return (mean of the last 3 evaluations, as the staleness report). The PNG shows
evaluation return against wall time, one line per run.
"""

from __future__ import annotations

import argparse
import json
import shutil
import signal
import statistics
import sys
import tempfile
from pathlib import Path

from _common import ROOT, BenchmarkError, machine_info, raise_on_signal, run_launcher  # noqa: E402

sys.path.insert(0, str(ROOT / "launch"))
from staleness import load_run  # noqa: E402

SETTINGS = ("rollout", "step")


def overrides(a: argparse.Namespace, setting: str, seed: int) -> list[str]:
    sets = [f"trainer.seed={seed}", f"trainer.total_steps={a.steps}", "trainer.buffer_type=async",
            "trainer.lag_policy=pace", f"trainer.max_policy_lag={a.max_lag}", "trainer.rollouts_per_update=1",
            f"trainer.buffer_size={a.buffer_size}", f"trainer.eval_freq={max(a.steps // 10, 1)}",
            "trainer.save_freq=0", f"actors.num_actors={a.actors}", f"actors.num_envs={a.num_envs}",
            f"actors.inference_latency_s={a.latency}", f"actors.weights_at={setting}", *a.sets]
    out = []
    for s in sets:
        out += ["--set", s]
    return out


def measure(run_dir: Path, setting: str, seed: int, wall: float) -> dict:
    run = load_run(run_dir)
    s = run.summary
    first, last = s.get("first_rollout_time"), s.get("last_rollout_time")
    window = (last - first) if isinstance(first, (int, float)) and isinstance(last, (int, float)) else None
    curve = [(run.since_start(e), float(e["eval/return_mean"])) for e in run.evals]
    return {"setting": setting, "seed": seed, "launcher_wall_s": round(wall, 1),
            "window_s": None if window is None else round(window, 2),
            "env_steps": run.env_steps, "updates": run.updates,
            "sps": None if not window else round(run.env_steps / window, 1),
            "mean_lag": run.mean_lag, "p95_lag": run.lag_quantile(0.95), "max_lag": run.max_lag,
            "multi_version_share": run.multi_version_share,
            "dropped": s.get("dropped_lag", 0) + s.get("overwritten", 0),
            "final_return": run.final_return, "curve": [(t, r) for t, r in curve if t is not None]}


def _mean_std(values: list[float]) -> str:
    values = [v for v in values if v is not None]
    if not values:
        return "-"
    if len(values) == 1:
        return f"{values[0]:.2f}"
    return f"{statistics.mean(values):.2f} ± {statistics.stdev(values):.2f}"


def table(results: list[dict]) -> str:
    lines = ["| setting | seed | mean lag | p95 lag | rollouts with >1 version | env steps/s | final return | dropped |",
             "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for r in results:
        share = r["multi_version_share"]
        lines.append(f"| {r['setting']} | {r['seed']} | {r['mean_lag']:.2f} | {r['p95_lag']} | "
                     f"{'-' if share is None else f'{100 * share:.0f}%'} | {r['sps']:.0f} | "
                     f"{r['final_return']:.1f} | {r['dropped']} |")
    lines += ["", "| setting | mean lag | p95 lag | env steps/s | final return |", "|---|---:|---:|---:|---:|"]
    for setting in SETTINGS:
        rs = [r for r in results if r["setting"] == setting]
        if rs:
            lines.append(f"| {setting} | {_mean_std([r['mean_lag'] for r in rs])} | "
                         f"{_mean_std([float(r['p95_lag']) for r in rs])} | {_mean_std([r['sps'] for r in rs])} | "
                         f"{_mean_std([r['final_return'] for r in rs])} |")
    return "\n".join(lines)


def ratios(results: list[dict]) -> dict:
    by = {s: [r for r in results if r["setting"] == s] for s in SETTINGS}
    if not all(by.values()):
        return {}
    mean = {s: {k: statistics.mean(r[k] for r in rs) for k in ("mean_lag", "sps", "final_return")}
            for s, rs in by.items()}
    return {"lag_rollout_over_step": mean["rollout"]["mean_lag"] / max(mean["step"]["mean_lag"], 1e-9),
            "sps_step_over_rollout": mean["step"]["sps"] / mean["rollout"]["sps"],
            "return_step_minus_rollout": mean["step"]["final_return"] - mean["rollout"]["final_return"]}


def plot(results: list[dict], path: Path, title: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    colours = {"rollout": "tab:blue", "step": "tab:orange"}
    fig, ax = plt.subplots(figsize=(7, 4.2))
    for r in results:
        if r["curve"]:
            t, y = zip(*r["curve"])
            ax.plot(t, y, color=colours[r["setting"]], alpha=0.8, marker=".",
                    label=f"{r['setting']} (mean lag {r['mean_lag']:.2f})" if r["seed"] == results[0]["seed"] else None)
    ax.set_xlabel("wall time since the run started (s)")
    ax.set_ylabel("evaluation return")
    ax.set_title(title, fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", type=Path, default=ROOT / "configs" / "cartpole_ppo.json")
    p.add_argument("--latency", type=float, default=0.03, help="seconds per acting call (default 0.03)")
    p.add_argument("--actors", type=int, default=4)
    p.add_argument("--num-envs", type=int, default=16)
    p.add_argument("--buffer-size", type=int, default=64, help="steps per env per rollout (default 64)")
    p.add_argument("--steps", type=int, default=100_000)
    p.add_argument("--seeds", default="1,2,3")
    p.add_argument("--max-lag", type=int, default=8)
    p.add_argument("--timeout", type=float, default=900.0, help="seconds before a run is abandoned")
    p.add_argument("--keep-runs", type=Path, metavar="DIR", help="keep every run directory here")
    p.add_argument("--png", type=Path, default=Path("inflight_latency.png"))
    p.add_argument("--json", type=Path)
    p.add_argument("--set", dest="sets", action="append", default=[], metavar="KEY=VALUE")
    a = p.parse_args()
    seeds = [int(s) for s in a.seeds.split(",") if s]
    signal.signal(signal.SIGTERM, raise_on_signal)
    root = a.keep_runs or Path(tempfile.mkdtemp(prefix="tandem-inflight-"))
    results = []
    try:
        for seed in seeds:
            for setting in SETTINGS:
                run_dir = root / f"{setting}_s{seed}"
                if run_dir.exists():
                    shutil.rmtree(run_dir)
                wall, notes = run_launcher(["--config", str(a.config), *overrides(a, setting, seed)], run_dir,
                                           a.timeout, f"{setting} seed {seed}")
                r = measure(run_dir, setting, seed, wall)
                results.append(r)
                print(f"{setting:8s} seed {seed}: mean lag {r['mean_lag']:.2f}, p95 {r['p95_lag']}, "
                      f"{r['sps']:.0f} env steps/s, final return {r['final_return']:.1f}"
                      + (f" ({'; '.join(notes)})" if notes else ""), flush=True)
    except BenchmarkError as e:
        print(f"inflight_latency.py: {e}", file=sys.stderr)
        return 1
    finally:
        if a.keep_runs is None:
            shutil.rmtree(root, ignore_errors=True)
    print()
    print(table(results))
    q = ratios(results)
    if q:
        print(f"\nmean lag rollout / step: {q['lag_rollout_over_step']:.2f}x; env steps/s step / rollout: "
              f"{q['sps_step_over_rollout']:.3f}; final return step - rollout: {q['return_step_minus_rollout']:+.1f}")
    title = (f"{a.config.stem}, {a.actors} actors x {a.num_envs} envs, {a.latency * 1000:.0f} ms per acting call, "
             f"rollouts of {a.buffer_size} steps, one per update")
    plot(results, a.png, title)
    print(f"wrote {a.png}")
    if a.json:
        a.json.write_text(json.dumps({"args": {k: str(v) for k, v in vars(a).items()}, "machine": machine_info(),
                                      "results": results, "ratios": q}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
