"""Env steps per second of a batched simulator, alone and inside an actor's collector, per device and
number of envs, against gymnasium's C MuJoCo on the CPU measured in the same run.

    python benchmarks/sim_throughput.py [--env tandem/MJWarpHalfCheetah-v0] [--devices cpu,cuda:0]
        [--num-envs 32,256,1024,4096] [--baseline HalfCheetah-v5] [--baseline-envs 16] [--seconds 5]
        [--config configs/mjwarp_halfcheetah_ppo.json] [--steps-per-rollout 64] [--json OUT]

For every (device, num_envs), two figures:
- ``sim``: ``env.step`` alone, uniform random actions drawn on the device;
- ``actor``: the actor's :class:`actors.rollout.Collector`: the config's policy acting on the same
  device, the rollout assembled there and copied once per rollout into pinned host memory: what one
  actor process collects per second, before sending.
The baseline is ``--baseline`` (a gymnasium id, stepped on the CPU in this process: C MuJoCo for
HalfCheetah-v5) with ``--baseline-envs`` envs and its policy on the CPU; every row also gives its ratio
to the baseline's figure of the same kind. One torch thread (``--threads``), as an actor process has.
The first use of a MuJoCo Warp device compiles and captures its kernels: a warm-up step and a
warm-up rollout come before any clock starts.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import _common  # noqa: F401  (puts the repo root on sys.path)
import torch

from actors.rollout import Collector
from shared.config import load_config
from shared.envs import make_env
from shared.policies import make_policy


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _timed(fn, steps_per_call: int, seconds: float, device: torch.device) -> dict:
    """Calls `fn` until `seconds` have passed (at least 3 calls); env steps per second."""
    _sync(device)
    t0, n = time.perf_counter(), 0
    while n < 3 or time.perf_counter() - t0 < seconds:
        fn()
        n += 1
    _sync(device)
    wall = time.perf_counter() - t0
    return {"steps_per_s": n * steps_per_call / wall, "calls": n, "wall_s": wall}


def measure(env_id: str, num_envs: int, device: str, cfg, steps_per_rollout: int, seconds: float) -> dict:
    dev = torch.device(device)
    t0 = time.perf_counter()
    env = make_env(env_id, num_envs, cfg.env.cfg, dev)
    obs = env.reset(seed=0)
    spec = env.spec.action
    low = torch.as_tensor(spec.low, dtype=torch.float32, device=obs.device if torch.is_tensor(obs) else dev)
    high = torch.as_tensor(spec.high, dtype=torch.float32, device=low.device)

    def sim_step():
        env.step(low + (high - low) * torch.rand(num_envs, *spec.shape, device=low.device))

    sim_step()                                                 # compiles / captures on first use
    _sync(dev)
    build_s = time.perf_counter() - t0
    sim = _timed(sim_step, num_envs, seconds, dev)
    policy = make_policy(cfg, env.spec).to(dev)
    collector = Collector(env, policy, num_steps=steps_per_rollout, seed=1)
    collector.collect(version=0)                               # warm-up rollout
    actor = _timed(lambda: collector.collect(version=0), num_envs * steps_per_rollout, seconds, dev)
    if hasattr(env, "close"):
        env.close()
    return {"env": env_id, "device": device, "num_envs": num_envs, "build_s": build_s,
            "sim_steps_per_s": sim["steps_per_s"], "actor_steps_per_s": actor["steps_per_s"],
            "actor_rollouts": actor["calls"]}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--env", default="tandem/MJWarpHalfCheetah-v0")
    p.add_argument("--devices", default="cpu")
    p.add_argument("--num-envs", default="32,256")
    p.add_argument("--baseline", default="HalfCheetah-v5", help="gymnasium id on the CPU; '' for none")
    p.add_argument("--baseline-envs", type=int, default=16)
    p.add_argument("--config", default="configs/mjwarp_halfcheetah_ppo.json", help="its policy acts")
    p.add_argument("--steps-per-rollout", type=int, default=64)
    p.add_argument("--seconds", type=float, default=5.0)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--json", default=None, help="write every row here")
    a = p.parse_args(argv)
    torch.set_num_threads(a.threads)
    cfg = load_config(str(_common.ROOT / a.config) if not a.config.startswith("/") else a.config)
    cfg.env.cfg = {}
    rows = []
    base = None
    if a.baseline:
        base = measure(a.baseline, a.baseline_envs, "cpu", cfg, a.steps_per_rollout, a.seconds)
        rows.append(base)
    for device in a.devices.split(","):
        for n in (int(x) for x in a.num_envs.split(",")):
            try:
                rows.append(measure(a.env, n, device, cfg, a.steps_per_rollout, a.seconds))
            except (RuntimeError, MemoryError) as e:         # e.g. out of device memory at the largest size
                print(f"[sim_throughput] {a.env} on {device} with {n} envs failed: {e}", file=sys.stderr)
                rows.append({"env": a.env, "device": device, "num_envs": n, "error": str(e)})
    name = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no CUDA device"
    print(f"# {name}; torch {torch.__version__}; {a.threads} torch thread(s); {a.steps_per_rollout} steps per rollout")
    print(f"{'env':32s} {'device':8s} {'envs':>6s} {'build s':>8s} {'sim steps/s':>12s} {'x base':>7s} "
          f"{'actor steps/s':>14s} {'x base':>7s}")
    for r in rows:
        if "error" in r:
            print(f"{r['env']:32s} {r['device']:8s} {r['num_envs']:6d}  failed: {r['error'][:80]}")
            continue
        if base:
            r["sim_x_baseline"] = r["sim_steps_per_s"] / base["sim_steps_per_s"]
            r["actor_x_baseline"] = r["actor_steps_per_s"] / base["actor_steps_per_s"]
        print(f"{r['env']:32s} {r['device']:8s} {r['num_envs']:6d} {r['build_s']:8.1f} {r['sim_steps_per_s']:12,.0f} "
              f"{r.get('sim_x_baseline', float('nan')):7.2f} {r['actor_steps_per_s']:14,.0f} "
              f"{r.get('actor_x_baseline', float('nan')):7.2f}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"device_name": name, "torch": torch.__version__, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
