"""Does Tandem get there sooner than a single-process PPO loop with the same hyperparameters?

    .venv/bin/python benchmarks/vs_single_process.py [--config configs/halfcheetah_ppo.json]
        [--seeds 1,2,3] [--steps N] [--variants standard,overlap,plain,sb3] [--json out.json]
        [--keep-runs DIR] [--set KEY=VALUE ...]

In one sitting, for every seed in turn, every variant trains the config to the same env steps:

- ``shipped`` -- ``launch/run_local.sh --config C``, the config as it is (evaluating at the end only,
  as every variant does); ``shipped_evals`` -- the same with its periodic evaluations too;
  ``shipped_compile`` -- shipped with ``learner.compile=compile`` (the loss through torch.compile).
- ``standard`` -- ``launch/run_local.sh --config C``, the config as it is, with
  ``trainer.buffer_type=standard``: collect, then train, the actors waiting for every update.
- ``overlap`` -- the same with ``trainer.buffer_type=async``, ``lag_policy=pace``,
  ``max_policy_lag=1``, ``actors.nice=10`` and ``actors.weights_at=rollout``: the actors collect the
  next rollouts while the learner trains on the last ones, so every sample is trained on by the
  version after the one that acted (lag exactly 1), and the learner's update runs first where they
  compete for a core.
- ``overlap_idle`` -- ``overlap`` with ``learner.critic_thread=idle``: while the next rollouts already
  wait (the actors have nothing to do), each minibatch's value loss runs on a second thread.
- ``overlap_threads`` -- ``overlap`` with ``learner.torch_threads=idle``: while the next rollouts
  already wait, each minibatch runs with every core as torch intra-op threads instead.
- ``plain`` -- the serial runner (``runners/serial.py``: Tandem's own collector and
  :class:`Learner` update in one process) with one actor stepping every env, ``num_actors x
  num_envs``, run synchronously in a fresh interpreter with torch's default threads: the same
  algorithm, without processes.
- ``sb3`` -- Stable-Baselines3 PPO (if it is importable: ``pip install -e '.[bench]'``) with the
  same hyperparameters: ``DummyVecEnv`` of all the envs, ``VecNormalize`` for observations and
  rewards, the same network, log-std, learning rate (annealed linearly when ``anneal_lr``), steps per
  update, minibatch, epochs, clip, gamma, lambda and gradient clipping.

Printed per run and as medians over the seeds, next to the first variant in ``--baseline`` order
(sb3, else plain):

- ``train s`` -- the training loop's wall time: from the learner's start (Tandem: its actors start
  meanwhile) or the first collection (plain, sb3) to the end of the last update. Start-up of the
  interpreter and the final evaluation are outside it.
- ``total s`` -- the whole command, end to end (Tandem: the launcher, with start-up, final checkpoint,
  final evaluation and shutdown).
- ``return`` -- the deterministic evaluation of the final weights over ``trainer.num_eval_episodes``
  episodes (Tandem: its evaluator; plain: the same function and seed; sb3: its policy on
  ``VecNormalize`` statistics frozen at the end). Every variant evaluates only then: Tandem runs with
  ``trainer.eval_freq=0``, so that its evaluator does no work during training that the others skip.
- ``ideal s`` -- the shortest wall time this machine could do the work in: the CPU seconds of
  collection (``num_envs`` envs per process, one thread, as an actor does) and of the updates (one
  thread), measured in a calibration process at the start, divided by the usable cores.
- For Tandem runs, the CPU seconds its actors spent collecting and its learner spent updating
  (``time/*`` in ``summary.json``).

The machine should be idle: the script prints the load average and warns when it is not. Nothing
it starts outlives it (launchers are stopped with their process group, workers are killed).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from _common import (ROOT, BenchmarkError, child_env, finished_run, machine_info, raise_on_signal, run_launcher,
                     tail)

DEFAULT_CONFIG = ROOT / "configs" / "halfcheetah_ppo.json"
VARIANTS = ("shipped", "shipped_evals", "shipped_compile", "standard", "overlap", "overlap_idle", "overlap_threads", "plain", "sb3")
_OVERLAP = ["trainer.buffer_type=async", "trainer.lag_policy=pace", "trainer.max_policy_lag=1", "actors.nice=10",
            "actors.weights_at=rollout"]
# Every variant evaluates once, at the end, as sb3 and plain do: Tandem's periodic evaluations (a
# child process stepping its own envs while the run trains) would be work the others do not do.
_EVAL_AT_END = ["trainer.eval_freq=0"]
TANDEM_SETS = {"shipped": [*_EVAL_AT_END], "shipped_evals": [],
               "shipped_compile": [*_EVAL_AT_END, "learner.compile=compile"],
               "standard": [*_EVAL_AT_END, "trainer.buffer_type=standard"], "overlap": [*_EVAL_AT_END, *_OVERLAP],
               "overlap_idle": [*_EVAL_AT_END, *_OVERLAP, "learner.critic_thread=idle"],
               "overlap_threads": [*_EVAL_AT_END, *_OVERLAP, "learner.torch_threads=idle"]}
STOP_S = 10.0


def usable_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


@dataclass
class Run:
    variant: str
    seed: int
    train_s: float | None = None
    total_s: float | None = None
    env_steps: int | None = None
    updates: int | None = None
    eval_return: float | None = None
    collect_cpu_s: float | None = None
    update_cpu_s: float | None = None
    threads: int | None = None
    lag_mean: float | None = None
    error: str = ""
    extra: dict = field(default_factory=dict)


# ================================================================== workers (fresh interpreters)

def _load(config: str, sets: list[str]):
    from shared.config import load_config
    return load_config(config, sets)


def worker_calibrate(config: str, sets: list[str], rollouts: int, updates: int) -> dict:
    """CPU seconds per env step of collection (``actors.num_envs`` envs, one thread, as one actor)
    and per update (one thread), on the config's own policy and data."""
    import torch

    from actors.rollout import Collector, sends_bootstrap_obs
    from shared.rollout import RolloutMeta
    from learner.learner import Learner, ListPublisher
    from shared import keys
    from shared.envs import make_env
    torch.set_num_threads(1)
    # one thread per update, whatever the runs use: the ideal divides one-thread CPU by the cores
    cfg = _load(config, sets + ["trainer.buffer_type=standard", "learner.critic_thread=false"])
    learner = Learner(cfg, run_dir=None, publisher=ListPublisher())

    def per_step(num_envs: int):
        env = make_env(cfg.env.id, num_envs, cfg.env.cfg, "cpu")
        try:
            collector = Collector(env, learner.policy, cfg.trainer.buffer_size, seed=cfg.trainer.seed,
                                  bootstrap_obs=sends_bootstrap_obs(cfg, True))
            collector.collect(0)                                  # warm-up
            c0 = time.thread_time()
            for _ in range(rollouts):
                rollout, stats, _ = collector.collect(0)
            return (time.thread_time() - c0) / (rollouts * rollout.numel()), rollout.clone(), stats
        finally:
            env.close()

    # one process stepping every env: what the per-actor split costs in per-step overhead
    collect_all_per_step = per_step(cfg.actors.num_actors * cfg.actors.num_envs)[0]
    collect_per_step, rollout, stats = per_step(cfg.actors.num_envs)
    inference_share = stats.inference_s / max(stats.collect_s, 1e-9)
    per_update = []
    for i in range(updates + 1):                              # the first one warms up
        rollout[keys.POLICY_VERSION].fill_(learner.version)   # on-policy for the update it feeds
        for a in range(cfg.rollouts_per_update):
            learner.ingest(rollout.clone(), RolloutMeta(actor=a, seq=i).to_meta())
        batch = learner.take_batch(timeout_s=1.0)
        if batch is None:
            raise RuntimeError("calibration: the learner did not take the rollouts")
        u0 = time.process_time()
        learner.update_once(*batch)
        if i:
            per_update.append(time.process_time() - u0)
    return {"collect_cpu_per_step": collect_per_step, "collect_all_cpu_per_step": collect_all_per_step,
            "inference_share": inference_share, "update_cpu_s": statistics.median(per_update),
            "samples_per_update": cfg.rollouts_per_update * rollout.numel()}


