"""``tandem/Reach-v0``: an image-based reaching task whose goal is named by an instruction.

A batched, torch-native simulator (runs on the actor's device, CPU or CUDA). Three coloured
targets lie at random places in a 2-D arena, drawn into a small RGB image; the instruction
("reach red", as token ids) names one of them; the agent's own position is only in the
proprioceptive vector (it is not drawn). Solving it needs all three inputs.

Observation (a TensorDict): ``rgb`` uint8 ``[S, S, 3]``, ``proprio`` float32 ``[4]`` (position and
last action), ``instruction`` int64 ``[4]``. Action: a 2-D velocity in ``[-1, 1]``. Reward: the
progress towards the named target (in step lengths), +5 on reaching it (within ``success_radius``),
which ends the episode (terminated); ``max_episode_steps`` truncates. ``reward="success"`` gives
the sparse 0/1 reward instead: 1 on the step that reaches the target, else 0.

GRPO groups (``reset(seed=[...])``, envs sharing a seed) start from the same scene. With
``group_goals="same"`` (default) they also share the instruction, so the group's baseline compares
rollouts of one task. With ``group_goals="rotate"`` the j-th env of a group is told to reach target
``(g + j) % 3``: the same targets and start, a different instruction. A 0/1 outcome then says
something where a same-instruction group says nothing: a policy that ignores the instruction and
always reaches the same target scores 1 in one member and 0 in the others, so reaching it under the
wrong instruction gets a negative advantage. The group mean stays a valid baseline (it does not
depend on the member's own actions beyond its own return, as in any GRPO group), only no longer a
per-instruction one. Resets with an int seed (the evaluator) are unaffected.

Instructions (``instructions=``): ``"ids"`` (default) gives ids of Reach's own 8-id vocabulary
(``TOKENS``), 4 per instruction, for models pretrained on them or a checkpoint without a tokenizer
(``instruction_length`` is then 4 or left out). ``"text"`` says "reach red" (``TEXTS``) in words, and
the ids are those of the model's own tokenizer (``shared/instructions.py``), padded to
``instruction_length`` with its padding id: what a pretrained VLM understands.

Every option, its default and its accepted values are declared once, in
:class:`shared.envs.options.ReachOptions`, which checks them here and generates their documentation
(``docs/reference/envs.md``).
"""

from __future__ import annotations

import torch

from shared.envs.base import ActionSpec, EnvSpec, StepResult

COLORS = torch.tensor([[255, 40, 40], [40, 255, 40], [60, 60, 255]], dtype=torch.uint8)   # red, green, blue
TOKENS = {"<pad>": 0, "reach": 1, "red": 2, "green": 3, "blue": 4}
VOCAB_SIZE = 8
INSTRUCTION_LEN = 4
TEXTS = ("reach red", "reach green", "reach blue")   # target k's instruction, in words (instructions="text")
OWN_VOCABULARY = f"tandem/Reach-v0's own {VOCAB_SIZE} ids: {', '.join(k for k in TOKENS)}"


