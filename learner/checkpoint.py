"""Checkpoints that resume exactly: written atomically, verified, loaded with ``weights_only=True``.

A checkpoint holds the policy (normaliser statistics included), the optimiser, the version and
step counters, the reward scaler and every RNG state the learner draws from. Beside each one,
``<name>.sha256`` holds the SHA-256 of its bytes, read back right after they were written and synced,
and put in place before the checkpoint is: loading checks it first, so a truncated or bit-flipped file is reported by
name instead of loading silently different weights (``torch.load`` checks neither). ``--resume``
takes the newest checkpoint that verifies and loads, and says which it skipped.
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
from pathlib import Path
from typing import Any

import torch
from tensordict import TensorDict

from learner.disk import warn_if_nearly_full
from shared.policies import load_weights_, published_state

_NAME = re.compile(r"^ckpt_(\d+)\.pt$")
DIGEST_SUFFIX = ".sha256"
log = logging.getLogger("tandem.learner")


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be used (missing, damaged, unreadable); the message names the file."""


def digest_path(path: Path) -> Path:
    """Where the digest of checkpoint `path` is kept: ``<name>.sha256`` beside it."""
    return Path(path).with_name(Path(path).name + DIGEST_SUFFIX)


def save_checkpoint(directory: Path, state: dict[str, Any], version: int, keep: int = 3) -> Path:
    """Write ``ckpt_<version>.pt`` (temp file, fsync, rename: never half-written) and keep the newest `keep`."""
    directory = Path(directory)
    path = save_atomic(directory / f"ckpt_{version:08d}.pt", state)
    for old in [p for p in list_checkpoints(directory) if p != path][:-(keep - 1) or None]:
        old.unlink(missing_ok=True)
        digest_path(old).unlink(missing_ok=True)
    return path


def save_atomic(path: Path, state: dict[str, Any]) -> Path:
    """``torch.save`` to `path` through a temp file, fsync and rename, its digest beside it: a reader
    sees the old file or the new one, never half of one, even if the process dies while writing. The
    digest is renamed into place first, so a checkpoint in place always has its own. On any error
    (a full disk) the temp files are removed and the error raised."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp, digest = path.with_suffix(path.suffix + ".tmp"), digest_path(path)
    digest_tmp = digest.with_suffix(digest.suffix + ".tmp")
    try:
        with open(tmp, "wb") as f:
            torch.save(state, f)     # to the file itself: torch's fast path (a Python writer in between costs 2x)
            f.flush()
            os.fsync(f.fileno())
        digest_hex = file_sha256(tmp)     # read back while it is in the page cache
        with open(digest_tmp, "w") as f:
            f.write(f"{digest_hex}  {path.name}\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(digest_tmp, digest)
        os.replace(tmp, path)
        _fsync_dir(path.parent)
    except BaseException:
        tmp.unlink(missing_ok=True)
        digest_tmp.unlink(missing_ok=True)
        raise
    return path


def file_sha256(path: Path) -> str:
    """The SHA-256 of `path`'s bytes (read in 16 MiB pieces)."""
    sha = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 24):
            sha.update(chunk)
    return sha.hexdigest()


def _fsync_dir(directory: Path) -> None:
    dir_fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


def verify_checkpoint(path: Path) -> bool:
    """Check `path` against its digest. True: verified; False: it has no digest (written before
    checkpoints carried one, or copied without it): not verifiable, loaded as it is.

    Raises:
        CheckpointError: the file is missing or unreadable, or its bytes differ from its digest.
    """
    path = Path(path)
    try:
        expected = digest_path(path).read_text().split()[0] if digest_path(path).exists() else None
    except (OSError, IndexError) as e:
        raise CheckpointError(f"{path}: its digest {digest_path(path).name} is unreadable ({e})") from e
    try:
        actual = file_sha256(path)
    except OSError as e:
        raise CheckpointError(f"{path}: cannot read checkpoint: {e}") from e
    if expected is None:
        return False
    if actual != expected:
        raise CheckpointError(f"{path}: damaged: its SHA-256 is {actual[:16]}..., "
                              f"{digest_path(path).name} says {expected[:16]}... (truncated or altered since written)")
    return True


def list_checkpoints(directory: Path) -> list[Path]:
    """Checkpoints in `directory`, oldest first."""
    directory = Path(directory)
    if not directory.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in directory.iterdir() if (m := _NAME.match(p.name))]
    return [p for _, p in sorted(found)]