def worker_plain(config: str, sets: list[str], seed: int) -> dict:
    """Tandem's collector and update in one process, one after the other, every env in one batch:
    the serial runner (``runners/serial.py``) with one actor of ``num_actors x num_envs`` envs."""
    import torch

    from runners.serial import SerialRunner
    t_start = time.perf_counter()
    base = _load(config, sets)
    n = base.actors.num_actors * base.actors.num_envs
    cfg = _load(config, sets + [f"trainer.seed={seed}", "trainer.buffer_type=standard", "actors.num_actors=1",
                                f"actors.num_envs={n}", "trainer.rollouts_per_update=1"])
    threads = usable_cores()
    torch.set_num_threads(threads)
    runner = SerialRunner(cfg, run_dir=None, evaluate_every=0)   # evaluated once, at the end
    learner = runner.learner
    collect_cpu = update_cpu = 0.0
    try:
        t0 = time.perf_counter()
        while not learner.finished:                 # SerialRunner.step, its halves timed apart
            c0 = time.process_time()
            collected = runner.collect()
            collect_cpu += time.process_time() - c0
            for rollout, meta in collected:
                learner.ingest(rollout, meta)
            u0 = time.process_time()
            if not runner.train():
                raise RuntimeError("plain loop: the learner did not take the rollout")
            update_cpu += time.process_time() - u0
        train_s = time.perf_counter() - t0
        returns = runner.evaluate()["returns"]      # the evaluator's first seed, trainer.seed + 1_000_003
    finally:
        runner.close()
    return {"train_s": train_s, "total_s": time.perf_counter() - t_start, "env_steps": learner.env_steps,
            "updates": learner.updates, "eval_return": sum(returns) / len(returns), "threads": threads,
            "collect_cpu_s": collect_cpu, "update_cpu_s": update_cpu}


