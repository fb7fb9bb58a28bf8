"""Make the "pretrained" VLA checkpoint that the Reach fine-tuning configs start from.

Behaviour cloning of ``TinyVLA`` on the scripted expert of ``tandem/Reach-v0``, stopped as soon as
the deterministic policy's success rate reaches ``--target`` (a modest one: RL fine-tuning is meant
to raise it), then saved as safetensors::

    python launch/pretrain_vla_reach.py                # -> outputs/pretrained/tiny_vla_reach.safetensors
    launch/run_local.sh --config configs/vla_reach_ppo.json
    launch/run_local.sh --config configs/vla_reach_grpo.json
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

from learner.evaluator import evaluate
from shared.config import VLAConfig
from shared.envs.reach import VOCAB_SIZE, Reach, expert_batch
from shared.policies.tiny_vla import TinyVLA
from shared.policies.vla import VLAPolicy

MODEL_CONFIG = {"image_size": 16, "vocab_size": VOCAB_SIZE, "proprio_dim": 4, "action_dim": 2, "hidden": 64,
                "log_std_init": -1.5}


def success_rate(model: TinyVLA, episodes: int, seed: int) -> float:
    policy = VLAPolicy(model, VLAConfig(model_class="shared.policies.tiny_vla.TinyVLA")).eval()
    successes = evaluate(policy, Reach(episodes), episodes, seed=seed).successes
    return sum(successes) / max(len(successes), 1)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=Path("outputs/pretrained/tiny_vla_reach.safetensors"))
    p.add_argument("--target", type=float, default=0.5, help="stop at this deterministic success rate")
    p.add_argument("--max-steps", type=int, default=3000, help="gradient steps at most")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    torch.manual_seed(args.seed)
    torch.set_num_threads(2)
    gen = torch.Generator().manual_seed(args.seed)
    model = TinyVLA(**MODEL_CONFIG)
    log_std = model.log_std.detach().clone()
    opt = torch.optim.Adam([q for n, q in model.named_parameters() if n != "log_std"], lr=1e-3)
    env = Reach(128)
    t0 = time.time()
    rate, step = success_rate(model, 200, seed=10_000), 0
    print(f"[pretrain] step 0: success {rate:.2f}")
    while rate < args.target and step < args.max_steps:
        obs, act = expert_batch(env, 20, noise=0.5, gen=gen)         # fresh expert data every round
        for _ in range(50):
            idx = torch.randint(0, act.shape[0], (256,), generator=gen)
            mean = model.action_head(model._features(obs[idx]))
            loss = (mean - act[idx]).pow(2).mean()                   # BC on the action mean
            opt.zero_grad()
            loss.backward()
            opt.step()
            step += 1
        rate = success_rate(model, 200, seed=10_000 + step)
        print(f"[pretrain] step {step}: loss {loss.item():.4f}, success {rate:.2f} ({time.time() - t0:.0f} s)")
    with torch.no_grad():
        model.log_std.copy_(log_std)                                   # exploration noise for RL
    args.out.parent.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(args.out))
    (args.out.with_suffix(".json")).write_text(json.dumps({"model_config": MODEL_CONFIG, "success_rate": rate,
                                                          "bc_steps": step}, indent=2) + "\n")
    print(f"[pretrain] saved {args.out}: deterministic success rate {rate:.2f} after {step} BC steps")


if __name__ == "__main__":
    main()
