"""Pretrained vision-language-action (VLA) models as Tandem policies.

:class:`VLAPolicy` wraps a model that implements either of two interfaces; it finds out which.

(a) The distribution interface: the model returns an action distribution and Tandem samples.

    action_dist(obs) -> torch.distributions.Distribution
        for a (possibly multi-modal, nested) observation ``[*B]``; ``log_prob(action)`` and
        ``entropy()`` must return ``[*B]`` (sum over action dims inside).
    value(obs) -> Tensor [*B]            optional: a value head (PPO needs it)
    deterministic_action(dist) -> Tensor optional: default ``dist.mode``

(b) The seed framework's policy interface: TensorDict in, TensorDict out (Tandem's own policies).

    forward(td) -> td       reads td["observation"] (batch ``[B]``), adds "action", "sample_log_prob"
                            and, with a critic, "value"; if it takes ``deterministic=True`` the
                            evaluator gets its deterministic action, else the sampled one (warned once)
    get_value(td) -> Tensor [B]
    evaluate_actions(td) -> (log_prob [B], entropy [B], value [B] or None)    td has "action" too

    A model without a critic says so with ``critic = None`` (as Tandem's ``actor_only`` policy does).

A model with all three methods of (b) is used through (b), one with ``action_dist`` through (a).
The observation reaches the model exactly as the env produced it (``rgb`` stays uint8, ``instruction``
stays int64): the model converts what it needs. Both, as run by ``tests/test_vla_loading.py``:

    >>> import torch
    >>> from tensordict import TensorDict
    >>> from torch import nn
    >>> from torch.distributions import Categorical
    >>> class DistModel(nn.Module):                       # (a)
    ...     def __init__(self):
    ...         super().__init__()
    ...         self.pi, self.v = nn.Linear(4, 2), nn.Linear(4, 1)
    ...     def action_dist(self, obs):
    ...         return Categorical(logits=self.pi(obs))
    ...     def value(self, obs):
    ...         return self.v(obs).squeeze(-1)
    >>> class SeedModel(DistModel):                       # (b)
    ...     def forward(self, td, deterministic=False):
    ...         dist = self.action_dist(td["observation"])
    ...         action = dist.probs.argmax(-1) if deterministic else dist.sample()
    ...         td["action"], td["sample_log_prob"] = action, dist.log_prob(action)
    ...         td["value"] = self.get_value(td)
    ...         return td
    ...     def get_value(self, td):
    ...         return self.value(td["observation"])
    ...     def evaluate_actions(self, td):
    ...         dist = self.action_dist(td["observation"])
    ...         return dist.log_prob(td["action"]), dist.entropy(), self.get_value(td)
    >>> for model in (DistModel(), SeedModel()):
    ...     policy = VLAPolicy(model, VLAConfig(model_class=type(model).__name__))
    ...     td = policy(TensorDict({"observation": torch.randn(3, 4)}, batch_size=[3]))
    ...     log_prob, entropy, value = policy.evaluate_actions(td)
    ...     print(policy.interface, tuple(td["action"].shape), torch.allclose(log_prob, td["sample_log_prob"]))
    action_dist (3,) True
    seed (3,) True

:func:`load_vla_model` builds the model from ``policy.vla_config``. ``model_path`` is local, never
fetched: a ``.safetensors`` file, a ``torch.save`` state dict (``weights_only=True``), or a Hugging Face
directory (``model.safetensors``, or shards named by ``model.safetensors.index.json``). A class with
``from_pretrained`` (a transformers model, or an adapter around one) is loaded by
:func:`load_pretrained` instead. ``vla_config.lora`` adds peft LoRA adapters (:func:`apply_lora`).
Every failure raises :class:`VLALoadError` naming the path, the class or the parameter.
"""

from __future__ import annotations

import contextlib
import importlib
import inspect
import json
import logging
import warnings
from pathlib import Path
from typing import Any

import torch
from tensordict import TensorDictBase
from torch import nn

from shared import keys
from shared.chunks import executed_sum
from shared.config import LoRAConfig, VLAConfig

log = logging.getLogger("tandem.vla")