def worker_sb3(config: str, sets: list[str], seed: int) -> dict:
    """Stable-Baselines3 PPO with the config's hyperparameters (see the module docstring)."""
    t_start = time.perf_counter()
    import gymnasium as gym
    import numpy as np
    import torch
    from stable_baselines3 import PPO
    from stable_baselines3.common.vec_env import DummyVecEnv, VecNormalize

    cfg = _load(config, sets)
    a, pol = cfg.algorithm.cfg, cfg.policy
    if cfg.algorithm.name != "ppo" or pol.name != "actor_critic":
        raise RuntimeError("sb3: only algorithm ppo with policy actor_critic maps onto SB3's PPO")
    n = cfg.actors.num_actors * cfg.actors.num_envs
    threads = usable_cores()
    torch.set_num_threads(threads)

    def factory(s: int):
        def make():
            env = gym.make(cfg.env.id, **cfg.env.cfg)
            env.reset(seed=s)
            return env
        return make

    venv = VecNormalize(DummyVecEnv([factory(seed * 1000 + i) for i in range(n)]), norm_obs=pol.normalize_obs,
                        norm_reward=a.normalize_reward, gamma=a.gamma, clip_obs=pol.clip_obs)
    act = {"tanh": torch.nn.Tanh, "relu": torch.nn.ReLU, "elu": torch.nn.ELU,
           "gelu": torch.nn.GELU}[pol.actor.network_cfg.activation]
    critic = pol.critic or pol.actor
    lr = (lambda progress: a.learning_rate * progress) if a.anneal_lr else a.learning_rate
    model = PPO("MlpPolicy", venv, learning_rate=lr, n_steps=cfg.trainer.buffer_size, batch_size=a.batch_size,
                n_epochs=a.n_epochs, gamma=a.gamma, gae_lambda=a.gae_lambda, clip_range=a.clip_coef,
                clip_range_vf=a.clip_coef if a.clip_vloss else None, normalize_advantage=a.norm_adv,
                ent_coef=a.ent_coef, vf_coef=a.vf_coef, max_grad_norm=a.max_grad_norm, target_kl=a.target_kl,
                seed=seed, device="cpu", verbose=0,
                policy_kwargs=dict(net_arch=dict(pi=list(pol.actor.network_cfg.hidden_sizes),
                                                 vf=list(critic.network_cfg.hidden_sizes)),
                                   activation_fn=act, log_std_init=pol.log_std_init, ortho_init=pol.ortho_init))
    t0 = time.perf_counter()
    model.learn(total_timesteps=cfg.trainer.total_steps)
    train_s = time.perf_counter() - t0
    episodes = cfg.trainer.num_eval_episodes
    eval_env = VecNormalize(DummyVecEnv([factory(seed + 1_000_003 + i) for i in range(episodes)]), training=False,
                            norm_obs=venv.norm_obs, norm_reward=False, clip_obs=pol.clip_obs)
    eval_env.obs_rms = venv.obs_rms
    returns = np.zeros(episodes)
    finished = np.zeros(episodes, dtype=bool)
    obs = eval_env.reset()
    while not finished.all():                 # the first episode of each env, as Tandem evaluates
        action, _ = model.predict(obs, deterministic=True)
        obs, reward, dones, _ = eval_env.step(action)
        returns += np.where(finished, 0.0, eval_env.get_original_reward())
        finished |= dones
    return {"train_s": train_s, "total_s": time.perf_counter() - t_start, "env_steps": int(model.num_timesteps),
            "updates": int(model._n_updates // max(a.n_epochs, 1)), "eval_return": float(returns.mean()),
            "threads": threads}


WORKERS = {"calibrate": worker_calibrate, "plain": worker_plain, "sb3": worker_sb3}


def run_worker(kind: str, args, seed: int, timeout_s: float, log_dir: Path, extra: list[str] = ()) -> dict:
    """Run a worker in a fresh interpreter; its result is the last line of its stdout (JSON)."""
    log_dir.mkdir(parents=True, exist_ok=True)
    log = log_dir / f"{kind}_s{seed}.log"
    cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", kind, "--config", str(args.config),
           "--seed", str(seed), *extra]
    for s in args.sets:
        cmd += ["--set", s]
    env = child_env()
    env.pop("OMP_NUM_THREADS", None)              # the single-process loops use every core, as SB3 does
    with open(log, "wb") as f:
        p = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=f, stdin=subprocess.DEVNULL,
                             start_new_session=True)
        try:
            out, _ = p.communicate(timeout=timeout_s)
        except BaseException:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait(timeout=STOP_S)
            raise
    if p.returncode != 0:
        raise BenchmarkError(f"{kind} (seed {seed}) exited with code {p.returncode}; its log ends:\n{tail(log)}")
    try:
        return json.loads(out.decode().strip().splitlines()[-1])
    except (ValueError, IndexError):
        raise BenchmarkError(f"{kind} (seed {seed}) printed no result; its log ends:\n{tail(log)}") from None


