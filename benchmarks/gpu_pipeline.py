"""What one update and the whole pipeline cost on one device, per ``learner.compile`` mode, against a
graph-captured floor and a single process doing the same work.

    python benchmarks/gpu_pipeline.py [--device cuda:0] [--minibatches 4096,32768] [--envs 4096]
        [--steps 32] [--epochs 5] [--hidden 256] [--modes off,compile,graph] [--pipeline]
        [--actors N] [--total-steps N] [--warp] [--out FILE.json] [--keep-runs DIR]

Three parts, all in one run on one device, each printed as a table with ratios:

1. **Update.** PPO on ``tandem/Pendulum-v0``-shaped data (``envs x steps`` samples, a 256x256 ReLU
   actor and critic, ``epochs`` epochs) at each minibatch size: milliseconds per minibatch of
   ``ppo_update`` in each ``learner.compile`` mode, next to the floor: the same minibatch step
   (gather, Tandem's PPO loss, backward, clip, fused Adam), with no bookkeeping at all, eager and
   (on CUDA) captured once in a CUDA graph.
2. **Pipeline** (``--pipeline``). Env steps per second of the same work (``tandem/Pendulum-v0``
   on the device, ``--actors`` actors of ``envs / actors`` envs, 2 by default) in one process (``python -m runners.serial``'s
   runner) and through ``launch/run_local.sh`` in standard and vla mode (vla also with the rollouts
   through the same-host ring, ``vla_ring``: device memory by CUDA IPC, and on CUDA with the weights
   too, ``vla_ring_ipc``: ``learner.weights_transport: "cuda_ipc"``), per minibatch size, in the
   best ``learner.compile`` mode of part 1. Steady state: start-up (imports, building the envs and
   policies, the first rollout) is left out of both.
3. **MuJoCo Warp** (``--warp``, needs CUDA and ``mujoco-warp``). HalfCheetah at mjlab's settings
   (4,096 envs x 24 steps, 5 epochs x 4 minibatches, 256x256) through the launcher, env steps/s
   against mjlab's ~450k (``../shared/ANCHORS.md``).

``--out`` writes every figure, with the device name, as JSON (``docs/results/`` pages are built
from such files by ``benchmarks/results.py``). On the CPU the script runs too (small settings), which
is what its test does; its figures only mean something on the device they name.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import tempfile
import time
from pathlib import Path

from _common import ROOT, BenchmarkError, RunDir, finished_run, machine_info, run_launcher  # noqa: F401

import torch  # noqa: E402
from tensordict import TensorDict  # noqa: E402

from learner.fast_epochs import MinibatchStep  # noqa: E402
from learner.learner import make_optimizer  # noqa: E402
from learner.minibatch import _total  # noqa: E402
from learner.ppo import ppo_loss, ppo_update  # noqa: E402
from shared import keys  # noqa: E402
from shared.config import config_from_dict  # noqa: E402
from shared.envs import env_spec  # noqa: E402
from shared.policies import make_policy  # noqa: E402

ENV = "tandem/Pendulum-v0"
MJLAB_ANCHOR = 450_000   # env steps/s, mjlab HalfCheetah-v5 4,096 envs (its BENCHMARK.md; ANCHORS.md)


def run_config(device: str, envs: int, steps: int, epochs: int, minibatch: int, hidden: int, mode: str,
               total_steps: int, actors: int = 2) -> dict:
    """The config every part uses: Pendulum on the device, `actors` actors, the given update shape."""
    net = {"type": "mlp", "network_cfg": {"hidden_sizes": [hidden, hidden], "activation": "relu"}}
    return {"trainer": {"exp_name": "gpu_pipeline", "seed": 1, "total_steps": total_steps, "buffer_size": steps,
                        "buffer_type": "standard", "buffer_capacity": 4, "max_policy_lag": 1, "eval_freq": 0,
                        "save_freq": 0, "log_interval_s": 30},
            "actors": {"num_actors": actors, "num_envs": max(envs // actors, 1), "devices": [device]},
            "learner": {"device": device, "compile": mode},
            "env": {"id": ENV, "cfg": {}},
            "policy": {"name": "actor_critic", "normalize_obs": True, "actor": net, "critic": net},
            "algorithm": {"name": "ppo", "cfg": {"learning_rate": 3e-4, "n_epochs": epochs, "batch_size": minibatch,
                                                 "max_grad_norm": 0.5, "clip_vloss": True}}}


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _batch(spec, n: int, device: torch.device) -> TensorDict:
    g = torch.Generator().manual_seed(0)
    act = spec.action.shape
    return TensorDict({keys.OBS: torch.randn(n, *spec.obs_shape, generator=g),
                       keys.ACTION: torch.randn(n, *act, generator=g) * 0.3,
                       keys.LOG_PROB: torch.randn(n, generator=g) - 1, keys.ADVANTAGE: torch.randn(n, generator=g),
                       keys.VALUE: torch.randn(n, generator=g), keys.VALUE_TARGET: torch.randn(n, generator=g)},
                      [n]).to(device)


def _policy(raw: dict, device: torch.device):
    cfg = config_from_dict(raw, source="gpu_pipeline")
    torch.manual_seed(1)
    spec = env_spec(ENV)
    return cfg, spec, make_policy(cfg, spec).to(device)


def time_update(raw: dict, device: torch.device, mode: str, n: int, repeats: int) -> float:
    """Seconds per minibatch of ``ppo_update`` in `mode` (after two warm-up updates)."""
    cfg, spec, policy = _policy(raw, device)
    a = cfg.algorithm.cfg
    opt = make_optimizer(policy, a.learning_rate, a.adam_eps)
    step = MinibatchStep(mode, policy, opt, a.max_grad_norm) if mode != "off" else None
    batch, gen = _batch(spec, n, device), torch.Generator().manual_seed(0)
    for _ in range(2):
        ppo_update(policy, opt, batch, a, gen, step=step)
    _sync(device)
    t0 = time.perf_counter()
    for _ in range(repeats):
        ppo_update(policy, opt, batch, a, gen, step=step)
    _sync(device)
    return (time.perf_counter() - t0) / (repeats * a.n_epochs * math.ceil(n / a.batch_size))


def time_floor(raw: dict, device: torch.device, n: int, repeats: int, capture: bool) -> float:
    """Seconds per minibatch of the bare step (no skip, no sums, no early stop): eager, or captured."""
    cfg, spec, policy = _policy(raw, device)
    a = cfg.algorithm.cfg
    opt = make_optimizer(policy, a.learning_rate, a.adam_eps)
    params = [p for p in policy.parameters() if p.requires_grad]
    fields = {k: v for k, v in _batch(spec, n, device).items()}
    b = a.batch_size
    idx = torch.arange(b, device=device) % n

    def step():
        mb = TensorDict({k: v.index_select(0, idx) for k, v in fields.items()}, batch_size=[b])
        opt.zero_grad(set_to_none=True)
        _total(ppo_loss(policy, mb, a)).backward()
        torch.nn.utils.clip_grad_norm_(params, a.max_grad_norm)
        opt.step()

    run = step
    if capture:
        for g in opt.param_groups:
            g["lr"], g["capturable"] = torch.tensor(float(g["lr"]), device=device), True
        side = torch.cuda.Stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):
            for _ in range(3):
                step()
        torch.cuda.current_stream(device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            step()
        run = graph.replay
    steps = repeats * a.n_epochs * math.ceil(n / b)
    for _ in range(3):
        run()
    _sync(device)
    t0 = time.perf_counter()
    for _ in range(steps):
        perm = torch.randperm(n, device=device)
        idx.copy_(perm[:b])
        run()
    _sync(device)
    return (time.perf_counter() - t0) / steps


def part_update(args, device: torch.device) -> list[dict]:
    rows = []
    n = args.envs * args.steps
    for mb in args.minibatches:
        raw = run_config(str(device), args.envs, args.steps, args.epochs, mb, args.hidden, "off", n)
        row = {"minibatch": mb, "samples": n, "steps_per_update": args.epochs * math.ceil(n / mb)}
        row["floor_eager_ms"] = 1e3 * time_floor(raw, device, n, args.repeats, capture=False)
        if device.type == "cuda":
            row["floor_graph_ms"] = 1e3 * time_floor(raw, device, n, args.repeats, capture=True)
        for mode in args.modes:
            try:
                row[f"{mode}_ms"] = 1e3 * time_update(raw, device, mode, n, args.repeats)
            except Exception as e:   # a mode this device cannot run: said, the others still measured
                row[f"{mode}_error"] = f"{type(e).__name__}: {e}"[:300]
        floor = row.get("floor_graph_ms", row["floor_eager_ms"])
        for mode in args.modes:
            if f"{mode}_ms" in row:
                row[f"{mode}_over_floor"] = row[f"{mode}_ms"] / floor
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


def _serial_rate(raw: dict) -> dict:
    """Steady-state env steps/s of the serial runner: from the end of its first turn (start-up, the
    first collection and update, any capture) over the first half of the rest of the run. In the
    second half the halves of :meth:`SerialRunner.step` are timed apart (the device synchronised after
    each, which the first half's rate does not pay): the collection (over the number of actors, as
    if they collected side by side) and the update per update, each alone on the device, give the
    uncontended overlap bound the launcher rows are also measured against
    (``samples_per_update / max(collect, update)``: what perfect overlap of the two would reach if
    neither slowed the other)."""
    from runners.serial import SerialRunner
    runner = SerialRunner(config_from_dict(raw, source="gpu_pipeline"))
    device = torch.device(raw["learner"]["device"])
    collect_s, update_s, samples = [], [], []
    actors = max(1, raw["actors"]["num_actors"])
    t0 = time.perf_counter()
    try:
        runner.step()
        t1, first = time.perf_counter(), runner.learner.env_steps
        half = first + (runner.cfg.trainer.total_steps - first) // 2
        while runner.step() and runner.learner.env_steps < half:   # one turn at least
            pass
        t2, steps = time.perf_counter(), runner.learner.env_steps
        collecting, before = 0.0, runner.learner.env_steps
        while not runner.learner.finished:      # SerialRunner.step, halves timed (eval_freq is 0 here)
            a = time.perf_counter()
            for rollout, meta in runner.collect():
                runner.learner.ingest(rollout, meta)
            _sync(device)
            b = time.perf_counter()
            collecting += b - a                  # turns without an update add up until one comes
            updates = len(runner.train())
            _sync(device)
            if updates:
                # the actors collect one after another here and side by side in the launcher: the
                # bound takes them as perfectly parallel (the launcher's own bound does the same)
                collect_s.append(collecting / actors / updates)
                update_s.append((time.perf_counter() - b) / updates)
                samples.append((runner.learner.env_steps - before) / updates)
                collecting, before = 0.0, runner.learner.env_steps
    finally:
        runner.close()
    out = {"env_steps": runner.learner.env_steps, "wall_s": time.perf_counter() - t0,
           "sps": (steps - first) / max(t2 - t1, 1e-9) if steps > first else None}
    if collect_s:
        collect, update = statistics.median(collect_s), statistics.median(update_s)
        out.update(collect_s_per_update=collect, update_s_per_update=update,
                   bound_sps=statistics.median(samples) / max(collect, update))
    return out


# The launcher variants of part 2: (label, trainer.buffer_type, actors.rollout_transport,
# learner.weights_transport). "cuda_ipc" runs on CUDA only.
LAUNCHER_VARIANTS = (("standard", "standard", "zmq", "zmq"), ("vla", "vla", "zmq", "zmq"),
                     ("vla_ring", "vla", "ring", "zmq"), ("vla_ring_ipc", "vla", "ring", "cuda_ipc"))


def _launcher_rate(raw: dict, label: str, buffer_type: str, transport: str, weights: str, work: Path,
                   timeout_s: float) -> dict:
    raw = json.loads(json.dumps(raw))
    raw["trainer"]["buffer_type"] = buffer_type
    raw["actors"]["rollout_transport"] = transport
    raw["learner"]["weights_transport"] = weights
    if weights == "cuda_ipc":
        raw["trainer"]["eval_device"] = raw["learner"]["device"]
    path = work / f"{label}_{raw['algorithm']['cfg']['batch_size']}.json"
    path.write_text(json.dumps(raw))
    run_dir = work / path.stem
    wall, notes = run_launcher(["--config", str(path)], run_dir, timeout_s, f"launcher {label}")
    summary = finished_run(run_dir, f"launcher {label}")[1]
    return {"env_steps": summary["env_steps"], "launcher_wall_s": wall, "learner_wall_s": summary["wall_s"],
            **run_rates(run_dir, raw["actors"]["num_actors"]), "stop_notes": notes}


def run_rates(run_dir: Path, num_actors: int) -> dict:
    """A launcher run's steady state, measured as the serial runner's is: from the end of the first
    update (start-up, the first rollouts, the first update and any capture left out) to the last
    publish, env steps trained over that time (``sps``, from ``versions.jsonl``'s publish events).
    Next to it the overlap bound: samples per update over the larger of the collection time per
    update (the actors' summed collection time per update over ``num_actors``, who collect side by
    side) and the learner's update time (medians over the updates after the first, ``metrics.jsonl``),
    and ``overlap`` = sps / bound (1 = collection and update fully overlapped, nothing else costs).
    Both times are measured while the two run side by side, so each is slowed by the other and this
    bound is lower than the uncontended one (:func:`_serial_rate`; ``overlap_uncontended`` in part 2)."""
    run = RunDir(run_dir)
    pubs = [e for e in run.versions("publish", missing_ok=True) if e.get("version", 0) >= 1]
    if len(pubs) < 2:
        raise BenchmarkError(f"{run_dir}: {len(pubs)} updates published, too few for a steady rate")
    sps = (pubs[-1]["env_steps"] - pubs[0]["env_steps"]) / max(pubs[-1]["time"] - pubs[0]["time"], 1e-9)
    rows = [r for r in run.metrics(missing_ok=True) if "perf/update_s" in r][1:]
    out = {"sps": sps, "updates_timed": len(pubs) - 1}
    if len(rows) >= 2:
        per_update = [(b["perf/total/collect_wall_s"] - a["perf/total/collect_wall_s"])
                      / max(b["env_steps"] - a["env_steps"], 1) * a["perf/samples_per_update"] / num_actors
                      for a, b in zip(rows, rows[1:]) if b["env_steps"] > a["env_steps"]]
        collect = statistics.median(per_update) if per_update else math.nan
        update = statistics.median(r["perf/update_s"] for r in rows)
        bound = rows[-1]["perf/samples_per_update"] / max(collect, update)
        out.update(collect_s_per_update=collect, update_s_per_update=update, bound_sps=bound, overlap=sps / bound)
    return out


def part_pipeline(args, device: torch.device, mode: str) -> list[dict]:
    rows = []
    with tempfile.TemporaryDirectory(prefix="gpu_pipeline_") as tmp:
        if args.keep_runs is not None:   # every run's directory (metrics, logs, summary) kept there
            args.keep_runs.mkdir(parents=True, exist_ok=True)
            tmp = str(args.keep_runs)
        for mb in args.minibatches:
            raw = run_config(str(device), args.envs, args.steps, args.epochs, mb, args.hidden, mode, args.total_steps,
                             args.actors)
            row = {"minibatch": mb, "mode": mode, "actors": args.actors, "serial": _serial_rate(raw)}
            for label, buffer_type, transport, weights in LAUNCHER_VARIANTS:
                if weights == "cuda_ipc" and device.type != "cuda":
                    continue
                try:
                    row[label] = _launcher_rate(raw, label, buffer_type, transport, weights, Path(tmp), args.timeout)
                    if row["serial"]["sps"]:          # None when the run ended in its first turn
                        row[f"{label}_over_serial"] = row[label]["sps"] / row["serial"]["sps"]
                    if "bound_sps" in row["serial"]:   # against collection and update each alone on the device
                        row[label]["overlap_uncontended"] = row[label]["sps"] / row["serial"]["bound_sps"]
                except BenchmarkError as e:
                    row[label] = {"error": str(e)[-600:]}
            rows.append(row)
            print(json.dumps(row), flush=True)
    return rows


def part_warp(args, device: torch.device, mode: str) -> dict:
    """MuJoCo Warp HalfCheetah at mjlab's settings through the launcher (vla mode, 1 actor)."""
    sets = ["actors.num_actors=1", "actors.num_envs=4096", "trainer.buffer_size=24", f"actors.devices=[\"{device}\"]",
            f"learner.device={device}", f"learner.compile={mode}", "algorithm.cfg.n_epochs=5",
            "algorithm.cfg.batch_size=24576", "trainer.buffer_type=async", "trainer.max_policy_lag=1",
            f"trainer.total_steps={args.warp_steps}", "trainer.eval_freq=0", "trainer.save_freq=0"]
    with tempfile.TemporaryDirectory(prefix="gpu_pipeline_warp_") as tmp:
        run_dir = Path(tmp) / "warp"
        args_ = ["--config", str(ROOT / "configs/mjwarp_halfcheetah_ppo.json")] + [x for s in sets for x in ("--set", s)]
        wall, _ = run_launcher(args_, run_dir, args.timeout, "mjwarp")
        run, summary = finished_run(run_dir, "mjwarp")
        train = [r for r in run.metrics(missing_ok=True) if "train/episode_return" in r]
        rates = run_rates(run_dir, 1)
    row = {"env_steps": summary["env_steps"], "learner_wall_s": summary["wall_s"], "launcher_wall_s": wall,
           **rates, "anchor_sps": MJLAB_ANCHOR,
           "last_train_return": train[-1]["train/episode_return"] if train else None}
    row["over_anchor"] = row["sps"] / MJLAB_ANCHOR
    print(json.dumps(row), flush=True)
    return row


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda:0" if torch.cuda.is_available() else "cpu")
    p.add_argument("--minibatches", type=lambda s: [int(x) for x in s.split(",")], default=[4096, 32768])
    p.add_argument("--envs", type=int, default=4096)
    p.add_argument("--steps", type=int, default=32)
    p.add_argument("--epochs", type=int, default=5)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--repeats", type=int, default=3, help="timed updates per mode")
    p.add_argument("--modes", type=lambda s: s.split(","), default=["off", "compile", "graph"])
    p.add_argument("--pipeline", action="store_true", help="part 2: serial runner against the launcher")
    p.add_argument("--actors", type=int, default=2, help="part 2: actors sharing --envs (and the device)")
    p.add_argument("--pipeline-mode", default=None, help="learner.compile for part 2 (default: part 1's fastest)")
    p.add_argument("--total-steps", type=int, default=4096 * 32 * 20)
    p.add_argument("--warp", action="store_true", help="part 3: MuJoCo Warp HalfCheetah at mjlab's settings")
    p.add_argument("--warp-steps", type=int, default=4096 * 24 * 60)
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per launcher run")
    p.add_argument("--out", type=Path, default=None)
    p.add_argument("--keep-runs", type=Path, default=None, help="keep the launcher runs' directories here")
    args = p.parse_args(argv)
    device = torch.device(args.device)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    result = {"device": name, "torch": torch.__version__, "machine": machine_info(),
              "settings": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}}
    print(f"[gpu_pipeline] {name}: update, {args.envs} envs x {args.steps} steps, {args.epochs} epochs", flush=True)
    result["update"] = part_update(args, device)
    fastest = {m: sum(r.get(f"{m}_ms", math.inf) for r in result["update"]) for m in args.modes}
    mode = args.pipeline_mode or min(fastest, key=fastest.get)
    if args.pipeline:
        print(f"[gpu_pipeline] pipeline, learner.compile {mode}", flush=True)
        result["pipeline"] = part_pipeline(args, device, mode)
    if args.warp:
        print(f"[gpu_pipeline] MuJoCo Warp HalfCheetah, learner.compile {mode}", flush=True)
        try:
            result["warp"] = part_warp(args, device, mode)
        except BenchmarkError as e:
            result["warp"] = {"error": str(e)[-600:]}
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
