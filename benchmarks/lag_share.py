"""The cost of lag as a user feels it, from finished run directories: how much of the lag-1 return a
constant lag keeps at a given update size, how much later it gets there, and how the policy drifts.

Two studies, each written as a results file (``docs/results/<name>.json``, its page rebuilt by
``benchmarks/results.py``):

``sizes``: lag as a share of the budget. Runs of ``configs/halfcheetah_ppo.json`` at a constant lag of 8
and at lag 1, with updates c times smaller than the shipped config's (``trainer.buffer_size`` / c,
learning rate / sqrt(c), Hilton et al.'s batch-size-invariance recipe), laid out as
``RUNS/c{c}_lag{L}/<run>`` (``launch/sweep_staleness.sh --out RUNS/c{c}_lag{L}``)::

    .venv/bin/python benchmarks/lag_share.py sizes outputs/lagshare --json docs/results/lag_share_halfcheetah.json

``modes``: async where it pays, the wall time to a return. Runs of one config in standard and in async
mode, laid out as ``RUNS/{standard,async}/<run>``::

    .venv/bin/python benchmarks/lag_share.py modes outputs/modes --json docs/results/time_to_return_halfcheetah.json

Every figure comes from the runs' ``metrics.jsonl``, ``versions.jsonl`` and ``config.json``
(``launch/staleness_runs.py`` reads them): the final return is the mean of the last 3 evaluations;
a threshold crossed between two evaluations is linearly interpolated (``first_crossing``).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from launch.staleness_runs import Run, eval_points, first_crossing, load_run  # noqa: E402

FRACTIONS = (0.5, 0.8)


def _runs(folder: Path) -> list[Run]:
    return [load_run(p) for p in sorted(folder.iterdir()) if p.is_dir() and (p / "metrics.jsonl").exists()]


def _median_metric(run: Run, key: str) -> float | None:
    values = [float(m[key]) for m in run.metrics if isinstance(m.get(key), (int, float))]
    return statistics.median(values) if values else None


def _crossings(run: Run, reference_final: float) -> dict[str, Any]:
    """Env steps and wall seconds at which `run` first reached each fraction of `reference_final`."""
    points = eval_points(run)
    out: dict[str, Any] = {}
    for f in FRACTIONS:
        c = first_crossing(points, f * reference_final)
        tag = f"{round(100 * f)}"
        out[f"steps_to_{tag}"] = None if c is None else round(c.env_steps)
        out[f"wall_to_{tag}"] = None if c is None or c.wall_s is None else round(c.wall_s, 1)
    return out


def _record(run: Run, reference_final: float, **fields: Any) -> dict[str, Any]:
    return {**fields, "seed": run.setting("trainer", "seed"), "return": run.final_return,
            "mean_lag": run.mean_lag, "wall_s": run.summary.get("wall_s"),
            "drift_ratio": _median_metric(run, "offpolicy/drift_ratio"),
            "kl_behaviour": _median_metric(run, "offpolicy/kl_behaviour"),
            **_crossings(run, reference_final)}


def _reference(runs: list[Run]) -> float:
    finals = [r.final_return for r in runs if r.final_return is not None]
    if not finals:
        raise SystemExit("lag_share: the reference runs have no evaluations")
    return statistics.mean(finals)


def _commit() -> str:
    return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                          text=True).stdout.strip()


def _columns(extra: list[dict]) -> list[dict]:
    return [{"key": "return", "label": "return", "agg": "mean_sd", "fmt": ".0f"},
            {"key": "return", "label": "seeds", "agg": "list", "fmt": ".0f"},
            {"key": "mean_lag", "label": "mean lag", "agg": "mean", "fmt": ".1f"},
            *extra,
            {"key": "steps_to_50", "label": "env steps to 50%", "agg": "mean", "fmt": ".0f"},
            {"key": "steps_to_80", "label": "env steps to 80%", "agg": "mean", "fmt": ".0f"},
            {"key": "steps_to_80", "label": "reached 80% (of seeds)", "agg": "count", "fmt": "d"},
            {"key": "wall_to_80", "label": "wall s to 80%", "agg": "mean", "fmt": ".0f"},
            {"key": "drift_ratio", "label": "drift ratio (median)", "agg": "mean", "fmt": ".2f"}]


def sizes(folder: Path) -> dict[str, Any]:
    """Records and ratios of the ``sizes`` study (see the module's docstring)."""
    records, ratios = [], []
    for c in sorted({int(p.name.split("_")[0][1:]) for p in folder.glob("c*_lag*")}):
        lag1 = _runs(folder / f"c{c}_lag1")
        ref = _reference(lag1)
        for lag in (1, 8):
            for run in (lag1 if lag == 1 else _runs(folder / f"c{c}_lag{lag}")):
                samples = run.setting("trainer", "buffer_size") * run.setting("actors", "num_envs") * \
                    run.setting("actors", "num_actors")
                budget = run.setting("trainer", "total_steps")
                records.append(_record(run, ref, update=f"{c}x smaller ({samples:,} samples)", lag=lag,
                                       versions_8_share=round(100 * 8 * samples / budget, 1),
                                       learning_rate=run.setting("algorithm", "cfg", "learning_rate")))
        size = records[-1]["update"]
        pair = {"numerator": {"update": size, "lag": 8}, "denominator": {"update": size, "lag": 1}}
        ratios.append({"label": f"{size}: lag 8's return / lag 1's", "as": "percent", "key": "return",
                       "agg": "mean", **pair})
        for tag in ("80", "50"):   # the slowdown at the highest threshold some lag-8 seed reached
            if any(r[f"steps_to_{tag}"] is not None for r in records if r["update"] == size and r["lag"] == 8):
                ratios.append({"label": f"{size}: lag 8's env steps to {tag}% of lag 1's return / lag 1's "
                                        f"(seeds that reached it)", "key": f"steps_to_{tag}", "agg": "mean", **pair})
                break
    return {"records": records, "group_by": ["update", "lag"], "ratios": ratios,
            "columns": _columns([{"key": "versions_8_share", "label": "8 versions, % of the budget", "agg": "first",
                                  "fmt": ".1f"},
                                 {"key": "learning_rate", "label": "learning rate", "agg": "first", "fmt": ".2e"}])}


def modes(folder: Path) -> dict[str, Any]:
    """Records and ratios of the ``modes`` study (see the module's docstring)."""
    standard = _runs(folder / "standard")
    ref = _reference(standard)
    records = [_record(run, ref, mode=mode) for mode in ("standard", "async")
               for run in (standard if mode == "standard" else _runs(folder / "async"))]
    ratios = [{"label": "async's wall time to 80% of standard's final return / standard's", "key": "wall_to_80",
               "agg": "mean", "numerator": {"mode": "async"}, "denominator": {"mode": "standard"}},
              {"label": "async's env steps to 80% / standard's", "key": "steps_to_80", "agg": "mean",
               "numerator": {"mode": "async"}, "denominator": {"mode": "standard"}},
              {"label": "async's final return / standard's", "as": "percent", "key": "return", "agg": "mean",
               "numerator": {"mode": "async"}, "denominator": {"mode": "standard"}}]
    return {"records": records, "group_by": ["mode"], "ratios": ratios,
            "columns": _columns([{"key": "wall_s", "label": "run wall s", "agg": "mean", "fmt": ".0f"}])}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("study", choices=("sizes", "modes"))
    p.add_argument("runs", type=Path, help="the folder of run directories (see above)")
    p.add_argument("--json", type=Path, required=True, help="the results file to write")
    p.add_argument("--title", required=True)
    p.add_argument("--question", required=True)
    p.add_argument("--machine", required=True)
    p.add_argument("--date", required=True, help="the sitting, e.g. 2026-11-28 (10:50-11:40 UTC)")
    p.add_argument("--command", required=True, help="the commands that made the runs")
    p.add_argument("--note", action="append", default=[], help="a note for the page (repeatable)")
    args = p.parse_args(argv)
    body = sizes(args.runs) if args.study == "sizes" else modes(args.runs)
    doc = {"title": args.title, "question": args.question, "date": args.date, "machine": args.machine,
           "command": args.command, "commit": _commit(),
           "source": f"metrics.jsonl, versions.jsonl and config.json of the run directories under {args.runs} "
                     f"(benchmarks/lag_share.py {args.study})",
           **body, "notes": args.note}
    args.json.write_text(json.dumps(doc, indent=1) + "\n")
    for r in body["records"]:
        print({k: v for k, v in r.items()})
    print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
