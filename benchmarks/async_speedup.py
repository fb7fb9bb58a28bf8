"""How much the asynchronous actor-learner design gains when inference is slow.

    .venv/bin/python benchmarks/async_speedup.py [--config configs/cartpole_ppo.json] [--latency 0.2]
                                                 [--latency-per-env 0] [--steps 32768] [--num-envs 16]
                                                 [--buffer-size 32] [--max-lag 8] [--per-update actors|one]
                                                 [--variants std1-1dev,vla4-1dev,thread-1dev,std4-4dev,vla4-4dev]
                                                 [--json out.json] [--keep-runs DIR] [--set KEY=VALUE ...]
    .venv/bin/python benchmarks/async_speedup.py --aggregate seed1.json seed2.json seed3.json

Every variant trains the same config to the same number of env steps, with an emulated inference
latency of ``a + b x N`` seconds per acting call on N envs (``--latency`` a,
``--latency-per-env`` b: ``actors.inference_latency_s`` and ``actors.inference_latency_per_env_s``,
a sleep) standing in for a large model.

**Equal hardware (the default variants).** Every variant runs ``4 x --num-envs`` envs in all, takes
one rollout of ``--buffer-size`` steps from each actor per update (the same samples per update and
the same updates), and infers on the same emulated devices (``actors.emulated_devices``: actors on
one device take turns, across processes; ``actors/emulated_device.py``):

- 1 device: ``standard 1x64`` (one actor with every env), ``vla 4x16 shared`` (four actors of 16
  envs taking turns on the one device), ``vla 4x16 server`` (the four actors' calls batched into one
  by an inference server, ``actors.inference=server``, whose every call costs ``a + b x batch``),
  ``vla 4x16 server, 2 parts`` (the same with ``actors.server_splits=2``: each actor steps half its
  envs while the server acts for the other half), ``vla 4x16 server, zmq`` (the server reached over
  ZeroMQ instead of its Unix socket, ``actors.server_transport=zmq``), ``thread 64`` (the seed's
  one-process design, the lock being the device);
- 4 devices: ``standard 4x16`` and ``vla 4x16``, an actor per device.

For each group the table prints the speed-up over the group's standard variant on the training
window, the bound asynchrony has at equal hardware, ``(collect + update) / max(collect, update)``,
from the standard run's own collect and update times, and the share of the bound reached
(speed-up / bound). With a
fixed latency (b = 0), four actors sharing a device pay ``a`` four times per round where one actor
of 64 envs pays it once: sharing never batches across actors.

**Unequal hardware (earlier comparison, by name).** The variants below give every actor
``--num-envs`` envs and an inference engine of its own, so vla-4 has four times standard-1's
inference capacity; their speed-up measures that capacity more than asynchrony:

1. ``standard-1`` -- ``trainer.buffer_type=standard``, 1 actor: collect, then train, then collect.
2. ``vla-1``, ``vla-2``, ``vla-4`` -- ``trainer.buffer_type=async`` with 1, 2 and 4 actor processes:
   actors never wait for the learner.
3. ``thread`` -- the seed framework's own asynchronous design rebuilt in ONE process (this one): a
   background collection thread and the training thread share ONE policy object under a
   ``threading.Lock``. The collector (the real :class:`actors.rollout.Collector`) acts through a
   wrapper that holds the lock for every policy call and sleeps the latency inside the lock (the
   model is busy while it infers, as on a shared GPU); the training thread takes the lock for each
   PPO update of the real :class:`learner.learner.Learner` (vla buffer, same overrides).

Variants 1-2 run the real ``launch/run_local.sh`` (learner, evaluator and actor processes), started
in its own session and stopped in bounded time (SIGTERM to its process group, SIGKILL after
``STOP_TIMEOUT_S``), also on failure or Ctrl-C. Nothing the script starts outlives it.

Every variant trains ``--num-envs x --buffer-size`` samples per update (512 by default) for the
same number of updates. How an update gathers them (``--per-update``):

- ``actors`` (the default, and the system's own: ``trainer.rollouts_per_update`` defaults to the
  number of actors): one rollout from each actor, each ``--buffer-size / actors`` steps long. The
  actors collect side by side and the learner updates once per round, so a rollout is acted by
  the version before the one that trains on it: mean lag near 1, whatever the number of actors.
- ``one``: one rollout of ``--buffer-size`` steps per update whatever the number of actors. An
  actor loads weights at its rollout boundaries, so while it collects, the learner trains on the
  other actors' rollouts: mean lag near the number of actors (about 5 with 4). This is the worst
  case for PPO's return (``benchmarks/lag_sensitivity.py``: lag 4 costs CartPole 13-17%).

Why 16 envs per actor by default: A actors run A x ``--num-envs`` envs, each for 1/A of the steps.
With 64 envs per actor, vla-4's 256 CartPole envs got 128 steps each in 32k steps, never deep into
a 500-step episode, and vla-4's return was half of standard-1's even without lag
(``benchmarks/lag_sensitivity.py``, case 4:0). With 16 per actor, vla-4 runs 64 envs for 512 steps
each. The speed-up comes from A models inferring at once, for A times the envs; the latency of a
call does not depend on its batch here.

The other overrides are the same for every variant: ``trainer.total_steps``, ``actors.num_envs``,
``trainer.buffer_size`` and ``trainer.rollouts_per_update`` as above,
``trainer.buffer_capacity=8``, ``trainer.max_policy_lag``, ``trainer.eval_freq=0``,
``trainer.save_freq=0``, ``algorithm.cfg.batch_size=256`` (or one update's samples if fewer) and
``actors.inference_latency_s``. The config's ``n_epochs`` is kept. The final return is a
deterministic evaluation of the final weights over ``trainer.num_eval_episodes`` episodes (the
learner's evaluator process, or :func:`learner.evaluator.evaluate` with the evaluator's seed for the
thread variant).

Wall times:
- ``wall s`` -- process variants: the launcher's end-to-end wall time (process start-up, the final
  checkpoint, the final evaluation and shutdown included); thread: in-process, from the start of
  the first collection to the end of training (every step received, the last update done).
- ``learner s`` -- process variants: ``wall_s`` from the learner's ``summary.json`` (from the
  learner's construction: it includes waiting for the actors' start-up and the final evaluation).
- ``window s`` -- every variant: from the first rollout the learner received to its last update;
  start-up-free and measured the same way everywhere, so the fairest comparison of the designs.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from _common import (LAUNCHER, ROOT, BenchmarkError, child_env,  # noqa: E402
                     raise_on_signal, finished_run, stop_launcher, tail, write_results)

DEFAULT_CONFIG = ROOT / "configs" / "cartpole_ppo.json"
TARGET_VS_STANDARD = 3.0               # vla-4 / standard-1 should be at least this
TARGET_VS_THREAD = 1.0                 # vla-4 / thread should be above this

@dataclass(frozen=True)
class Variant:
    label: str
    buffer_type: str
    actors: int
    kind: str                          # "process" (run_local.sh) or "thread" (in this process)
    group: str = "unequal"             # variants compared with each other: the same inference hardware
    devices: str = ""                  # emulated devices: "one" shared by all actors, "own" one each, "" none;
                                       # "server": one inference server acts for all (actors.inference)
    splits: int = 1                    # server: actors.server_splits (each actor's envs in this many parts)
    transport: str = ""                # server: actors.server_transport ("": the config's)

    def __iter__(self):                # (label, buffer_type, actors, kind), as the tuples this replaced
        return iter((self.label, self.buffer_type, self.actors, self.kind))

    def __getitem__(self, i):
        return tuple(self)[i]

    @property
    def equal(self) -> bool:
        return self.group != "unequal"


EQUAL_ACTORS = 4                       # the equal-hardware variants split the envs over 4 actors (or 1)
VARIANTS = {
    # Equal hardware: the same total envs (EQUAL_ACTORS x --num-envs), the same inference devices.
    "std1-1dev": Variant("standard 1x64", "standard", 1, "process", "1 device", "one"),
    "vla4-1dev": Variant("vla 4x16 shared", "vla", 4, "process", "1 device", "one"),
    "thread-1dev": Variant("thread 64", "vla", 1, "thread", "1 device", "one"),
    "server4-1dev": Variant("vla 4x16 server", "vla", 4, "process", "1 device", "server"),
    "server4s2-1dev": Variant("vla 4x16 server, 2 parts", "vla", 4, "process", "1 device", "server", splits=2),
    "server4z-1dev": Variant("vla 4x16 server, zmq", "vla", 4, "process", "1 device", "server", transport="zmq"),
    "std4-4dev": Variant("standard 4x16", "standard", 4, "process", "4 devices", "own"),
    "vla4-4dev": Variant("vla 4x16", "vla", 4, "process", "4 devices", "own"),
    # Unequal (the earlier comparison): every actor adds --num-envs envs and an inference engine of its
    # own, so vla-4 has four times standard-1's inference capacity.
    "standard1": Variant("standard-1", "standard", 1, "process"),
    "vla1": Variant("vla-1", "vla", 1, "process"),
    "vla2": Variant("vla-2", "vla", 2, "process"),
    "vla4": Variant("vla-4", "vla", 4, "process"),
    "thread": Variant("thread", "vla", 1, "thread"),
}
DEFAULT_VARIANTS = [n for n, v in VARIANTS.items() if v.equal]


@dataclass
class Result:
    name: str
    label: str
    kind: str                          # "process" (run_local.sh) or "thread" (in this process)
    buffer_type: str
    actors: int
    wall_s: float | None = None        # launcher end-to-end (process) or first collect -> end (thread)
    learner_wall_s: float | None = None
    window_s: float | None = None      # first rollout received -> last update
    startup_s: float | None = None     # start -> first rollout received (includes one collection)
    env_steps: int | None = None
    updates: int | None = None
    lag_mean: float | None = None
    lag_max: int | None = None
    dropped_lag: int | None = None
    overwritten: int | None = None
    update_s_mean: float | None = None
    update_total_s: float | None = None  # the learner's seconds in updates (process: time/update_wall_s)
    eval_return: float | None = None
    speedup: float | None = None       # standard-1 wall / this wall
    speedup_window: float | None = None
    error: str | None = None
    extra: dict = field(default_factory=dict)


# ================================================================== overrides

def rollout_shape(args, actors: int, equal: bool = False) -> tuple[int, int]:
    """(steps per rollout, rollouts per update) of a variant with `actors` actors. Unequal variants
    train ``--num-envs x --buffer-size`` samples per update; with ``--per-update actors`` an update
    takes one rollout from each actor, so each actor's rollouts are ``--buffer-size / actors`` long.
    Equal-hardware variants split ``EQUAL_ACTORS x --num-envs`` envs over their actors; an update takes
    one rollout of ``--buffer-size`` steps from each actor."""
    if equal:
        return args.buffer_size, actors
    if args.per_update == "one":
        return args.buffer_size, 1
    return args.buffer_size // actors, actors


def envs_per_actor(args, v: Variant) -> int:
    return EQUAL_ACTORS * args.num_envs // v.actors if v.equal else args.num_envs


def variant_overrides(args, v: Variant) -> list[str]:
    """The --set overrides of one variant: the user's, then the benchmark's (which win)."""
    buffer_type, actors, equal = v.buffer_type, v.actors, v.equal
    samples = (EQUAL_ACTORS if equal else 1) * args.num_envs * args.buffer_size
    steps, k = rollout_shape(args, actors, equal)
    devices = {"one": ["dev0"], "own": [f"dev{i}" for i in range(actors)]}.get(v.devices, [])
    extra = [f"actors.emulated_devices={json.dumps(devices)}"] if devices and v.kind == "process" else []
    if v.devices == "server":   # the device is the server's: it batches the 4 actors' calls into one
        extra = (["actors.inference=server"] + ([f"actors.server_splits={v.splits}"] if v.splits > 1 else [])
                 + ([f"actors.server_transport={v.transport}"] if v.transport else []))
    return list(args.sets) + extra + [
        f"trainer.buffer_type={buffer_type}",
        f"actors.num_actors={actors}",
        f"trainer.total_steps={args.steps}",
        f"actors.num_envs={envs_per_actor(args, v)}",
        f"trainer.buffer_size={steps}",
        f"trainer.rollouts_per_update={k}",
        "trainer.buffer_capacity=8",
        f"trainer.max_policy_lag={args.max_lag}",
        "trainer.eval_freq=0",
        "trainer.save_freq=0",
        f"algorithm.cfg.batch_size={min(256, samples)}",
        f"actors.inference_latency_s={args.latency}",
        f"actors.inference_latency_per_env_s={args.latency_per_env}",
    ]


# ================================================================== process variants

def run_process_variant(name: str, args, run_dir: Path) -> Result:
    label, buffer_type, actors, kind = VARIANTS[name]
    res = Result(name, label, kind, buffer_type, actors)
    run_dir.mkdir(parents=True, exist_ok=True)
    sets = [x for o in variant_overrides(args, VARIANTS[name]) for x in ("--set", o)]
    cmd = ["bash", str(LAUNCHER), "--config", str(args.config), "--actors", str(actors), "--out", str(run_dir),
           *sets]
    log_path = run_dir / "launcher.log"
    t_start_wall = time.time()
    t0 = time.monotonic()
    with open(log_path, "wb") as log:
        p = subprocess.Popen(cmd, cwd=ROOT, env=child_env(launcher_python=True), stdin=subprocess.DEVNULL, stdout=log,
                             stderr=subprocess.STDOUT, start_new_session=True)
    try:
        try:
            code = p.wait(timeout=args.timeout)
        except subprocess.TimeoutExpired:
            raise BenchmarkError(f"{label}: not finished within --timeout {args.timeout:.0f} s; the launcher's "
                                 f"log ends:\n{tail(log_path)}") from None
        res.wall_s = time.monotonic() - t0
        if code != 0:
            raise BenchmarkError(f"{label}: run_local.sh exited with code {code}; its log ends:\n{tail(log_path)}")
    finally:
        notes = stop_launcher(p)      # bounded; also on failure and Ctrl-C
        for note in notes:
            print(f"[async] {label}: {note}", flush=True)
        if notes:
            res.extra["stop_notes"] = notes
    run, summary = finished_run(run_dir, label)
    res.learner_wall_s = summary.get("wall_s")
    res.env_steps = summary.get("env_steps")
    res.updates = summary.get("updates")
    res.dropped_lag = summary.get("dropped_lag")
    res.overwritten = summary.get("overwritten")
    res.eval_return = summary.get("last_eval/return_mean")
    versions = run.versions(missing_ok=True)
    lags = [v["lag"] for v in versions if v.get("event") == "consume" and isinstance(v.get("lag"), int)]
    if lags:
        res.lag_mean, res.lag_max = sum(lags) / len(lags), max(lags)
    publishes = [v["time"] for v in versions if v.get("event") == "publish" and v.get("version", 0) > 0]
    first = summary.get("first_rollout_time")
    if first is not None:
        res.startup_s = first - t_start_wall
        if publishes:
            res.window_s = max(publishes) - first
    updates = [m for m in run.metrics(missing_ok=True) if "perf/update_s" in m]
    if updates:
        res.update_s_mean = sum(m["perf/update_s"] for m in updates) / len(updates)
        res.update_total_s = summary.get("time/update_wall_s", sum(m["perf/update_s"] for m in updates))
        res.extra["learner_wait_s"] = sum(m.get("perf/learner_wait_s", 0.0) for m in updates)
    if args.keep_runs:
        res.extra["run_dir"] = str(run_dir)
    return res


# ================================================================== thread variant

def _locked_policy(policy, lock: threading.Lock, latency: float):
    """`policy` as the thread variant's collector sees it, behind `lock` (the one device)."""
    from torch import nn

    class LockedPolicy(nn.Module):
        """The one shared policy, as the collector sees it: every call holds the lock, and the
        acting call sleeps the inference latency inside it (the model is busy while it infers)."""

        def __init__(self, policy: nn.Module):
            super().__init__()
            self.policy = policy       # a submodule: parameters() (the Collector's device) are the policy's

        @property
        def critic(self):              # the Collector's with_value check
            return self.policy.critic

        def forward(self, td, deterministic: bool = False):
            with lock:
                out = self.policy(td, deterministic=deterministic)
                if latency:
                    time.sleep(latency)
                return out

        def get_value(self, td):
            with lock:
                return self.policy.get_value(td)

    return LockedPolicy(policy)


