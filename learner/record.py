"""``trainer.record``: every batch the learner trains on, kept for ``launch/replay.py``.

``RUN/record/update_NNNNNNN`` holds the batch (a memory-mapped TensorDict) and
``RUN/record/index.jsonl`` one line per update: the learner's version before it, the reward std the
update scaled with, and where each rollout came from.
"""

from __future__ import annotations

import json
from pathlib import Path

from tensordict import TensorDictBase


class BatchRecorder:
    def __init__(self, directory: Path):
        self.directory = Path(directory)

    def write(self, data: TensorDictBase, infos: list[dict], reward_std: float | None, update: int,
              version: int) -> None:
        """Append the batch about to be trained on by `update` (numbered from 1)."""
        name = f"update_{update:07d}"
        self.directory.mkdir(parents=True, exist_ok=True)
        data.cpu().memmap(self.directory / name)
        entry = {"update": update, "version": version, "dir": name, "reward_std": reward_std,
                 "rollouts": [{k: i[k] for k in ("actor", "seq", "policy_version", "policy_version_max",
                                                 "env_steps")} for i in infos]}
        with open(self.directory / "index.jsonl", "a") as f:
            f.write(json.dumps(entry) + "\n")

    def write_threads(self, update: int, schedule: list[list[int]]) -> None:
        """After `update`: the intra-op threads its minibatches ran on, as ``[threads, count]`` runs
        (``learner.torch_threads: "idle"`` only; CPU float sums depend on the thread count)."""
        with open(self.directory / "threads.jsonl", "a") as f:
            f.write(json.dumps({"update": update, "threads": schedule}) + "\n")
