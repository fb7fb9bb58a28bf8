"""What Tandem costs over the bare simulator, measured in one run and reported as ratios.

    .venv/bin/python benchmarks/overhead.py [--config configs/halfcheetah_ppo.json] [--actors 2]
                                            [--steps 200000] [--json out.json] [--set KEY=VALUE ...]

Four phases, each with the same number P of processes (``--actors``), the same envs
(``make_env(env.id, actors.num_envs, env.cfg)`` in every process) and ``--steps`` env steps in
total across the P processes:

1. ``raw env``         -- each process steps its batched env with uniformly random actions.
2. ``env+inference``   -- each process runs the real :class:`actors.rollout.Collector` with the
                          real policy (``make_policy``), fills rollouts of ``trainer.buffer_size``
                          steps and throws them away. No sockets.
3. ``transport only``  -- the real learner (``python -m learner --discard --no-eval``, vla mode)
                          and P real ``python -m actors`` processes: rollouts are encoded, pushed
                          over ZeroMQ, decoded, checked and counted, never trained on.
4. ``tandem training`` -- the same processes without ``--discard``, in the config's own
                          ``buffer_type``: the real run, the learner trains (evaluator off).

Each phase reports total env steps per second. Start-up (python and torch imports, env and policy
construction) is excluded everywhere: phases 1-2 time from a barrier that every worker reaches
after its set-up and one warm-up rollout; phases 3-4 time from the learner's own progress lines,
from the first one past ``--warmup`` of the run (see :func:`learner_window`).

The key figure is ``transport-only / env+inference`` (target >= 0.9): the share of the actors'
collection rate that survives sending every rollout to the learner.

All child processes are stopped before the script returns (terminate, then kill after a
timeout), also on Ctrl-C, SIGTERM or a failed phase.
"""

from __future__ import annotations

import argparse
import json
import math
import multiprocessing as mp
import os
import platform
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from dataclasses import asdict, dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:          # spawned workers re-import this file: they need it too
    sys.path.insert(0, str(ROOT))

DEFAULT_CONFIG = ROOT / "configs" / "halfcheetah_ppo.json"
TARGET = 0.9                           # transport-only / env+inference should be at least this
STOP_TIMEOUT_S = 10.0                  # SIGTERM -> SIGKILL grace for every child we start
MIN_WINDOW_S = 5.0                     # phases 3-4: shorter timed windows get a warning


class BenchmarkError(RuntimeError):
    """A phase could not be measured; the message says which and why."""


@dataclass
class PhaseResult:
    name: str
    processes: int
    env_steps: int = 0                 # env steps inside the timed window
    seconds: float = 0.0               # length of the timed window
    steps_per_s: float | None = None
    ratio_raw: float | None = None
    ratio_inference: float | None = None
    error: str | None = None
    extra: dict = field(default_factory=dict)


# ================================================================== phases 1-2: worker processes

def _random_action(spec, num_envs: int, device):
    """Uniform random actions for `num_envs` envs: ints in [0, n) or floats within the Box bounds."""
    import torch
    act = spec.action
    if act.kind == "discrete":
        return torch.randint(act.n, (num_envs,), device=device)
    low = torch.tensor(act.low, dtype=torch.float32, device=device).reshape(act.shape)
    high = torch.tensor(act.high, dtype=torch.float32, device=device).reshape(act.shape)
    finite = torch.isfinite(low) & torch.isfinite(high)   # unbounded dims: standard normal instead
    low, high = torch.where(finite, low, -1.0), torch.where(finite, high, 1.0)
    u = low + (high - low) * torch.rand(num_envs, *act.shape, device=device)
    return torch.where(finite, u, torch.randn_like(u))


