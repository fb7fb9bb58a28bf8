"""Make the π0 checkpoint that the ``pi0_reach_*`` configs start from (``outputs/pretrained/pi0_reach/``).

A tiny π0, transformers' ``PI0ForConditionalGeneration`` built from a ``PI0Config`` in code (a PaliGemma VLM
and a Gemma action expert, the shapes in ``TEXT``, ``VISION`` and ``EXPERT`` below; about 0.2M parameters,
CPU-trainable), trained with the flow-matching loss (transformers' own: ``model(..., actions=chunk).loss``,
the MSE between the predicted velocity and ε − a at a Beta-sampled time) in two stages:

1. **Grounding** (``--ground-steps``): the prompt ``locate <colour>`` (``LOCATE`` in place of ``reach``)
   and, as the chunk to generate, the named target's position repeated H times. Trained on the task
   alone, this model does not learn to read the instruction, as the action-token model does not (see
   ``launch/pretrain_vla_tokens_reach.py``): in a trial without this stage, success settled at 31-39%
   over 1,100 steps while the first action headed for the named target no more often than chance
   (0.32-0.40), a policy that goes for some target whatever it is told. Here, where nothing but the
   colour word explains the answer, the model learns to point: at chance for 1,000-1,300 steps, then
   near 1 within 200 more (two seeds tried).
2. **Behaviour cloning** on ``tandem/Reach-v0``'s scripted expert: from each visited state, the chunk
   label is the expert's plan for the next H steps, rolled forward through Reach's dynamics from the
   agent's position (:func:`expert_plan`; Reach moves by ``step_size × action``, clamped, so no env
   step is needed). The demonstrations add action noise (``--noise``) so that states off the expert's
   path are visited too. Training stops as soon as the ODE policy (``deterministic``, K =
   ``NUM_STEPS`` Euler steps, ``ACTIONS_PER_CALL`` of each chunk executed, as the configs do) succeeds
   in ``--target`` to ``--ceiling`` of 200 held-out episodes (a modest rate: RL is meant to raise it)
   while reading the instruction (``--min-pointing``: how often its first action heads for the named
   target rather than another; a blind policy scores about a third). Success climbs fast once it
   starts, so an evaluation interval that jumps over the band is taken back and retried at half the
   length. The rate on 200 other held-out episodes is reported beside it.

Written with ``save_pretrained`` (config.json and model.safetensors: a plain π0 directory, no Tandem
file; the value and noise heads start fresh in the RL run) plus ``pretrain.json`` (the figures)::

    .venv/bin/python launch/pretrain_pi0_reach.py      # -> outputs/pretrained/pi0_reach/
    launch/run_local.sh --config configs/pi0_reach_ppo.json
    launch/run_local.sh --config configs/pi0_reach_grpo.json

The recipe: docs/guides/finetune_pi0.md.
"""

from __future__ import annotations

import argparse
import copy
import json
import time
from pathlib import Path

import torch

from learner.evaluator import evaluate
from shared.config import FlowConfig
from shared.envs.reach import TOKENS, VOCAB_SIZE, Reach
from shared.policies.flow_policy import FlowVLAPolicy
from shared.policies.flow_vla import pi0_inputs, save_pi0

