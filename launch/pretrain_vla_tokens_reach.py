"""Make the pretrained action-token VLA checkpoint that the ``vla_tokens_reach_*`` configs start from.

A PaliGemma-class model (SigLIP vision tower + Gemma decoder) small enough for a CPU, built from a
config in code (``PaliGemmaActionTokenPolicy``, the ``tiny`` preset widened by ``BACKBONE``), trained
in two stages, as real VLAs are (a vision-language model that can point at what a sentence names,
then behaviour cloning):

1. **Grounding** (``--ground-steps``): the prompt ``locate <colour>`` (``LOCATE`` in place of
   ``reach``) and, as the answer, the named target's position in the action tokens' bins. This is
   PaliGemma's own kind of pretraining (its ``detect`` prompts answer in location tokens).
2. **Behaviour cloning** on the scripted expert of ``tandem/Reach-v0`` (image + instruction +
   proprioception; loss: minus the log-probability of the expert's action bins), until the
   deterministic policy's success rate over 200 episodes reaches ``--target`` (a modest one: RL
   fine-tuning is meant to raise it) with the instruction read (below). Each batch of expert data
   is used for ``--data-every`` steps (a few epochs): reusing it longer lets the model memorise it.

Why stage 1: trained on the task alone, this model from scratch does not learn to read the
instruction. It settles at a policy that heads for one of the three targets whatever it is told
(its actions barely change when the instruction names another colour). The localisation task asks
for the binding of a colour word to an image patch directly, which the model learns on its own (not
when mixed into behaviour cloning from the start). The figures behind this are in
docs/results/notebook.md ("Pretraining the action-token Reach model"). The "grounding" figure
printed is the KL between the action distribution given the true instruction and given one naming
another target (``--min-grounding``).

Written as a local Hugging Face checkpoint directory (``save_pretrained``: config.json and
model.safetensors, plus the value head in tandem_adapter.safetensors and the adapter's keywords in
tandem_adapter.json)::

    python launch/pretrain_vla_tokens_reach.py     # -> outputs/pretrained/tokens_reach/
    launch/run_local.sh --config configs/vla_tokens_reach_ppo.json
    launch/run_local.sh --config configs/vla_tokens_reach_grpo.json
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from learner.evaluator import evaluate
from shared.config import VLAConfig
from shared.envs.reach import TOKENS, Reach, expert_batch
from shared.policies.action_tokens import PaliGemmaActionTokenPolicy
from shared.policies.vla import VLAPolicy

MODEL_CLASS = "shared.policies.action_tokens.PaliGemmaActionTokenPolicy"
BACKBONE = {"hidden": 64, "layers": 2, "heads": 2, "kv_heads": 1, "head_dim": 32, "intermediate": 128,
            "vision_hidden": 48, "vision_layers": 2, "vision_heads": 2, "vision_intermediate": 96}
ADAPTER = {"action_dim": 2, "n_bins": 21, "decoding": "parallel"}
LOCATE = max(TOKENS.values()) + 1      # the grounding prompt's verb: a token id the task never uses


@torch.no_grad()
def success_rate(model: PaliGemmaActionTokenPolicy, episodes: int, seed: int) -> float:
    policy = VLAPolicy(model, VLAConfig(model_class=MODEL_CLASS)).eval()
    successes = evaluate(policy, Reach(episodes), episodes, seed=seed).successes
    model.train()
    return sum(successes) / max(len(successes), 1)


@torch.no_grad()
def grounding(model: PaliGemmaActionTokenPolicy, verb: int = TOKENS["reach"], n: int = 256, seed: int = 0) -> float:
    """Mean KL (nats) between the action distribution given the true instruction and given one that
    names another target, over `n` fresh episodes' first observations: ~0 for a policy blind to it."""
    obs = Reach(n).reset(seed=seed)
    obs["instruction"][:, 0] = verb
    other = obs.clone()
    colour = other["instruction"][:, 1] - TOKENS["red"]
    other["instruction"][:, 1] = (colour + 1) % Reach.num_targets + TOKENS["red"]
    p, q = model.action_dist(obs).bin_logp, model.action_dist(other).bin_logp
    return float((p.exp() * (p - q)).sum(-1).sum(-1).mean())


@torch.no_grad()
def pointing_accuracy(model: PaliGemmaActionTokenPolicy, n: int = 256, seed: int = 1) -> float:
    """How often the position the model answers to ``locate <colour>`` is nearest the named target."""
    env = Reach(n)
    obs = env.reset(seed=seed)
    obs["instruction"][:, 0] = LOCATE
    answer = model.action_dist(obs).mode                                       # [n, 2]
    nearest = (answer[:, None] - env.targets).norm(dim=-1).argmin(-1)
    return float((nearest == env.goal).float().mean())