def run_tandem(variant: str, args, seed: int, run_dir: Path) -> Run:
    sets = [f"trainer.seed={seed}", *TANDEM_SETS[variant]]
    launch = ["--config", str(args.config)]
    for s in [*args.sets, *sets]:
        launch += ["--set", s]
    total, notes = run_launcher(launch, run_dir, args.timeout, f"{variant} seed {seed}")
    run_files, summary = finished_run(run_dir, f"{variant} seed {seed}")
    rows = [r for r in run_files.metrics(missing_ok=True) if "train/updates" in r]
    lags = [r["lag/mean"] for r in rows if r.get("lag/mean") is not None]
    train_s = rows[-1]["time"] - summary["start_time"] if rows else None   # to the last update's line
    run = Run(variant, seed, train_s=train_s, total_s=total,
              env_steps=summary.get("env_steps"), updates=summary.get("updates"),
              eval_return=summary.get("last_eval/return_mean"), collect_cpu_s=summary.get("time/collect_cpu_s"),
              update_cpu_s=summary.get("time/update_cpu_s"), threads=summary.get("learner_threads"),
              lag_mean=sum(lags) / len(lags) if lags else None)
    if notes:
        run.extra["stop_notes"] = notes
    return run


# ================================================================== report

def _f(x, spec: str) -> str:
    return "-" if x is None else format(x, spec)


