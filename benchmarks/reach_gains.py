"""Fine-tuning gains on tandem/Reach-v0, several settings x several seeds, measured as the README does.

    python benchmarks/reach_gains.py --config configs/vla_tokens_reach_grpo.json \\
        --set policy.vla_config.model_path=benchmarks/pretrained/tokens_reach_intel \\
        --variant config --variant "gamma1 algorithm.cfg.gamma=1.0" --seeds 1,2,3 \\
        [--parallel 6] [--device cuda:0] [--episodes 2000] [--steps N] --out DIR

A variant is ``LABEL [KEY=JSON ...]``: config overrides on top of ``--set``. Every (variant, seed) is one
``launch/run_local.sh`` run (``trainer.seed``, in-run evaluations off unless ``--set trainer.eval_freq``
says otherwise), up to ``--parallel`` at a time; each gets ``--timeout-s``. Then every final
checkpoint, and the model the config starts from (``--checkpoint none``), is evaluated
deterministically by ``launch/evaluate.py`` on two sets of ``--episodes`` episodes per seed: the
evaluator's seeds (``trainer.seed + 1,000,003``: the "first set") and held-out ones
(``trainer.seed + 2,000,003``). A run's gain is its success rate on both sets together minus the
starting model's on the same episodes.

``--device`` puts the learner, the actors and the evaluations on one device, ``--actor-device`` the
actors elsewhere (default: each as the config says). Prints a table (variant x seed: first set / held-out -> gain, and the mean gain) and
writes ``DIR/gains.json``. Runs that fail or time out are reported, not retried; nothing is left
running.
"""

from __future__ import annotations

import argparse
import json
import shlex
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from _common import ROOT, BenchmarkError, child_env, run_launcher, tail
from learner.checkpoint import list_checkpoints

FIRST, HELD_OUT = 1_000_003, 2_000_003


def parse_variant(text: str) -> tuple[str, list[str]]:
    """``"LABEL KEY=JSON ..."`` -> (label, overrides)."""
    parts = shlex.split(text)
    if not parts or "=" in parts[0]:
        raise ValueError(f"--variant {text!r}: give a label first, then KEY=JSON overrides")
    bad = [p for p in parts[1:] if "=" not in p]
    if bad:
        raise ValueError(f"--variant {text!r}: {bad[0]!r} is not KEY=JSON")
    return parts[0], parts[1:]


def success_gain(run: tuple[float, float], start: tuple[float, float]) -> float:
    """Percentage points gained on two equal-sized sets together."""
    return 100 * ((run[0] + run[1]) / 2 - (start[0] + start[1]) / 2)


def evaluate(args: list[str], out: Path, timeout_s: float) -> float:
    """``launch/evaluate.py ARGS --json OUT``; the success rate."""
    log = out.with_suffix(".log")
    with open(log, "wb") as f:
        code = subprocess.run([sys.executable, str(ROOT / "launch" / "evaluate.py"), *args, "--threads", "1",
                               "--json", str(out)], cwd=ROOT, env=child_env(), stdout=f, stderr=subprocess.STDOUT,
                              timeout=timeout_s).returncode
    if code != 0:
        raise BenchmarkError(f"evaluate.py {' '.join(args)}: exit {code}; its log ends:\n{tail(log)}")
    return json.loads(out.read_text())["success_rate"]


