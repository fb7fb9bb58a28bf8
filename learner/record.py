"""``trainer.record``: every batch the learner trains on, kept for ``launch/replay.py``.

``RUN/record/update_NNNNNNN`` holds the batch (a memory-mapped TensorDict) and
``RUN/record/index.jsonl`` one line per update: the learner's version before it, the reward std the
update scaled with, and where each rollout came from.
"""

from __future__ import annotations

import errno
import json
import shutil
from pathlib import Path

from tensordict import TensorDictBase

from learner.disk import DISK


class BatchRecorder:
    """Writes ``RUN/record``. A write that fails (a full disk) goes to ``learner.disk.DISK``, which
    stops the run; nothing more is recorded. An update whose batch is on disk but not in the index
    is not replayed (the index line comes last)."""

    def __init__(self, directory: Path):
        self.directory = Path(directory)
        self.failed = False

    def write(self, data: TensorDictBase, infos: list[dict], reward_std: float | None, update: int,
              version: int) -> None:
        """Append the batch about to be trained on by `update` (numbered from 1)."""
        name = f"update_{update:07d}"
        entry = {"update": update, "version": version, "dir": name, "reward_std": reward_std,
                 "rollouts": [{k: i[k] for k in ("actor", "seq", "policy_version", "policy_version_max",
                                                 "env_steps")} for i in infos]}
        self._guarded(self.directory / name, lambda: _memmap_with_room(data, self.directory / name))
        self._append("index.jsonl", entry)

    def write_threads(self, update: int, schedule: list[list[int]]) -> None:
        """After `update`: the intra-op threads its minibatches ran on, as ``[threads, count]`` runs
        (``learner.torch_threads: "idle"`` only; CPU float sums depend on the thread count)."""
        self._append("threads.jsonl", {"update": update, "threads": schedule})

    def _append(self, name: str, entry: dict) -> None:
        def append() -> None:
            with open(self.directory / name, "a") as f:
                f.write(json.dumps(entry) + "\n")
        self._guarded(self.directory / name, append)

    def _guarded(self, path: Path, write) -> None:
        if self.failed:
            return
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            write()
        except OSError as e:
            self.failed = True
            DISK.record(path, e)


def _memmap_with_room(data: TensorDictBase, path: Path) -> None:
    """``data.memmap(path)``, after checking that the disk has room: a memory-mapped file written past
    the end of the disk dies with SIGBUS, not an OSError, so a full disk is reported here instead."""
    need = sum(t.numel() * t.element_size() for t in data.values(include_nested=True, leaves_only=True))
    free = shutil.disk_usage(path.parent).free
    if free < need + (1 << 20):
        raise OSError(errno.ENOSPC, f"No space left on device (the batch needs {need / 1e6:.1f} MB, "
                                    f"{free / 1e6:.1f} MB free)", str(path))
    data.cpu().memmap(path)
