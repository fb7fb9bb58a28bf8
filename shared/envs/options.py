"""The options (``env.cfg``) of every built-in env, declared once: checked here, documented from here.

Each built-in env has a dataclass whose fields are its ``env.cfg`` keys, with their type (a ``Literal``
for the accepted values, ``Range`` bounds), their default and a one-line docstring under the field,
as in ``shared/config.py``. The same declarations

* check ``env.cfg`` before any env is built (:func:`check_env_config`, called by each process's entry
  point right after the config is loaded, and :func:`env_options` inside ``make_env`` / ``env_spec``):
  an unknown key, a wrong type, a value that is not accepted or an invalid combination is an
  :class:`EnvConfigError`, a :class:`~shared.config.ConfigError` that names ``env.cfg.<key>``, the
  file and the accepted values, printed as one message like every config error;
* and generate ``docs/reference/envs.md`` (``python -m shared.envs.reference``).

gymnasium ids have no declaration here: their ``env.cfg`` goes to ``gymnasium.make`` as keywords,
which refuses what the env does not take.
"""

from __future__ import annotations

import dataclasses
import json
import typing
from dataclasses import dataclass, field
from typing import Annotated, Any, Literal

from shared.config import ConfigError, Range, _build, type_words

REFERENCE = "docs/reference/envs.md"


class EnvConfigError(ConfigError):
    """``env.cfg`` does not fit its env: every problem, each naming ``env.cfg.<key>`` (and the file)."""


def problems_text(env_id: str, problems: list[str], source: str = "") -> str:
    """The message of a refused ``env.cfg``: the same layout as a config error, one problem a line."""
    where = f"{source}: " if source else ""
    lines = "\n".join(f"  {where}{p}" for p in problems)
    return (f"invalid env.cfg for {env_id} ({len(problems)} problem{'s' * (len(problems) > 1)}):\n{lines}\n"
            f"  (every option of every built-in env, with its accepted values: {REFERENCE})")


# ---------------------------------------------------------------------------------------------- Reach
REACH_INSTRUCTION_LEN = 4   # shared/envs/reach.py's INSTRUCTION_LEN: the length of Reach's own ids


@dataclass
class ReachOptions:
    """``tandem/Reach-v0`` (``shared/envs/reach.py``): reach the coloured target that the instruction
    names, from a camera image, the agent's position and the instruction. Torch-native: steps on the
    actor's device."""
    image_size: Annotated[int, Range(ge=2, le=1024)] = 16
    """Width and height of the ``rgb`` camera image, in pixels."""
    max_episode_steps: Annotated[int, Range(ge=1)] = 30
    """Steps after which an episode is truncated."""
    step_size: Annotated[float, Range(gt=0)] = 0.15
    """How far one step at full speed moves the agent (the arena is [-1, 1] square)."""
    success_radius: Annotated[float, Range(gt=0)] = 0.15
    """Distance to the named target that counts as reaching it (success; the episode terminates)."""
    reward: Literal["dense", "success"] = "dense"
    """dense: progress towards the named target, in step lengths, +5 on reaching it. success: 1 on the
    step that reaches it, else 0 (what GRPO's dynamic sampling reads as an outcome)."""
    group_goals: Literal["same", "rotate"] = "same"
    """GRPO groups (envs reset with one seed share the scene). same: they share the instruction too.
    rotate: member j of a group is told to reach target (g + j) mod 3, so that an outcome depends on
    following the instruction."""
    instructions: Literal["ids", "text"] = "ids"
    """ids: ids of Reach's own 8-id vocabulary (``<pad>`` 0, reach 1, red 2, green 3, blue 4), for a
    model pretrained on them or a checkpoint without a tokenizer. text: "reach red" in words,
    tokenized in the actors with the model's tokenizer (``tokenizer.json`` in
    ``policy.vla_config.model_path``, or ``policy.vla_config.tokenizer``), which the checkpoint must
    have."""
    instruction_length: Annotated[int, Range(ge=1, le=512)] = REACH_INSTRUCTION_LEN
    """Ids per instruction. With instructions "ids": 4 (Reach's own ids are 4 long; leave it out or
    set 4). With "text": any length the tokenized instructions fit in, padded with the tokenizer's
    padding id."""

    def problems(self) -> list[str]:
        if self.instructions == "ids" and self.instruction_length != REACH_INSTRUCTION_LEN:
            return [f"env.cfg.instruction_length: {self.instruction_length} with env.cfg.instructions \"ids\": "
                    f"Reach's own ids are {REACH_INSTRUCTION_LEN} long, so it must be {REACH_INSTRUCTION_LEN} or "
                    f"left out (other lengths are for instructions \"text\", which need the model's tokenizer)"]
        return []

    def texts(self) -> list[str]:
        """The instructions the env says in words (empty unless instructions is "text")."""
        from shared.envs.reach import TEXTS
        return list(TEXTS) if self.instructions == "text" else []