def _worker(phase: str, config: str, overrides: list[str], idx: int, steps: int, barrier, results) -> None:
    """One process of phase 1 ("raw") or 2 ("inference"): set up, warm up, wait for the others,
    then time `steps` env steps and report ``(idx, t_start, t_end, steps_done)`` on `results`."""
    try:
        import torch
        from shared.config import load_config
        from shared.envs import make_env

        cfg = load_config(config, overrides)
        torch.set_num_threads(cfg.actors.torch_threads)   # what an actor process does (1 by default)
        device = cfg.actors.devices[idx % len(cfg.actors.devices)]
        seed = cfg.trainer.seed * 100_003 + 1_000 * idx   # as actors.actor.Actor seeds itself
        torch.manual_seed(seed)
        env = make_env(cfg.env.id, cfg.actors.num_envs, cfg.env.cfg, device)
        try:
            n = env.num_envs
            if phase == "raw":
                env.reset(seed=seed)
                per_call = n

                def work():
                    env.step(_random_action(env.spec, n, env.device))
            else:
                from actors.rollout import Collector
                from shared.policies import make_policy
                policy = make_policy(cfg, env.spec).to(env.device).eval()
                slow = not cfg.actors.slow_actor_ids or idx in cfg.actors.slow_actor_ids   # as Actor does
                collector = Collector(env, policy, cfg.trainer.buffer_size, seed=seed,
                                      step_delay_s=cfg.actors.slowdown_s if slow else 0.0)
                per_call = n * cfg.trainer.buffer_size

                def work():
                    collector.collect(0)      # the rollout is thrown away

            calls = max(1, math.ceil(steps / per_call))
            # Warm-up outside the timed window: first-call allocations, caches, lazy imports.
            # One rollout's worth of steps (trainer.buffer_size per env).
            for _ in range(math.ceil(n * cfg.trainer.buffer_size / per_call)):
                work()
            barrier.wait(timeout=600)
            t0 = time.monotonic()         # CLOCK_MONOTONIC: one clock for every process on Linux
            for _ in range(calls):
                work()
            t1 = time.monotonic()
            results.put(("ok", idx, t0, t1, calls * per_call))
        finally:
            env.close()
    except BaseException:              # report everything, even a broken barrier, then exit
        try:
            barrier.abort()
        except Exception:
            pass
        results.put(("error", idx, traceback.format_exc()))


def _stop_workers(procs: list) -> None:
    for p in procs:
        if p.is_alive():
            p.terminate()
    deadline = time.monotonic() + STOP_TIMEOUT_S
    for p in procs:
        p.join(timeout=max(0.0, deadline - time.monotonic()))
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join(timeout=5)


def run_worker_phase(name: str, phase: str, args, overrides: list[str]) -> PhaseResult:
    """Phases 1-2: P spawned processes; rate = all their steps / (last end - first start)."""
    P = args.actors
    res = PhaseResult(name, P)
    ctx = mp.get_context("spawn")
    barrier = ctx.Barrier(P)
    results = ctx.Queue()
    per_proc = math.ceil(args.steps / P)
    procs = [ctx.Process(target=_worker, args=(phase, str(args.config), overrides, i, per_proc, barrier, results),
                         name=f"overhead-{phase}-{i}", daemon=True) for i in range(P)]
    try:
        for p in procs:
            p.start()
        reports, deadline = [], time.monotonic() + args.phase_timeout
        while len(reports) < P:
            try:
                reports.append(results.get(timeout=1.0))
            except Exception:           # queue.Empty
                pass
            errors = [r for r in reports if r[0] == "error"]
            if errors:
                raise BenchmarkError(f"{name}: worker {errors[0][1]} failed:\n{errors[0][2]}")
            if time.monotonic() > deadline:
                raise BenchmarkError(f"{name}: no result within --phase-timeout {args.phase_timeout:.0f} s")
            dead = [p for p in procs if not p.is_alive() and p.exitcode not in (0, None)]
            if dead and len(reports) < P and results.empty():
                raise BenchmarkError(f"{name}: worker {dead[0].name} died with exit code {dead[0].exitcode}")
    finally:
        _stop_workers(procs)
    t0, t1 = min(r[2] for r in reports), max(r[3] for r in reports)
    res.env_steps = sum(r[4] for r in reports)
    res.seconds = t1 - t0
    res.steps_per_s = res.env_steps / res.seconds
    res.extra["per_process_steps_per_s"] = [round(r[4] / (r[3] - r[2]), 1) for r in sorted(reports, key=lambda r: r[1])]
    return res


# ================================================================== phases 3-4: learner + actors

_PROGRESS = re.compile(r"^\[learner\]\s+([\d.]+)s \| steps ([\d.]+)([kM]?)/")