def _start_collector(learner, collector, lock: threading.Lock, stop: threading.Event, errors: list[Exception],
                     times: dict[str, float]) -> threading.Thread:
    """The thread variant's collector thread, started: rollouts into `learner` until `stop` or the
    run's end; a failure goes to `errors` and sets `stop`; first collection and ingest in `times`."""
    from shared.rollout import RolloutMeta

    def collect_loop() -> None:
        seq = 0
        try:
            while not stop.is_set() and not learner.finished:
                with lock:             # the version of the weights the rollout starts with
                    version = learner.version
                times.setdefault("first_collect", time.perf_counter())
                rollout, stats, _ = collector.collect(version)
                meta = RolloutMeta.of(0, seq, stats, policy_version=version, env_steps=rollout.numel())
                learner.ingest(rollout.clone(), meta.to_meta())
                times.setdefault("first_ingest", time.perf_counter())
                seq += 1
        except Exception as e:  # noqa: BLE001 -- any failure is reported by the training thread
            errors.append(e)
            stop.set()

    thread = threading.Thread(target=collect_loop, name="collector", daemon=True)
    thread.start()
    return thread


def _train_while_collecting(args, label: str, learner, lock: threading.Lock, stop: threading.Event
                            ) -> tuple[list[int], list[float], float | None, float]:
    """The thread variant's training thread (this one): an update, under `lock`, whenever a batch is
    in. Returns the lags trained on, each update's seconds, when the last update ended and when
    training ended (``time.perf_counter``)."""
    lags: list[int] = []
    update_s: list[float] = []
    last_update = None
    deadline = time.monotonic() + args.timeout
    while not stop.is_set() and not learner.finished:
        if time.monotonic() > deadline:
            raise BenchmarkError(f"{label}: not finished within --timeout {args.timeout:.0f} s "
                                 f"({learner.env_steps} of {learner.cfg.trainer.total_steps} env steps)")
        batch = learner.take_batch(timeout_s=0.05)
        if batch is None:
            continue
        data, infos = batch
        with lock:
            lags += [learner.version - int(i["policy_version"]) for i in infos]
            t = time.perf_counter()
            learner.update_once(data, infos)
            last_update = time.perf_counter()
            update_s.append(last_update - t)
    return lags, update_s, last_update, time.perf_counter()