class Reach:
    num_targets = 3

    def __init__(self, num_envs: int, device: str | torch.device = "cpu", image_size: int = 16,
                 max_episode_steps: int = 30, step_size: float = 0.15, success_radius: float = 0.15,
                 reward: str = "dense", group_goals: str = "same", instructions: str = "ids",
                 instruction_length: int = INSTRUCTION_LEN, tokenizer=None):
        o = self.options(image_size=image_size, max_episode_steps=max_episode_steps, step_size=step_size,
                         success_radius=success_radius, reward=reward, group_goals=group_goals,
                         instructions=instructions, instruction_length=instruction_length)
        self.reward_kind, self.group_goals = o.reward, o.group_goals
        self.num_envs, self.device = num_envs, torch.device(device)
        self.image_size, self.max_episode_steps = o.image_size, o.max_episode_steps
        self.step_size, self.success_radius = o.step_size, o.success_radius
        instructions, instruction_length = o.instructions, o.instruction_length
        self.spec = self._spec(o)
        if instructions == "text":
            if tokenizer is None:
                from shared.instructions import InstructionError
                raise InstructionError("tandem/Reach-v0: env.cfg.instructions \"text\" needs the model's tokenizer "
                                       "(make_env(..., tokenizer=); actors load it from vla_config.model_path or "
                                       "vla_config.tokenizer)")
            table = tokenizer.table(list(TEXTS), instruction_length, "env.cfg.instruction_length")   # [3, L]
        else:
            table = torch.zeros(self.num_targets, INSTRUCTION_LEN, dtype=torch.int64)
            table[:, 0] = TOKENS["reach"]
            table[:, 1] = torch.arange(self.num_targets) + TOKENS["red"]
        self._instructions = table.to(self.device)                   # target k's instruction ids
        n, d = num_envs, self.device
        # Scenes are drawn on the CPU and copied to the device, so that a seed is the same episode on
        # every device (a CUDA generator's stream differs from the CPU's); a few small tensors per reset.
        self._gen = torch.Generator()
        self.targets = torch.zeros(n, self.num_targets, 2, device=d)
        self.goal = torch.zeros(n, dtype=torch.int64, device=d)
        self.pos = torch.zeros(n, 2, device=d)
        self.last_action = torch.zeros(n, 2, device=d)
        self.t = torch.zeros(n, dtype=torch.int64, device=d)
        self.ep_return = torch.zeros(n, dtype=torch.float64, device=d)
        self._colors = COLORS.to(d)

    @staticmethod
    def spec_for(image_size: int = 16, max_episode_steps: int = 30, instructions: str = "ids",
                 instruction_length: int = INSTRUCTION_LEN, **_ignored) -> EnvSpec:
        """The spec for these ``env.cfg`` values, without building the env (nor a tokenizer).

        Raises:
            EnvConfigError: a value :class:`~shared.envs.options.ReachOptions` does not accept.
        """
        return Reach._spec(Reach.options(image_size=image_size, max_episode_steps=max_episode_steps,
                                         instructions=instructions, instruction_length=instruction_length, **_ignored))

    @staticmethod
    def options(**cfg):
        """`cfg` (``env.cfg``) checked against :class:`~shared.envs.options.ReachOptions`, the one
        declaration of Reach's options, their defaults and accepted values.

        Raises:
            EnvConfigError: naming each refused ``env.cfg.<key>`` and what it accepts.
        """
        from shared.envs.options import env_options
        return env_options("tandem/Reach-v0", cfg)

    @staticmethod
    def _spec(o) -> EnvSpec:
        image_size, max_episode_steps = o.image_size, o.max_episode_steps
        instructions, instruction_length = o.instructions, o.instruction_length
        return EnvSpec(
            obs_shape=(), obs_dtype=torch.float32,
            action=ActionSpec(kind="box", shape=(2,), low=(-1.0, -1.0), high=(1.0, 1.0)),
            max_episode_steps=max_episode_steps,
            obs_keys={"rgb": ((image_size, image_size, 3), torch.uint8), "proprio": ((4,), torch.float32),
                      "instruction": ((instruction_length,), torch.int64)},
            extra={"instructions": "text" if instructions == "text" else OWN_VOCABULARY})

    # ------------------------------------------------------------------ state
    def _sample(self, idx: torch.Tensor, gen: torch.Generator) -> None:
        k = idx.numel()
        d = self.device
        # targets on a coarse grid so they never overlap in the image (drawn on the CPU: see __init__)
        cells = torch.stack([torch.randperm(9, generator=gen)[:self.num_targets] for _ in range(k)])
        xy = torch.stack([cells % 3, cells // 3], -1).float() * (2 / 3) - (2 / 3)
        self.targets[idx] = (xy + (torch.rand(k, self.num_targets, 2, generator=gen) - 0.5) * 0.3).to(d)
        self.goal[idx] = torch.randint(0, self.num_targets, (k,), generator=gen).to(d)
        self.pos[idx] = ((torch.rand(k, 2, generator=gen) * 2 - 1) * 0.9).to(d)
        self.last_action[idx] = 0.0
        self.t[idx] = 0
        self.ep_return[idx] = 0.0

    def _obs(self):
        from tensordict import TensorDict
        n, s = self.num_envs, self.image_size
        img = torch.zeros(n, s, s, 3, dtype=torch.uint8, device=self.device)
        pix = ((self.targets + 1) / 2 * (s - 2)).long().clamp(0, s - 2)          # [n, K, 2] top-left of a 2x2 blob
        rows = torch.arange(n, device=self.device)[:, None]
        for dy in (0, 1):
            for dx in (0, 1):
                for k in range(self.num_targets):
                    img[rows[:, 0], pix[:, k, 1] + dy, pix[:, k, 0] + dx] = self._colors[k]
        instr = self._instructions[self.goal]                                     # [n, L]
        proprio = torch.cat([self.pos, self.last_action], -1)
        return TensorDict({"rgb": img, "proprio": proprio, "instruction": instr}, batch_size=[n], device=self.device)

    def goal_position(self) -> torch.Tensor:
        return self.targets[torch.arange(self.num_envs, device=self.device), self.goal]

    def expert_action(self) -> torch.Tensor:
        """The scripted expert: head straight for the named target."""
        return ((self.goal_position() - self.pos) / self.step_size).clamp(-1, 1)

    # ------------------------------------------------------------------ protocol
    def reset(self, seed: int | list[int] | None = None):
        all_idx = torch.arange(self.num_envs, device=self.device)
        if isinstance(seed, list):
            for s in sorted(set(seed)):  # envs given the same seed start from the same state
                idx = torch.tensor([i for i, x in enumerate(seed) if x == s], device=self.device)
                g = torch.Generator().manual_seed(s)
                self._sample(idx[:1], g)
                for name in ("targets", "goal", "pos"):
                    t = getattr(self, name)
                    t[idx] = t[idx[:1]]
                if self.group_goals == "rotate":   # same scene, the instruction rotated through the targets
                    rank = torch.arange(idx.numel(), device=self.device)
                    self.goal[idx] = (self.goal[idx[:1]] + rank) % self.num_targets
                self.last_action[idx], self.t[idx], self.ep_return[idx] = 0.0, 0, 0.0
            return self._obs()
        if seed is not None:
            self._gen.manual_seed(seed)
        self._sample(all_idx, self._gen)
        return self._obs()

    partial_steps = True   # step(action, active): the envs not active are left as they are (action chunks)

    def step(self, action: torch.Tensor, active: torch.Tensor | None = None) -> StepResult:
        a = action.to(self.device, torch.float32).reshape(self.num_envs, 2).clamp(-1, 1)
        live = None if active is None else active.to(self.device, torch.bool)
        if live is not None:
            a = torch.where(live[:, None], a, torch.zeros_like(a))
        self.pos_before = self.pos
        self.pos = (self.pos + self.step_size * a).clamp(-1, 1)
        self.last_action = a if live is None else torch.where(live[:, None], a, self.last_action)
        self.t += 1 if live is None else live.long()
        prev = (self.goal_position() - self.pos_before).norm(dim=-1)
        dist = (self.goal_position() - self.pos).norm(dim=-1)
        success = dist < self.success_radius
        # progress towards the named target (in step lengths, within [-1, 1]) and a success bonus
        reward = (prev - dist) / self.step_size + 5.0 * success.float()
        if self.reward_kind == "success":   # sparse 0/1
            reward = success.float()
        if live is not None:   # an inactive env did not move: no reward, and its episode does not end here
            reward, success = reward * live, success & live
        self.ep_return += reward.double()
        terminated = success
        truncated = (self.t >= self.max_episode_steps) & ~terminated
        done = terminated | truncated
        final_obs = self._obs()
        returns, lengths, successes, metrics = [], [], [], []
        if bool(done.any()):
            idx = done.nonzero().squeeze(-1)
            returns, lengths = self.ep_return[idx].tolist(), self.t[idx].tolist()
            successes = success[idx].tolist()
            metrics = [{"final_distance": d} for d in dist[idx].tolist()]
            self._sample(idx, self._gen)
            obs = self._obs()
        else:
            obs = final_obs
        return StepResult(obs=obs, reward=reward, terminated=terminated, truncated=truncated, final_obs=final_obs,
                          episode_returns=returns, episode_lengths=lengths, episode_successes=successes,
                          episode_metrics=metrics)

    def render_frames(self, indices: list[int], size: int = 128) -> list:
        """A view for evaluation videos, ``[size, size, 3]`` uint8 per env at `indices`: the targets
        in their colours (the named one ringed in white) and the agent as a white dot with a grey
        success circle. The policy's own camera image (``rgb``) shows only the targets."""
        import numpy as np
        frames = []
        ys, xs = np.mgrid[0:size, 0:size]
        px = (xs + 0.5) / size * 2 - 1                 # pixel centres in the task's [-1, 1] square
        py = (ys + 0.5) / size * 2 - 1
        colors = self._colors.cpu().numpy()
        for i in indices:
            img = np.full((size, size, 3), 24, dtype=np.uint8)
            targets = self.targets[i].cpu().numpy()
            goal = int(self.goal[i])
            pos = self.pos[i].cpu().numpy()
            for k, (tx, ty) in enumerate(targets):
                d = np.hypot(px - tx, py - ty)
                if k == goal:
                    img[(d > 0.09) & (d < 0.12)] = 255
                img[d < 0.07] = colors[k]
            d = np.hypot(px - pos[0], py - pos[1])
            img[np.abs(d - self.success_radius) < 0.012] = 110
            img[d < 0.045] = 255
            frames.append(img)
        return frames

    def close(self) -> None:
        pass


def expert_batch(env: Reach, steps: int, noise: float, gen: torch.Generator) -> tuple:
    """Roll the scripted expert for `steps` steps of `env` (with action noise, so that states off its
    path are visited too) and return ``(observations, expert actions)``, concatenated over steps:
    behaviour-cloning data for the pretraining scripts."""
    obs_list, act_list = [], []
    obs = env.reset(seed=int(torch.randint(0, 2**31 - 1, (1,), generator=gen)))
    for _ in range(steps):
        target = env.expert_action()
        obs_list.append(obs.clone())
        act_list.append(target.clone())
        act = (target + noise * torch.randn(target.shape, generator=gen)).clamp(-1, 1)
        obs = env.step(act).obs
    return torch.cat(obs_list), torch.cat(act_list)
