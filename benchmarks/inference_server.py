"""Slow policies, many actors: ``actors.inference`` local (a copy per actor) against server (one copy
per device, batched), on the same work, in one sitting.

    .venv/bin/python benchmarks/inference_server.py [--config configs/cartpole_ppo.json] [--actors 1,2,4,8]
        [--num-envs 4] [--latency 0.2] [--latency-per-env 0.0] [--steps 4096] [--buffer-size 16]
        [--device cpu] [--modes local,server] [--server-splits 1] [--prebuild DIR] [--mps] [--no-updates]
        [--json out.json] [--set KEY=VALUE ...]

For every number of actors A in ``--actors`` and every mode, one ``launch/run_local.sh`` run in vla
mode trains ``--steps`` env steps with A actors of ``--num-envs`` envs, one rollout of
``--buffer-size`` steps from each actor per update (the same samples per update in both modes):

- ``local``: every actor acts with its own copy. On the CPU the actors share one emulated device
  (``actors.emulated_devices``: they take turns, as processes sharing one GPU do) whose every call
  costs ``--latency`` a + ``--latency-per-env`` b x envs (``benchmarks/calibrate_latency.py``
  measures a and b for a real model); on a GPU (``--device cuda:0``) every actor runs the config's
  model there, and the hardware sets the cost.
- ``server``: ``actors.inference=server``: one inference server holds the only copy and batches the
  actors' calls (on the CPU each batch costs ``a + b x batch``).

It prints, per run: env steps/s over the training window (first rollout received to the last),
and the samples trained per second where they differ,
the peak memory of the acting processes together and, with a server, of the server and of its actors
apart (resident memory on the CPU; on a GPU, the device memory ``nvidia-smi`` reports for each process),
the final return, the learner's update time and the rate it could train at, the server's
mean batch in envs and in requests; then the ratio server / local at each A. The equal-hardware
speed-up against standard mode and its overlap bound are ``benchmarks/async_speedup.py``'s (variant
``server4-1dev``).

Under the config's ``lag_policy: pace`` (the default) every actor waits for the learner before
collecting more than its share, so where the learner is slower than acting (a large model whose
learner shares the GPU) both modes run at the learner's pace and env steps/s measures the learner.
``--set trainer.lag_policy=drop`` lets the actors run free: env steps/s is then what acting alone
reaches beside a busy learner, and the trained samples per second (what the learner kept) are
printed beside it.

``--no-updates``: acting alone. The learner keeps its copy of the policy on its device but never
trains (an update would take more rollouts than the run collects: ``trainer.rollouts_per_update``
and ``trainer.buffer_capacity`` are set past them, with ``lag_policy: drop``), so no learner
kernels share the device and env steps/s is what acting reaches on it: where the learner runs on a
device of its own, as on a node with several GPUs. On a single GPU with the learner beside the
actors, the learner's rate bounds both modes under pace, and its kernels take the GPU's time slices
(``docs/results/inference_server_h100.md``).

``--prebuild DIR``: a config whose VLA is built fresh from ``model_config`` (``model_path`` empty, as
``configs/vla_tokens_reach_0p5b_smoke.json``) makes every process initialise the whole model at
random, the same seeded weights in each: 15-18 s of CPU per process for the 0.5B model, nine times
over with eight local actors. With ``--prebuild`` the model is built once, saved to DIR with its
``save_pretrained`` and every process of every run loads it from there (about 2 s), so a few minutes
of a lent GPU go to the measurement rather than to start-up.

Nothing the script starts outlives it (each launcher is stopped with its process group).
"""

from __future__ import annotations

import argparse
import json
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

from _common import (BenchmarkError, finished_run, machine_info, raise_on_signal, start_launcher,  # noqa: E402
                     stop_launcher, tail)

import psutil  # noqa: E402

DEFAULT_CONFIG = Path(__file__).resolve().parents[1] / "configs" / "cartpole_ppo.json"
POLL_S = 0.2