def _final_eval_return(learner, cfg) -> float | None:
    """The mean return of the deterministic policy on ``trainer.num_eval_episodes`` episodes, from the
    seed of the evaluator process's first evaluation (trainer.seed + 1_000_003 + count, count 0)."""
    from learner.evaluator import evaluate
    from shared.envs import make_env
    learner.policy.eval()
    eval_env = make_env(cfg.env.id, cfg.trainer.num_eval_episodes, cfg.env.cfg, "cpu")
    try:
        returns = evaluate(learner.policy, eval_env, cfg.trainer.num_eval_episodes,
                           seed=cfg.trainer.seed + 1_000_003).returns
    finally:
        eval_env.close()
    return sum(returns) / len(returns) if returns else None


def run_thread_variant(args, name: str = "thread") -> Result:
    """The seed framework's design in this process: one collector thread and the training thread
    share one policy object under a lock (see the module docstring)."""
    import torch

    from actors.rollout import Collector, sends_bootstrap_obs
    from shared.rollout import actor_seed
    from learner.learner import Learner, ListPublisher, learner_threads
    from shared.config import load_config
    from shared.envs import make_env

    label, buffer_type, actors, kind = VARIANTS[name]
    res = Result(name, label, kind, buffer_type, actors)
    cfg = load_config(args.config, variant_overrides(args, VARIANTS[name]))
    torch.set_num_threads(learner_threads(cfg))   # as the learner and actor processes do
    lock = threading.Lock()
    # the lock is the one device: its latency for a call on all of the collector's envs
    latency = cfg.actors.inference_latency_s + cfg.actors.inference_latency_per_env_s * cfg.actors.num_envs
    learner = Learner(cfg, run_dir=None, publisher=ListPublisher())
    seed = actor_seed(cfg, 0)                   # actor 0's seed, as actors.actor.Actor seeds itself
    torch.manual_seed(seed)
    env = make_env(cfg.env.id, cfg.actors.num_envs, cfg.env.cfg, cfg.learner.device)
    collector = Collector(env, _locked_policy(learner.policy, lock, latency), cfg.trainer.buffer_size, seed=seed,
                          inference_latency_s=0.0,   # the wrapper sleeps, under the lock
                          bootstrap_obs=sends_bootstrap_obs(cfg, True))
    stop = threading.Event()
    errors: list[Exception] = []
    times: dict[str, float] = {}
    join_s = 2 * cfg.trainer.buffer_size * (latency + 0.05) + 30.0   # one rollout in progress, then it stops
    thread = _start_collector(learner, collector, lock, stop, errors, times)
    try:
        lags, update_s, last_update, end = _train_while_collecting(args, label, learner, lock, stop)
    finally:
        learner.accepting = False      # as the learner process: later rollouts are not counted
        stop.set()
        thread.join(timeout=join_s)
        env.close()
    if thread.is_alive():
        raise BenchmarkError(f"{label}: the collector thread did not stop within {join_s:.0f} s")
    if errors:
        raise BenchmarkError(f"{label}: the collector thread failed: {type(errors[0]).__name__}: {errors[0]}")
    res.wall_s = end - times["first_collect"]
    if last_update is not None:
        res.window_s = last_update - times["first_ingest"]
    res.env_steps = learner.env_steps
    res.updates = learner.updates
    res.dropped_lag = learner.counts["dropped_lag"]
    res.overwritten = learner.counts["overwritten"]
    if lags:
        res.lag_mean, res.lag_max = sum(lags) / len(lags), max(lags)
    if update_s:
        res.update_s_mean = sum(update_s) / len(update_s)
        res.update_total_s = sum(update_s)
    res.eval_return = _final_eval_return(learner, cfg)
    return res


