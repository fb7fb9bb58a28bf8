"""Pretrained vision-language-action (VLA) models as Tandem policies.

The VLA model interface: any ``nn.Module`` with

    action_dist(obs: TensorDictBase) -> torch.distributions.Distribution
        the action distribution for a (possibly multi-modal, nested) observation ``[*B]``;
        ``log_prob(action)`` and ``entropy()`` must return ``[*B]`` (sum over action dims inside).
    value(obs: TensorDictBase) -> Tensor            (optional: a value head, ``[*B]``; PPO needs it)
    deterministic_action(dist) -> Tensor            (optional: default ``dist.mode``)

The observation reaches the model exactly as the env produced it (``rgb`` stays uint8,
``instruction`` stays int64): the model converts what it needs.

``load_vla_model`` builds such a model from ``policy.vla_config`` and loads its weights (safetensors,
or a state dict read with ``torch.load(weights_only=True)``); every failure names the path, the
class or the mismatched parameter.
"""

from __future__ import annotations

import contextlib
import importlib
from pathlib import Path
from typing import Any

import torch
from tensordict import TensorDictBase
from torch import nn

from shared import keys
from shared.config import VLAConfig


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


def _read_state(path: Path) -> dict[str, torch.Tensor]:
    if not path.is_file():
        raise VLALoadError(f"vla_config.model_path {str(path)!r}: no such file")
    try:
        if path.suffix == ".safetensors":
            from safetensors.torch import load_file
            return load_file(str(path))
        state = torch.load(path, map_location="cpu", weights_only=True)
    except VLALoadError:
        raise
    except Exception as e:
        raise VLALoadError(f"vla_config.model_path {str(path)!r}: cannot read weights: {type(e).__name__}: {e}") from None
    if isinstance(state, dict) and "state_dict" in state and isinstance(state["state_dict"], dict):
        state = state["state_dict"]
    if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise VLALoadError(f"vla_config.model_path {str(path)!r}: expected a state dict of tensors")
    return state


def load_vla_model(model_path: str, model_class: str, model_config: dict[str, Any]) -> nn.Module:
    """Import ``model_class``, build it with ``model_config`` and load ``model_path`` into it.

    Raises:
        VLALoadError: missing file, unknown module or class, bad constructor arguments, missing or
            unexpected parameters, or a parameter whose shape differs (named with both shapes).
    """
    cls = _import_class(model_class)
    try:
        model = cls(**model_config)
    except TypeError as e:
        raise VLALoadError(f"vla_config.model_config does not fit {model_class}: {e}") from None
    for name in ("action_dist",):
        if not callable(getattr(model, name, None)):
            raise VLALoadError(f"{model_class} does not implement the VLA model interface: no {name}(obs)")
    if not model_path:
        return model
    path = Path(model_path)
    state = _read_state(path)
    own = model.state_dict()
    missing, unexpected = sorted(own.keys() - state.keys()), sorted(state.keys() - own.keys())
    wrong = [f"{k}: file {tuple(state[k].shape)}, model {tuple(own[k].shape)}"
             for k in sorted(own.keys() & state.keys()) if state[k].shape != own[k].shape]
    if missing or unexpected or wrong:
        parts = ([f"missing {missing}"] if missing else []) + ([f"unexpected {unexpected}"] if unexpected else []) \
            + ([f"shape mismatch: {'; '.join(wrong)}"] if wrong else [])
        raise VLALoadError(f"vla_config.model_path {str(path)!r} does not match {model_class}: " + ", ".join(parts))
    with torch.no_grad():
        for k, v in state.items():
            own[k].copy_(v)
    return model


class VLAPolicy(nn.Module):
    """A VLA model behind Tandem's policy interface (TensorDict in, TensorDict out)."""

    def __init__(self, model: nn.Module, cfg: VLAConfig):
        super().__init__()
        self.model = model
        self.autocast = cfg.autocast
        if cfg.dtype == "bfloat16":
            self.model.to(torch.bfloat16)
        frozen = 0
        for name, p in self.model.named_parameters():
            if any(name.startswith(prefix) for prefix in cfg.freeze):
                p.requires_grad_(False)
                frozen += 1
        if cfg.freeze and not frozen:
            raise VLALoadError(f"vla_config.freeze {cfg.freeze}: no parameter name starts with these prefixes")
        # PPO needs a value head; has_critic() reads this attribute.
        self.critic = self.model if callable(getattr(model, "value", None)) else None

    def _ctx(self, device: torch.device):
        if self.autocast and device.type in ("cuda", "cpu"):
            return torch.autocast(device.type, dtype=torch.bfloat16)
        return contextlib.nullcontext()

    def _device(self) -> torch.device:
        return next(self.model.parameters()).device

    def forward(self, td: TensorDictBase, deterministic: bool = False) -> TensorDictBase:
        with self._ctx(self._device()):
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

    def get_value(self, td: TensorDictBase) -> torch.Tensor:
        if self.critic is None:
            raise RuntimeError("get_value: this VLA model has no value head")
        with self._ctx(self._device()):
            return self.model.value(td[keys.OBS]).float()

    def evaluate_actions(self, td: TensorDictBase) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        with self._ctx(self._device()):
            obs = td[keys.OBS]
            dist = self.model.action_dist(obs)
            value = self.model.value(obs).float() if self.critic is not None else None
            return dist.log_prob(td[keys.ACTION]).float(), dist.entropy().float(), value

    def update_normalizer(self, obs, all_reduce=None) -> None:
        """VLA models normalise their own inputs; nothing to track here."""
