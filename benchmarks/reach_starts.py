"""Where Reach policies fail, start by start, on the same starts for every model.

    python benchmarks/reach_starts.py --config configs/vla_tokens_reach_grpo.json \\
        --set policy.vla_config.model_path=benchmarks/pretrained/tokens_reach_intel \\
        --model pretrained=none --model grpo=RUN_DIR [--model ppo=RUN_DIR2] [--starts 200] [--samples 16]

A model is ``LABEL=none`` (the policy ``--config`` builds: the pretrained model), ``LABEL=CHECKPOINT``
(a checkpoint file for that config) or ``LABEL=RUN_DIR`` (the run's own config and newest checkpoint).

Each start (seed ``--seed + i``: a scene, a start position and a named target) is played greedily once
and sampled ``--samples`` times (the policy's acting distribution at ``--temperature``) by every model.
An episode ends in one of: ``success``; ``wrong`` (it passed within the success radius of a target
other than the named one); ``near`` (a near miss: within 0.3 of the named target); ``elsewhere``.

The starts are split by what the **first** model's greedy episode did there, and every model is
measured on those same starts: sampled success, starts never solved in the samples, the chance that a
GRPO group of 4 (drawn from the samples without replacement) holds no success, sampled wrong-target
trips and greedy success; then how each start's greedy outcome moved from the first model's to each
other model's. Splitting each model's starts by its own greedy outcome instead would compare
different sets of starts (after training, the starts a model still misreads are the hardest ones).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import _common  # noqa: F401  (puts the repo root on sys.path)
import torch
from tensordict import TensorDict

from launch.evaluate import load_policy_checkpoint, resolve_checkpoint
from shared import keys
from shared.config import load_config
from shared.envs import env_spec, make_env
from shared.policies import make_policy

OUTCOMES = ("success", "wrong", "near", "elsewhere")
NEAR = 0.3


def reach_env(cfg, n: int):
    """`n` Reach envs as the config builds them, with groups sharing the named target too."""
    return make_env(cfg.env.id, n, {**cfg.env.cfg, "group_goals": "same"}, "cpu")


@torch.no_grad()
def play(policy, env, seeds: list[int], deterministic: bool) -> torch.Tensor:
    """One episode per env from ``env.reset(seed=seeds)`` (envs sharing a seed start alike); the
    outcome index (into OUTCOMES) of each env's first episode."""
    obs = env.reset(seed=list(seeds))
    n = env.num_envs
    targets, goal = env.targets.clone(), env.goal.clone()
    rows = torch.arange(n)
    radius = env.success_radius
    alive = torch.ones(n, dtype=torch.bool)
    outcome = torch.full((n,), OUTCOMES.index("elsewhere"))
    wrong = torch.zeros(n, dtype=torch.bool)
    closest = torch.full((n,), float("inf"))
    for _ in range(env.max_episode_steps):
        td = policy(TensorDict({keys.OBS: obs}, batch_size=[n]), deterministic=deterministic)
        step = env.step(td[keys.ACTION])
        pos = step.final_obs["proprio"][:, :2]
        dist = (targets - pos[:, None, :]).norm(dim=-1)                 # [n, targets]
        to_goal = dist[rows, goal]
        others = dist.clone()
        others[rows, goal] = float("inf")
        wrong |= alive & (others.min(-1).values < radius)
        closest = torch.where(alive, torch.minimum(closest, to_goal), closest)
        done = step.terminated | step.truncated
        ended = alive & done
        outcome[ended & step.terminated] = OUTCOMES.index("success")
        alive &= ~done
        obs = step.obs
        if not alive.any():
            break
    failed = outcome != OUTCOMES.index("success")
    outcome[failed & wrong] = OUTCOMES.index("wrong")
    outcome[failed & ~wrong & (closest < NEAR)] = OUTCOMES.index("near")
    return outcome