# ================================================================== report

def _f(x, spec: str) -> str:
    return "-" if x is None else format(x, spec)


def fmt_table(results: list[Result]) -> str:
    head = ("variant", "actors", "wall s", "learner s", "window s", "speed-up", "speed-up (window)",
            "updates", "s/update", "mean lag", "dropped", "eval return")
    rows = []
    for r in results:
        if r.error:
            rows.append((r.label, str(r.actors), "FAILED", *["-"] * (len(head) - 3)))
            continue
        dropped = "-" if r.dropped_lag is None else f"{r.dropped_lag}+{r.overwritten}"
        rows.append((r.label, str(r.actors), _f(r.wall_s, ".1f") + ("*" if r.kind == "process" else ""),
                     _f(r.learner_wall_s, ".1f"), _f(r.window_s, ".1f"), _f(r.speedup, ".2f") + ("x" * (r.speedup is not None)),
                     _f(r.speedup_window, ".2f") + ("x" * (r.speedup_window is not None)),
                     _f(r.updates, "d"), _f(r.update_s_mean, ".3f"), _f(r.lag_mean, ".2f"), dropped, _f(r.eval_return, ".1f")))
    widths = [max(len(h), *(len(row[i]) for row in rows)) for i, h in enumerate(head)]

    def line(cells) -> str:
        return "  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(cells, widths)))
    return "\n".join([line(head), line(["-" * w for w in widths]), *(line(r) for r in rows)])