def parse_progress(text: str) -> list[tuple[float, float]]:
    """``(elapsed_s, env_steps)`` from the learner's progress lines, in order.

    Steps are printed rounded (``12.3k``: 100-step resolution below 1M, 10k above), which is
    small against the step counts this benchmark measures over.
    """
    out = []
    for line in text.splitlines():
        m = _PROGRESS.match(line.strip())
        if m:
            out.append((float(m.group(1)), float(m.group(2)) * {"": 1, "k": 1e3, "M": 1e6}[m.group(3)]))
    return out


def learner_window(points: list[tuple[float, float]], start_steps: float) -> tuple[float, float]:
    """``(env_steps, seconds)`` of the steady-state window seen in the learner's progress lines.

    Why this window: the learner's own ``wall_s`` (summary.json) and ``perf/sps`` count from the
    learner's start, so they include seconds of python/torch imports and the actors' start-up;
    in discard mode nothing else is logged per rollout. The learner prints a progress line every
    ``trainer.log_interval_s`` (we pass 1 s) with its elapsed time and the env steps it has
    received. The window opens at the first line at or past `start_steps` (the warm-up: every
    actor has been sending for a while by then) and closes at the last *periodic* line: the very
    last line is printed after shutdown work (final checkpoint, stop messages) and is dropped.
    """
    periodic = points[:-1]
    inside = [p for p in periodic if p[1] >= start_steps and p[1] > 0]
    if len(inside) < 2 or inside[-1][0] <= inside[0][0] or inside[-1][1] <= inside[0][1]:
        raise BenchmarkError(f"too few progress lines after the warm-up ({len(inside)} past {start_steps:.0f} "
                             f"steps) to time a steady state: raise --steps or lower --warmup")
    (t0, s0), (t1, s1) = inside[0], inside[-1]
    return s1 - s0, t1 - t0


def _child_env() -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(ROOT) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env["OMP_NUM_THREADS"] = "1"
    env["PYTHONUNBUFFERED"] = "1"
    return env


def _start(cmd: list[str], log_path: Path) -> subprocess.Popen:
    """Start `cmd` in its own session (process group), stdout+stderr to `log_path`."""
    with open(log_path, "wb") as log:
        return subprocess.Popen(cmd, cwd=ROOT, env=_child_env(), stdout=log, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True)


def _signal_group(p: subprocess.Popen, sig: int) -> None:
    try:
        os.killpg(p.pid, sig)          # session leader: its pid is the group id
    except (ProcessLookupError, PermissionError):
        pass


def _stop_processes(procs: list[subprocess.Popen]) -> None:
    """SIGTERM every process group, wait up to STOP_TIMEOUT_S in all, SIGKILL the rest."""
    for p in procs:
        if p.poll() is None:
            _signal_group(p, signal.SIGTERM)
    deadline = time.monotonic() + STOP_TIMEOUT_S
    for p in procs:
        try:
            p.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            pass
    for p in procs:                    # also reaps group members that outlived their leader
        _signal_group(p, signal.SIGKILL)
        try:
            p.wait(timeout=5)
        except subprocess.TimeoutExpired:
            pass


def _tail(path: Path, n: int = 15) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-n:])
    except OSError:
        return "(no log)"


def _read_jsonl(path: Path) -> list[dict]:
    rows = []
    if path.exists():
        for line in path.read_text().splitlines():
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError:
                pass               # a line cut by a crash
    return rows


def _training_stats(run_dir: Path, start_steps: float) -> dict:
    """Learner-side figures of a training run, from metrics.jsonl (one line per update) and
    summary.json, over the updates logged at or past `start_steps` received env steps."""
    rows = [r for r in _read_jsonl(run_dir / "metrics.jsonl")
            if "perf/samples_per_update" in r and r.get("env_steps", 0) >= start_steps]
    out: dict = {}
    if len(rows) >= 2 and rows[-1]["time"] > rows[0]["time"]:
        span = rows[-1]["time"] - rows[0]["time"]
        later = rows[1:]               # samples trained between the first and the last logged update
        out["samples_trained_per_s"] = sum(r["perf/samples_per_update"] for r in later) / span
        out["update_s_mean"] = sum(r["perf/update_s"] for r in later) / len(later)
        out["learner_busy_fraction"] = sum(r["perf/update_s"] for r in later) / span
        lags = [r["lag/mean"] for r in later if r.get("lag/mean") is not None]
        if lags:
            out["lag_mean"] = sum(lags) / len(lags)
    try:
        summary = json.loads((run_dir / "summary.json").read_text())
        out.update({k: summary[k] for k in ("updates", "version", "rollouts", "dropped_lag", "overwritten",
                                            "malformed", "rejected") if k in summary})
    except (OSError, json.JSONDecodeError):
        pass
    return out