def no_success_in_4(fails: int, k: int) -> float:
    """P(4 of k samples, without replacement, all fail) when `fails` of them failed."""
    return math.comb(fails, 4) / math.comb(k, 4) if k >= 4 else float("nan")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", required=True)
    p.add_argument("--set", action="append", default=[], metavar="KEY=JSON")
    p.add_argument("--model", action="append", required=True, metavar="LABEL=CHECKPOINT|none",
                   help="a model to measure (repeat); the first one's greedy outcome splits the starts")
    p.add_argument("--starts", type=int, default=200)
    p.add_argument("--samples", type=int, default=16)
    p.add_argument("--temperature", type=float, default=1.0, help="sampling temperature of the acting distribution")
    p.add_argument("--seed", type=int, default=5_000_003)
    p.add_argument("--json", default=None)
    a = p.parse_args(argv)
    torch.set_num_threads(max(1, torch.get_num_threads()))
    sets = [*a.set, f"policy.vla_config.model_config.temperature={a.temperature}"]
    cfg = load_config(a.config, sets)
    if not cfg.env.id.startswith("tandem/Reach"):
        p.error(f"{cfg.env.id}: this analysis is for tandem/Reach-v0")
    starts = [a.seed + i for i in range(a.starts)]
    results = {}
    for spec in a.model:
        label, _, where = spec.partition("=")
        model_cfg, ckpt = cfg, None
        if where and where != "none":
            ckpt = Path(where)
            if ckpt.is_dir():
                model_cfg = load_config(ckpt / "config.json", sets)
                ckpt = resolve_checkpoint(ckpt, "latest")
        policy = make_policy(model_cfg, env_spec(model_cfg.env.id, model_cfg.env.cfg)).eval()
        if ckpt is not None:
            load_policy_checkpoint(policy, ckpt)
        env = reach_env(cfg, a.starts)
        greedy = play(policy, env, starts, deterministic=True)
        env.close()
        env = reach_env(cfg, a.starts * a.samples)
        torch.manual_seed(a.seed)                   # every model draws its samples from the same stream
        sampled = play(policy, env, [s for s in starts for _ in range(a.samples)], deterministic=False)
        env.close()
        results[label] = {"greedy": greedy, "sampled": sampled.view(a.starts, a.samples)}
        g = [100 * float((greedy == i).float().mean()) for i in range(len(OUTCOMES))]
        print(f"[reach_starts] {label}: greedy " + " / ".join(f"{o} {x:.1f}%" for o, x in zip(OUTCOMES, g)),
              flush=True)
    ref_label = next(iter(results))
    ref = results[ref_label]["greedy"]
    rows = []
    print(f"\nStarts split by {ref_label}'s greedy outcome ({a.starts} starts, {a.samples} samples each, "
          f"temperature {a.temperature}):")
    print(f"{'model':14s} {'starts where ' + ref_label + ' greedy...':32s} {'starts':>6s} {'sampled success':>16s} "
          f"{'never solved':>13s} {'P(group of 4 fails)':>20s} {'sampled wrong':>14s} {'greedy success':>15s}")
    for o_idx, o in enumerate(OUTCOMES):
        sel = ref == o_idx
        if not sel.any():
            continue
        for label, r in results.items():
            s = r["sampled"][sel]
            succ = (s == 0).float()
            fails = (s != 0).sum(-1).tolist()
            row = {"model": label, "split": o, "starts": int(sel.sum()),
                   "sampled_success": float(succ.mean()),
                   "never_solved": float((succ.sum(-1) == 0).float().mean()),
                   "p_group4_fails": sum(no_success_in_4(f, a.samples) for f in fails) / len(fails),
                   "sampled_wrong": float((s == 1).float().mean()),
                   "greedy_success": float((r["greedy"][sel] == 0).float().mean())}
            rows.append(row)
            print(f"{label:14s} {o:32s} {row['starts']:6d} {row['sampled_success']:16.2f} "
                  f"{100 * row['never_solved']:12.0f}% {row['p_group4_fails']:20.2f} {row['sampled_wrong']:14.2f} "
                  f"{row['greedy_success']:15.2f}")
    print(f"\nGreedy outcome on each start: {ref_label}'s (rows) -> each model's (columns), in starts:")
    moves = {}
    for label, r in list(results.items())[1:]:
        m = [[int(((ref == i) & (r["greedy"] == j)).sum()) for j in range(len(OUTCOMES))] for i in range(len(OUTCOMES))]
        moves[label] = m
        print(f"{label:14s} " + " ".join(f"{o:>10s}" for o in OUTCOMES))
        for i, o in enumerate(OUTCOMES):
            print(f"  {o:12s} " + " ".join(f"{x:10d}" for x in m[i]))
    if a.json:
        out = {"args": vars(a), "rows": rows, "moves": moves,
               "greedy": {k: [100 * float((v["greedy"] == i).float().mean()) for i in range(len(OUTCOMES))]
                          for k, v in results.items()}}
        Path(a.json).write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