FOOTNOTE = """\
* wall s of a process variant is run_local.sh end to end: python and torch start-up of the learner,
  evaluator and actor processes, the final checkpoint, the final evaluation and shutdown included.
  thread: in-process, from the first collection to the end of training (no start-up at all).
  learner s: the learner's own wall_s (summary.json), from its start; includes waiting for the actors.
  window s: first rollout received -> last update, the same clock for every variant (no start-up).
  speed-up: standard-1's time / the variant's, on wall s and on window s.
  s/update: mean seconds per PPO update (the learner's perf/update_s; thread: inside the lock).
  mean lag: learner version at the update - version the rollout was acted with, over trained rollouts.
  dropped: rollouts dropped for lag + overwritten in the buffer before they were trained on."""


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def equal_hardware_rows(results: list[Result]) -> list[dict]:
    """Per equal-hardware group, each variant against the group's standard variant (collect, then
    update): its speed-up on the training window, and the bound asynchrony has at equal hardware,
    (collect + update) / max(collect, update), from the standard run's own times (collect = its
    window less its time in updates)."""
    rows = []
    for group in dict.fromkeys(VARIANTS[r.name].group for r in results if VARIANTS[r.name].equal):
        members = [r for r in results if VARIANTS[r.name].group == group and not r.error]
        std = next((r for r in members if r.buffer_type == "standard"), None)
        bound = collect = update = None
        if std is not None and std.window_s and std.update_total_s is not None:
            update = std.update_total_s
            collect = max(std.window_s - update, 0.0)
            bound = (collect + update) / max(collect, update, 1e-9)
        for r in members:
            speed = _ratio(std.window_s, r.window_s) if std is not None else None
            rows.append({"group": group, "variant": r.label, "name": r.name, "wall_s": r.wall_s, "window_s": r.window_s,
                         "collect_s": collect, "update_s": update, "speedup": speed, "bound": bound,
                         "share_of_bound": _ratio(speed, bound),
                         "eval_return": r.eval_return, "lag_mean": r.lag_mean})
    return rows