# ------------------------------------------------------------------------------------------ Pendulum
@dataclass
class PendulumOptions:
    """``tandem/Pendulum-v0`` (``shared/envs/torch_envs.py``): gymnasium's ``Pendulum-v1`` dynamics,
    batched in torch on the actor's device."""
    max_episode_steps: Annotated[int, Range(ge=1)] = 200
    """Steps after which an episode is truncated (Pendulum never terminates)."""


# ------------------------------------------------------------------------------------- MuJoCo Warp
@dataclass
class MJWarpHalfCheetahOptions:
    """``tandem/MJWarpHalfCheetah-v0`` (``shared/envs/mjwarp.py``): gymnasium's HalfCheetah-v5 simulated
    for all envs at once by MuJoCo Warp on the actor's device (needs the ``warp`` extra)."""
    frame_skip: Annotated[int, Range(ge=1)] = 5
    """Physics steps per env step."""
    forward_reward_weight: float = 1.0
    """Weight of the forward velocity in the reward."""
    ctrl_cost_weight: Annotated[float, Range(ge=0)] = 0.1
    """Weight of the control cost (the squared action) subtracted from the reward."""
    reset_noise_scale: Annotated[float, Range(ge=0)] = 0.1
    """Scale of the reset noise: U(-s, s) on the joint positions, s N(0, 1) on the velocities."""
    max_episode_steps: Annotated[int, Range(ge=1)] = 1000
    """Steps after which an episode is truncated (HalfCheetah never terminates)."""
    use_graph: bool = True
    """Record a step and a reset as Warp graphs (CUDA graphs on a GPU) and replay them: one launch per
    step instead of about a hundred."""


# ---------------------------------------------------------------------------------------- ManiSkill
@dataclass
class ManiSkillOptions:
    """``maniskill/<Task>`` (``shared/envs/maniskill.py``): any installed ManiSkill3 task
    (``PushCube-v1``, ``PickCube-v1``, ...); needs ``launch/setup_maniskill.sh``."""
    obs_mode: Literal["state", "rgb"] = "state"
    """state: a flat float vector. rgb: a TensorDict of ``rgb`` uint8 [H, W, 3] from ``camera`` and
    ``state`` float32 (the agent's joints and the task's extra state)."""
    control_mode: str | None = None
    """ManiSkill's controller (e.g. ``"pd_ee_delta_pos"``); null: the task's default."""
    reward_mode: str = "normalized_dense"
    """ManiSkill's reward mode (``"normalized_dense"``, ``"dense"``, ``"sparse"``)."""
    max_episode_steps: Annotated[int, Range(ge=1)] | None = None
    """Steps after which an episode is truncated; null: the task's registered limit."""
    sim_backend: Literal["physx_cpu", "physx_cuda"] | None = None
    """physx_cpu: one SAPIEN scene per env, stepped in turn. physx_cuda: ManiSkill's GPU-batched
    simulation, tensors stay on the device. null: physx_cuda on a CUDA device, else physx_cpu."""
    image_size: Annotated[int, Range(ge=8, le=4096)] | None = None
    """The camera's width and height (obs_mode "rgb"); null: the task's own."""
    camera: str | None = None
    """The camera that gives ``rgb``; null: the task's first."""
    instruction: str | list[Annotated[int, Range(ge=0)]] | None = None
    """For a vision-language-action model, an int64 ``instruction`` leaf: text (``"pick up the cube"``),
    tokenized in the actors with the model's tokenizer and padded to instruction_length, or a list of
    that tokenizer's ids; null: none."""
    instruction_length: Annotated[int, Range(ge=1, le=512)] | None = None
    """Ids per instruction: required with a text instruction, not accepted otherwise."""
    state_key: str = "state"
    """The name of the ``state`` leaf (``"proprio"`` for ``ActionTokenPolicy``); not ``rgb`` or
    ``instruction``."""
    sim_kwargs: dict = field(default_factory=dict)
    """Anything else ``gym.make`` accepts for the task."""
    terminate_on_success: bool = False
    """false: an episode runs to the time limit and its success is ManiSkill's ``success_once``. true:
    success ends the episode."""

    def problems(self) -> list[str]:
        out = []
        text = isinstance(self.instruction, str)
        if text and not self.instruction.strip():
            out.append("env.cfg.instruction: an empty text; give the instruction's words, a list of token ids, "
                       "or null")
        if isinstance(self.instruction, list) and not self.instruction:
            out.append("env.cfg.instruction: an empty list of token ids; give some, or text, or null")
        if text and self.instruction_length is None:
            out.append("env.cfg.instruction_length: required with a text env.cfg.instruction (the tokenized ids "
                       "are padded to it): an integer in [1, 512]")
        if not text and self.instruction_length is not None:
            out.append(f"env.cfg.instruction_length: got {self.instruction_length}, but instruction_length applies to "
                       f"a text instruction only (env.cfg.instruction is {json.dumps(self.instruction)}): leave it out")
        if self.state_key in ("rgb", "instruction") or not self.state_key:
            out.append(f"env.cfg.state_key: {self.state_key!r} must be a name other than 'rgb' and 'instruction'")
        return out

    def texts(self) -> list[str]:
        return [self.instruction] if isinstance(self.instruction, str) else []