def overrides(args, actors: int, mode: str) -> list[str]:
    per_update, capacity = actors, max(8, 2 * actors)
    if args.no_updates:   # an update would need more rollouts than the run makes: the learner never trains
        per_update = capacity = -(-args.steps // (args.num_envs * args.buffer_size)) + actors
    sets = list(args.sets) + [
        "trainer.buffer_type=async", f"actors.num_actors={actors}", f"actors.num_envs={args.num_envs}",
        f"trainer.total_steps={args.steps}", f"trainer.buffer_size={args.buffer_size}",
        f"trainer.rollouts_per_update={per_update}", "trainer.eval_freq=0", "trainer.save_freq=0",
        f"trainer.buffer_capacity={capacity}",
        f"algorithm.cfg.batch_size={min(256, actors * args.num_envs * args.buffer_size)}",
        f"actors.devices={json.dumps([args.device])}",
    ]
    if args.no_updates:
        sets.append("trainer.lag_policy=drop")   # under pace the actors would wait for updates that never come
    if args.env_device:
        sets.append(f"env.device={args.env_device}")
    if args.device == "cpu":
        sets += [f"actors.inference_latency_s={args.latency}", f"actors.inference_latency_per_env_s={args.latency_per_env}"]
    if mode == "server":
        sets += ["actors.inference=server", f"actors.server_max_wait_ms={args.max_wait_ms}",
                 f"actors.server_splits={args.server_splits}"]
    elif args.device == "cpu":
        sets += ['actors.emulated_devices=["dev0"]']
    return sets


def prebuild(config: Path, sets: list[str], out: Path) -> list[str]:
    """Build the config's fresh VLA once (seeded with ``trainer.seed``, as every process would) and save
    it to `out`; returns the overrides that make every process load it instead."""
    import torch
    from shared.config import load_config
    from shared.policies.vla import load_vla_model

    cfg = load_config(config, sets)
    v = cfg.policy.vla_config
    if cfg.policy.name != "vla" or v is None or v.model_path:
        raise BenchmarkError(f"--prebuild: {config} does not build a VLA afresh (policy.name {cfg.policy.name!r}, "
                             f"model_path {v.model_path if v else None!r}): nothing to build once")
    t0 = time.perf_counter()
    torch.manual_seed(cfg.trainer.seed)
    model = load_vla_model("", v.model_class, v.model_config)
    if not callable(getattr(model, "save_pretrained", None)):
        raise BenchmarkError(f"--prebuild: {v.model_class} has no save_pretrained")
    model.save_pretrained(out)
    print(f"[inference] built {v.model_class.rsplit('.', 1)[-1]} ({sum(p.numel() for p in model.parameters()) / 1e6:.0f}M "
          f"parameters) once and saved it to {out} in {time.perf_counter() - t0:.1f} s", flush=True)
    return [f"policy.vla_config.model_path={out}"]


def acting_pids(run_dir: Path) -> dict[str, list[int]]:
    """The run's inference-server and actor processes, by role."""
    out: dict[str, list[int]] = {"server": [], "actors": []}
    for p in psutil.process_iter(["pid", "cmdline"]):
        line = " ".join(p.info.get("cmdline") or [])
        if str(run_dir) not in line:
            continue
        if "-m actors.inference" in line:
            out["server"].append(p.info["pid"])
        elif "-m actors " in line + " ":
            out["actors"].append(p.info["pid"])
    return out


def compute_apps_mib(text: str) -> dict[int, float]:
    """``nvidia-smi --query-compute-apps=pid,used_memory --format=csv,noheader,nounits`` -> MiB by pid."""
    used = {}
    for line in text.strip().splitlines():
        parts = [x.strip() for x in line.split(",")]
        if len(parts) == 2 and parts[0].isdigit():
            try:
                used[int(parts[0])] = float(parts[1])
            except ValueError:      # "[N/A]" where the driver does not say
                pass
    return used


def memory_mib(pids: list[int], device: str) -> dict[int, float]:
    """Each of `pids`' memory: on the device (nvidia-smi) for CUDA, else resident (CPU)."""
    if device.startswith("cuda"):
        try:
            out = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"],
                                 capture_output=True, text=True, timeout=10).stdout
        except (OSError, subprocess.TimeoutExpired):
            return {}
        used = compute_apps_mib(out)
        return {p: used[p] for p in pids if p in used}
    rss = {}
    for pid in pids:
        try:
            rss[pid] = psutil.Process(pid).memory_info().rss / 2**20
        except psutil.Error:
            pass
    return rss


def server_batches(run_dir: Path) -> dict:
    """The server's own account at its end: batches, mean envs and requests per batch (older logs:
    the mean requests per batch of its progress lines)."""
    log = run_dir / "logs" / "inference_0.log"
    if not log.exists():
        return {}
    text = log.read_text(errors="replace")
    out = {}
    reqs = [float(x) for x in re.findall(r"envs \(max \d+(?: of \d+)?\) from ([\d.]+) requests each", text)]
    if reqs:
        out["batch_requests"] = sum(reqs) / len(reqs)
    ms = [float(x) for x in re.findall(r"([\d.]+) ms per batch", text)]
    if ms:   # the mean of its progress lines' windows
        out["forward_ms"] = sum(ms) / len(ms)
    peak = re.findall(r"peak device memory (\d+) MiB allocated, (\d+) MiB reserved", text)
    if peak:
        out["server_allocated_mib"], out["server_reserved_mib"] = float(peak[-1][0]), float(peak[-1][1])
    m = re.findall(r"stopping after (\d+) batches \(([\d.]+) envs(?: from ([\d.]+) requests)? each"
                   r"(?:, ([\d.]+) ms per batch)?\)", text)
    if m:   # the server's account of its whole life (one incarnation's), when it logs one
        out["batches"], out["batch_envs"] = int(m[-1][0]), float(m[-1][1])
        if m[-1][2]:
            out["batch_requests"] = float(m[-1][2])
        if m[-1][3]:   # over its whole life, where the progress lines cover only their windows (or none)
            out["forward_ms"] = float(m[-1][3])
    return out