def load_checkpoint(path: Path, map_location: str | torch.device = "cpu") -> dict[str, Any]:
    """Verify a checkpoint against its digest (:func:`verify_checkpoint`), then load it with
    ``weights_only=True`` (no arbitrary code runs).

    Raises:
        CheckpointError: naming the file: missing, damaged, or not loadable.
    """
    if not verify_checkpoint(path):
        log.warning("%s has no digest (%s): loaded without verification", path, digest_path(path).name)
    try:
        state = torch.load(path, map_location=map_location, weights_only=True)
    except Exception as e:
        raise CheckpointError(f"{path}: cannot load checkpoint: {e}") from e
    if not isinstance(state, dict):
        raise CheckpointError(f"{path}: not a checkpoint (a {type(state).__name__}, not a dict)")
    return state


def load_newest_intact(directory: Path, map_location: str | torch.device = "cpu"
                       ) -> tuple[Path, dict[str, Any], list[str]]:
    """The newest checkpoint in `directory` that verifies and loads: ``(path, state, skipped)``, where
    `skipped` says, newest first, which newer ones were damaged and why.

    Raises:
        CheckpointError: there is none, or none is intact (every reason listed).
    """
    found = list_checkpoints(directory)
    if not found:
        raise CheckpointError(f"--resume: no checkpoint in {directory}")
    skipped = []
    for path in reversed(found):
        try:
            verified = verify_checkpoint(path)
        except CheckpointError as e:      # damaged: truncated, altered or unreadable
            log.error("--resume: skipping %s: %s", path.name, e)
            skipped.append(str(e))
            continue
        try:
            return path, load_checkpoint(path, map_location), skipped
        except CheckpointError as e:
            if verified:   # whole as written, yet not loadable here (out of memory, another torch): stop, no fallback
                raise
            log.error("--resume: skipping %s: %s", path.name, e)
            skipped.append(str(e))
    raise CheckpointError(f"--resume: no intact checkpoint in {directory}:\n  " + "\n  ".join(skipped))


def set_aside_newer(chosen: Path) -> list[Path]:
    """Move the checkpoints of `chosen`'s directory with a higher version than it (damaged ones
    skipped by ``--resume``, or a later branch left by ``--resume-from``) into ``set_aside/``, with
    their digests: kept for inspection, out of the rotation and of the next ``--resume``."""
    chosen = Path(chosen)
    newer = [p for p in list_checkpoints(chosen.parent) if _NAME.match(p.name) and
             int(_NAME.match(p.name).group(1)) > int(_NAME.match(chosen.name).group(1))] if _NAME.match(chosen.name) else []
    if newer:
        aside = chosen.parent / "set_aside"
        aside.mkdir(exist_ok=True)
        for p in newer:
            for f in (p, digest_path(p)):
                if f.exists():
                    os.replace(f, aside / f.name)
        log.warning("set aside %d newer checkpoint(s) in %s: %s", len(newer), aside, ", ".join(p.name for p in newer))
    return newer


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

    def load_for_resume(self, map_location: str | torch.device, path: Path | None = None
                        ) -> tuple[Path, dict[str, Any], list[str]]:
        """``(path, state, skipped)``: `path` when given (``--resume-from``: that one or an error, no
        fallback), else the newest intact checkpoint of this run (:func:`load_newest_intact`)."""
        if path is not None:
            found = Path(path), load_checkpoint(path, map_location), []
        elif self.directory is None:
            raise CheckpointError("--resume: this learner has no run directory")
        else:
            found = load_newest_intact(self.directory, map_location)
        if self.directory is not None and found[0].resolve().parent == self.directory.resolve():
            set_aside_newer(found[0])
        return found

    def path_for(self, version: int) -> Path | None:
        return self.directory / f"ckpt_{version:08d}.pt" if self.directory is not None else None

    def save(self, state: dict[str, Any], version: int) -> Path | None:
        """Write the checkpoint of `version`; warn when the disk has room for fewer than two more."""
        if self.directory is None:
            return None
        path = save_checkpoint(self.directory, state, version)
        warn_if_nearly_full(self.directory, path.stat().st_size)
        return path

    def last_intact(self) -> Path | None:
        """The newest checkpoint that verifies against its digest (for messages; reads the files)."""
        for p in reversed(list_checkpoints(self.directory) if self.directory else []):
            try:
                if verify_checkpoint(p):
                    return p
            except CheckpointError:
                continue
        return None

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