LOCATE = max(TOKENS.values()) + 1      # the grounding prompt's verb: an id the task never uses
IMAGE_TOKEN = VOCAB_SIZE + 1           # the VLM's <image> id, after Reach's 8 ids and LOCATE
CHUNK, NUM_STEPS, ACTIONS_PER_CALL = 8, 4, 4
# Joint attention: the expert's layers attend to the VLM's keys and values, layer by layer, so the two
# share the number of layers, key-value heads and head_dim.
TEXT = {"model_type": "gemma", "hidden_size": 64, "num_hidden_layers": 2, "intermediate_size": 128,
        "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 32, "vocab_size": IMAGE_TOKEN + 1}
VISION = {"model_type": "siglip_vision_model", "hidden_size": 64, "intermediate_size": 128, "patch_size": 4,
          "image_size": 16, "num_hidden_layers": 2, "num_attention_heads": 2, "vision_use_head": False}
EXPERT = {"model_type": "gemma", "hidden_size": 32, "num_hidden_layers": 2, "intermediate_size": 64,
          "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 32}
SHAPE = {"chunk_size": CHUNK, "max_state_dim": 4, "max_action_dim": 2, "num_inference_steps": NUM_STEPS}
EVAL_EPISODES, EVAL_SEED, OTHER_SEED = 200, 10_000, 20_000


def make_model(seed: int):
    """A fresh tiny π0 (Reach's 16x16 images, 4 patches a side: 16 image tokens)."""
    from transformers import PI0Config, PI0ForConditionalGeneration

    torch.manual_seed(seed)
    config = PI0Config(vlm_config={"model_type": "paligemma", "text_config": TEXT, "vision_config": VISION,
                                   "projection_dim": TEXT["hidden_size"], "image_token_id": IMAGE_TOKEN},
                       dit_config=EXPERT, **SHAPE)
    return PI0ForConditionalGeneration(config)


def expert_plan(pos: torch.Tensor, goal: torch.Tensor, step_size: float, horizon: int) -> torch.Tensor:
    """The scripted expert's next `horizon` actions from positions `pos` ``[N, 2]`` towards `goal`
    ``[N, 2]``: ``[N, horizon, 2]``. Each is Reach's ``expert_action`` at the position the previous
    ones lead to (``pos + step_size × action``, clamped to the arena, as ``Reach.step`` moves)."""
    actions = []
    for _ in range(horizon):
        action = ((goal - pos) / step_size).clamp(-1, 1)
        actions.append(action)
        pos = (pos + step_size * action).clamp(-1, 1)
    return torch.stack(actions, dim=1)


def demonstrations(env: Reach, steps: int, noise: float, gen: torch.Generator):
    """Roll the noisy expert for `steps` steps of `env` from a fresh seed: ``(observations, chunk labels
    [steps × num_envs, CHUNK, 2])``, each label the expert's plan from that observation's state."""
    obs_list, plans = [], []
    obs = env.reset(seed=int(torch.randint(0, 2**31 - 1, (1,), generator=gen)))
    for _ in range(steps):
        plan = expert_plan(env.pos, env.goal_position(), env.step_size, CHUNK)
        obs_list.append(obs.clone())
        plans.append(plan)
        action = (plan[:, 0] + noise * torch.randn(plan[:, 0].shape, generator=gen)).clamp(-1, 1)
        obs = env.step(action).obs
    return torch.cat(obs_list), torch.cat(plans)


def flow_loss(model, obs, chunk: torch.Tensor) -> torch.Tensor:
    """transformers' flow-matching loss of `model` on the observations `obs` and target chunks `chunk`."""
    inputs = pi0_inputs(model.config, obs["rgb"], obs["proprio"], obs["instruction"], instruction_pad_id=0)
    return model(**inputs.prefix_kwargs(), actions=chunk).loss


@torch.no_grad()
def ode_chunk(model, obs) -> torch.Tensor:
    """The ODE policy's chunk ``[N, CHUNK, 2]`` for the observations `obs` (one draw of the noise)."""
    inputs = pi0_inputs(model.config, obs["rgb"], obs["proprio"], obs["instruction"], instruction_pad_id=0)
    return model.sample_actions(inputs.state, inputs.input_ids, inputs.pixel_values,
                                attention_mask=inputs.attention_mask,
                                pixel_attention_mask=inputs.pixel_attention_mask)


def pointing(model, n: int = 256, seed: int = 1, verb: int = TOKENS["reach"]) -> float:
    """How often the model points at the named target rather than another, over `n` fresh first
    observations. ``reach``: the first action's direction is closest (in angle) to the named target's;
    ``LOCATE``: the chunk's mean position is nearest the named target. About 1/3 for a blind model."""
    env = Reach(n)
    obs = env.reset(seed=seed)
    obs["instruction"][:, 0] = verb
    chunk = ode_chunk(model.eval(), obs)
    if verb == LOCATE:
        chosen = (chunk.mean(1)[:, None] - env.targets).norm(dim=-1).argmin(-1)
    else:
        towards = env.targets - env.pos[:, None]                                   # [n, 3, 2]
        cosine = torch.nn.functional.cosine_similarity(towards, chunk[:, None, 0], dim=-1)
        chosen = cosine.argmax(-1)
    model.train()
    return float((chosen == env.goal).float().mean())


def success_rate(model, episodes: int = EVAL_EPISODES, seed: int = EVAL_SEED) -> float:
    """The ODE policy's success over `episodes` held-out episodes, chunks executed as the configs do."""
    policy = FlowVLAPolicy(model, FlowConfig(num_steps=NUM_STEPS), action_dim=2, with_value=False).eval()
    policy.actions_per_call = ACTIONS_PER_CALL
    successes = evaluate(policy, Reach(episodes), episodes, seed=seed).successes
    model.train()
    return sum(successes) / max(len(successes), 1)


def ground(model, args, gen: torch.Generator, t0: float) -> tuple[int, float]:
    """Stage 1: ``locate <colour>`` -> the named target's position (as a constant chunk), on fresh scenes
    each step, until the model points at the named target in ``--ground-until`` of fresh scenes (checked
    every 100 steps) or ``--ground-steps`` run out. Returns the steps taken and that pointing accuracy."""
    opt = torch.optim.Adam(model.parameters(), lr=args.ground_lr)
    env = Reach(256)
    points = 0.0
    for step in range(1, args.ground_steps + 1):
        obs = env.reset(seed=int(torch.randint(0, 2**31 - 1, (1,), generator=gen)))
        obs["instruction"][:, 0] = LOCATE
        loss = flow_loss(model, obs, env.goal_position()[:, None].expand(-1, CHUNK, -1))
        opt.zero_grad()
        loss.backward()
        opt.step()
        if step % 100 == 0 or step == args.ground_steps:
            points = pointing(model, verb=LOCATE)
            print(f"[pretrain] grounding step {step}: loss {loss.item():.3f}, points at the named target "
                  f"{points:.3f} (chance 0.33) ({time.time() - t0:.0f} s)", flush=True)
            if points >= args.ground_until:
                break
    return step, points


def clone(model, args, gen: torch.Generator, t0: float) -> dict:
    """Stage 2: behaviour cloning, evaluated every ``--eval-every`` steps, until the success rate is in
    [``--target``, ``--ceiling``] with the instruction read (or ``--max-steps`` run out).

    Success rises steeply once it starts (about 0.1 per 10 steps at the default rate), so an interval
    that jumps over the band is taken back (weights and optimiser restored) and retried at half the
    length. Returns the last figures."""
    opt = torch.optim.Adam(model.parameters(), lr=args.lr)
    env = Reach(128)
    every, step, rate, points = args.eval_every, 0, success_rate(model, args.episodes), pointing(model)
    print(f"[pretrain] behaviour cloning, step 0: success {rate:.3f}, points {points:.3f}", flush=True)
    while (rate < args.target or points < args.min_pointing) and step < args.max_steps:
        saved = copy.deepcopy((model.state_dict(), opt.state_dict()))
        for _ in range(every):
            if step % args.data_every == 0:                                # fresh expert data
                obs, plans = demonstrations(env, 20, args.noise, gen)
            idx = torch.randint(0, plans.shape[0], (args.batch,), generator=gen)
            loss = flow_loss(model, obs[idx], plans[idx])
            opt.zero_grad()
            loss.backward()
            opt.step()
            step += 1
        new_rate, new_points = success_rate(model, args.episodes), pointing(model)
        print(f"[pretrain] behaviour cloning, step {step}: loss {loss.item():.3f}, success {new_rate:.3f}, points "
              f"{new_points:.3f} ({time.time() - t0:.0f} s)", flush=True)
        if new_rate > args.ceiling and every > 1:       # over the band: take the interval back, go slower
            model.load_state_dict(saved[0])
            opt.load_state_dict(saved[1])
            step -= every
            every = max(1, every // 2)
            print(f"[pretrain] above --ceiling {args.ceiling}: back to step {step}, evaluating every {every} "
                  f"steps", flush=True)
            continue
        rate, points = new_rate, new_points
    return {"success_rate": rate, "pointing": points, "bc_steps": step}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=Path("outputs/pretrained/pi0_reach"))
    p.add_argument("--ground-steps", type=int, default=3000, help="stage 1 (grounding) gradient steps at most")
    p.add_argument("--ground-until", type=float, default=0.95,
                   help="stage 1 stops once the model points at the named target this often")
    p.add_argument("--ground-lr", type=float, default=1e-3)
    p.add_argument("--target", type=float, default=0.45,
                   help="stage 2 stops at this success rate of the ODE policy (200 held-out episodes)")
    p.add_argument("--ceiling", type=float, default=0.55,
                   help="an evaluation above this rate takes its interval back and retries it at half the length")
    p.add_argument("--min-pointing", type=float, default=0.6,
                   help="and only once the first action heads for the named target this often (chance: 1/3)")
    p.add_argument("--max-steps", type=int, default=3000, help="stage 2 gradient steps at most")
    p.add_argument("--eval-every", type=int, default=10, help="stage 2 gradient steps between evaluations")
    p.add_argument("--data-every", type=int, default=25, help="stage 2 gradient steps on each batch of expert data")
    p.add_argument("--batch", type=int, default=256, help="chunks per gradient step")
    p.add_argument("--episodes", type=int, default=EVAL_EPISODES, help="held-out episodes per evaluation")
    p.add_argument("--noise", type=float, default=0.5, help="std of the demonstrations' action noise")
    p.add_argument("--lr", type=float, default=1e-4, help="stage 2 learning rate")
    p.add_argument("--threads", type=int, default=1,
                   help="torch CPU threads (1: on a shared CPU, more threads than free cores is much slower)")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    gen = torch.Generator().manual_seed(args.seed)
    model = make_model(args.seed).train()
    print(f"[pretrain] π0: {sum(q.numel() for q in model.parameters()):,} parameters; chunks of {CHUNK}, "
          f"K = {NUM_STEPS}, {ACTIONS_PER_CALL} actions executed per call", flush=True)
    t0 = time.time()
    ground_steps, located = ground(model, args, gen, t0)
    figures = clone(model, args, gen, t0)
    # A second set of held-out episodes: the first one chose when to stop, which biases it a little.
    figures["success_rate_other_episodes"] = success_rate(model, args.episodes, seed=OTHER_SEED)
    save_pi0(model.eval(), args.out)
    figures.update(ground_steps=ground_steps, ground_pointing=located, eval_episodes=args.episodes,
                   eval_seed=EVAL_SEED, other_seed=OTHER_SEED, actions_per_call=ACTIONS_PER_CALL,
                   num_steps=NUM_STEPS, seed=args.seed, parameters=sum(q.numel() for q in model.parameters()),
                   wall_s=round(time.time() - t0, 1), threads=args.threads)
    (args.out / "pretrain.json").write_text(json.dumps(figures, indent=2) + "\n")
    print(f"[pretrain] saved {args.out}: ODE success {figures['success_rate']:.3f} over {args.episodes} held-out "
          f"episodes ({figures['success_rate_other_episodes']:.3f} over {args.episodes} others), first action "
          f"towards the named target {figures['pointing']:.3f}; {ground_steps} grounding and {figures['bc_steps']} "
          f"BC steps, {figures['wall_s']:.0f} s", flush=True)
    if not (args.target <= figures["success_rate"] <= args.ceiling and figures["pointing"] >= args.min_pointing):
        print(f"[pretrain] warning: not in the band [--target {args.target}, --ceiling {args.ceiling}] with "
              f"--min-pointing {args.min_pointing}: raise --ground-steps or --max-steps, or lower --lr", flush=True)

if __name__ == "__main__":
    main()
