"""An action-token policy from a plain Hugging Face checkpoint directory, and back.

A directory written by transformers' ``save_pretrained`` (``config.json`` plus ``model.safetensors``
or shards and their index) is enough: :func:`load_token_policy` builds the backbone named by
``config.json``'s ``architectures`` (``PaliGemmaForConditionalGeneration``, or any transformers
class with an LM head) and wraps it in :class:`~shared.policies.action_tokens.ActionTokenPolicy`
with the action settings of the config (``vla_config.model_config``: ``action_dim``, ``low``,
``high``, ``n_bins``, ``reserve_tail`` or ``token_offset``, ``decoding``, ``binning``, ...).

Tandem's own files are optional; :func:`save_token_policy` writes them, and they are read when present:

* ``tandem_adapter.json``: the adapter's keywords. ``model_config`` overrides it key by key.
* ``tandem_adapter.safetensors``: the adapter's own tensors (the value head).

Loading is strict. Every backbone tensor must be in the files and every tensor in the files must
belong to the model, with the same shape; otherwise :class:`~shared.policies.vla.VLALoadError`
names the tensors and the file. The one declared exception is the value head (``value_head.weight``,
``value_head.bias``): where no file holds it, it starts fresh at zero (weight and bias, so V = 0 for
every state until the critic learns) and a warning says so, in the process that trains it (the
learner: :func:`policy_copy` quiets the copies that take its weights).
"""

from __future__ import annotations

import contextlib
import contextvars
import inspect
import json
import logging
from pathlib import Path
from typing import Any

import torch
from torch import nn

log = logging.getLogger("tandem.vla")

ADAPTER_WEIGHTS, ADAPTER_CONFIG = "tandem_adapter.safetensors", "tandem_adapter.json"
# The adapter's tensors that may start fresh when no file holds them (the allow-list; logged).
FRESH_TENSORS = ("value_head.weight", "value_head.bias")
# Keys of model_config that are not the adapter's: the backbone's class and its from_pretrained keywords.
BACKBONE_KEYS = ("backbone_class", "backbone_kwargs")


def _error(message: str) -> Exception:
    from shared.policies.vla import VLALoadError
    return VLALoadError(message)


def adapter_keys(cls: type) -> list[str]:
    """The keywords ``cls`` (an ActionTokenPolicy) takes besides the model: what model_config may set."""
    from shared.policies.action_tokens import ActionTokenPolicy
    params = inspect.signature(ActionTokenPolicy.__init__).parameters
    return [n for n in params if n not in ("self", "model")]


def weight_files(path: Path) -> str:
    """The weights files of a checkpoint directory, for error messages."""
    index = path / "model.safetensors.index.json"
    if index.is_file():
        try:
            shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            shards = []
        return f"{index.name} ({len(shards)} shard{'s' * (len(shards) != 1)}: {', '.join(shards[:4])}" \
               f"{', ...' if len(shards) > 4 else ''})"
    names = [n for n in ("model.safetensors", "pytorch_model.bin") if (path / n).is_file()]
    return names[0] if names else "no weights file"


def _read_adapter_config(path: Path, cls: type) -> dict[str, Any]:
    file = path / ADAPTER_CONFIG
    if not file.is_file():
        return {}
    try:
        saved = json.loads(file.read_text())
    except (OSError, ValueError) as e:
        raise _error(f"{file}: not readable JSON: {e}") from None
    if not isinstance(saved, dict):
        raise _error(f"{file}: expected a JSON object of adapter keywords, got {type(saved).__name__}")
    unknown = sorted(set(saved) - set(adapter_keys(cls)))
    if unknown:
        raise _error(f"{file}: unknown adapter keyword(s) {unknown}; allowed: {adapter_keys(cls)}")
    return saved