def fmt_equal(rows: list[dict]) -> str:
    head = (f"{'equal hardware':<14} {'variant':<16} {'wall s':>7} {'window s':>8} {'speed-up':>8} "
            f"{'bound':>6} {'share':>6} {'return':>7} {'lag':>5}")
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(f"{r['group']:<14} {r['variant']:<16} {_f(r['wall_s'], '7.1f')} {_f(r['window_s'], '8.1f')} "
                     f"{_f(r['speedup'], '8.2f')} {_f(r['bound'], '6.2f')} "
                     f"{'     -' if r['name'].startswith('std') else _f(r['share_of_bound'], '6.2f')} "
                     f"{_f(r['eval_return'], '7.1f')} {_f(r['lag_mean'], '5.2f')}")
    std = {r["group"]: r for r in rows if r["collect_s"] is not None}
    for g, r in std.items():
        lines.append(f"{g}: the standard run collected {r['collect_s']:.1f} s and updated {r['update_s']:.1f} s; "
                     f"overlapping them perfectly gives at most {r['bound']:.2f}x")
    lines.append("speed-up: the group's standard window / this window; bound: (collect + update) / max(collect, "
                 "update); share: speed-up / bound (1.00: collection and updates overlapped perfectly)")
    return "\n".join(lines)


def aggregate(docs: list[dict]) -> str:
    """Several runs' ``--json`` files (one per seed, ``--set trainer.seed=N``): the equal-hardware
    table with each figure's mean +- standard deviation over the runs."""
    import statistics
    by: dict[tuple[str, str], list[dict]] = {}
    for doc in docs:
        for row in doc.get("equal", []):
            by.setdefault((row["group"], row["variant"]), []).append(row)

    def ms(rows: list[dict], key: str, spec: str) -> str:
        xs = [r[key] for r in rows if r.get(key) is not None]
        if not xs:
            return "-"
        if len(xs) == 1:
            return format(xs[0], spec)
        return f"{format(statistics.mean(xs), spec)} ± {format(statistics.stdev(xs), spec)}"

    seeds = sorted({d.get("seed") for d in docs if d.get("seed") is not None})
    lat = {(d.get("latency_s"), d.get("latency_per_env_s")) for d in docs}
    lines = [f"{len(docs)} runs (seeds {seeds}); latency (a, b): {', '.join(map(str, sorted(lat, key=str)))}",
             "| hardware | variant | wall s | window s | collect s | update s | speed-up | bound | share | "
             "final return | mean lag |", "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for (group, variant), rows in by.items():
        std = variant.startswith("standard")
        lines.append(f"| {group} | {variant} | {ms(rows, 'wall_s', '.1f')} | {ms(rows, 'window_s', '.1f')} | "
                     f"{ms(rows, 'collect_s', '.1f') if std else ''} | {ms(rows, 'update_s', '.1f') if std else ''} | "
                     f"{ms(rows, 'speedup', '.2f')} | {ms(rows, 'bound', '.2f')} | "
                     f"{'' if std else ms(rows, 'share_of_bound', '.2f')} | "
                     f"{ms(rows, 'eval_return', '.1f')} | {ms(rows, 'lag_mean', '.2f')} |")
    return "\n".join(lines)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="benchmarks/async_speedup.py", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", type=Path, default=DEFAULT_CONFIG,
                   help="JSON config file (default: configs/cartpole_ppo.json)")
    p.add_argument("--latency", type=float, default=0.2,
                   help="a: seconds added to every acting policy call (actors.inference_latency_s; default 0.2)")
    p.add_argument("--latency-per-env", type=float, default=0.0,
                   help="b: seconds added per env in the call (actors.inference_latency_per_env_s; default 0): "
                        "a call on N envs takes a + b x N")
    p.add_argument("--steps", type=int, default=32768, help="env steps to train on, every variant (default 32768)")
    p.add_argument("--num-envs", type=int, default=16,
                   help="envs per actor: one batched policy call serves them all (default 16)")
    p.add_argument("--buffer-size", type=int, default=32, help="steps per env per rollout (default 32)")
    p.add_argument("--max-lag", type=int, default=8, help="trainer.max_policy_lag (default 8)")
    p.add_argument("--per-update", choices=("actors", "one"), default="actors",
                   help="actors (default, the system's own default): an update takes one rollout from each "
                        "actor, rollouts of --buffer-size / actors steps, so the mean lag stays near 1; one: "
                        "an update takes one rollout of --buffer-size steps whatever the number of actors "
                        "(lag near the number of actors)")
    p.add_argument("--variants", default=",".join(DEFAULT_VARIANTS),
                   help=f"comma-separated subset of {', '.join(VARIANTS)} (default: the equal-hardware ones, "
                        f"{', '.join(DEFAULT_VARIANTS)})")
    p.add_argument("--timeout", type=float, default=900.0, help="seconds before a variant is abandoned (default 900)")
    p.add_argument("--json", type=Path, help="also write the results as JSON here")
    p.add_argument("--keep-runs", type=Path, metavar="DIR",
                   help="keep the run directories of the process variants under DIR (default: a temporary "
                        "dir, deleted)")
    p.add_argument("--set", dest="sets", action="append", default=[], metavar="KEY=VALUE",
                   help="config override for every variant, applied before the benchmark's own (repeatable)")
    return p