def one_run(args, actors: int, mode: str, out_dir: Path) -> dict:
    run_dir = out_dir / f"{mode}_{actors}"
    cmd = (["--config", str(args.config)] + [x for o in overrides(args, actors, mode) for x in ("--set", o)]
           + (["--mps"] if args.mps else []))
    t0 = time.monotonic()
    p = start_launcher(cmd, run_dir)
    peak = {"all": 0.0, "server": 0.0, "actors": 0.0}   # each its own peak (they need not coincide)
    try:
        while p.poll() is None:
            if time.monotonic() - t0 > args.timeout:
                raise BenchmarkError(f"{mode} x{actors}: not done in {args.timeout:.0f} s:\n{tail(run_dir / 'launcher.log')}")
            roles = acting_pids(run_dir)
            used = memory_mib(roles["server"] + roles["actors"], args.device)
            now = {role: sum(used.get(pid, 0.0) for pid in pids) for role, pids in roles.items()}
            now["all"] = now["server"] + now["actors"]
            peak = {k: max(v, now[k]) for k, v in peak.items()}
            time.sleep(POLL_S)
        if p.returncode != 0:
            raise BenchmarkError(f"{mode} x{actors}: exit {p.returncode}:\n{tail(run_dir / 'launcher.log')}")
    finally:
        stop_launcher(p)
    wall = time.monotonic() - t0
    s = finished_run(run_dir, f"{mode} x{actors}")[1]
    window = s["last_rollout_time"] - s["first_rollout_time"]
    row = {"mode": mode, "actors": actors, "envs": actors * args.num_envs, "wall_s": wall, "window_s": window,
           "env_steps": s["env_steps"], "sps": s["env_steps"] / window if window > 0 else None,
           # what the updates trained on: all of it under lag_policy pace, less what drop threw away
           "env_steps_trained": s.get("env_steps_trained"),
           "trained_sps": s["env_steps_trained"] / window if window > 0 and "env_steps_trained" in s else None,
           "peak_mib": peak["all"], "actors_peak_mib": peak["actors"],
           "server_peak_mib": peak["server"] if mode == "server" else None,
           "return": s.get("last_eval/return_mean"), "updates": s["updates"],
           # the learner's side: its update time, and what collection sent that it never trained on
           "update_s": s.get("time/update_wall_s", 0.0) / max(1, s["updates"]),
           "dropped_lag": s.get("dropped_lag"), "overwritten": s.get("overwritten")}
    # The most env steps/s the learner could train at this update time (one rollout of every actor
    # per update): where sps is close to it, the learner, not acting, sets the pace.
    row["learner_ceiling_sps"] = (actors * args.num_envs * args.buffer_size / row["update_s"]) if row["update_s"] else None
    row.update(server_batches(run_dir) if mode == "server" else {})
    return row


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", type=Path, default=DEFAULT_CONFIG)
    p.add_argument("--actors", default="1,2,4,8")
    p.add_argument("--num-envs", type=int, default=4)
    p.add_argument("--latency", type=float, default=0.2, help="a: seconds per acting call (CPU)")
    p.add_argument("--latency-per-env", type=float, default=0.0, help="b: seconds per env in a call (CPU)")
    p.add_argument("--steps", type=int, default=4096)
    p.add_argument("--buffer-size", type=int, default=16)
    p.add_argument("--device", default="cpu")
    p.add_argument("--modes", default="local,server")
    p.add_argument("--max-wait-ms", type=float, default=5.0)
    p.add_argument("--server-splits", type=int, default=1, help="server: actors.server_splits")
    p.add_argument("--env-device", default="", help="env.device in both modes (default: the actors' device)")
    p.add_argument("--timeout", type=float, default=600.0)
    p.add_argument("--json", type=Path)
    p.add_argument("--out", type=Path, help="keep the run directories here (default: a temporary one, "
                   "removed at the end unless a run failed)")
    p.add_argument("--set", dest="sets", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument("--mps", action="store_true", help="every run under CUDA MPS (launch/run_local.sh --mps: a daemon "
                   "of its own per run)")
    p.add_argument("--no-updates", action="store_true", help="acting alone: the learner holds its copy but never "
                   "trains (lag_policy drop), so nothing of it runs on the device beside the acting processes")
    p.add_argument("--prebuild", type=Path, metavar="DIR",
                   help="build the config's fresh VLA once, save it here, and have every process load it")
    return p


def _print_row(args, row: dict, mode: str, a: int) -> None:
    """One run's line: env steps/s, peak memory, return, and the server's batches or the learner's pace."""
    extra = (f" | batch {row.get('batch_envs', 0):.1f} envs from {row.get('batch_requests', 0):.1f} requests, "
             f"{row.get('forward_ms', float('nan')):.1f} ms per batch" if mode == "server" else "")
    extra += (" | no updates (acting alone)" if args.no_updates else
              f" | update {row['update_s']:.2f} s (the learner trains at most "
              f"{row['learner_ceiling_sps'] or float('nan'):.0f} env steps/s), {row['dropped_lag']} rollouts "
              f"dropped for lag, {row['overwritten']} overwritten")
    split = (f" (server {row['server_peak_mib']:.0f}, actors {row['actors_peak_mib']:.0f})"
             if mode == "server" else "")
    trained = (f" ({row['trained_sps']:.1f} trained)" if row.get("trained_sps") is not None
               and row["env_steps_trained"] != row["env_steps"] and not args.no_updates else "")
    print(f"[inference] {mode:<6} {a} actors: {row['sps']:8.1f} env steps/s{trained}, peak {row['peak_mib']:8.0f} MiB{split}, "
          f"return {row['return']}{extra}", flush=True)


def _print_ratios(rows: list[dict], counts: list[int]) -> dict[int, float | None]:
    """The server-over-local table, printed; returns the ratio for each number of actors."""
    by = {(r["mode"], r["actors"]): r for r in rows if "sps" in r}
    print(f"\n{'actors':>6} {'local sps':>10} {'server sps':>10} {'server/local':>12} {'local MiB':>10} "
          f"{'server MiB':>10} {'batch envs':>10} {'requests':>8}")
    ratios = {}
    for a in counts:
        lo, se = by.get(("local", a)), by.get(("server", a))
        r = se["sps"] / lo["sps"] if lo and se and lo["sps"] else None
        ratios[a] = r
        print(f"{a:>6} {lo['sps'] if lo else float('nan'):>10.1f} {se['sps'] if se else float('nan'):>10.1f} "
              f"{r if r else float('nan'):>11.2f}x {lo['peak_mib'] if lo else float('nan'):>10.0f} "
              f"{se['peak_mib'] if se else float('nan'):>10.0f} {se.get('batch_envs', float('nan')) if se else float('nan'):>10.1f} "
              f"{se.get('batch_requests', float('nan')) if se else float('nan'):>8.1f}")
    return ratios


def main(argv: list[str] | None = None) -> int:
    p = _parser()
    args = p.parse_args(argv)
    signal.signal(signal.SIGTERM, raise_on_signal)
    import tempfile
    out_dir = args.out or Path(tempfile.mkdtemp(prefix="tandem-inference-"))
    counts = [int(x) for x in args.actors.split(",")]
    modes = args.modes.split(",")
    info = machine_info()
    print(f"[inference] {args.config.name}: {args.steps:,} env steps, actors {counts} x {args.num_envs} envs, "
          f"rollouts of {args.buffer_size}, device {args.device}"
          + "".join(f", {x}" for x in args.sets if x.startswith("trainer.lag_policy="))
          + (", under CUDA MPS" if args.mps else "")
          + (", acting alone (the learner never trains)" if args.no_updates else "")
          + (f", a = {args.latency} s + b = {args.latency_per_env} s x envs per call" if args.device == "cpu" else "")
          + f" | {info}")
    if args.prebuild is not None:
        try:
            args.sets = list(args.sets) + prebuild(args.config, args.sets, args.prebuild)
        except BenchmarkError as e:
            print(e, file=sys.stderr)
            return 2
    rows = []
    for a in counts:
        for mode in modes:
            try:
                row = one_run(args, a, mode, out_dir)
            except BenchmarkError as e:
                row = {"mode": mode, "actors": a, "error": str(e)[:2000]}
                print(f"[inference] {mode} x{a} failed: {e}", file=sys.stderr)
            rows.append(row)
            if "sps" in row:
                _print_row(args, row, mode, a)
    ratios = _print_ratios(rows, counts)
    if args.json:
        args.json.write_text(json.dumps({"args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
                                         "machine": info, "rows": rows,
                                         "server_over_local": {str(k): v for k, v in ratios.items()},
                                         "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}, indent=1) + "\n")
    ok = all("sps" in r for r in rows)
    if args.out is None:   # the temporary run directories: kept only where a run failed, to be read
        if ok:
            import shutil
            shutil.rmtree(out_dir, ignore_errors=True)
        else:
            print(f"[inference] the runs' directories are kept in {out_dir}", file=sys.stderr)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
