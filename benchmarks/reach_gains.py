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
actors elsewhere (default: each as the config says). Prints a table (variant x seed: first set /
held-out -> gain, and the mean gain) and writes ``DIR/gains.json``. A run stopped by its time limit is
measured from its last checkpoint and marked; runs that fail are reported, not retried. Ctrl-C or
SIGTERM stops every run and evaluation: nothing is left running.
"""

from __future__ import annotations

import argparse
import json
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable

from _common import ROOT, RunDir, child_env, finished_run, raise_on_signal, start_launcher, stop_launcher, tail

FIRST, HELD_OUT = 1_000_003, 2_000_003
POLL_S = 0.5


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


def run_parallel(jobs: list, start: Callable[[object], subprocess.Popen], parallel: int,
                 timeout_s: float) -> dict:
    """Start ``start(job)`` (a process in its own session) for each job, at most `parallel` at a time,
    each for at most `timeout_s`. Returns ``{job: (exit code or None if stopped late, wall seconds,
    stop notes)}``. Whatever happens (an exception, Ctrl-C, SIGTERM), no process is left running."""
    pending, active, done = list(jobs), {}, {}
    try:
        while pending or active:
            while pending and len(active) < parallel:
                job = pending.pop(0)
                active[job] = (start(job), time.monotonic())
            for job, (p, t0) in list(active.items()):
                code, late = p.poll(), time.monotonic() - t0 > timeout_s
                if code is None and not late:
                    continue
                del active[job]
                notes = stop_launcher(p)
                done[job] = (code, time.monotonic() - t0, notes)
            if active:
                time.sleep(POLL_S)
    finally:
        for p, _ in active.values():
            stop_launcher(p)
    return done


def start_evaluation(args: list[str], out: Path) -> subprocess.Popen:
    """``launch/evaluate.py ARGS --json OUT`` in its own session (log: OUT with .log)."""
    with open(out.with_suffix(".log"), "wb") as log:
        return subprocess.Popen([sys.executable, str(ROOT / "launch" / "evaluate.py"), *args, "--threads", "1",
                                 "--json", str(out)], cwd=ROOT, env=child_env(), stdin=subprocess.DEVNULL,
                                stdout=log, stderr=subprocess.STDOUT, start_new_session=True)


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
    previous = signal.signal(signal.SIGTERM, raise_on_signal)     # unwind through run_parallel's clean-up
    try:
        return measure(a, variants, seeds, common)
    except KeyboardInterrupt as e:
        print(f"[reach_gains] stopped ({e or 'SIGINT'}): no run or evaluation is left running", flush=True)
        return 130
    finally:
        signal.signal(signal.SIGTERM, previous)


def _run_dir(a: argparse.Namespace, label: str, seed: int) -> Path:
    return a.out / f"{label}_s{seed}"


def _train_all(a: argparse.Namespace, variants: list[tuple[str, list[str]]], seeds: list[int], common: list[str],
               failures: dict[str, str]) -> dict[tuple[str, int], dict]:
    """Train every (variant, seed), `a.parallel` at a time. Returns what each measured run reports
    (a run stopped by --timeout-s with a checkpoint is measured, marked); failures go to `failures`."""
    def start_run(job):
        label, seed = job
        args = ["--config", str(Path(a.config).resolve())]
        for x in [*common, *dict(variants)[label], f"trainer.seed={seed}"]:
            args += ["--set", x]
        return start_launcher(args, _run_dir(a, label, seed))

    runs = {}
    trained = run_parallel([(label, seed) for label, _ in variants for seed in seeds], start_run, a.parallel,
                           a.timeout_s)
    for (label, seed), (code, wall, notes) in trained.items():
        d = _run_dir(a, label, seed)
        note = "".join(f"; {n}" for n in notes)
        if code == 0:
            learner_wall = finished_run(d, f"{label} seed {seed}")[1].get("wall_s")
            runs[(label, seed)] = {"launcher_wall_s": wall, "learner_wall_s": learner_wall}
            print(f"[reach_gains] {label} seed {seed}: trained in {wall:.0f} s (learner {learner_wall:.0f} s){note}",
                  flush=True)
        elif code is None and d.is_dir() and RunDir(d).checkpoints():
            # stopped by --timeout-s: the learner wrote a final checkpoint on SIGTERM; measured, marked
            runs[(label, seed)] = {"stopped": True, "launcher_wall_s": wall}
            print(f"[reach_gains] {label} seed {seed}: stopped at the {a.timeout_s:.0f} s limit; its last "
                  f"checkpoint is measured, marked *{note}", flush=True)
        else:
            why = (f"not finished within {a.timeout_s:.0f} s" if code is None
                   else f"run_local.sh exited with code {code}")
            failures[f"{label}_s{seed}"] = f"{why}; its log ends:\n{tail(d / 'launcher.log')}"
            print(f"[reach_gains] {label} seed {seed}: FAILED: {failures[f'{label}_s{seed}']}", flush=True)
    return runs


def _evaluations(a: argparse.Namespace, seeds: list[int], runs: dict) -> dict[tuple, list[str]]:
    """The evaluate.py arguments of every evaluation: the starting model and every measured run, on
    the first and the held-out set of each seed."""
    dev = ["--device", a.device] if a.device else []
    evals = {}   # key -> evaluate.py arguments
    for seed in seeds:
        for name, offset in (("first", FIRST), ("held_out", HELD_OUT)):
            start_sets = [x for s in [*a.set, f"trainer.seed={seed}"] for x in ("--set", s)]
            evals[("start", seed, name)] = ["--config", str(Path(a.config).resolve()), "--checkpoint", "none",
                                            *start_sets, "--episodes", str(a.episodes), "--seed", str(seed + offset),
                                            *dev]
    for (label, seed) in runs:
        for name, offset in (("first", FIRST), ("held_out", HELD_OUT)):
            evals[(label, seed, name)] = [str(_run_dir(a, label, seed)), "--episodes", str(a.episodes),
                                          "--seed", str(seed + offset), *dev]
    return evals


def _evaluate_all(a: argparse.Namespace, evals: dict[tuple, list[str]], failures: dict[str, str]
                  ) -> tuple[dict[tuple, float], dict[tuple, int | None]]:
    """Run every evaluation, `a.parallel` at a time. Returns the success rates and env steps by key;
    failures go to `failures`."""
    def eval_path(key):
        return a.out / ("eval_" + "_".join(str(k) for k in key) + ".json")

    rates, env_steps = {}, {}
    for key, (code, _, _) in run_parallel(list(evals), lambda k: start_evaluation(evals[k], eval_path(k)),
                                          a.parallel, a.timeout_s).items():
        if code == 0:
            result = json.loads(eval_path(key).read_text())
            rates[key], env_steps[key] = result["success_rate"], result.get("env_steps")
        else:
            why = "timed out" if code is None else f"exit {code}"
            failures["eval_" + "_".join(map(str, key))] = (f"evaluate.py {' '.join(evals[key])}: {why}; its log "
                                                           f"ends:\n{tail(eval_path(key).with_suffix('.log'))}")
            print(f"[reach_gains] evaluation {key}: FAILED ({why})", flush=True)
    return rates, env_steps


def _print_gains(a: argparse.Namespace, variants: list[tuple[str, list[str]]], seeds: list[int], runs: dict,
                 rates: dict, env_steps: dict) -> tuple[list[dict], dict[int, tuple]]:
    """The table of success rates and gains, printed. Returns its rows and the starting model's rates."""
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
                         "env_steps": env_steps.get((label, s, "first")),
                         **runs.get((label, s), {})})
        mean = f"{sum(gains) / len(gains):+10.1f}" if gains else f"{'-':>10s}"
        print(f"{label:12s}" + "".join(f"{c:>24s}" for c in cells) + mean)
    if any(r.get("stopped") for r in runs.values()):
        print("(* stopped by --timeout-s before trainer.total_steps: the env steps reached are in gains.json)")
    return rows, start


def measure(a: argparse.Namespace, variants: list[tuple[str, list[str]]], seeds: list[int], common: list[str]) -> int:
    """Train every (variant, seed), evaluate, print the table and write gains.json; the exit code."""
    t0 = time.monotonic()
    failures: dict[str, str] = {}
    runs = _train_all(a, variants, seeds, common, failures)
    rates, env_steps = _evaluate_all(a, _evaluations(a, seeds, runs), failures)
    rows, start = _print_gains(a, variants, seeds, runs, rates, env_steps)
    out = {"args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(a).items()}, "rows": rows,
           "start": {str(s): start[s] for s in seeds}, "failures": failures, "wall_s": time.monotonic() - t0}
    (a.out / "gains.json").write_text(json.dumps(out, indent=1) + "\n")
    print(f"[reach_gains] {len(rows)} runs measured, {len(failures)} failures, {out['wall_s']:.0f} s; "
          f"{a.out / 'gains.json'}", flush=True)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
