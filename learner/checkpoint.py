"""Checkpoints that resume exactly: written atomically, loaded with ``weights_only=True``.

A checkpoint holds the policy (normaliser statistics included), the optimiser, the version and
step counters, the reward scaler and every RNG state the learner draws from.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

import torch
from tensordict import TensorDict

from shared.policies import load_weights_, published_state

_NAME = re.compile(r"^ckpt_(\d+)\.pt$")


def save_checkpoint(directory: Path, state: dict[str, Any], version: int, keep: int = 3) -> Path:
    """Write ``ckpt_<version>.pt`` (temp file, fsync, rename: never half-written) and keep the newest `keep`."""
    directory = Path(directory)
    path = save_atomic(directory / f"ckpt_{version:08d}.pt", state)
    for old in list_checkpoints(directory)[:-keep]:
        old.unlink(missing_ok=True)
    return path


def save_atomic(path: Path, state: dict[str, Any]) -> Path:
    """``torch.save`` to `path` through a temp file, fsync and rename: a reader sees the old file or
    the new one, never half of one, even if the process dies while writing."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    with open(tmp, "wb") as f:
        torch.save(state, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    dir_fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)
    return path


def list_checkpoints(directory: Path) -> list[Path]:
    """Checkpoints in `directory`, oldest first."""
    directory = Path(directory)
    if not directory.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in directory.iterdir() if (m := _NAME.match(p.name))]
    return [p for _, p in sorted(found)]


def load_checkpoint(path: Path, map_location: str | torch.device = "cpu") -> dict[str, Any]:
    """Load a checkpoint with ``weights_only=True`` (no arbitrary code runs)."""
    try:
        return torch.load(path, map_location=map_location, weights_only=True)
    except Exception as e:
        raise RuntimeError(f"{path}: cannot load checkpoint: {e}") from e


def load_policy_tensors_(policy: torch.nn.Module, tensors: dict[str, torch.Tensor]) -> None:
    """A checkpoint's ``policy`` tensors into `policy`: what trains (:func:`published_state`, by
    dotted name), or, from a checkpoint written before only those were saved, the whole state dict.
    Raises on a missing, unexpected or misshapen tensor."""
    if set(tensors) == set(published_state(policy)):
        load_weights_(policy, TensorDict({tuple(k.split(".")): v for k, v in tensors.items()}, []))
    else:
        policy.load_state_dict(tensors)


class Checkpoints:
    """Where and when one learner saves: ``RUN_DIR/checkpoints``, every `save_freq` env steps (0:
    only when asked). Its own state (the next step count to save at) goes into each checkpoint."""

    def __init__(self, run_dir: Path | None, save_freq: int):
        self.directory = Path(run_dir) / "checkpoints" if run_dir is not None else None
        self.save_freq, self.next_save = save_freq, save_freq

    def newest(self) -> Path:
        found = list_checkpoints(self.directory) if self.directory is not None else []
        if not found:
            raise FileNotFoundError(f"--resume: no checkpoint in {self.directory}")
        return found[-1]

    def save(self, state: dict[str, Any], version: int) -> Path | None:
        return save_checkpoint(self.directory, state, version) if self.directory is not None else None

    def due(self, env_steps: int) -> bool:
        """Whether a checkpoint is due at `env_steps`."""
        return bool(self.save_freq) and env_steps >= self.next_save

    def saved_at(self, env_steps: int) -> None:
        """A due checkpoint was written: the next one a period on."""
        self.next_save = (env_steps // self.save_freq + 1) * self.save_freq

    def state_dict(self) -> dict[str, Any]:
        return {"next_save": self.next_save}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.next_save = state["next_save"]