def _aggregate_files(files: list[str]) -> int:
    """``--aggregate RUN.json ...``: the table over several runs."""
    if not files:
        print("usage: benchmarks/async_speedup.py --aggregate RUN.json [RUN.json ...]", file=sys.stderr)
        return 2
    print(aggregate([json.loads(Path(f).read_text()) for f in files]))
    return 0


def _checked_variants(p: argparse.ArgumentParser, args) -> list[str]:
    """The variants to run, in the table's order; options that do not fit end with the parser's error."""
    if (args.latency < 0 or args.latency_per_env < 0 or args.steps < 1 or args.num_envs < 1 or args.buffer_size < 1
            or args.max_lag < 0):
        p.error("--latency, --latency-per-env and --max-lag must be >= 0; --steps, --num-envs and --buffer-size "
                "positive")
    names = [x.strip() for x in args.variants.split(",") if x.strip()]
    unknown = [x for x in names if x not in VARIANTS]
    if not names or unknown:
        p.error(f"--variants: unknown {unknown}; choose among {', '.join(VARIANTS)}")
    names = [n for n in VARIANTS if n in names]        # the table's order
    if args.per_update == "actors":
        uneven = [VARIANTS[n][0] for n in names if not VARIANTS[n].equal and args.buffer_size % VARIANTS[n][2]]
        if uneven:
            p.error(f"--buffer-size {args.buffer_size} is not a multiple of the number of actors of "
                    f"{', '.join(uneven)} (--per-update actors splits it over the actors)")
    return names


def _print_plan(args, names: list[str], cfg) -> None:
    """What the variants will train, and on what machine."""
    if any(VARIANTS[n].equal for n in names):
        per_update = EQUAL_ACTORS * args.num_envs * args.buffer_size
        print(f"[async] {args.config.name}: {cfg.env.id}, {args.steps:,} env steps; equal hardware: "
              f"{EQUAL_ACTORS * args.num_envs} envs in all, {per_update} samples per update "
              f"({math.ceil(args.steps / per_update)} updates), one rollout of {args.buffer_size} steps from each "
              f"actor; {cfg.algorithm.cfg.n_epochs} epochs of minibatch {cfg.algorithm.cfg.batch_size}; latency "
              f"{args.latency} s + {args.latency_per_env} s x envs per acting call; max lag {args.max_lag} | "
              f"{os.cpu_count()} cpus, load average {os.getloadavg()[0]:.2f}", flush=True)
    if any(not VARIANTS[n].equal for n in names):
        per_update = args.num_envs * args.buffer_size
        shape = ("one rollout per update of " if args.per_update == "one" else
                 "an update takes one rollout from each actor, of ")
        print(f"[async] {args.config.name}: {cfg.env.id}, {args.steps:,} env steps; unequal variants: "
              f"{args.num_envs} envs per actor, {per_update} samples per update "
              f"({math.ceil(args.steps / per_update)} updates): {shape}"
              f"{args.buffer_size} steps{'' if args.per_update == 'one' else ' / actors'}, "
              f"{cfg.algorithm.cfg.n_epochs} epochs of minibatch "
              f"{cfg.algorithm.cfg.batch_size}, inference latency {args.latency} s per acting call, max lag "
              f"{args.max_lag} | {os.cpu_count()} cpus, load average {os.getloadavg()[0]:.2f}", flush=True)
    if os.getloadavg()[0] > 1.0:
        print("[async] note: the machine is not idle; other processes share the cores and skew the figures",
              flush=True)


def _run_variants(args, names: list[str]) -> list[Result] | None:
    """Every variant in turn (a failed one is a result with its error); None when interrupted."""
    signal.signal(signal.SIGINT, raise_on_signal)
    signal.signal(signal.SIGTERM, raise_on_signal)
    tmp = None if args.keep_runs else tempfile.mkdtemp(prefix="tandem-async-")
    runs_root = args.keep_runs.resolve() if args.keep_runs else Path(tmp)
    results: list[Result] = []
    try:
        for n in names:
            label, buffer_type, actors, kind = VARIANTS[n]
            print(f"[async] {label} ({buffer_type}, {actors} actor{'s' * (actors > 1)}"
                  f"{', one process, shared policy under a lock' if kind == 'thread' else ''}) ...", flush=True)
            t = time.monotonic()
            try:
                if kind == "thread":
                    r = run_thread_variant(args, n)
                else:
                    r = run_process_variant(n, args, runs_root / n)
            except BenchmarkError as e:
                r = Result(n, label, kind, buffer_type, actors, error=str(e))
                print(f"[async] {label} failed: {e}", file=sys.stderr, flush=True)
            results.append(r)
            if not r.error:
                print(f"[async] {label}: wall {r.wall_s:.1f} s, window {_f(r.window_s, '.1f')} s, "
                      f"{r.updates} updates, lag {_f(r.lag_mean, '.2f')}, eval {_f(r.eval_return, '.1f')} "
                      f"(took {time.monotonic() - t:.0f} s)", flush=True)
    except KeyboardInterrupt:
        print("[async] interrupted: children stopped", file=sys.stderr)
        return None
    finally:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
    return results