def fmt_table(runs: list[Run], baseline: str | None, ideal_s: float | None) -> str:
    base = {r.seed: r for r in runs if r.variant == baseline and not r.error}
    head = (f"{'variant':<9} {'seed':>4} {'train s':>8} {'total s':>8} {'/ ' + (baseline or '-') + ' train':>13} "
            f"{'/ ideal':>8} {'env steps':>10} {'updates':>7} {'return':>8} {'lag':>5} {'thr':>3} "
            f"{'collect cpu':>11} {'update cpu':>10}")
    lines = [head, "-" * len(head)]
    for r in runs:
        if r.error:
            lines.append(f"{r.variant:<9} {r.seed:>4}  failed: {r.error.splitlines()[0]}")
            continue
        b = base.get(r.seed)
        ratio = r.train_s / b.train_s if b and r.train_s and b.train_s else None
        lines.append(f"{r.variant:<9} {r.seed:>4} {_f(r.train_s, '8.1f')} {_f(r.total_s, '8.1f')} "
                     f"{_f(ratio, '13.3f')} {_f(r.train_s / ideal_s if ideal_s and r.train_s else None, '8.2f')} "
                     f"{_f(r.env_steps, '10,d')} {_f(r.updates, '7d')} {_f(r.eval_return, '8.1f')} "
                     f"{_f(r.lag_mean, '5.2f')} {_f(r.threads, '3d')} {_f(r.collect_cpu_s, '11.1f')} "
                     f"{_f(r.update_cpu_s, '10.1f')}")
    return "\n".join(lines)


def medians(runs: list[Run], variants: list[str], baseline: str | None) -> list[dict]:
    out = []
    by = {v: [r for r in runs if r.variant == v and not r.error] for v in variants}
    b = by.get(baseline) or []
    b_train = statistics.median([r.train_s for r in b]) if b else None
    for v, rs in by.items():
        if not rs:
            continue
        train = statistics.median([r.train_s for r in rs if r.train_s is not None])
        rets = [r.eval_return for r in rs if r.eval_return is not None]
        out.append({"variant": v, "seeds": len(rs), "train_s": train,
                    "total_s": statistics.median([r.total_s for r in rs if r.total_s is not None]),
                    "return_median": statistics.median(rets) if rets else None,
                    "return_std": statistics.stdev(rets) if len(rets) > 1 else None,
                    "train_vs_baseline": train / b_train if b_train else None})
    return out


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="benchmarks/vs_single_process.py", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", type=Path, default=DEFAULT_CONFIG, help="JSON config (default: halfcheetah_ppo)")
    p.add_argument("--seeds", default="1,2,3", help="comma-separated trainer.seed values (default 1,2,3)")
    p.add_argument("--steps", type=int, help="env steps (default: the config's trainer.total_steps)")
    p.add_argument("--variants", default=",".join(VARIANTS),
                   help=f"comma-separated subset of {', '.join(VARIANTS)} (default: all; sb3 is skipped with a "
                        f"note when stable_baselines3 is not importable)")
    p.add_argument("--timeout", type=float, default=1800.0, help="seconds before a run is abandoned")
    p.add_argument("--json", type=Path, help="also write every figure here")
    p.add_argument("--keep-runs", type=Path, metavar="DIR", help="keep run directories and logs under DIR")
    p.add_argument("--set", dest="sets", action="append", default=[], metavar="KEY=VALUE",
                   help="config override for every variant (repeatable)")
    p.add_argument("--worker", choices=sorted(WORKERS), help=argparse.SUPPRESS)
    p.add_argument("--seed", type=int, default=1, help=argparse.SUPPRESS)
    return p