def env_steps_of(out_dir: Path, label: str, seed: int) -> int | None:
    path = out_dir / f"eval_{label}_{seed}_first.json"
    return json.loads(path.read_text()).get("env_steps") if path.is_file() else None


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", required=True)
    p.add_argument("--set", action="append", default=[], metavar="KEY=JSON", help="for every run and evaluation")
    p.add_argument("--variant", action="append", default=[], metavar='"LABEL [KEY=JSON ...]"')
    p.add_argument("--seeds", default="1,2,3")
    p.add_argument("--steps", type=int, default=None, help="trainer.total_steps (default: the config's)")
    p.add_argument("--episodes", type=int, default=2000, help="per set (two sets per seed)")
    p.add_argument("--parallel", type=int, default=1, help="runs (and then evaluations) at a time")
    p.add_argument("--device", default=None, help="learner, actors and evaluations on this device")
    p.add_argument("--actor-device", default=None,
                   help="the actors' device instead (a small model collects faster on one CPU core each)")
    p.add_argument("--timeout-s", type=float, default=3600.0, help="per run")
    p.add_argument("--out", type=Path, required=True)
    a = p.parse_args(argv)
    try:
        variants = [parse_variant(v) for v in (a.variant or ["config"])]
        seeds = [int(s) for s in a.seeds.split(",") if s.strip()]
    except ValueError as e:
        p.error(str(e))
    if len({v[0] for v in variants}) != len(variants):
        p.error("variant labels must differ")
    if a.parallel < 1 or a.episodes < 1 or not seeds:
        p.error("--parallel and --episodes must be at least 1, and --seeds must name a seed")
    common = [*a.set] + (["trainer.eval_freq=0"] if not any(s.startswith("trainer.eval_freq=") for s in a.set) else [])
    if a.steps:
        common.append(f"trainer.total_steps={a.steps}")
    if a.device:
        common += [f"learner.device={json.dumps(a.device)}", f"trainer.eval_device={json.dumps(a.device)}"]
    if a.actor_device or a.device:
        common.append(f"actors.devices=[{json.dumps(a.actor_device or a.device)}]")
    a.out.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()

    def train(job):
        label, sets, seed = job
        run_dir = a.out / f"{label}_s{seed}"
        args = ["--config", str(Path(a.config).resolve())]
        for s in [*common, *sets, f"trainer.seed={seed}"]:
            args += ["--set", s]
        try:
            wall, notes = run_launcher(args, run_dir, a.timeout_s, f"{label} seed {seed}")
        except BenchmarkError as e:
            # Stopped by the timeout: the learner wrote a final checkpoint on SIGTERM; it is measured
            # too, marked as stopped (the evaluation's JSON says at how many env steps).
            if "not finished within" in str(e) and list_checkpoints(run_dir / "checkpoints"):
                print(f"[reach_gains] {label} seed {seed}: stopped at the {a.timeout_s:.0f} s limit; its last "
                      f"checkpoint is measured, marked *", flush=True)
                return job, {"stopped": True, "launcher_wall_s": a.timeout_s}, None
            return job, None, str(e)
        learner_wall = json.loads((run_dir / "summary.json").read_text()).get("wall_s")
        print(f"[reach_gains] {label} seed {seed}: trained in {wall:.0f} s (learner {learner_wall:.0f} s)"
              + ("".join(f"; {n}" for n in notes)), flush=True)
        return job, {"launcher_wall_s": wall, "learner_wall_s": learner_wall}, None

    jobs = [(label, sets, seed) for label, sets in variants for seed in seeds]
    runs, failures = {}, {}
    with ThreadPoolExecutor(a.parallel) as pool:
        for (label, _, seed), info, err in pool.map(train, jobs):
            if err:
                failures[f"{label}_s{seed}"] = err
                print(f"[reach_gains] {label} seed {seed}: FAILED: {err}", flush=True)
            else:
                runs[(label, seed)] = info

    dev = ["--device", a.device] if a.device else []
    evals = []   # (key, args)
    for seed in seeds:
        for name, offset in (("first", FIRST), ("held_out", HELD_OUT)):
            start_sets = [x for s in [*a.set, f"trainer.seed={seed}"] for x in ("--set", s)]
            evals.append((("start", seed, name), ["--config", str(Path(a.config).resolve()), "--checkpoint", "none",
                                                  *start_sets, "--episodes", str(a.episodes),
                                                  "--seed", str(seed + offset), *dev]))
    for (label, seed) in runs:
        for name, offset in (("first", FIRST), ("held_out", HELD_OUT)):
            evals.append(((label, seed, name), [str(a.out / f"{label}_s{seed}"), "--episodes", str(a.episodes),
                                                "--seed", str(seed + offset), *dev]))

    def run_eval(item):
        key, args = item
        path = a.out / ("eval_" + "_".join(str(k) for k in key) + ".json")
        try:
            return key, evaluate(args, path, a.timeout_s), None
        except (BenchmarkError, subprocess.TimeoutExpired) as e:
            return key, None, str(e)

    rates = {}
    with ThreadPoolExecutor(a.parallel) as pool:
        for key, rate, err in pool.map(run_eval, evals):
            if err:
                failures["eval_" + "_".join(map(str, key))] = err
                print(f"[reach_gains] evaluation {key}: FAILED: {err}", flush=True)
            else:
                rates[key] = rate

    rows = []
    print(f"\nSuccess on the first set / held-out set ({a.episodes} episodes each), gain in points over the "
          f"starting model on both ({a.config}):")
    print(f"{'':12s}" + "".join(f"{'seed ' + str(s):>24s}" for s in seeds) + f"{'mean gain':>11s}")
    start = {s: (rates.get(("start", s, "first")), rates.get(("start", s, "held_out"))) for s in seeds}
    print(f"{'start':12s}" + "".join(
        f"{f'{100 * start[s][0]:5.1f} / {100 * start[s][1]:.1f}%':>24s}" if None not in start[s] else f"{'-':>24s}"
        for s in seeds))
    for label, sets in variants:
        cells, gains = [], []
        for s in seeds:
            r = (rates.get((label, s, "first")), rates.get((label, s, "held_out")))
            if None in r or None in start[s]:
                cells.append(f"{'failed':>24s}")
                continue
            g = success_gain(r, start[s])
            stopped = runs.get((label, s), {}).get("stopped", False)
            gains.append(g)
            cells.append(f"{100 * r[0]:5.1f} / {100 * r[1]:.1f}% -> {g:+5.1f}{'*' if stopped else ''}")
            rows.append({"variant": label, "overrides": sets, "seed": s, "first": r[0], "held_out": r[1],
                         "start_first": start[s][0], "start_held_out": start[s][1], "gain": g,
                         "env_steps": env_steps_of(a.out, label, s),
                         **runs.get((label, s), {})})
        mean = f"{sum(gains) / len(gains):+10.1f}" if gains else f"{'-':>10s}"
        print(f"{label:12s}" + "".join(f"{c:>24s}" for c in cells) + mean)
    if any(r.get("stopped") for r in runs.values()):
        print("(* stopped by --timeout-s before trainer.total_steps: the env steps reached are in gains.json)")
    out = {"args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(a).items()}, "rows": rows,
           "start": {str(s): start[s] for s in seeds}, "failures": failures, "wall_s": time.monotonic() - t0}
    (a.out / "gains.json").write_text(json.dumps(out, indent=1) + "\n")
    print(f"[reach_gains] {len(rows)} runs measured, {len(failures)} failures, {out['wall_s']:.0f} s; "
          f"{a.out / 'gains.json'}", flush=True)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
