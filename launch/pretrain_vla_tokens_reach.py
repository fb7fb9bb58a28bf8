"""Make the pretrained action-token VLA checkpoint that the ``vla_tokens_reach_*`` configs start from.

A PaliGemma-class model (SigLIP vision tower + Gemma decoder) small enough for a CPU, built from a
config in code (``PaliGemmaActionTokenPolicy``, the ``tiny`` preset widened by ``BACKBONE``),
behaviour-cloned on the scripted expert of ``tandem/Reach-v0`` (image + instruction + proprioception;
loss: minus the log-probability of the expert's action bins) until the deterministic policy's success
rate over 200 episodes reaches ``--target`` (a modest one: RL fine-tuning is meant to raise it), then
written as a local Hugging Face checkpoint directory (``save_pretrained``: config.json and
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
from shared.envs.reach import Reach, expert_batch
from shared.policies.action_tokens import PaliGemmaActionTokenPolicy
from shared.policies.vla import VLAPolicy

MODEL_CLASS = "shared.policies.action_tokens.PaliGemmaActionTokenPolicy"
BACKBONE = {"hidden": 64, "layers": 2, "heads": 2, "kv_heads": 1, "head_dim": 32, "intermediate": 128,
            "vision_hidden": 48, "vision_layers": 2, "vision_heads": 2, "vision_intermediate": 96}
ADAPTER = {"action_dim": 2, "n_bins": 21, "decoding": "parallel"}


@torch.no_grad()
def success_rate(model: PaliGemmaActionTokenPolicy, episodes: int, seed: int) -> float:
    policy = VLAPolicy(model, VLAConfig(model_class=MODEL_CLASS)).eval()
    _, _, successes = evaluate(policy, Reach(episodes), episodes, seed=seed)
    model.train()
    return sum(successes) / max(len(successes), 1)


def count(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=Path("outputs/pretrained/tokens_reach"))
    p.add_argument("--target", type=float, default=0.4, help="stop at this deterministic success rate")
    p.add_argument("--max-steps", type=int, default=3000, help="gradient steps at most")
    p.add_argument("--eval-every", type=int, default=50, help="gradient steps between evaluations")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    torch.manual_seed(args.seed)
    torch.set_num_threads(2)
    gen = torch.Generator().manual_seed(args.seed)
    model = PaliGemmaActionTokenPolicy(size="tiny", backbone=BACKBONE, **ADAPTER)
    print(f"[pretrain] {count(model):,} parameters ({count(model.model):,} in the PaliGemma backbone)")
    opt = torch.optim.Adam(model.parameters(), lr=args.lr)
    env = Reach(128)
    t0 = time.time()
    rate, step = success_rate(model, 200, seed=10_000), 0
    print(f"[pretrain] step 0: success {rate:.3f}")
    while rate < args.target and step < args.max_steps:
        obs, act = expert_batch(env, 20, noise=0.5, gen=gen)         # fresh expert data every round
        for _ in range(args.eval_every):
            idx = torch.randint(0, act.shape[0], (256,), generator=gen)
            loss = -model.action_dist(obs[idx]).log_prob(act[idx]).mean()   # BC: NLL of the expert's bins
            opt.zero_grad()
            loss.backward()
            opt.step()
            step += 1
        rate = success_rate(model, 200, seed=10_000 + step)
        print(f"[pretrain] step {step}: loss {loss.item():.3f}, success {rate:.3f} ({time.time() - t0:.0f} s)",
              flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(args.out)
    (args.out / "pretrain.json").write_text(json.dumps({"backbone": BACKBONE, "adapter": ADAPTER,
                                                       "success_rate": rate, "bc_steps": step,
                                                       "parameters": count(model),
                                                       "wall_s": round(time.time() - t0, 1)}, indent=2) + "\n")
    print(f"[pretrain] saved {args.out}: deterministic success rate {rate:.3f} (200 episodes) after {step} "
          f"BC steps, {time.time() - t0:.0f} s")


if __name__ == "__main__":
    main()
