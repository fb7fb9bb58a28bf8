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

Every process of every phase is a fresh interpreter in its own session (see :func:`_start`), with
OMP_NUM_THREADS=1 and PYTHONPATH=<repo root>. Each phase reports total env steps per second.
Start-up (python and torch imports, env and policy construction) is excluded everywhere: phases
1-2 start their timers together once every worker has set up and run one warm-up rollout; phases
3-4 time from the learner's own progress lines, from the first one past ``--warmup`` of the run
(see :func:`learner_window`).

The key figure is ``transport-only / env+inference`` (target >= 0.9): the share of the actors'
collection rate that survives sending every rollout to the learner.

All child processes are stopped before the script returns (terminate, then kill after a
timeout), also on Ctrl-C, SIGTERM or a failed phase.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import queue
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from _common import (ROOT, BenchmarkError, RunDir, child_env, raise_on_signal,  # noqa: E402
                     stop_process_groups, tail, write_results)

DEFAULT_CONFIG = ROOT / "configs" / "halfcheetah_ppo.json"
TARGET = 0.9                           # transport-only / env+inference should be at least this
STOP_TIMEOUT_S = 10.0                  # SIGTERM -> SIGKILL grace for every child we start
MIN_WINDOW_S = 5.0                     # phases 3-4: shorter timed windows get a warning
LOG_INTERVAL_S = 0.25                  # phases 3-4: period of the learner progress lines they are timed by


@dataclass
class PhaseResult:
    name: str
    processes: int                     # worker or actor processes (P)
    learner: bool = False              # phases 3-4 also run the learner process
    env_steps: int = 0                 # env steps inside the timed window
    seconds: float = 0.0               # length of the timed window
    steps_per_s: float | None = None
    ratio_raw: float | None = None
    ratio_inference: float | None = None
    error: str | None = None
    extra: dict = field(default_factory=dict)


# ================================================================== child processes

def _start(cmd: list[str], log_path: Path, stdin=subprocess.DEVNULL, stdout=None) -> subprocess.Popen:
    """Start `cmd` as a fresh interpreter in its own session (process group); what it writes goes
    to `log_path` (stdout too, unless `stdout` is given).

    Every phase starts its processes this way, not only the learner and actors. That matters for
    a fair comparison: with Linux scheduler autogroups (``/proc/sys/kernel/sched_autogroup_enabled``)
    each session is one CPU-share group, so on a busy machine P processes in one session would get
    the share of one process while P sessions get the share of P.
    """
    with open(log_path, "wb") as log:
        return subprocess.Popen(cmd, cwd=ROOT, env=child_env(), stdin=stdin,
                                stdout=log if stdout is None else stdout,
                                stderr=subprocess.STDOUT if stdout is None else log, start_new_session=True)


def _stop_processes(procs: list[subprocess.Popen]) -> None:
    stop_process_groups(procs, STOP_TIMEOUT_S)


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