def ground(model: PaliGemmaActionTokenPolicy, steps: int, lr: float, gen: torch.Generator) -> None:
    """Stage 1: ``locate <colour>`` -> the named target's position, on fresh scenes every step."""
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    env = Reach(256)
    t0 = time.time()
    for step in range(1, steps + 1):
        obs = env.reset(seed=int(torch.randint(0, 2**31 - 1, (1,), generator=gen)))
        obs["instruction"][:, 0] = LOCATE
        loss = -model.action_dist(obs).log_prob(env.goal_position()).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        if step % 100 == 0 or step == steps:
            print(f"[pretrain] grounding step {step}: loss {loss.item():.3f}, points at the named target "
                  f"{pointing_accuracy(model):.3f} (chance 0.33), grounding {grounding(model, LOCATE):.3f} nats "
                  f"({time.time() - t0:.0f} s)", flush=True)


def count(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=Path("outputs/pretrained/tokens_reach"))
    p.add_argument("--ground-steps", type=int, default=800, help="stage 1 (grounding) gradient steps")
    p.add_argument("--ground-lr", type=float, default=5e-4)
    p.add_argument("--target", type=float, default=0.4,
                   help="stage 2 stops at this deterministic success rate (with the instruction read)")
    p.add_argument("--min-grounding", type=float, default=0.5,
                   help="nats of instruction KL (see above) needed to stop: a success rate reached without "
                        "reading the instruction is luck")
    p.add_argument("--max-steps", type=int, default=3000, help="stage 2 gradient steps at most")
    p.add_argument("--eval-every", type=int, default=50, help="stage 2 gradient steps between evaluations")
    p.add_argument("--data-every", type=int, default=25, help="stage 2 gradient steps on each batch of expert data")
    p.add_argument("--lr", type=float, default=1e-3, help="stage 2 learning rate")
    p.add_argument("--threads", type=int, default=2, help="torch CPU threads")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    torch.manual_seed(args.seed)
    torch.set_num_threads(args.threads)
    gen = torch.Generator().manual_seed(args.seed)
    model = PaliGemmaActionTokenPolicy(size="tiny", backbone=BACKBONE, **ADAPTER)
    print(f"[pretrain] {count(model):,} parameters ({count(model.model):,} in the PaliGemma backbone)")
    t0 = time.time()
    ground(model, args.ground_steps, args.ground_lr, gen)
    pointing = pointing_accuracy(model)
    opt = torch.optim.Adam(model.parameters(), lr=args.lr)
    env = Reach(128)
    rate, step, grounded = success_rate(model, 200, seed=10_000), 0, 0.0
    print(f"[pretrain] behaviour cloning, step 0: success {rate:.3f}")
    while (rate < args.target or grounded < args.min_grounding) and step < args.max_steps:
        for i in range(args.eval_every):
            if i % args.data_every == 0:                              # fresh expert data
                obs, act = expert_batch(env, 20, noise=0.5, gen=gen)
            idx = torch.randint(0, act.shape[0], (256,), generator=gen)
            loss = -model.action_dist(obs[idx]).log_prob(act[idx]).mean()   # BC: NLL of the expert's bins
            opt.zero_grad()
            loss.backward()
            opt.step()
            step += 1
        rate, grounded = success_rate(model, 200, seed=10_000 + step), grounding(model)
        print(f"[pretrain] behaviour cloning, step {step}: loss {loss.item():.3f}, success {rate:.3f}, "
              f"grounding {grounded:.3f} nats ({time.time() - t0:.0f} s)", flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(args.out)
    (args.out / "pretrain.json").write_text(json.dumps({"backbone": BACKBONE, "adapter": ADAPTER,
                                                       "success_rate": rate, "bc_steps": step,
                                                       "grounding_kl_nats": round(grounded, 4),
                                                       "ground_steps": args.ground_steps,
                                                       "pointing_accuracy": pointing,
                                                       "parameters": count(model),
                                                       "wall_s": round(time.time() - t0, 1)}, indent=2) + "\n")
    print(f"[pretrain] saved {args.out}: deterministic success rate {rate:.3f} (200 episodes) after {step} "
          f"BC steps, {time.time() - t0:.0f} s")
    if grounded < args.min_grounding:
        print(f"[pretrain] warning: --max-steps {args.max_steps} ran out before the policy read the instruction "
              f"(grounding {grounded:.3f} < --min-grounding {args.min_grounding} nats): RL from this checkpoint "
              f"will struggle past ~40%; raise --ground-steps or --max-steps", flush=True)


if __name__ == "__main__":
    main()