DIST, SEED = "action_dist", "seed"            # the two model interfaces, as VLAPolicy.interface names them
SEED_METHODS = ("forward", "get_value", "evaluate_actions")
# Weight files of a Hugging Face directory, in the order transformers looks for them: (single, index).
HF_WEIGHTS = (("model.safetensors", "model.safetensors.index.json"),
              ("pytorch_model.bin", "pytorch_model.bin.index.json"))


class VLALoadError(RuntimeError):
    """A VLA model cannot be built or loaded; the message names what and where."""


def _import_class(path: str) -> type:
    module_name, _, cls_name = path.rpartition(".")
    if not module_name:
        raise VLALoadError(f"vla_config.model_class {path!r}: expected 'package.module.Class'")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise VLALoadError(f"vla_config.model_class {path!r}: cannot import module {module_name!r}: {e}") from None
    cls = getattr(module, cls_name, None)
    if not isinstance(cls, type) or not issubclass(cls, nn.Module):
        raise VLALoadError(f"vla_config.model_class {path!r}: {module_name} has no nn.Module class {cls_name!r}")
    return cls


# ----------------------------------------------------------------------------- checkpoints

def _read_file(path: Path, where: str) -> dict[str, torch.Tensor]:
    """One weights file as a state dict (memory-mapped where the format allows)."""
    try:
        if path.name.endswith(".safetensors"):
            from safetensors.torch import load_file
            return load_file(str(path))
        try:
            state = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
        except RuntimeError as e:
            if "mmap" not in str(e):       # a legacy (non-zip) torch.save file cannot be mapped
                raise
            state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:
        raise VLALoadError(f"{where}: cannot read weights: {type(e).__name__}: {e}") from None
    if isinstance(state, dict) and isinstance(state.get("state_dict"), dict):
        state = state["state_dict"]
    if not isinstance(state, dict) or not all(isinstance(k, str) and isinstance(v, torch.Tensor)
                                              for k, v in state.items()):
        raise VLALoadError(f"{where}: expected a state dict of tensors")
    return state