def worker_main(phase: str, config: str, overrides: list[str], idx: int, steps: int) -> int:
    """One process of phase 1 (``raw``) or 2 (``inference``), run as
    ``overhead.py --worker PHASE --worker-index I --worker-steps N --config C [--set ...]``.

    Protocol on stdout/stdin: set up and warm up, print ``READY``, wait for a ``GO`` line, step
    `steps` env steps, print ``RESULT {"t0": .., "t1": .., "steps": ..}`` (``time.monotonic``:
    CLOCK_MONOTONIC, one clock for every process on Linux). Errors go to stderr, exit code 1.
    """
    import torch
    from shared.config import load_config
    from shared.envs import make_env
    from shared.rollout import actor_seed

    cfg = load_config(config, overrides)
    torch.set_num_threads(cfg.actors.torch_threads)   # what an actor process does (1 by default)
    device = cfg.actors.devices[idx % len(cfg.actors.devices)]
    seed = actor_seed(cfg, idx)                        # as actors.actor.Actor seeds itself
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
            from actors.rollout import Collector, sends_bootstrap_obs
            from shared.policies import has_critic, make_policy
            policy = make_policy(cfg, env.spec).to(env.device).eval()
            slow = not cfg.actors.slow_actor_ids or idx in cfg.actors.slow_actor_ids   # as Actor does
            collector = Collector(env, policy, cfg.trainer.buffer_size, seed=seed,
                                  step_delay_s=cfg.actors.slowdown_s if slow else 0.0,
                                  bootstrap_obs=sends_bootstrap_obs(cfg, has_critic(policy)))
            per_call = n * cfg.trainer.buffer_size

            def work():
                collector.collect(0)      # the rollout is thrown away

        calls = max(1, math.ceil(steps / per_call))
        # Warm-up outside the timed window (first-call allocations, lazy imports): one rollout's worth.
        for _ in range(math.ceil(n * cfg.trainer.buffer_size / per_call)):
            work()
        # GPU simulators run asynchronously: time finished work only.
        sync = (lambda: torch.cuda.synchronize(env.device)) if env.device.type == "cuda" else (lambda: None)
        sync()
        print("READY", flush=True)
        if sys.stdin.readline().strip() != "GO":
            return 1                  # the parent went away
        t0 = time.monotonic()
        for _ in range(calls):
            work()
        sync()
        t1 = time.monotonic()
        print("RESULT " + json.dumps({"t0": t0, "t1": t1, "steps": calls * per_call}), flush=True)
        return 0
    finally:
        env.close()


def run_worker_phase(name: str, phase: str, args, overrides: list[str], log_dir: Path) -> PhaseResult:
    """Phases 1-2: P worker processes started together once all are set up;
    rate = all their steps / (last end - first start)."""
    P = args.actors
    res = PhaseResult(name, P)
    log_dir.mkdir(parents=True, exist_ok=True)
    per_proc = math.ceil(args.steps / P)
    sets = [x for o in overrides for x in ("--set", o)]
    lines: "queue.Queue[tuple[int, str | None]]" = queue.Queue()

    def read(i: int, stream) -> None:          # one thread per worker: its stdout, line by line
        for line in stream:
            lines.put((i, line.decode(errors="replace").strip()))
        lines.put((i, None))

    def expect(prefix: str, deadline: float) -> dict[int, str]:
        got: dict[int, str] = {}
        while len(got) < P:
            try:
                i, line = lines.get(timeout=max(0.01, min(1.0, deadline - time.monotonic())))
            except queue.Empty:
                if time.monotonic() > deadline:
                    raise BenchmarkError(f"{name}: no {prefix} from every worker within --phase-timeout "
                                         f"{args.phase_timeout:.0f} s") from None
                continue
            if line is None:
                if i in got:              # it said its piece and left: fine
                    continue
                procs[i].wait(timeout=5)
                raise BenchmarkError(f"{name}: worker {i} exited (code {procs[i].returncode}) before {prefix}; "
                                     f"its log ends:\n{tail(log_dir / f'worker_{i}.log')}")
            if line.startswith(prefix):
                got[i] = line[len(prefix):].strip()
        return got

    procs: list[subprocess.Popen] = []
    try:
        for i in range(P):
            cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", phase, "--worker-index", str(i),
                   "--worker-steps", str(per_proc), "--config", str(args.config), *sets]
            procs.append(_start(cmd, log_dir / f"worker_{i}.log", stdin=subprocess.PIPE, stdout=subprocess.PIPE))
            threading.Thread(target=read, args=(i, procs[-1].stdout), daemon=True).start()
        deadline = time.monotonic() + args.phase_timeout
        expect("READY", deadline)
        for i, p in enumerate(procs):         # microseconds apart: a start barrier
            try:
                p.stdin.write(b"GO\n")
                p.stdin.flush()
            except OSError:                   # it died after READY
                raise BenchmarkError(f"{name}: worker {i} went away before the start; its log ends:\n"
                                     f"{tail(log_dir / f'worker_{i}.log')}") from None
        reports = {i: json.loads(text) for i, text in expect("RESULT", deadline).items()}
    finally:
        _stop_processes(procs)
    t0, t1 = min(r["t0"] for r in reports.values()), max(r["t1"] for r in reports.values())
    res.env_steps = sum(r["steps"] for r in reports.values())
    res.seconds = t1 - t0
    res.steps_per_s = res.env_steps / res.seconds
    res.extra["per_process_steps_per_s"] = [round(reports[i]["steps"] / (reports[i]["t1"] - reports[i]["t0"]), 1)
                                            for i in range(P)]
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