def _calibrate(args, seed: int, cfg, cores: int, logs: Path) -> float:
    """One-thread CPU costs of collection and of an update (the calibrate worker), printed; returns
    the ideal wall time on `cores` cores."""
    cal = run_worker("calibrate", args, seed, args.timeout, logs)
    updates = -(-cfg.trainer.total_steps // cal["samples_per_update"])
    steps = updates * cal["samples_per_update"]
    collect_cpu, update_cpu = cal["collect_cpu_per_step"] * steps, cal["update_cpu_s"] * updates
    ideal = (collect_cpu + update_cpu) / cores
    print(f"[vs1] calibration (one thread): collection {cal['collect_cpu_per_step'] * 1e6:.1f} us CPU per env "
          f"step with {cfg.actors.num_envs} envs per process ({cal['inference_share']:.0%} of it in the policy), "
          f"{cal['collect_all_cpu_per_step'] * 1e6:.1f} us with all "
          f"{cfg.actors.num_actors * cfg.actors.num_envs} in one; "
          f"{cal['update_cpu_s']:.3f} s CPU per update -> {steps:,} steps: "
          f"{collect_cpu:.1f} s collecting + {update_cpu:.1f} s updating = {collect_cpu + update_cpu:.1f} s CPU; "
          f"ideal wall on {cores} cores {ideal:.1f} s", flush=True)
    return ideal


def _run_variant(v: str, args, seed: int, root: Path) -> Run:
    """One variant on one seed (a failed one is a Run with its error), printed."""
    t = time.monotonic()
    try:
        if v in TANDEM_SETS:
            r = run_tandem(v, args, seed, root / f"{v}_s{seed}")
        else:
            res = run_worker(v, args, seed, args.timeout, root / "logs")
            r = Run(v, seed, **{k: res.get(k) for k in ("train_s", "total_s", "env_steps", "updates",
                                                        "eval_return", "collect_cpu_s", "update_cpu_s",
                                                        "threads")})
    except BenchmarkError as e:
        r = Run(v, seed, error=str(e))
        print(f"[vs1] {v} seed {seed} failed: {e}", file=sys.stderr, flush=True)
    if not r.error:
        print(f"[vs1] {v:<8} seed {seed}: train {_f(r.train_s, '.1f')} s, total {_f(r.total_s, '.1f')} s, "
              f"return {_f(r.eval_return, '.1f')} (took {time.monotonic() - t:.0f} s)", flush=True)
    return r


def _run_all(args, variants: list[str], seeds: list[int], cfg, cores: int
             ) -> tuple[list[Run], float | None, int | None]:
    """The calibration, then every variant on every seed. Returns the runs, the ideal wall time and,
    where the benchmark ends early, its exit code (130 interrupted, 1 calibration failed)."""
    signal.signal(signal.SIGINT, raise_on_signal)
    signal.signal(signal.SIGTERM, raise_on_signal)
    tmp = None if args.keep_runs else tempfile.mkdtemp(prefix="tandem-vs1-")
    root = args.keep_runs.resolve() if args.keep_runs else Path(tmp)
    runs: list[Run] = []
    ideal = None
    try:
        ideal = _calibrate(args, seeds[0], cfg, cores, root / "logs")
        for seed in seeds:
            for v in variants:
                runs.append(_run_variant(v, args, seed, root))
    except KeyboardInterrupt:
        print("[vs1] interrupted: children stopped", file=sys.stderr)
        return runs, ideal, 130
    except BenchmarkError as e:
        print(f"[vs1] calibration failed: {e}", file=sys.stderr)
        return runs, ideal, 1
    finally:
        if tmp is not None:
            import shutil
            shutil.rmtree(tmp, ignore_errors=True)
    return runs, ideal, None


def _report(runs: list[Run], variants: list[str], baseline: str | None, ideal: float | None, seeds: list[int],
            cores: int) -> list[dict]:
    """The table and the medians, printed; returns the medians."""
    print()
    print(fmt_table(runs, baseline, ideal))
    summary = medians(runs, variants, baseline)
    print()
    print(f"medians over {len(seeds)} seed(s); ideal wall {_f(ideal, '.1f')} s on {cores} cores")
    for m in summary:
        print(f"  {m['variant']:<9} train {m['train_s']:7.1f} s  total {m['total_s']:7.1f} s  "
              f"x{_f(m['train_vs_baseline'], '.3f')} of {baseline}  x{_f(m['train_s'] / ideal if ideal else None, '.2f')} "
              f"of ideal  return {_f(m['return_median'], '.1f')} (std {_f(m['return_std'], '.1f')})")
    return summary


def main(argv: list[str] | None = None) -> int:
    p = _parser()
    args = p.parse_args(argv)
    args.config = args.config.resolve()
    if args.steps is not None:
        if args.steps < 1:
            p.error("--steps must be positive")
        args.sets = [*args.sets, f"trainer.total_steps={args.steps}"]
    if args.worker:
        extra = {"rollouts": 4, "updates": 3} if args.worker == "calibrate" else {"seed": args.seed}
        print(json.dumps(WORKERS[args.worker](str(args.config), args.sets, **extra)), flush=True)
        return 0

    variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    if not variants or any(v not in VARIANTS for v in variants):
        p.error(f"--variants: choose among {', '.join(VARIANTS)}")
    try:
        seeds = [int(s) for s in args.seeds.split(",") if s.strip()]
    except ValueError:
        p.error("--seeds: comma-separated integers")
    from shared.config import ConfigError
    try:
        cfg = _load(str(args.config), args.sets)
    except ConfigError as e:
        print(e, file=sys.stderr)
        return 2
    if "sb3" in variants:
        import importlib.util
        if importlib.util.find_spec("stable_baselines3") is None:
            print("[vs1] stable_baselines3 is not importable (pip install -e '.[bench]'): sb3 skipped", flush=True)
            variants.remove("sb3")
    baseline = next((v for v in ("sb3", "plain") if v in variants), None)
    cores = usable_cores()
    load = os.getloadavg()[0]
    print(f"[vs1] {args.config.name}: {cfg.env.id}, {cfg.trainer.total_steps:,} env steps, "
          f"{cfg.actors.num_actors} x {cfg.actors.num_envs} envs, {cfg.trainer.buffer_size} steps per rollout, "
          f"{cfg.algorithm.cfg.n_epochs} epochs of minibatch {cfg.algorithm.cfg.batch_size} | seeds {seeds} | "
          f"{cores} usable cores, load average {load:.2f}", flush=True)
    if load > 0.5:
        print("[vs1] note: the machine is not idle; other processes share the cores and skew the times", flush=True)
    runs, ideal, early = _run_all(args, variants, seeds, cfg, cores)
    if early is not None:
        return early
    summary = _report(runs, variants, baseline, ideal, seeds, cores)
    if args.json:
        args.json.write_text(json.dumps({"config": str(args.config), "sets": args.sets, "seeds": seeds,
                                         "cores": cores, "ideal_s": ideal, "runs": [asdict(r) for r in runs],
                                         "medians": summary, "machine": machine_info()}, indent=2) + "\n")
    return 1 if any(r.error for r in runs) else 0


if __name__ == "__main__":
    sys.exit(main())