def _backbone_class(path: Path, given: str | None) -> str:
    if given:
        return given if "." in given else f"transformers.{given}"
    try:
        archs = json.loads((path / "config.json").read_text()).get("architectures") or []
    except (OSError, ValueError, AttributeError) as e:
        raise _error(f"{path / 'config.json'}: not readable: {e}") from None
    if not archs or not isinstance(archs[0], str):
        raise _error(f"{path / 'config.json'} names no 'architectures': set vla_config.model_config.backbone_class "
                     f"(e.g. 'PaliGemmaForConditionalGeneration')")
    return f"transformers.{archs[0]}"


def load_token_policy(cls: type, path: str | Path, model_config: dict[str, Any]) -> nn.Module:
    """``cls`` (ActionTokenPolicy or a subclass) from the checkpoint directory `path`.

    Args:
        cls: the adapter class.
        path: a directory written by ``save_pretrained`` (transformers', or Tandem's).
        model_config: adapter keywords (see ``ActionTokenPolicy``), plus ``backbone_class`` (default:
            ``config.json``'s first ``architectures`` entry) and ``backbone_kwargs`` (for the
            backbone's ``from_pretrained``, e.g. ``{"attn_implementation": "eager"}``).
    Raises:
        VLALoadError: not a checkpoint directory, unknown keywords, no ``action_dim`` anywhere, a
            backbone that does not match its files (missing, unexpected or wrongly shaped tensors), or
            adapter tensors that do not match the adapter. Each names the file and the tensors.
    """
    from shared.policies.vla import VLALoadError, load_pretrained

    path = Path(path)
    if not path.is_dir() or not (path / "config.json").is_file():
        present = sorted(p.name for p in path.iterdir())[:10] if path.is_dir() else None
        raise _error(f"{path}: {cls.__name__} loads a checkpoint directory written by save_pretrained (config.json "
                     f"and model.safetensors); " + (f"this one holds {present}" if present is not None
                                                     else "no such directory"))
    ignored = getattr(cls, "IGNORED_ON_LOAD", ())
    allowed = adapter_keys(cls) + list(BACKBONE_KEYS)
    unknown = sorted(set(model_config) - set(allowed) - set(ignored))
    if unknown:
        raise _error(f"vla_config.model_config: unknown key(s) {unknown} for {cls.__name__}; allowed: {allowed}")
    backbone_kwargs = model_config.get("backbone_kwargs") or {}
    if not isinstance(backbone_kwargs, dict):
        raise _error(f"vla_config.model_config.backbone_kwargs: expected an object, got {backbone_kwargs!r}")
    saved = _read_adapter_config(path, cls)
    given = {k: v for k, v in model_config.items() if k not in BACKBONE_KEYS and k not in ignored}
    kwargs = {**saved, **given}
    if "action_dim" not in kwargs:
        raise _error(f"vla_config.model_config.action_dim: required for {path} (it has no {ADAPTER_CONFIG} that "
                     f"says it); set it, with low, high and n_bins, to the action space the model was trained on")
    arch = _backbone_class(path, model_config.get("backbone_class"))
    try:
        backbone = load_pretrained(str(path), arch, backbone_kwargs)
    except VLALoadError as e:
        raise _error(f"{e} (the backbone class is config.json's 'architectures'; weights: {weight_files(path)})") \
            from None
    if not saved and "instruction_pad_id" not in kwargs:
        # a foreign checkpoint: its own padding id is what its tokenizer pads instructions with
        text_cfg = backbone.config.get_text_config() if hasattr(backbone.config, "get_text_config") else backbone.config
        pad = getattr(text_cfg, "pad_token_id", None)
        kwargs["instruction_pad_id"] = pad if pad is not None else 0
    policy = cls.__new__(cls)
    try:
        from shared.policies.action_tokens import ActionTokenPolicy
        ActionTokenPolicy.__init__(policy, backbone, **kwargs)
    except (ValueError, TypeError) as e:
        raise _error(f"vla_config.model_config for {path} ({arch}): {e}") from None
    _load_adapter_tensors(policy, path)
    policy.source = {"path": str(path), "backbone": arch, "adapter_config": bool(saved)}
    return policy