def learner_window(points: list[tuple[float, float]], start_steps: float) -> tuple[int, float]:
    """``(env_steps, seconds)`` of the steady-state window seen in the learner's progress lines.

    Why this window: the learner's own ``wall_s`` (summary.json) and ``perf/sps`` count from the
    learner's start, so they include seconds of python/torch imports and the actors' start-up;
    in discard mode nothing else is logged per rollout. The learner prints a progress line every
    ``trainer.log_interval_s`` (we pass LOG_INTERVAL_S) with its elapsed time (to 0.1 s) and the
    env steps it has received. The window opens at the first line at or past `start_steps` (the
    warm-up: every actor has been sending for a while by then) and closes at the first line that
    shows the count of the last *periodic* line (the very last line is printed after shutdown
    work, final checkpoint and stop messages, and is dropped). Steps arrive a rollout at a time,
    so the count is a staircase; taking the first line of a step at both ends keeps the idle
    stretch of a plateau out of the window.
    """
    periodic = points[:-1]
    inside = [p for p in periodic if p[1] >= start_steps and p[1] > 0]
    if inside:
        (t0, s0), s1 = inside[0], inside[-1][1]
        t1 = min(t for t, n in inside if n == s1)
        if s1 > s0 and t1 > t0:
            return int(round(s1 - s0)), t1 - t0
    raise BenchmarkError(f"too few progress lines after the warm-up ({len(inside)} at or past {start_steps:.0f} "
                         f"steps) to time a steady state: raise --steps or lower --warmup")


def _training_stats(run_dir: Path, start_steps: float) -> dict:
    """Learner-side figures of a training run, from metrics.jsonl (one line per update) and
    summary.json, over the updates logged at or past `start_steps` received env steps."""
    run = RunDir(run_dir)
    rows = [r for r in run.metrics(missing_ok=True)
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
    summary = run.summary() or {}     # a phase stopped before the end has none
    out.update({k: summary[k] for k in ("updates", "version", "rollouts", "dropped_lag", "overwritten",
                                        "malformed", "rejected") if k in summary})
    return out


def run_tandem_phase(name: str, args, overrides: list[str], discard: bool, run_dir: Path) -> PhaseResult:
    """Phases 3-4: the real learner and P real actors, each its own process, as run_local.sh does."""
    P = args.actors
    res = PhaseResult(name, P, learner=True)
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
                                         f"finished; its log ends:\n{tail(run_dir / f'actor_{i}.log')}")
            # Exit code 0 is an actor obeying the learner's stop message, sent before the learner's
            # own shutdown work; but a learner still up long after every actor left would wait forever.
            if all_gone_at is None and all(a.poll() is not None for a in actors):
                all_gone_at = time.monotonic()
            if all_gone_at is not None and time.monotonic() - all_gone_at > 3 * STOP_TIMEOUT_S:
                raise BenchmarkError(f"{name}: every actor left but the learner did not finish; its log ends:\n"
                                     f"{tail(learner_log)}")
            if time.monotonic() > deadline:
                raise BenchmarkError(f"{name}: not finished within --phase-timeout {args.phase_timeout:.0f} s "
                                     f"(learner log ends:\n{tail(learner_log)})")
            time.sleep(0.2)
        if learner.returncode != 0:
            raise BenchmarkError(f"{name}: the learner exited with code {learner.returncode}; its log ends:\n"
                                 f"{tail(learner_log)}")
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
        res.extra["warning"] = (f"timed window only {res.seconds:.1f} s (timed from progress lines every "
                                f"{LOG_INTERVAL_S} s, to 0.1 s): raise --steps for a steadier figure")
    if not discard:
        res.extra.update(_training_stats(run_dir, start_steps))
    return res


