"""Circular rollout buffer: pre-allocated, FIFO, capacity in rollouts.

It owns storage and the consume/overwrite bookkeeping; it knows nothing of losses or sockets.
Every rollout leaves the buffer exactly once, either taken for training or counted as dropped.
Slots start poisoned (NaN floats, ``True`` bools, -1 integers) so a read of unwritten memory is loud.
Thread-safe: a receiver thread puts while the training thread takes.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any

import torch
from tensordict import TensorDictBase

from shared import keys


def _poison(t: torch.Tensor) -> float | int | bool:
    if t.dtype.is_floating_point:
        return float("nan")   # reaches the loss, and the non-finite check fires
    if t.dtype == torch.bool:
        return True           # "done" everywhere: GAE cannot run across unwritten steps
    return -1                 # never a valid version or id (255 for uint8)


@dataclass
class Entry:
    """Bookkeeping for one stored rollout."""
    info: dict[str, Any]
    min_version: int


@dataclass
class Taken:
    """What :meth:`CircularBuffer.take` returns: stacked rollouts ``[k, N, T]`` and their entries."""
    data: TensorDictBase | None
    infos: list[dict[str, Any]] = field(default_factory=list)
    stale: list[dict[str, Any]] = field(default_factory=list)


class CircularBuffer:
    """Fixed-capacity FIFO of ``[N, T]`` rollouts.

    Args:
        capacity: number of rollouts held.
        template: one rollout; fixes keys, shapes and dtypes of every slot.
    """

    def __init__(self, capacity: int, template: TensorDictBase):
        if capacity < 1:
            raise ValueError(f"CircularBuffer capacity must be >= 1, got {capacity}")
        self.capacity = capacity
        self._slots = template.apply(lambda t: torch.full((capacity, *t.shape), _poison(t), dtype=t.dtype,
                                                          device=t.device),
                                     batch_size=[capacity, *template.batch_size])
        self._entries: list[Entry | None] = [None] * capacity
        self._read = 0        # index of the oldest unconsumed rollout
        self._count = 0
        self._lock = threading.Lock()
        self.total_put = 0
        self.total_taken = 0
        self.total_overwritten = 0
        self.total_stale = 0

    def __len__(self) -> int:
        return self._count

    def put(self, rollout: TensorDictBase, info: dict[str, Any]) -> dict[str, Any] | None:
        """Copy `rollout` into the next slot. Returns the info of the unconsumed rollout that was
        overwritten to make room (the oldest), or None."""
        min_version = int(rollout[keys.POLICY_VERSION].min())
        with self._lock:
            overwritten = None
            if self._count == self.capacity:
                overwritten = self._entries[self._read].info
                self._entries[self._read] = None
                self._read = (self._read + 1) % self.capacity
                self._count -= 1
                self.total_overwritten += 1
            idx = (self._read + self._count) % self.capacity
            self._slots[idx].update_(rollout)
            self._entries[idx] = Entry(info=info, min_version=min_version)
            self._count += 1
            self.total_put += 1
            return overwritten

    def take(self, k: int, min_version: int | None = None) -> Taken:
        """Remove and return the oldest `k` rollouts (fewer if fewer are held), as one ``[k, N, T]``
        copy. Rollouts with any step older than `min_version` are removed too, but returned in
        ``Taken.stale`` instead of being trained on."""
        out = Taken(data=None)
        with self._lock:
            idx = []
            while self._count and len(idx) < k:
                i = self._read
                entry = self._entries[i]
                self._entries[i] = None
                self._read = (self._read + 1) % self.capacity
                self._count -= 1
                if min_version is not None and entry.min_version < min_version:
                    out.stale.append(entry.info)
                    self.total_stale += 1
                    continue
                idx.append(i)
                out.infos.append(entry.info)
            if idx:
                out.data = self._slots[torch.tensor(idx)].clone()  # own the data: slots get reused
            self.total_taken += len(idx)
        return out