def run_tandem_phase(name: str, args, overrides: list[str], discard: bool, run_dir: Path) -> PhaseResult:
    """Phases 3-4: the real learner and P real actors, each its own process, as run_local.sh does."""
    P = args.actors
    res = PhaseResult(name, P)
    run_dir.mkdir(parents=True, exist_ok=True)
    sets: list[str] = []
    for o in overrides:
        sets += ["--set", o]
    py = sys.executable
    learner_cmd = [py, "-m", "learner", "--config", str(args.config), "--run-dir", str(run_dir), "--no-eval", *sets]
    if discard:
        learner_cmd.append("--discard")
    learner_log = run_dir / "learner.log"
    procs: list[subprocess.Popen] = []
    try:
        learner = _start(learner_cmd, learner_log)
        procs.append(learner)
        actors = []
        for i in range(P):
            cmd = [py, "-m", "actors", "--config", str(args.config), "--actor-id", str(i),
                   "--run-dir", str(run_dir), *sets]
            actors.append(_start(cmd, run_dir / f"actor_{i}.log"))
        procs += actors
        deadline = time.monotonic() + args.phase_timeout
        all_gone_at = None
        while learner.poll() is None:
            for i, a in enumerate(actors):
                if a.poll() not in (None, 0):
                    raise BenchmarkError(f"{name}: actor {i} exited with code {a.returncode} before the learner "
                                         f"finished; its log ends:\n{_tail(run_dir / f'actor_{i}.log')}")
            # Exit code 0 is an actor obeying the learner's stop message, sent before the learner's
            # own shutdown work; but a learner still up long after every actor left would wait forever.
            if all_gone_at is None and all(a.poll() is not None for a in actors):
                all_gone_at = time.monotonic()
            if all_gone_at is not None and time.monotonic() - all_gone_at > 3 * STOP_TIMEOUT_S:
                raise BenchmarkError(f"{name}: every actor left but the learner did not finish; its log ends:\n"
                                     f"{_tail(learner_log)}")
            if time.monotonic() > deadline:
                raise BenchmarkError(f"{name}: not finished within --phase-timeout {args.phase_timeout:.0f} s "
                                     f"(learner log ends:\n{_tail(learner_log)})")
            time.sleep(0.2)
        if learner.returncode != 0:
            raise BenchmarkError(f"{name}: the learner exited with code {learner.returncode}; its log ends:\n"
                                 f"{_tail(learner_log)}")
        # The learner has sent its stop message: the actors should leave on their own.
        end = time.monotonic() + STOP_TIMEOUT_S
        for a in actors:
            try:
                a.wait(timeout=max(0.0, end - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
        slow = [i for i, a in enumerate(actors) if a.poll() is None]
        if slow:
            res.extra["actors_not_stopped_by_learner"] = slow
    finally:
        _stop_processes(procs)
    start_steps = args.warmup * args.steps
    res.env_steps, res.seconds = learner_window(parse_progress(learner_log.read_text()), start_steps)
    res.steps_per_s = res.env_steps / res.seconds
    if res.seconds < MIN_WINDOW_S:
        res.extra["warning"] = (f"timed window only {res.seconds:.1f} s (progress lines come every 1 s, "
                                f"elapsed to 0.1 s): raise --steps for a steadier figure")
    if not discard:
        res.extra.update(_training_stats(run_dir, start_steps))
    return res


# ================================================================== driver

def phase_overrides(base_cfg, args, user_sets: list[str], transport_only: bool) -> list[str]:
    """The --set overrides of one phase (the user's, then the benchmark's)."""
    sets = list(user_sets) + [f"actors.num_actors={args.actors}", f"trainer.total_steps={args.steps}",
                              "trainer.log_interval_s=1"]
    if transport_only:
        sets.append("trainer.buffer_type=vla")
        k = base_cfg.trainer.rollouts_per_update or args.actors
        if base_cfg.trainer.buffer_capacity < k:
            # Only the vla config check needs this: in discard mode the buffer is never used.
            sets.append(f"trainer.buffer_capacity={k}")
    return sets


def fmt_table(results: list[PhaseResult]) -> str:
    head = ("phase", "processes", "env steps/s", "/ raw env", "/ env+inference")
    rows = []
    for r in results:
        def f(x, spec):
            return "-" if x is None else format(x, spec)
        rows.append((r.name, str(r.processes), "FAILED" if r.error else f(r.steps_per_s, ",.0f"),
                     f(r.ratio_raw, ".3f"), f(r.ratio_inference, ".3f")))
    widths = [max(len(h), *(len(row[i]) for row in rows)) for i, h in enumerate(head)]
    line = lambda cells: "  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(cells, widths)))  # noqa: E731
    return "\n".join([line(head), line(["-" * w for w in widths]), *(line(r) for r in rows)])


def _raise_on_sigterm(signum, frame):
    raise KeyboardInterrupt(f"signal {signum}")   # so every finally: block stops its children


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="benchmarks/overhead.py", description=__doc__,
        epilog="Phases: 1 raw env (random actions), 2 env+inference (Collector, rollouts thrown away), "
               "3 transport only (learner --discard, vla), 4 tandem training (the config's buffer_type). "
               "Every phase uses --actors processes and --steps env steps in total.",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", type=Path, default=DEFAULT_CONFIG, help="JSON config file (default: configs/halfcheetah_ppo.json)")
    p.add_argument("--actors", type=int, default=2, help="processes per phase (= actor processes; default 2)")
    p.add_argument("--steps", type=int, default=200_000, help="env steps per phase, all processes together (default 200000)")
    p.add_argument("--warmup", type=float, default=0.1,
                   help="phases 3-4: fraction of --steps received before the timed window opens (default 0.1)")
    p.add_argument("--phases", default="1,2,3,4", help="comma-separated subset of phases to run (default 1,2,3,4)")
    p.add_argument("--phase-timeout", type=float, default=900.0, help="seconds before a phase is abandoned (default 900)")
    p.add_argument("--json", type=Path, help="also write the results as JSON here")
    p.add_argument("--keep-runs", type=Path, metavar="DIR",
                   help="keep the learner run dirs and process logs of phases 3-4 under DIR (default: a "
                        "temporary dir, deleted)")
    p.add_argument("--set", dest="sets", action="append", default=[], metavar="KEY=VALUE",
                   help="config override for every phase, e.g. --set actors.num_envs=16 (repeatable)")
    args = p.parse_args(argv)
    if args.actors < 1 or args.steps < 1:
        p.error("--actors and --steps must be positive")
    if not 0.0 <= args.warmup < 1.0:
        p.error("--warmup must be in [0, 1)")
    try:
        phases = sorted({int(x) for x in args.phases.split(",") if x.strip()})
    except ValueError:
        p.error(f"--phases {args.phases!r}: expected numbers such as 1,2,3,4")
    if not phases or not set(phases) <= {1, 2, 3, 4}:
        p.error("--phases: choose among 1, 2, 3, 4")
    args.config = args.config.resolve()

    os.environ["OMP_NUM_THREADS"] = "1"        # inherited by the spawned workers of phases 1-2
    os.environ["PYTHONPATH"] = _child_env()["PYTHONPATH"]
    from shared.config import ConfigError, load_config
    try:   # check every phase's config here, so a typo fails in a second and names the key
        base = load_config(args.config, args.sets + [f"actors.num_actors={args.actors}"])
        sets = {i: phase_overrides(base, args, args.sets, transport_only=(i == 3)) for i in (1, 2, 3, 4)}
        cfgs = {i: load_config(args.config, sets[i]) for i in phases}
    except ConfigError as e:
        print(e, file=sys.stderr)
        return 2
    cfg = cfgs[phases[0]]
    print(f"[overhead] {args.config.name}: {cfg.env.id}, {args.actors} processes x {cfg.actors.num_envs} envs, "
          f"rollouts of {cfg.trainer.buffer_size} steps, {args.steps:,} env steps per phase | "
          f"{os.cpu_count()} cpus, load average {os.getloadavg()[0]:.2f} at start", flush=True)
    if os.getloadavg()[0] > 0.5:
        print("[overhead] note: the machine is not idle; other processes share the cores and skew the figures",
              flush=True)

    signal.signal(signal.SIGTERM, _raise_on_sigterm)
    names = {1: "raw env", 2: "env+inference", 3: "transport only", 4: f"tandem training ({base.trainer.buffer_type})"}
    results: list[PhaseResult] = []
    tmp = None if args.keep_runs else tempfile.mkdtemp(prefix="tandem-overhead-")
    runs_root = args.keep_runs.resolve() if args.keep_runs else Path(tmp)
    try:
        for i in phases:
            print(f"[overhead] phase {i}: {names[i]} ...", flush=True)
            t = time.monotonic()
            try:
                if i in (1, 2):
                    r = run_worker_phase(names[i], "raw" if i == 1 else "inference", args, sets[i])
                else:
                    run_dir = runs_root / f"phase{i}-{time.strftime('%Y%m%d-%H%M%S')}"
                    r = run_tandem_phase(names[i], args, sets[i], discard=(i == 3), run_dir=run_dir)
                    r.extra["run_dir"] = str(run_dir) if args.keep_runs else None
            except BenchmarkError as e:
                r = PhaseResult(names[i], args.actors, error=str(e))
                print(f"[overhead] phase {i} failed: {e}", file=sys.stderr, flush=True)
            results.append(r)
            if r.steps_per_s is not None:
                print(f"[overhead] phase {i}: {r.steps_per_s:,.0f} env steps/s over {r.env_steps:,.0f} steps in "
                      f"{r.seconds:.1f} s (phase took {time.monotonic() - t:.0f} s)", flush=True)
            if "warning" in r.extra:
                print(f"[overhead] phase {i}: warning: {r.extra['warning']}", flush=True)
    except KeyboardInterrupt:
        print("[overhead] interrupted: children stopped", file=sys.stderr)
        return 130
    finally:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)

    by = {r.name: r for r in results}
    raw, inf = by.get(names[1]), by.get(names[2])
    for r in results:
        if r.steps_per_s is None:
            continue
        if raw is not None and raw.steps_per_s:
            r.ratio_raw = r.steps_per_s / raw.steps_per_s
        if inf is not None and inf.steps_per_s:
            r.ratio_inference = r.steps_per_s / inf.steps_per_s

    print()
    print(fmt_table(results))
    train = by.get(names[4])
    if train is not None and "samples_trained_per_s" in train.extra:
        x = train.extra
        print(f"\nlearner (phase 4): {x['samples_trained_per_s']:,.0f} samples trained/s, "
              f"{x['update_s_mean']:.3f} s per update, busy {100 * x['learner_busy_fraction']:.0f}% of the time"
              + (f", mean lag {x['lag_mean']:.2f}" if "lag_mean" in x else "")
              + f", dropped {x.get('dropped_lag', 0)} (lag) + {x.get('overwritten', 0)} (overwritten)")
    transport = by.get(names[3])
    key = (transport.ratio_inference if transport is not None else None)
    if key is not None:
        verdict = "ok" if key >= TARGET else "BELOW TARGET"
        print(f"\ntransport-only / env+inference = {key:.3f} (target >= {TARGET}) {verdict}")
    else:
        print("\ntransport-only / env+inference = n/a (needs phases 2 and 3)")

    if args.json:
        doc = {"config": str(args.config), "env": cfg.env.id, "actors": args.actors,
               "num_envs": cfg.actors.num_envs, "buffer_size": cfg.trainer.buffer_size, "steps": args.steps,
               "warmup": args.warmup, "overrides": args.sets, "phases": [asdict(r) for r in results],
               "transport_over_inference": key, "target": TARGET,
               "machine": {"cpus": os.cpu_count(), "platform": platform.platform(),
                           "python": platform.python_version(), "load_average_at_end": os.getloadavg()[0]},
               "time": time.strftime("%Y-%m-%dT%H:%M:%S")}
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(doc, indent=2) + "\n")
        print(f"[overhead] results written to {args.json}")
    return 1 if any(r.error for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
