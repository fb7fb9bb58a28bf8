"""Calibrate the emulated inference latency ``a + b x batch`` from a real policy's acting forward pass.

    .venv/bin/python benchmarks/calibrate_latency.py [--config configs/vla_tokens_reach_0p5b_smoke.json]
                     [--batches 1,4,16] [--repeats 5] [--device cpu] [--scale-to SECONDS@BATCH]
                     [--json out.json] [--set KEY=VALUE ...]

For each batch size N it builds the config's env with N envs and its policy (as an actor does,
``shared.policies.make_policy``; a ``policy.vla_config.model_path`` checkpoint is loaded), and times
the acting call ``policy(TensorDict({obs}))`` under ``torch.inference_mode`` on ``--device``: one
warm-up call, then the median of ``--repeats`` (CUDA calls are synchronised). A least-squares line
through the medians gives ``a`` (seconds per call) and ``b`` (seconds per env in the call), the two
keys ``actors.inference_latency_s`` and ``actors.inference_latency_per_env_s`` that
``benchmarks/async_speedup.py`` takes as ``--latency`` and ``--latency-per-env``.

``--scale-to 0.2@16`` keeps the measured shape (b / a) but scales both so that a call on 16 envs
takes 0.2 s: a CPU study of a model whose real speed is set by hardware we do not have here.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

from _common import ROOT, machine_info  # noqa: F401  (puts the repo on sys.path)

import torch  # noqa: E402
from tensordict import TensorDict  # noqa: E402


def fit_line(xs: list[float], ys: list[float]) -> tuple[float, float]:
    """Least-squares (intercept, slope) of ys against xs; slope 0 for a single point."""
    if len(xs) == 1:
        return ys[0], 0.0
    mx, my = statistics.mean(xs), statistics.mean(ys)
    sxx = sum((x - mx) ** 2 for x in xs)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx
    return my - slope * mx, slope


def time_forward(cfg, batch: int, repeats: int, device: str) -> list[float]:
    from shared import keys
    from shared.envs import make_env
    from shared.policies import make_policy
    env = make_env(cfg.env.id, batch, cfg.env.cfg, "cpu")
    policy = make_policy(cfg, env.spec).to(device).eval()
    obs = env.reset(seed=0)
    obs = obs.to(device) if hasattr(obs, "to") else obs

    def call() -> float:
        t0 = time.perf_counter()
        with torch.inference_mode():
            policy(TensorDict({keys.OBS: obs}, batch_size=[batch], device=device))
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        return time.perf_counter() - t0

    call()   # warm-up: lazy initialisation, allocator, kernels
    times = [call() for _ in range(repeats)]
    env.close()
    return times


def main() -> int:
    from shared.config import load_config
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", type=Path, default=ROOT / "configs" / "vla_tokens_reach_0p5b_smoke.json")
    p.add_argument("--batches", default="1,4,16")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--device", default="cpu")
    p.add_argument("--threads", type=int, default=0, help="torch threads (default: torch's own choice)")
    p.add_argument("--scale-to", default="", metavar="SECONDS@BATCH")
    p.add_argument("--json", type=Path)
    p.add_argument("--set", dest="sets", action="append", default=[], metavar="KEY=VALUE")
    a = p.parse_args()
    if a.threads:
        torch.set_num_threads(a.threads)
    cfg = load_config(a.config, a.sets)
    batches = [int(b) for b in a.batches.split(",") if b]
    rows = []
    for n in batches:
        times = time_forward(cfg, n, a.repeats, a.device)
        rows.append({"batch": n, "median_s": statistics.median(times), "min_s": min(times), "max_s": max(times)})
        print(f"batch {n:4d}: median {rows[-1]['median_s'] * 1000:9.1f} ms (min {min(times) * 1000:.1f}, "
              f"max {max(times) * 1000:.1f}; {a.repeats} calls)", flush=True)
    intercept, slope = fit_line([r["batch"] for r in rows], [r["median_s"] for r in rows])
    print(f"\nfit: a = {intercept:.4f} s per call, b = {slope:.5f} s per env "
          f"({a.config.name}, {a.device}, torch {torch.__version__}, {torch.get_num_threads()} threads)")
    out = {"config": str(a.config), "device": a.device, "threads": torch.get_num_threads(), "rows": rows,
           "a": intercept, "b": slope, "machine": machine_info()}
    if a.scale_to:
        seconds, _, at = a.scale_to.partition("@")
        target, at_batch = float(seconds), int(at or 1)
        k = target / (intercept + slope * at_batch)
        out.update({"scaled_a": intercept * k, "scaled_b": slope * k, "scaled_to": a.scale_to})
        print(f"scaled to {target} s at {at_batch} envs: --latency {intercept * k:.4f} "
              f"--latency-per-env {slope * k:.5f}")
    else:
        print(f"benchmarks/async_speedup.py --latency {intercept:.4f} --latency-per-env {slope:.5f}")
    if intercept < 0 or slope < 0:
        print("note: a negative coefficient: the forward time is not linear in the batch over these sizes",
              file=sys.stderr)
    if a.json:
        a.json.write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