# ------------------------------------------------------------------------------------------- lookup
TORCH_NATIVE = {"tandem/Reach-v0": ReachOptions, "tandem/Pendulum-v0": PendulumOptions,
                "tandem/MJWarpHalfCheetah-v0": MJWarpHalfCheetahOptions}
MANISKILL = "maniskill/"


def options_class(env_id: str) -> type | None:
    """The options dataclass of `env_id`; None for a gymnasium id (its env.cfg goes to gymnasium.make)
    and for an unknown ``tandem/`` id (``make_env`` names the known ones)."""
    if env_id.startswith(MANISKILL):
        return ManiSkillOptions
    return TORCH_NATIVE.get(env_id)


def env_problems(env_id: str, cfg: dict | None) -> tuple[Any, list[str]]:
    """``(options, problems)``: `cfg` checked against `env_id`'s declaration; options is None for a
    gymnasium id or when `cfg` is not an object."""
    cls = options_class(env_id)
    if cls is None:
        return None, []
    cfg = {} if cfg is None else cfg
    if not isinstance(cfg, dict):
        return None, [f"env.cfg: expected an object, got {cfg!r}"]
    problems: list[str] = []
    options = _build(cls, cfg, "env.cfg", problems)
    if not problems:
        problems += options.problems() if hasattr(options, "problems") else []
    return options, [_with_accepted(cls, str(p)) for p in problems]


def accepted_text(tp: Any) -> str:
    """An option's accepted values in words: ``"ids" | "text"``, ``integer in [1, 512]``, ..."""
    return type_words(tp, json.dumps, bounds=True)


def default_of(f: dataclasses.Field) -> Any:
    return f.default_factory() if f.default is dataclasses.MISSING else f.default


def _with_accepted(cls: type, problem: str) -> str:
    """A wrong type's problem with what the key accepts and its default (a bad choice or bound says it)."""
    hints = typing.get_type_hints(cls, include_extras=True)
    for f in dataclasses.fields(cls):
        if problem.startswith(f"env.cfg.{f.name}: expected ") and "expected one of" not in problem:
            return f"{problem} (accepted: {accepted_text(hints[f.name])}; default {json.dumps(default_of(f))})"
    return problem


def env_options(env_id: str, cfg: dict | None, source: str = "") -> Any:
    """`env_id`'s options with `cfg` applied (None for a gymnasium id).

    Raises:
        EnvConfigError: every problem, each naming ``env.cfg.<key>`` and what it accepts (and `source`).
    """
    options, problems = env_problems(env_id, cfg)
    if problems:
        raise EnvConfigError(problems_text(env_id, problems, source))
    return options


def check_env_config(cfg) -> None:
    """Check a loaded :class:`~shared.config.Config`'s ``env`` block before anything is built, so that a
    process refuses it at start-up in one message naming the file: a known ``tandem/`` id, the env's
    options, and for text instructions that the model's tokenizer exists and that the instructions
    fit ``instruction_length``.

    Raises:
        EnvConfigError: see :func:`env_options`.
        InstructionError: (a ConfigError) no tokenizer for text instructions, one that cannot be read,
            or an instruction longer than ``instruction_length``.
    """
    from shared.instructions import InstructionTokenizer, instruction_tokenizer, tokenizer_path, wants_text
    env_id = cfg.env.id
    if env_id.startswith("tandem/") and env_id not in TORCH_NATIVE:
        raise EnvConfigError(f"invalid config (1 problem):\n  {cfg.source}: env.id: unknown torch-native env "
                             f"{env_id!r} (known: {', '.join(TORCH_NATIVE)})")
    options = env_options(env_id, cfg.env.cfg, cfg.source)
    texts = options.texts() if hasattr(options, "texts") else []
    if not (wants_text(cfg) and texts):
        return
    instruction_tokenizer(cfg)   # raises where there is none, saying where it looked and what to set
    tok = InstructionTokenizer(tokenizer_path(cfg))
    tok.table(texts, options.instruction_length, f"{cfg.source}: env.cfg.instruction_length")


def load_process_config(path: str, overrides: list[str], log_format: str):
    """What a process's entry point does first: answer SIGUSR1 with its threads' stacks, log with its
    prefix (`log_format`), load the config and check its ``env.cfg``. Returns the config, or None after
    printing the one-message error (a :class:`~shared.config.ConfigError`) to stderr."""
    import logging
    import sys

    from shared.config import load_config
    from shared.console import dump_stacks_on_signal
    dump_stacks_on_signal()
    logging.basicConfig(level=logging.INFO, format=log_format)
    try:
        cfg = load_config(path, overrides)
        check_env_config(cfg)   # env.cfg's keys and values, the instruction tokenizer: one message, no traceback
    except ConfigError as e:
        print(e, file=sys.stderr)
        return None
    return cfg