# ================================================================== driver

def phase_overrides(base_cfg, args, user_sets: list[str], transport_only: bool) -> list[str]:
    """The --set overrides of one phase (the user's, then the benchmark's)."""
    sets = list(user_sets) + [f"actors.num_actors={args.actors}", f"trainer.total_steps={args.steps}",
                              f"trainer.log_interval_s={LOG_INTERVAL_S}"]
    if transport_only:
        # a discarding learner consumes nothing, so no admission credit ever comes back: actors run free
        sets += ["trainer.buffer_type=async", "trainer.lag_policy=drop"]
        k = base_cfg.trainer.rollouts_per_update or args.actors
        if base_cfg.trainer.buffer_capacity < k:
            # Only the vla config check needs this: in discard mode the buffer is never used.
            sets.append(f"trainer.buffer_capacity={k}")
    return sets


def fmt_table(results: list[PhaseResult]) -> str:
    head = ("phase", "processes", "env steps/s", "/ raw env", "/ env+inference")
    rows = []

    def f(x, spec):
        return "-" if x is None else format(x, spec)
    for r in results:
        procs = f"{r.processes} + learner" if r.learner else str(r.processes)
        rows.append((r.name, procs, "FAILED" if r.error else f(r.steps_per_s, ",.0f"),
                     f(r.ratio_raw, ".3f"), f(r.ratio_inference, ".3f")))
    widths = [max(len(h), *(len(row[i]) for row in rows)) for i, h in enumerate(head)]

    def line(cells) -> str:
        return "  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(cells, widths)))
    return "\n".join([line(head), line(["-" * w for w in widths]), *(line(r) for r in rows)])


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="benchmarks/overhead.py", description=__doc__,
        epilog="Phases: 1 raw env (random actions), 2 env+inference (Collector, rollouts thrown away), "
               "3 transport only (learner --discard, vla), 4 tandem training (the config's buffer_type). "
               "Every phase uses --actors processes and --steps env steps in total.",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", type=Path, default=DEFAULT_CONFIG,
                   help="JSON config file (default: configs/halfcheetah_ppo.json)")
    p.add_argument("--actors", type=int, default=2, help="processes per phase (= actor processes; default 2)")
    p.add_argument("--steps", type=int, default=200_000,
                   help="env steps per phase, all processes together (default 200000)")
    p.add_argument("--warmup", type=float, default=0.1,
                   help="phases 3-4: fraction of --steps received before the timed window opens (default 0.1)")
    p.add_argument("--phases", default="1,2,3,4", help="comma-separated subset of phases to run (default 1,2,3,4)")
    p.add_argument("--phase-timeout", type=float, default=900.0,
                   help="seconds before a phase is abandoned (default 900)")
    p.add_argument("--json", type=Path, help="also write the results as JSON here")
    p.add_argument("--keep-runs", type=Path, metavar="DIR",
                   help="keep every phase's process logs (and the learner run dirs of phases 3-4) under DIR "
                        "(default: a temporary dir, deleted)")
    p.add_argument("--set", dest="sets", action="append", default=[], metavar="KEY=VALUE",
                   help="config override for every phase, e.g. --set actors.num_envs=16 (repeatable)")
    # Internal: this same file is the worker process of phases 1-2.
    p.add_argument("--worker", choices=("raw", "inference"), help=argparse.SUPPRESS)
    p.add_argument("--worker-index", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--worker-steps", type=int, default=0, help=argparse.SUPPRESS)
    return p


def _checked_phases(p: argparse.ArgumentParser, args) -> list[int]:
    """The phases to run, in order; options that do not fit end with the parser's error."""
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
    return phases


def _run_phases(args, phases: list[int], names: dict[int, str], sets: dict[int, list[str]]
                ) -> list[PhaseResult] | None:
    """Every phase in turn (a failed one is a result with its error); None when interrupted."""
    # Ctrl-C and SIGTERM (also when SIGINT came in ignored, as in a background job) unwind
    # through the finally: blocks below, which stop every child.
    signal.signal(signal.SIGINT, raise_on_signal)
    signal.signal(signal.SIGTERM, raise_on_signal)
    results: list[PhaseResult] = []
    tmp = None if args.keep_runs else tempfile.mkdtemp(prefix="tandem-overhead-")
    runs_root = args.keep_runs.resolve() if args.keep_runs else Path(tmp)
    try:
        for i in phases:
            print(f"[overhead] phase {i}: {names[i]} ...", flush=True)
            t = time.monotonic()
            try:
                run_dir = runs_root / f"phase{i}-{time.strftime('%Y%m%d-%H%M%S')}"
                if i in (1, 2):
                    r = run_worker_phase(names[i], "raw" if i == 1 else "inference", args, sets[i], run_dir)
                else:
                    r = run_tandem_phase(names[i], args, sets[i], discard=(i == 3), run_dir=run_dir)
                if args.keep_runs:
                    r.extra["run_dir"] = str(run_dir)
            except BenchmarkError as e:
                r = PhaseResult(names[i], args.actors, learner=i in (3, 4), error=str(e))
                print(f"[overhead] phase {i} failed: {e}", file=sys.stderr, flush=True)
            results.append(r)
            if r.steps_per_s is not None:
                print(f"[overhead] phase {i}: {r.steps_per_s:,.0f} env steps/s over {r.env_steps:,.0f} steps in "
                      f"{r.seconds:.1f} s (phase took {time.monotonic() - t:.0f} s)", flush=True)
            if "warning" in r.extra:
                print(f"[overhead] phase {i}: warning: {r.extra['warning']}", flush=True)
    except KeyboardInterrupt:
        print("[overhead] interrupted: children stopped", file=sys.stderr)
        return None
    finally:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
    return results


def _report(results: list[PhaseResult], names: dict[int, str]) -> float | None:
    """The ratios, the table and the verdict, printed; returns transport-only / env+inference."""
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
    return key


def _write_json(args, cfg, results: list[PhaseResult], key: float | None) -> None:
    """--json: the run's settings, every phase's result and the key ratio."""
    doc = {"config": str(args.config), "env": cfg.env.id, "actors": args.actors,
           "num_envs": cfg.actors.num_envs, "buffer_size": cfg.trainer.buffer_size, "steps": args.steps,
           "warmup": args.warmup, "overrides": args.sets, "phases": [asdict(r) for r in results],
           "transport_over_inference": key, "target": TARGET}
    write_results(args.json, doc, "overhead")


def main(argv: list[str] | None = None) -> int:
    p = _parser()
    args = p.parse_args(argv)
    if args.worker:
        return worker_main(args.worker, str(args.config), args.sets, args.worker_index, args.worker_steps)
    phases = _checked_phases(p, args)
    args.config = args.config.resolve()

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
    names = {1: "raw env", 2: "env+inference", 3: "transport only",
             4: f"tandem training ({base.trainer.buffer_type})"}
    results = _run_phases(args, phases, names, sets)
    if results is None:
        return 130
    key = _report(results, names)
    if args.json:
        _write_json(args, cfg, results, key)
    return 1 if any(r.error for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