def _report(results: list[Result]) -> tuple[list, dict]:
    """The tables and the key ratios, printed; returns the equal-hardware rows and the key ratios."""
    by = {r.name: r for r in results if not r.error}
    base = by.get("standard1")
    for r in by.values():
        if base is not None:
            r.speedup = _ratio(base.wall_s, r.wall_s)
            r.speedup_window = _ratio(base.window_s, r.window_s)
    print()
    print(fmt_table(results))
    print(FOOTNOTE)
    equal = equal_hardware_rows(results)
    if equal:
        print("\n" + fmt_equal(equal))
    parts = [r for r in results if not r.error and r.kind == "process" and r.startup_s is not None
             and r.window_s is not None]
    if parts:
        print("\nwhere the wall time of the process variants goes (s): start-up = launcher start -> first rollout "
              "received\n(one collection included); window; end = last update -> launcher exit (final checkpoint, "
              "final evaluation, shutdown)")
        for r in parts:
            print(f"  {r.label:<10}  start-up {r.startup_s:5.1f}  window {r.window_s:5.1f}  "
                  f"end {r.wall_s - r.startup_s - r.window_s:5.1f}  = wall {r.wall_s:5.1f}")
    print()
    key = _key_ratios(by, base)
    print("final deterministic eval return: " + " | ".join(f"{r.label} {_f(r.eval_return, '.1f')}" for r in results))
    return equal, key


def _key_ratios(by: dict[str, Result], base: Result | None) -> dict[str, float | None]:
    """vla-4's speed-ups over standard-1 and over the thread variant, printed against their targets."""
    vla4, thread = by.get("vla4"), by.get("thread")
    key = {}
    if vla4 is not None and base is not None:
        key["vla4_over_standard1"] = _ratio(base.wall_s, vla4.wall_s)
        key["vla4_over_standard1_window"] = _ratio(base.window_s, vla4.window_s)
        verdict = "ok" if key["vla4_over_standard1"] >= TARGET_VS_STANDARD else "BELOW TARGET"
        print(f"vla-4 / standard-1 speed-up = {key['vla4_over_standard1']:.2f}x on wall s (target >= "
              f"{TARGET_VS_STANDARD:g}) {verdict}; {_f(key['vla4_over_standard1_window'], '.2f')}x on window s")
    else:
        print("vla-4 / standard-1 speed-up = n/a (needs standard1 and vla4)")
    if vla4 is not None and thread is not None:
        key["vla4_over_thread"] = _ratio(thread.wall_s, vla4.wall_s)
        key["vla4_over_thread_window"] = _ratio(thread.window_s, vla4.window_s)
        verdict = "ok" if key["vla4_over_thread"] > TARGET_VS_THREAD else "BELOW TARGET"
        print(f"vla-4 vs thread speed-up    = {key['vla4_over_thread']:.2f}x on wall s (target > "
              f"{TARGET_VS_THREAD:g}; vla-4's wall includes process start-up, thread's none) {verdict}; "
              f"{_f(key['vla4_over_thread_window'], '.2f')}x on window s")
    else:
        print("vla-4 vs thread speed-up = n/a (needs vla4 and thread)")
    return key


def _write_json(args, cfg, names: list[str], results: list[Result], equal: list, key: dict) -> None:
    """--json: the run's settings, every result, the equal-hardware rows and the key ratios."""
    doc = {"config": str(args.config), "env": cfg.env.id, "latency_s": args.latency,
           "latency_per_env_s": args.latency_per_env, "seed": cfg.trainer.seed, "steps": args.steps,
           "num_envs": args.num_envs, "buffer_size": args.buffer_size, "per_update": args.per_update,
           "max_policy_lag": args.max_lag,
           "batch_size": cfg.algorithm.cfg.batch_size, "n_epochs": cfg.algorithm.cfg.n_epochs,
           "overrides": {n: variant_overrides(args, VARIANTS[n]) for n in names},
           "results": [asdict(r) for r in results], "equal": equal,
           "key": key, "targets": {"vla4_over_standard1": TARGET_VS_STANDARD, "vla4_over_thread": TARGET_VS_THREAD}}
    write_results(args.json, doc, "async")


def main(argv: list[str] | None = None) -> int:
    p = _parser()
    if argv is None:
        argv = sys.argv[1:]
    if argv[:1] == ["--aggregate"]:
        return _aggregate_files(argv[1:])
    args = p.parse_args(argv)
    names = _checked_variants(p, args)
    args.config = args.config.resolve()

    from shared.config import ConfigError, load_config
    try:   # check every variant's config here, so a typo fails in a second and names the key
        cfgs = {n: load_config(args.config, variant_overrides(args, VARIANTS[n])) for n in names}
    except ConfigError as e:
        print(e, file=sys.stderr)
        return 2
    cfg = cfgs[names[0]]
    _print_plan(args, names, cfg)
    results = _run_variants(args, names)
    if results is None:
        return 130
    equal, key = _report(results)
    if args.json:
        _write_json(args, cfg, names, results, equal, key)
    return 1 if any(r.error for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
