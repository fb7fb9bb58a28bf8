"""Instructions as text, tokenized with the checkpoint's own tokenizer, once per instruction, in the actor.

An env that can say its instructions in words (``tandem/Reach-v0`` with ``env.cfg.instructions:
"text"``, a ManiSkill task with ``env.cfg.instruction: "pick up the cube"``) takes an
:class:`InstructionTokenizer` when it is built. It tokenizes each distinct instruction once (cached),
pads the ids to the env's fixed ``instruction_length`` with the tokenizer's padding id, and puts the
ids in the observation. Token ids, not text, travel on the wire, so the learner never needs the
tokenizer; only the processes that step envs (actors, the evaluator) load it.

The tokenizer is ``tokenizer.json`` (the format of Hugging Face's ``tokenizers``, which every fast
transformers tokenizer saves), found at the policy block's ``tokenizer`` or else in its ``model_path``:
``policy.vla_config`` for ``policy.name: "vla"``, ``policy.flow_config`` for ``"flow_vla"`` (π0).
Special tokens (bos, eos) are not added: the policy builds its own prompt around the instruction.

:func:`check_instruction_vocabulary` refuses an env and a model that do not share a vocabulary: an
env that gives ids of its own (Reach's 8-id vocabulary) to a model that has a tokenizer, or a
tokenizer with more ids than the model's embedding table.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from shared.config import ConfigError

if TYPE_CHECKING:
    from shared.config import Config
    from shared.envs.base import EnvSpec

log = logging.getLogger("tandem.instructions")

TOKENIZER_FILE = "tokenizer.json"
# spec.extra["instructions"]: "text" (ids of the model's tokenizer) or the name of the env's own vocabulary
TEXT = "text"


class InstructionError(ConfigError):
    """A tokenizer that cannot be used, an instruction too long for the env, or mismatched vocabularies.

    A :class:`~shared.config.ConfigError`: each process's entry point prints it as one message (the
    file, the key, what to set), not as a traceback."""


class InstructionTokenizer:
    """Text -> token ids with a Hugging Face ``tokenizer.json``; each text is encoded once.

    Args:
        path: a ``tokenizer.json`` file, or a directory holding one.
    Raises:
        InstructionError: no such file, or one ``tokenizers`` cannot read.
    """

    def __init__(self, path: str | Path):
        path = Path(path)
        file = path / TOKENIZER_FILE if path.is_dir() else path
        if not file.is_file():
            raise InstructionError(f"{path}: no {TOKENIZER_FILE} (save the checkpoint's tokenizer with "
                                   f"tokenizer.save_pretrained(dir), or set vla_config.tokenizer, or "
                                   f"flow_config.tokenizer for π0)")
        try:
            from tokenizers import Tokenizer
            self._tok = Tokenizer.from_file(str(file))
        except ImportError:
            raise InstructionError("text instructions need the tokenizers package: pip install -e '.[vla]'") from None
        except Exception as e:
            raise InstructionError(f"{file}: not a tokenizer the tokenizers package reads: {e}") from None
        self.source = str(file)
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        self.pad_id = self._find_pad_id(file)
        self._cache: dict[str, list[int]] = {}

    def _find_pad_id(self, file: Path) -> int | None:
        padding = self._tok.padding
        if padding and padding.get("pad_id") is not None:
            return int(padding["pad_id"])
        config = file.parent / "tokenizer_config.json"
        if config.is_file():
            try:
                pad = json.loads(config.read_text()).get("pad_token")
            except (OSError, ValueError, AttributeError):
                pad = None
            pad = pad.get("content") if isinstance(pad, dict) else pad
            if isinstance(pad, str) and self._tok.token_to_id(pad) is not None:
                return int(self._tok.token_to_id(pad))
        pad = self._tok.token_to_id("<pad>")
        return None if pad is None else int(pad)

    def ids(self, text: str) -> list[int]:
        """The ids of `text`, without special tokens (cached: each text is encoded once)."""
        if text not in self._cache:
            self._cache[text] = list(self._tok.encode(text, add_special_tokens=False).ids)
        return self._cache[text]

    def table(self, texts: list[str], length: int, where: str) -> torch.Tensor:
        """``[len(texts), length]`` int64: each text's ids, padded with the padding id.

        Raises:
            InstructionError: a text with more than `length` tokens (named, with `where`), or padding
                needed and the tokenizer has no padding id.
        """
        rows = []
        for text in texts:
            ids = self.ids(text)
            if len(ids) > length:
                raise InstructionError(f"{where}: {text!r} is {len(ids)} tokens with {self.source}, more than the "
                                       f"instruction length {length}: raise it")
            if len(ids) < length and self.pad_id is None:
                raise InstructionError(f"{self.source} has no padding token to pad {text!r} to {length} ids")
            rows.append(ids + [self.pad_id] * (length - len(ids)))
        return torch.tensor(rows, dtype=torch.int64).reshape(len(texts), length)


class ShapeOnlyTokenizer:
    """Stands in for the tokenizer where only the observation's shape matters (the learner's env spec):
    every text is all padding."""

    source, vocab_size, pad_id = "(shape only)", 0, 0

    def table(self, texts: list[str], length: int, where: str) -> torch.Tensor:
        return torch.zeros(len(texts), length, dtype=torch.int64)


def model_block(cfg: Config) -> tuple[str, object | None]:
    """The policy block that names the model and its tokenizer: ``("vla_config", cfg.policy.vla_config)``
    for ``policy.name: "vla"``, ``("flow_config", cfg.policy.flow_config)`` for ``"flow_vla"``, else
    ``("vla_config", None)``."""
    if cfg.policy.name == "flow_vla":
        return "flow_config", cfg.policy.flow_config
    return "vla_config", cfg.policy.vla_config if cfg.policy.name == "vla" else None


def tokenizer_path(cfg: Config) -> Path | None:
    """Where the instruction tokenizer is: the policy block's ``tokenizer`` (``vla_config`` or
    ``flow_config``, :func:`model_block`), else its ``model_path`` when that holds a ``tokenizer.json``;
    None without a VLA policy or a tokenizer."""
    block = model_block(cfg)[1]
    if block is None:
        return None
    if block.tokenizer:
        return Path(block.tokenizer)
    if block.model_path and (Path(block.model_path) / TOKENIZER_FILE).is_file():
        return Path(block.model_path)
    return None


def text_instructions(env_kwargs: dict | None) -> bool:
    """Whether these ``env.cfg`` values ask the env for text instructions (Reach's ``instructions:
    "text"``, a ManiSkill ``instruction`` given as text)."""
    env = env_kwargs or {}
    return env.get("instructions") == TEXT or isinstance(env.get("instruction"), str)


def wants_text(cfg: Config) -> bool:
    """Whether the env is configured to give its instructions as text."""
    return text_instructions(cfg.env.cfg)


def instruction_tokenizer(cfg: Config) -> InstructionTokenizer | None:
    """The tokenizer an env process needs: None when the env gives no text.

    Raises:
        InstructionError: text instructions and no tokenizer anywhere (says where it was looked for).
    """
    if not wants_text(cfg):
        return None
    path = tokenizer_path(cfg)
    if path is None:
        name, block = model_block(cfg)
        model_path = block.model_path if block is not None else ""
        raise InstructionError(f"{cfg.source}: env.cfg asks for text instructions, which are tokenized with the "
                               f"model's tokenizer, but there is none: no {TOKENIZER_FILE} in "
                               f"{name}.model_path {model_path!r}, and {name}.tokenizer is not set. Save "
                               f"the tokenizer beside the weights (tokenizer.save_pretrained(dir)), set "
                               f"policy.{name}.tokenizer to a {TOKENIZER_FILE}, or {_ids_instead(cfg)}")
    return InstructionTokenizer(path)


def _ids_instead(cfg: Config) -> str:
    """How this env gives instructions without a tokenizer (the last way out of a missing one)."""
    if cfg.env.id == "tandem/Reach-v0":
        return ("give Reach's own instruction ids instead: env.cfg.instructions \"ids\" with "
                "env.cfg.instruction_length 4 (--set env.cfg.instructions=ids --set env.cfg.instruction_length=4)")
    if cfg.env.id.startswith("maniskill/"):
        return "give env.cfg.instruction as a list of the model's token ids, without env.cfg.instruction_length"
    return "configure the env to give no text instructions"


def check_instruction_vocabulary(cfg: Config, spec: EnvSpec, policy) -> None:
    """Refuse an env and a model whose instruction vocabularies differ (see the module docstring).

    Raises:
        InstructionError: naming the env's vocabulary and the model's tokenizer or vocabulary.
    """
    if spec is None or "instruction" not in spec.obs_keys:
        return
    said = spec.extra.get("instructions")
    path = tokenizer_path(cfg)
    if wants_text(cfg) and path is None:
        instruction_tokenizer(cfg)   # raises, naming where it looked: before any actor starts
    if said not in (None, TEXT) and path is not None:
        raise InstructionError(
            f"{cfg.source}: env {cfg.env.id} gives instruction ids of its own vocabulary ({said}), but the model "
            f"reads ids of its tokenizer ({path}): the ids would mean other words. Set env.cfg.instructions to "
            f"'text' so that the actors tokenize the instructions with the model's tokenizer")
    if said == TEXT and path is not None:
        _check_tokenizer_fits(cfg, InstructionTokenizer(path), policy)


def _check_tokenizer_fits(cfg: Config, tok: InstructionTokenizer, policy) -> None:
    """The tokenizer's ids fit the model's embedding table, and its padding id is the one the policy masks
    (the action-token VLA's ``model.instruction_pad_id``, π0's ``policy.instruction_pad_id``)."""
    name, block = model_block(cfg)
    model = getattr(policy, "model", None)
    embed = getattr(getattr(model, "model", None), "get_input_embeddings", None)
    if embed is None:
        return
    rows = embed().weight.shape[0]
    what = block.model_class if name == "vla_config" else "π0"
    if tok.vocab_size > rows:
        raise InstructionError(
            f"{cfg.source}: the tokenizer {tok.source} has {tok.vocab_size} ids, the model ({what} at "
            f"{block.model_path!r}) embeds {rows}: they are not the same vocabulary (set {name}.tokenizer to the "
            f"model's own)")
    pad = getattr(policy, "instruction_pad_id", None) if name == "flow_config" \
        else getattr(model, "instruction_pad_id", None)
    key = "flow_config.instruction_pad_id" if name == "flow_config" else "vla_config.model_config.instruction_pad_id"
    if tok.pad_id is not None and pad is not None and tok.pad_id != pad:
        raise InstructionError(
            f"{cfg.source}: the tokenizer {tok.source} pads with id {tok.pad_id}, the model masks id {pad}: set "
            f"{key} to {tok.pad_id}")
