"""The learner's buffer and the batches it trains on.

On the way in (the receiver thread), a rollout the intake accepted passes the lag filter
(``trainer.max_policy_lag``; 0 in standard mode) into the :class:`~learner.buffer.CircularBuffer`.
On the way out (the main thread), :meth:`Batcher.take` hands ``k`` rollouts at a time to the update,
dropping those that went stale while they waited. Every received rollout is consumed or dropped
exactly once; the learner records which (``versions.jsonl``) through the `drop` callback here and
its own consume events.
"""

from __future__ import annotations

import threading
import time
from typing import Callable

import torch
from tensordict import TensorDictBase

from learner.buffer import CircularBuffer
from shared.config import Config


class Batcher:
    """Buffer in, batches of `k` rollouts out.

    Args:
        cfg: the run's config (``trainer.buffer_type``, ``buffer_capacity``, ``max_policy_lag``).
        template: one rollout's TensorDict (shapes and dtypes the buffer preallocates).
        k: rollouts per update on this learner rank.
        version: the learner's current weights version.
        drop: called with a rollout's info and the reason whenever one is dropped.
    """

    def __init__(self, cfg: Config, template: TensorDictBase, k: int, version: Callable[[], int],
                 drop: Callable[[dict, str], None]):
        t = cfg.trainer
        # GRPO's dynamic sampling: a batch is k rollouts' worth of groups whose outcomes differ
        alg = cfg.algorithm.cfg
        self.groups_of = None
        if getattr(alg, "dynamic_sampling", False):
            from learner.grpo import informative_groups
            self.groups_of = lambda td: int(informative_groups(td["reward"], td["done"], alg).sum())
            self.target_groups = k * (cfg.actors.num_envs // alg.group_size)
        self.standard = t.buffer_type == "standard"
        self.max_lag = 0 if self.standard else t.max_policy_lag
        self.k, self.version, self.drop = k, version, drop
        self.buffer = CircularBuffer(max(t.buffer_capacity, k) if not self.standard else 2 * k, template)
        self._pending: list[tuple[TensorDictBase, dict]] = []   # taken, waiting for the rest of a batch
        self._data_ready = threading.Condition()
        self.wait_s = 0.0          # seconds spent waiting for data since the last update's log

    def __len__(self) -> int:
        return len(self.buffer)

    def put(self, td: TensorDictBase, info: dict) -> None:
        """Store one accepted rollout (any thread), unless it is already too old to train on (or,
        with dynamic sampling, none of its groups' outcomes differ)."""
        if self.version() - info["policy_version"] > self.max_lag:
            self.drop(info, "lag")
            return
        if self.groups_of is not None:
            info["groups"] = self.groups_of(td)
            if not info["groups"]:
                self.drop(info, "uninformative")
                return
        overwritten = self.buffer.put(td, info)
        if overwritten is not None:
            self.drop(overwritten, "overwritten")
        with self._data_ready:
            self._data_ready.notify_all()

    def take(self, timeout_s: float = 0.05) -> tuple[TensorDictBase, list[dict]] | None:
        """The next `k` rollouts ``[k, N, T]`` with their infos, or None if they are not all there
        within `timeout_s`. Rollouts too old for the current version are dropped."""
        if self.groups_of is not None:
            return self._take_groups(timeout_s)
        need = self.k - len(self._pending)
        t0 = time.perf_counter()
        with self._data_ready:
            if len(self.buffer) < need:
                self._data_ready.wait(timeout_s)
        self.wait_s += time.perf_counter() - t0
        taken = self.buffer.take(need, min_version=self.version() - self.max_lag)
        for info in taken.stale:
            self.drop(info, "stale")
        if taken.data is not None:
            self._pending += [(taken.data[i], info) for i, info in enumerate(taken.infos)]
        if len(self._pending) < self.k:
            return None
        return self._hand_over()

    def _hand_over(self) -> tuple[TensorDictBase, list[dict]]:
        if self.standard:
            # Arrival order between actors is a race; actor order is not. Same seed, same run.
            self._pending.sort(key=lambda p: (p[1]["actor"], p[1]["seq"] if isinstance(p[1]["seq"], int) else 0))
        data = torch.stack([d for d, _ in self._pending])
        infos = [i for _, i in self._pending]
        self._pending = []
        return data, infos

    def _take_groups(self, timeout_s: float) -> tuple[TensorDictBase, list[dict]] | None:
        """Dynamic sampling: rollouts one by one until they hold `target_groups` informative groups."""
        t0 = time.perf_counter()
        deadline = t0 + timeout_s
        while sum(i["groups"] for _, i in self._pending) < self.target_groups:
            with self._data_ready:
                if not len(self.buffer):
                    self._data_ready.wait(max(0.0, deadline - time.perf_counter()))
            taken = self.buffer.take(1, min_version=self.version() - self.max_lag)
            for info in taken.stale:
                self.drop(info, "stale")
            if taken.data is not None:
                self._pending.append((taken.data[0], taken.infos[0]))
            elif time.perf_counter() >= deadline:
                self.wait_s += time.perf_counter() - t0
                return None
        self.wait_s += time.perf_counter() - t0
        return self._hand_over()

    def held(self) -> dict[int, int]:
        """Per actor, rollouts waiting here for the rest of a dynamic-sampling batch: for pacing they
        count as finished, or actors out of credit and a learner short of groups would wait for each
        other. (Without dynamic sampling a batch never needs more than the credits allow: none.)"""
        counts: dict[int, int] = {}
        if self.groups_of is not None:
            for _, info in self._pending:
                counts[info["actor"]] = counts.get(info["actor"], 0) + 1
        return counts

    def drop_unconsumed(self, reason: str) -> None:
        """Drop every rollout still held (buffer and partial batch), each with `reason`."""
        taken = self.buffer.take(self.buffer.capacity)
        for info in [i for _, i in self._pending] + taken.stale + taken.infos:
            self.drop(info, reason)
        self._pending = []