def _read_sharded(index_path: Path, where: str) -> dict[str, torch.Tensor]:
    """The shards an index names, each holding exactly the tensors the index assigns to it."""
    try:
        weight_map = json.loads(index_path.read_text())["weight_map"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise VLALoadError(f"{where}: {index_path.name} is not a checkpoint index with a weight_map: "
                           f"{type(e).__name__}: {e}") from None
    if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
        raise VLALoadError(f"{where}: {index_path.name}: weight_map must map parameter names to shard file names")
    assigned: dict[str, set[str]] = {}
    for name, shard in weight_map.items():
        assigned.setdefault(shard, set()).add(name)
    for shard in sorted(assigned):
        # a shard name is a file next to the index, never a path out of the checkpoint directory
        if Path(shard).name != shard or shard in (".", ".."):
            raise VLALoadError(f"{where}: {index_path.name} names shard {shard!r}, which is not a file name")
        if not (index_path.parent / shard).is_file():
            raise VLALoadError(f"{where}: {index_path.name} names shard {shard!r}, which does not exist "
                               f"(it should hold {len(assigned[shard])} tensors, e.g. {sorted(assigned[shard])[0]!r})")
    state: dict[str, torch.Tensor] = {}
    for shard, names in sorted(assigned.items()):
        part = _read_file(index_path.parent / shard, f"{where}: shard {shard!r}")
        extra, absent = sorted(part.keys() - names), sorted(names - part.keys())
        if extra:
            raise VLALoadError(f"{where}: shard {shard!r} holds tensors {index_path.name} does not assign to it: "
                               f"{extra}")
        if absent:
            raise VLALoadError(f"{where}: {index_path.name} assigns {absent} to shard {shard!r}, which does not "
                               f"hold them")
        state.update(part)
    return state


def read_checkpoint(model_path: str | Path, model_class: str = "") -> dict[str, torch.Tensor]:
    """Read a local checkpoint into one state dict.

    Args:
        model_path: a ``.safetensors`` file, a ``torch.save`` state dict (read with
            ``weights_only=True``; a ``{"state_dict": ...}`` wrapper is unwrapped), or a Hugging Face
            directory with ``model.safetensors`` (or ``pytorch_model.bin``), or shards and their
            ``*.index.json``.
        model_class: only for the error messages.

    Raises:
        VLALoadError: no such file, unreadable weights, no weights in the directory, an index naming a
            missing shard, or a shard holding other tensors than the index assigns to it.
    """
    path = Path(model_path)
    where = f"vla_config.model_path {str(path)!r}" + (f" (model_class {model_class})" if model_class else "")
    if not path.exists():
        raise VLALoadError(f"vla_config.model_path {str(path)!r}: no such file or directory"
                           + (f" (model_class {model_class})" if model_class else ""))
    if path.is_file():
        return _read_file(path, where)
    for single, index in HF_WEIGHTS:
        if (path / single).is_file():
            return _read_file(path / single, where)
        if (path / index).is_file():
            return _read_sharded(path / index, where)
    present = sorted(p.name for p in path.iterdir())[:10]
    raise VLALoadError(f"{where}: a directory without model.safetensors, model.safetensors.index.json, "
                       f"pytorch_model.bin or pytorch_model.bin.index.json (it holds {present})")


def _load_state_(model: nn.Module, state: dict[str, torch.Tensor], where: str, model_class: str) -> None:
    """Copy `state` into `model` after checking every name and shape."""
    own = model.state_dict()
    missing, unexpected = sorted(own.keys() - state.keys()), sorted(state.keys() - own.keys())
    wrong = [f"{k}: file {tuple(state[k].shape)}, model {tuple(own[k].shape)}"
             for k in sorted(own.keys() & state.keys()) if state[k].shape != own[k].shape]
    if missing or unexpected or wrong:
        parts = ([f"missing {missing}"] if missing else []) + ([f"unexpected {unexpected}"] if unexpected else []) \
            + ([f"shape mismatch: {'; '.join(wrong)}"] if wrong else [])
        raise VLALoadError(f"{where} does not match {model_class}: " + ", ".join(parts))
    with torch.no_grad():
        for k, v in state.items():
            own[k].copy_(v)


# ----------------------------------------------------------------------------- building

@contextlib.contextmanager
def _no_transformers_progress_bars():
    """transformers draws a "Loading weights" bar on stderr for every load: in a run it lands in each
    process's log as carriage-return noise. Off for the load, then as it was."""
    try:
        from transformers.utils import logging as hf_logging
    except ImportError:
        yield
        return
    was = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was:
            hf_logging.enable_progress_bar()


def load_pretrained(model_path: str, model_class: str, model_config: dict[str, Any],
                    key: str = "vla_config.model_path") -> nn.Module:
    """``model_class.from_pretrained(model_path, local_files_only=True, **model_config)``, never from a hub.

    For a transformers class (any class with ``from_pretrained``: an adapter around one may reuse this
    for its base). Missing, unexpected or mismatched parameters are errors, as for the user's classes.

    Raises:
        VLALoadError: unknown class, no ``from_pretrained``, a path that does not exist here, or any
            failure of ``from_pretrained`` (named with the path and the class).

    `key` is the config key that names `model_path`, as the errors say it (π0: ``policy.flow_config.model_path``).
    """
    cls = _import_class(model_class)
    if not callable(getattr(cls, "from_pretrained", None)):
        raise VLALoadError(f"vla_config.model_class {model_class!r}: has no from_pretrained")
    if not model_path:
        raise VLALoadError(f"{key}: {model_class}.from_pretrained needs a local checkpoint "
                           f"directory (got an empty path)")
    if not Path(model_path).exists():   # a missing path would send from_pretrained to the hub
        raise VLALoadError(f"{key} {model_path!r}: no such file or directory (model_class "
                           f"{model_class}; checkpoints are never fetched from a hub)")
    if model_config.get("local_files_only", True) is not True:
        raise VLALoadError(f"vla_config.model_config.local_files_only: must stay true for {model_class} "
                           f"(checkpoints are never fetched from a hub)")
    kwargs = {**model_config, "local_files_only": True}
    try:
        from transformers import PreTrainedModel
        with_info = issubclass(cls, PreTrainedModel)
    except ImportError:
        with_info = False
    try:
        with _no_transformers_progress_bars():
            # with the loading info, transformers reports shape mismatches by name instead of raising without one
            extra = {"output_loading_info": True, "ignore_mismatched_sizes": True} if with_info else {}
            out = cls.from_pretrained(model_path, **{**extra, **kwargs})
    except VLALoadError as e:    # an adapter's own loader (shared/policies/token_checkpoints.py): already precise
        if key in str(e):
            raise
        raise VLALoadError(f"{key} {model_path!r} (model_class {model_class}): {e}") from None
    except Exception as e:
        raise VLALoadError(f"{key} {model_path!r}: {model_class}.from_pretrained failed: "
                           f"{type(e).__name__}: {e}") from None
    model, info = out if with_info and isinstance(out, tuple) and len(out) == 2 else (out, {})
    problems = [f"{what} {_in_files(model_path, info[field], field)}" for field, what in (("missing_keys", "missing"),
                ("unexpected_keys", "unexpected"), ("mismatched_keys", "shape mismatch")) if info.get(field)]
    if problems:  # transformers only warns: a half-initialised pretrained policy is a wrong checkpoint
        raise VLALoadError(f"{key} {model_path!r} does not match {model_class}: " + ", ".join(problems))
    if not isinstance(model, nn.Module):
        raise VLALoadError(f"vla_config.model_class {model_class!r}: from_pretrained returned "
                           f"{type(model).__name__}, not an nn.Module")
    return model


def _in_files(model_path: str, names, key: str) -> str:
    """`names` from transformers' loading info, each with the weights file that holds it where the
    checkpoint's index says (a missing tensor is in none)."""
    names = sorted(names, key=str)
    if key == "missing_keys":
        return f"{names} (in no weights file)"
    index = Path(model_path) / HF_WEIGHTS[0][1]
    try:
        weight_map = json.loads(index.read_text())["weight_map"] if index.is_file() else {}
    except (OSError, ValueError, KeyError, TypeError):
        weight_map = {}
    single = next((s for s, _ in HF_WEIGHTS if (Path(model_path) / s).is_file()), None)

    def saved_as(name: str) -> str | None:
        """The index's name for `name`: itself, or (transformers renames prefixes on load) the one
        sharing the longest dotted suffix with it, where that one is unique."""
        if name in weight_map or not weight_map:
            return name if name in weight_map else None
        parts = name.split(".")

        def common(k: str) -> int:
            n, other = 0, k.split(".")
            while n < min(len(parts), len(other)) and parts[-1 - n] == other[-1 - n]:
                n += 1
            return n
        scores = {k: common(k) for k in weight_map}
        best = max(scores.values())
        found = [k for k, s in scores.items() if s == best]
        return found[0] if best and len(found) == 1 else None

    def where(name) -> str:
        text = repr(name)
        if isinstance(name, tuple):   # mismatched: (name, file shape, model shape)
            text = f"{name[0]!r}: file {tuple(name[1])}, model {tuple(name[2])}" if len(name) == 3 else repr(name)
        key_ = name[0] if isinstance(name, tuple) else name
        saved = saved_as(key_)
        file = weight_map.get(saved) if saved else single
        return (f"{text}" + (f" (saved as {saved!r})" if saved and saved != key_ else "")
                + (f" in {file}" if file else ""))
    return "[" + ", ".join(where(n) for n in names) + "]"


def model_interface(model: nn.Module, model_class: str = "") -> str:
    """Which interface `model` implements: ``"seed"`` (b) or ``"action_dist"`` (a).

    Raises:
        VLALoadError: neither; the message says which methods of each interface are missing.
    """
    def has(name: str) -> bool:
        fn = getattr(model, name, None)
        # nn.Module's own forward only raises NotImplementedError
        return callable(fn) and not (name == "forward" and type(model).forward is nn.Module.forward)

    seed = [m for m in SEED_METHODS if has(m)]
    if len(seed) == len(SEED_METHODS):
        return SEED
    if has("action_dist"):
        return DIST
    absent = [m for m in SEED_METHODS if m not in seed]
    head = getattr(model, "get_output_embeddings", None)
    if callable(head) and isinstance(head(), nn.Linear):   # a language model with an LM head: action tokens
        raise VLALoadError(
            f"vla_config.model_class {model_class or type(model).__name__!r}: a {type(model).__name__} needs an "
            f"adapter that turns it into a policy: set model_class to "
            f"'shared.policies.action_tokens.ActionTokenPolicy', keep model_path, and give the action space in "
            f"model_config (action_dim, low, high, n_bins, binning; see docs/guides/finetune_your_own_vla.md)")
    seed_text = (f"has {', '.join(seed)} but no {', '.join(absent)}" if seed
                 else f"has none of {', '.join(SEED_METHODS)}")
    raise VLALoadError(
        f"vla_config.model_class {model_class or type(model).__name__!r}: {type(model).__name__} implements neither "
        f"interface: {seed_text} (seed interface: forward(td), get_value(td), evaluate_actions(td)); no "
        f"action_dist(obs) (distribution interface). A transformers model needs an adapter that implements one "
        f"(see shared/policies/vla.py)")


def load_vla_model(model_path: str, model_class: str, model_config: dict[str, Any]) -> nn.Module:
    """Build ``model_class`` from ``model_config``, load ``model_path`` and check its interface.

    With a ``model_path``, a class with ``from_pretrained`` goes through :func:`load_pretrained`; any
    other class, or any class without a ``model_path``, is built with ``model_class(**model_config)``
    (a class that also has ``from_pretrained``, such as an adapter that builds its backbone from a
    config, then starts from its own initialisation) and given the weights of :func:`read_checkpoint`
    (none for an empty ``model_path``).

    Raises:
        VLALoadError: missing file, unknown module or class, constructor arguments that do not fit,
            missing or unexpected parameters, a parameter whose shape differs (with both shapes), an index
            naming a missing shard, or a model implementing neither interface (naming the missing method).
    """
    cls = _import_class(model_class)
    if not model_path and getattr(cls, "needs_checkpoint", False):
        raise VLALoadError(f"vla_config.model_path: {model_class} is built from a checkpoint directory (a "
                           f"transformers save_pretrained output); none is given")
    if model_path and callable(getattr(cls, "from_pretrained", None)):
        model = load_pretrained(model_path, model_class, model_config)
    else:
        try:
            model = cls(**model_config)
        except TypeError as e:
            raise VLALoadError(f"vla_config.model_config does not fit {model_class}: {e}") from None
        except Exception as e:
            raise VLALoadError(f"vla_config.model_config: {model_class}(**model_config) failed: "
                               f"{type(e).__name__}: {e}") from None
        model_interface(model, model_class)  # before reading a large checkpoint for a model that cannot act
        if model_path:
            where = f"vla_config.model_path {model_path!r}"
            _load_state_(model, read_checkpoint(model_path, model_class), where, model_class)
    model_interface(model, model_class)
    return model


def apply_lora(model: nn.Module, lora: LoRAConfig, model_class: str = "") -> nn.Module:
    """Add peft LoRA adapters to `model` in place and freeze what they adapt.

    The adapters go into ``model.get_submodule(model.lora_base)`` when the model names its pretrained
    part that way (an adapter whose value head must stay trainable), else into the whole model. That
    base is frozen except the adapters and ``lora.modules_to_save``; the model's parameters outside it
    keep their ``requires_grad``.

    Returns:
        The ``peft.PeftModel`` around the base (its ``get_nb_trainable_parameters()`` counts the base only).

    Raises:
        VLALoadError: peft is not installed, ``dropout`` is 1, a target or a module to save matches no
            module of the base (a few that exist are named), or peft refuses a target.
    """
    try:
        import peft
    except ImportError:
        raise VLALoadError("vla_config.lora needs peft: pip install -e '.[vla]'") from None
    name = model_class or type(model).__name__
    if not lora.dropout < 1:
        raise VLALoadError(f"vla_config.lora.dropout: must be below 1 (got {lora.dropout}): it would drop every "
                           f"adapter input")
    base_name = getattr(model, "lora_base", None)
    try:
        base = model.get_submodule(base_name) if base_name else model
    except AttributeError:
        raise VLALoadError(f"{name}.lora_base {base_name!r}: no such submodule") from None
    names = [n for n, _ in base.named_modules() if n]
    adaptable = [n for n, m in base.named_modules() if isinstance(m, (nn.Linear, nn.Embedding, nn.Conv1d, nn.Conv2d))
                 or type(m).__name__ == "Conv1D"]   # transformers' GPT-2 projection layer
    short = list(dict.fromkeys(n.rsplit(".", 1)[-1] if not n.rsplit(".", 1)[-1].isdigit() else n for n in adaptable))
    exist = f"{', '.join(short[:10])}{f' (and {len(short) - 10} more)' if len(short) > 10 else ''}"
    where = f"{name}" + (f".{base_name}" if base_name else "")
    unsaved = [m for m in lora.modules_to_save if not any(n == m or n.endswith("." + m) for n in names)]
    if unsaved:
        raise VLALoadError(f"vla_config.lora.modules_to_save {unsaved}: no module of {where} has this name")
    config = peft.LoraConfig(r=lora.r, lora_alpha=lora.alpha, lora_dropout=lora.dropout,
                             target_modules=list(lora.target_modules),
                             modules_to_save=list(lora.modules_to_save) or None)
    try:
        with warnings.catch_warnings():
            # peft reads transformers' deprecated `is_gradient_checkpointing` itself: a warning in every
            # VLA process's log that names neither our code nor anything a user can change
            warnings.filterwarnings("ignore", message=r"`is_gradient_checkpointing` is deprecated",
                                    category=FutureWarning)
            return peft.get_peft_model(base, config)
    except (ValueError, TypeError) as e:
        raise VLALoadError(f"vla_config.lora.target_modules {lora.target_modules}: {e} (layers of {where} that "
                           f"can take adapters: {exist or 'none'})") from None


# ----------------------------------------------------------------------------- the policy

class VLAPolicy(nn.Module):
    """A VLA model behind Tandem's policy interface (TensorDict in, TensorDict out).

    Applies ``vla_config``'s ``dtype``, ``freeze`` and ``lora`` (in that order) to the model, which it
    keeps as ``self.model`` (with LoRA, adapters injected in place; ``peft_model`` is peft's view of it).
    """

    def __init__(self, model: nn.Module, cfg: VLAConfig):
        super().__init__()
        self.interface = model_interface(model, cfg.model_class)
        self.model = model
        self.autocast = cfg.autocast
        want = torch.bfloat16 if cfg.dtype == "bfloat16" else torch.float32
        have = sorted({str(p.dtype).removeprefix("torch.") for p in model.parameters() if p.is_floating_point()})
        if have and have != [cfg.dtype]:   # vla_config.dtype decides, whatever the checkpoint was saved in
            log.info("vla_config.dtype %s: the weights of %s (%s) are cast to %s", cfg.dtype,
                     cfg.model_class or type(model).__name__, ", ".join(have), cfg.dtype)
            self.model.to(want)
        frozen = 0
        for name, p in self.model.named_parameters():
            if any(name.startswith(prefix) for prefix in cfg.freeze):
                p.requires_grad_(False)
                frozen += 1
        if cfg.freeze and not frozen:
            raise VLALoadError(f"vla_config.freeze {cfg.freeze}: no parameter name starts with these prefixes")
        # Not a submodule: its parameters are the model's, registered once under "model.".
        self.__dict__["_peft_model"] = apply_lora(model, cfg.lora, cfg.model_class) if cfg.lora else None
        if self.interface == SEED:
            with_critic = getattr(model, "critic", True) is not None
            params = inspect.signature(model.forward).parameters.values()
            self._forward_deterministic = any(p.name == "deterministic" or p.kind is p.VAR_KEYWORD for p in params)
            self._warned_deterministic = False
        else:
            with_critic = callable(getattr(model, "value", None))
        # PPO needs a value head; has_critic() reads this attribute.
        self.critic = self.model if with_critic else None
        # an action-chunk model (shared/chunks.py): H actions per call, log-probs per position
        self.chunk_size = int(getattr(model, "chunk_size", 1) or 1)

    @property
    def peft_model(self):
        """``peft.PeftModel`` around the LoRA base, or None without ``vla_config.lora``."""
        return self._peft_model

    def _ctx(self, device: torch.device):
        if self.autocast and device.type in ("cuda", "cpu"):
            return torch.autocast(device.type, dtype=torch.bfloat16)
        return contextlib.nullcontext()

    def _device(self) -> torch.device:
        return next(self.model.parameters()).device

    def forward(self, td: TensorDictBase, deterministic: bool = False) -> TensorDictBase:
        with self._ctx(self._device()):
            if self.interface == SEED:
                return self._seed_forward(td, deterministic)
            obs = td[keys.OBS]
            dist = self.model.action_dist(obs)
            if deterministic:
                pick = getattr(self.model, "deterministic_action", None)
                action = pick(dist) if pick is not None else dist.mode
            else:
                action = dist.sample()
            td.set(keys.ACTION, action)
            td.set(keys.LOG_PROB, dist.log_prob(action).float())
            if self.critic is not None:
                td.set(keys.VALUE, self.model.value(obs).float())
        return td

    def _seed_forward(self, td: TensorDictBase, deterministic: bool) -> TensorDictBase:
        if deterministic and not self._forward_deterministic:
            if not self._warned_deterministic:
                log.warning("%s.forward takes no 'deterministic' keyword: deterministic calls (evaluation) use "
                            "the sampled action", type(self.model).__name__)
                self._warned_deterministic = True
            deterministic = False
        out = self.model(td, deterministic=True) if deterministic else self.model(td)
        out = td if out is None else out
        needed = (keys.ACTION, keys.LOG_PROB) + ((keys.VALUE,) if self.critic is not None else ())
        absent = [k for k in needed if k not in out.keys()]
        if absent:
            raise RuntimeError(f"{type(self.model).__name__}.forward did not add {absent} to the TensorDict "
                               f"(seed interface: action, sample_log_prob and, with a critic, value)")
        want = (*td.batch_size, self.chunk_size) if self.chunk_size > 1 else tuple(td.batch_size)
        if tuple(out[keys.LOG_PROB].shape) != want:
            raise RuntimeError(f"{type(self.model).__name__}.forward: sample_log_prob has shape "
                               f"{tuple(out[keys.LOG_PROB].shape)}, expected {want} (the batch"
                               f"{', and one per chunk position' if self.chunk_size > 1 else ''})")
        td.set(keys.ACTION, out[keys.ACTION])
        td.set(keys.LOG_PROB, out[keys.LOG_PROB].float())
        if self.critic is not None:
            td.set(keys.VALUE, out[keys.VALUE].float())
        return td

    def get_value(self, td: TensorDictBase) -> torch.Tensor:
        if self.critic is None:
            raise RuntimeError("get_value: this VLA model has no value head")
        with self._ctx(self._device()):
            if self.interface == SEED:
                return self.model.get_value(td).float()
            return self.model.value(td[keys.OBS]).float()

    def evaluate_actions(self, td: TensorDictBase) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """Log-prob and entropy of ``td["action"]``, and the value (None without a critic): each ``[B]``."""
        with self._ctx(self._device()):
            if self.interface == SEED:
                logp, entropy, value = self.model.evaluate_actions(td)
                return logp.float(), entropy.float(), value.float() if value is not None else None
            obs = td[keys.OBS]
            dist = self.model.action_dist(obs)
            value = self.model.value(obs).float() if self.critic is not None else None
            logp, entropy = dist.log_prob(td[keys.ACTION]).float(), dist.entropy().float()
            if self.chunk_size > 1:   # the positions the envs executed (shared/chunks.py)
                logp, entropy = executed_sum(logp, td[keys.EXECUTED]), executed_sum(entropy, td[keys.EXECUTED])
            return logp, entropy, value

    def update_normalizer(self, obs, all_reduce=None) -> None:
        """A seed-interface model's own normaliser is updated; VLA models otherwise normalise their inputs."""
        update = getattr(self.model, "update_normalizer", None) if self.interface == SEED else None
        if update is None:
            return
        if "all_reduce" in inspect.signature(update).parameters:
            update(obs, all_reduce=all_reduce)
        else:
            update(obs)
