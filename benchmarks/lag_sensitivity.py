"""How much final return a config loses to policy lag, and to spreading its data over more envs,
measured without wall-clock noise.

    .venv/bin/python benchmarks/lag_sensitivity.py [--config configs/cartpole_ppo.json]
                     [--cases 1:0,1:1,4:0,1:4,4:4] [--seeds 1,2,3,4,5,6,7,8] [--steps 32768]
                     [--num-envs 16] [--buffer-size 32] [--per-update one|actors] [--json out.json]
                     [--set KEY=VALUE ...]

An asynchronous run with A actors differs from a synchronous one with 1 actor in two ways at once:

1. **lag**: an actor loads weights at its rollout boundaries, so with one rollout per update the
   rollout trained on at version v was acted by about v - A (``mean lag`` in
   ``benchmarks/async_speedup.py``);
2. **more envs**: A actors run A x ``actors.num_envs`` envs, each for 1/A as many steps. With a
   short budget and long episodes (CartPole: up to 500 steps) no env ever gets deep into an
   episode, and the policy never sees the states it must learn to handle there.

This script separates the two. A case ``A:L`` trains the config in this one process with the real
:class:`learner.learner.Learner` and A serial-runner actors (:class:`runners.serial.SerialActor`: a
real :class:`actors.rollout.Collector` each, with its own env and policy copy, seeded as actor ``i``
seeds itself), round-robin: the rollout trained on at update u is collected by actor ``u mod A``
with the weights the learner published as version ``max(0, u - L)``. No sleeps, no sockets, no
scheduling: a case is a deterministic function of its seed, and a CartPole run of 32k steps takes
about 5 s. ``1:0`` is the synchronous baseline, ``4:0`` is 4 actors' envs without lag, ``1:4`` is
lag 4 without extra envs, ``4:4`` is what ``vla`` mode with 4 actors and one rollout per update
does. With ``--per-update actors`` an update instead trains one rollout of ``--buffer-size / A``
steps from each of the A actors, all acted by version ``max(0, u - L)``: ``4:1`` is then what
``vla`` mode with 4 actors does by default (``trainer.rollouts_per_update`` = number of actors).

Every case gets the benchmark's overrides of ``async_speedup.py`` (one rollout per update, the same
samples per update, no periodic evaluation) and the final weights get the evaluator's deterministic
evaluation (``trainer.num_eval_episodes`` episodes, the evaluator's first seed). The table gives
every seed's return, the mean, and the mean as a ratio of the first case's, measured in the same
run.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from pathlib import Path

from _common import ROOT, machine_info  # noqa: E402  (puts the repo on sys.path)

DEFAULT_CONFIG = ROOT / "configs" / "cartpole_ppo.json"


def parse_cases(text: str) -> list[tuple[int, int]]:
    """``"1:0,4:4"`` -> ``[(1, 0), (4, 4)]`` (actors >= 1, lag >= 0)."""
    cases = []
    for part in (x.strip() for x in text.split(",")):
        if not part:
            continue
        try:
            a, lag = (int(x) for x in part.split(":"))
        except ValueError:
            raise ValueError(f"--cases: {part!r} is not ACTORS:LAG (two integers)") from None
        if a < 1 or lag < 0:
            raise ValueError(f"--cases: {part!r}: actors must be >= 1 and lag >= 0")
        cases.append((a, lag))
    if not cases:
        raise ValueError("--cases: no case given")
    return cases


def run_case(config: Path, sets: list[str], actors: int, lag: int, seed: int, steps: int, num_envs: int,
             buffer_size: int, per_update: str = "one") -> dict:
    """Train one case to `steps` env steps; returns the final evaluation and the run's numbers.

    `per_update` "one": update u trains one rollout of `buffer_size` steps, from actor ``u mod A``;
    "actors": one rollout of ``buffer_size // A`` steps from every actor (as ``vla`` mode does by
    default). Either way every rollout of update u is acted by version ``max(0, u - lag)``."""
    from learner.evaluator import evaluate
    from learner.learner import Learner, ListPublisher
    from runners.serial import SerialActor
    from shared.config import load_config
    from shared.envs import make_env

    samples = num_envs * buffer_size
    if per_update not in ("one", "actors"):
        raise ValueError(f"per_update must be 'one' or 'actors', not {per_update!r}")
    if per_update == "actors" and buffer_size % actors:
        raise ValueError(f"buffer_size {buffer_size} is not a multiple of {actors} actors")
    k, rollout_steps = (1, buffer_size) if per_update == "one" else (actors, buffer_size // actors)
    cfg = load_config(config, list(sets) + [
        f"trainer.seed={seed}", "trainer.buffer_type=async", f"actors.num_actors={actors}",
        f"trainer.total_steps={steps}", f"actors.num_envs={num_envs}", f"trainer.buffer_size={rollout_steps}",
        f"trainer.rollouts_per_update={k}", "trainer.buffer_capacity=8", f"trainer.max_policy_lag={lag}",
        "trainer.eval_freq=0", "trainer.save_freq=0", f"algorithm.cfg.batch_size={min(256, samples)}",
        "actors.inference_latency_s=0"])
    publisher = ListPublisher()
    learner = Learner(cfg, run_dir=None, publisher=publisher)
    weights = {}                                   # version -> published weights still needed

    def take_published() -> None:
        for td, meta in publisher.published:
            weights[int(meta["version"])] = td
        publisher.published.clear()

    take_published()
    if 0 not in weights:
        learner.publish()
        take_published()
    # the serial runner's actors (seeded as actor i seeds itself), but not its loop: the lag is the point
    serial = [SerialActor(cfg, i, device="cpu") for i in range(actors)]
    lags, u = [], 0
    try:
        while not learner.finished:
            version = max(0, learner.version - lag)
            for i in ([u % actors] if k == 1 else range(actors)):
                serial[i].load(weights[version], version)
                learner.ingest(*serial[i].collect())
            batch = learner.take_batch(timeout_s=0.0)
            if batch is None:
                raise RuntimeError(f"case {actors}:{lag}: the learner did not take the rollout of update {u + 1}")
            lags.append(learner.version - version)
            learner.update_once(*batch)
            take_published()
            for old in [v for v in weights if v < learner.version - lag]:
                del weights[old]
            u += 1
    finally:
        for actor in serial:
            actor.close()
    learner.policy.eval()
    eval_env = make_env(cfg.env.id, cfg.trainer.num_eval_episodes, cfg.env.cfg, "cpu")
    try:   # the evaluator process's first evaluation uses this seed
        returns = evaluate(learner.policy, eval_env, cfg.trainer.num_eval_episodes, seed=cfg.trainer.seed + 1_000_003).returns
    finally:
        eval_env.close()
    return {"seed": seed, "eval_return": sum(returns) / len(returns), "updates": learner.updates,
            "env_steps": learner.env_steps, "lag_mean": sum(lags) / len(lags) if lags else 0.0,
            "dropped": learner.counts["dropped_lag"] + learner.counts["overwritten"]}


def fmt_table(rows: list[dict]) -> str:
    head = ("case", "actors", "lag", "envs in all", "steps per env", "returns (per seed)", "mean", "min", "vs first")
    base = rows[0]["mean"] if rows else None
    lines = []
    for r in rows:
        lines.append((f"{r['actors']}:{r['lag']}", str(r["actors"]), str(r["lag"]), str(r["envs"]),
                      str(r["steps_per_env"]), " ".join(f"{x:.0f}" for x in r["returns"]), f"{r['mean']:.1f}",
                      f"{r['min']:.1f}", f"{r['mean'] / base:.2f}x" if base else "-"))
    widths = [max(len(h), *(len(x[i]) for x in lines)) for i, h in enumerate(head)]

    def line(cells) -> str:
        return "  ".join(c.ljust(w) if i in (0, 5) else c.rjust(w) for i, (c, w) in enumerate(zip(cells, widths)))
    return "\n".join([line(head), line(["-" * w for w in widths]), *(line(x) for x in lines)])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="benchmarks/lag_sensitivity.py", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", type=Path, default=DEFAULT_CONFIG,
                   help="JSON config file (default: configs/cartpole_ppo.json)")
    p.add_argument("--cases", default="1:0,1:1,4:0,1:4,4:4",
                   help="comma-separated ACTORS:LAG cases; the first is the baseline (default 1:0,1:1,4:0,1:4,4:4)")
    p.add_argument("--seeds", default="1,2,3,4,5,6,7,8", help="comma-separated trainer.seed values (default 1..8)")
    p.add_argument("--steps", type=int, default=32768, help="env steps per run (default 32768)")
    p.add_argument("--num-envs", type=int, default=16, help="envs per actor (default 16)")
    p.add_argument("--buffer-size", type=int, default=32,
                   help="steps per env of one update's data (default 32)")
    p.add_argument("--per-update", choices=("one", "actors"), default="one",
                   help="one (default): an update trains one rollout of --buffer-size steps, from the actors in "
                        "turn; actors: one rollout of --buffer-size / A steps from each of the A actors, as vla "
                        "mode does by default")
    p.add_argument("--json", type=Path, help="also write the results as JSON here")
    p.add_argument("--set", dest="sets", action="append", default=[], metavar="KEY=VALUE",
                   help="config override for every case, applied before the script's own (repeatable)")
    args = p.parse_args(argv)
    try:
        cases = parse_cases(args.cases)
        seeds = [int(x) for x in args.seeds.split(",") if x.strip()]
    except ValueError as e:
        p.error(str(e))
    if not seeds or args.steps < 1 or args.num_envs < 1 or args.buffer_size < 1:
        p.error("--seeds must name at least one seed; --steps, --num-envs and --buffer-size must be positive")
    import torch
    torch.set_num_threads(1)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    logging.getLogger("learner").setLevel(logging.WARNING)
    rows = []
    for actors, lag in cases:
        t0 = time.perf_counter()
        if args.per_update == "actors" and args.buffer_size % actors:
            p.error(f"--buffer-size {args.buffer_size} is not a multiple of case {actors}:{lag}'s actors")
        runs = [run_case(args.config, args.sets, actors, lag, s, args.steps, args.num_envs, args.buffer_size,
                         args.per_update) for s in seeds]
        returns = [r["eval_return"] for r in runs]
        row = {"actors": actors, "lag": lag, "envs": actors * args.num_envs,
               "steps_per_env": args.steps // (actors * args.num_envs), "returns": returns,
               "mean": sum(returns) / len(returns), "min": min(returns), "max": max(returns),
               "lag_mean": sum(r["lag_mean"] for r in runs) / len(runs), "runs": runs,
               "seconds": time.perf_counter() - t0}
        rows.append(row)
        print(f"[lag] case {actors}:{lag}: returns {' '.join(f'{x:.0f}' for x in returns)} "
              f"(mean {row['mean']:.1f}, {row['seconds']:.0f} s)", flush=True)
    print()
    print(fmt_table(rows))
    shape = ("one rollout per update" if args.per_update == "one" else
             "an update takes one rollout of --buffer-size / A steps from each of the A actors")
    print(f"\n{args.config.name}, {args.steps} env steps, {args.num_envs} envs per actor, {args.buffer_size} steps "
          f"per env per update: {shape}; seeds {','.join(map(str, seeds))}")
    if args.json:
        args.json.write_text(json.dumps({"config": str(args.config), "steps": args.steps, "num_envs": args.num_envs,
                                         "buffer_size": args.buffer_size, "per_update": args.per_update, "seeds": seeds, "sets": args.sets,
                                         "cases": rows, "machine": machine_info()}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