def mismatch_text(saved: dict, own: dict, expected) -> str:
    """How a file's tensors (`saved`) differ from a model's (`own`), of which the file must hold the
    names in `expected`: unexpected, missing and misshapen tensors by name; "" when they fit."""
    unexpected, missing = sorted(saved.keys() - own.keys()), sorted(set(expected) - saved.keys())
    wrong = [f"{k}: file {tuple(saved[k].shape)}, model {tuple(own[k].shape)}"
             for k in sorted(own.keys() & saved.keys()) if saved[k].shape != own[k].shape]
    parts = ([f"unexpected {unexpected}"] if unexpected else []) + ([f"missing {missing}"] if missing else []) \
        + ([f"shape mismatch: {'; '.join(wrong)}"] if wrong else [])
    return ", ".join(parts)

def _load_adapter_tensors(policy: nn.Module, path: Path) -> None:
    """The adapter's own tensors (outside ``model.``) from ``tandem_adapter.safetensors``, strictly."""
    from safetensors.torch import load_file

    file = path / ADAPTER_WEIGHTS
    own = {k: v for k, v in policy.state_dict().items() if not k.startswith("model.")}
    try:
        saved = load_file(str(file)) if file.is_file() else {}
    except Exception as e:
        raise _error(f"{file}: cannot read: {type(e).__name__}: {e}") from None
    unused = sorted(k for k in saved.keys() - own.keys() if k in FRESH_TENSORS and policy.value_head is None)
    if unused:   # declared by the config (value_head false, e.g. GRPO from a PPO-ready checkpoint)
        log.info("%s: value_head is false, so the value head saved in %s is not used", path, file.name)
        saved = {k: v for k, v in saved.items() if k not in unused}
    fresh = [k for k in sorted(own.keys() - saved.keys()) if k in FRESH_TENSORS]
    if differences := mismatch_text(saved, own, own.keys() - FRESH_TENSORS):
        raise _error(f"{file} does not match {type(policy).__name__}'s own tensors: {differences}")
    with torch.no_grad():
        for k, v in saved.items():
            own[k].copy_(v)
        for k in fresh:
            own[k].zero_()
    if fresh:
        # said where it matters: the learner, which trains the value head (the copies that act and
        # evaluate take its weights, value head included, before they act)
        log.log(logging.WARNING if _ANNOUNCE_FRESH.get() else logging.DEBUG,
                "%s: no value head in %s: it starts fresh at zero (%s), so V = 0 until the critic learns",
                path, ADAPTER_WEIGHTS if file.is_file() else "the checkpoint", ", ".join(fresh))


_ANNOUNCE_FRESH: contextvars.ContextVar[bool] = contextvars.ContextVar("tandem_announce_fresh", default=True)


@contextlib.contextmanager
def policy_copy():
    """Load a policy copy that takes the learner's weights before it acts (an actor's, the evaluator's):
    a value head that starts fresh is then logged at DEBUG, not warned about; the learner says it."""
    token = _ANNOUNCE_FRESH.set(False)
    try:
        yield
    finally:
        _ANNOUNCE_FRESH.reset(token)


def save_token_policy(policy: nn.Module, path: str | Path) -> None:
    """The backbone's ``save_pretrained(path)`` (config.json, model.safetensors) plus the adapter's own
    tensors in ``tandem_adapter.safetensors`` and its keywords in ``tandem_adapter.json``."""
    from safetensors.torch import save_file

    path = Path(path)
    policy.model.save_pretrained(str(path))
    own = {k: v.detach().contiguous() for k, v in policy.state_dict().items() if not k.startswith("model.")}
    if own:
        save_file(own, str(path / ADAPTER_WEIGHTS))
    kwargs = {k: list(v) if isinstance(v, tuple) else v for k, v in policy._adapter_kwargs.items()}
    (path / ADAPTER_CONFIG).write_text(json.dumps(kwargs, indent=2) + "\n")
