"""When an actor loads the weights it receives: the newest at once, or held back on purpose.

Two study knobs emulate stale weights without slow hardware, each as a gate between the weights
socket and the policy copy (``actors/actor.py`` asks it at every rollout boundary, or every step
with in-flight updates):

* :class:`DelayedWeights` (``actors.weights_delay_s``): a message is due once it is that many
  seconds old; 0 is the default, plain behaviour (the newest received, at once).
* :class:`LaggedWeights` (``actors.weights_lag_versions`` K): the newest message at least K versions
  behind the newest received is due, so the actor acts a fixed K versions late.

A gate queues what arrived (``offer``) and hands over the message to load now (``due``), dropping
everything older. It never loads anything itself, so a half-loaded model cannot come from here.
"""

from __future__ import annotations

from collections import deque
from typing import Any

Message = tuple[Any, dict]          # (weights TensorDict, meta), as the weights socket gives them


class DelayedWeights:
    """The newest message at least `delay_s` seconds old (0: the newest, at once)."""

    def __init__(self, delay_s: float = 0.0):
        self.delay_s = delay_s
        self.queue: deque[tuple[float, Message]] = deque()    # (arrival time, message), oldest first

    def offer(self, now: float, msg: Message) -> None:
        if self.delay_s <= 0:
            self.queue.clear()          # only the newest can ever be loaded
        self.queue.append((now, msg))
        cutoff = now - self.delay_s
        while len(self.queue) > 1 and self.queue[1][0] <= cutoff:
            self.queue.popleft()        # superseded by a newer message that is also due

    def due(self, now: float, version: int, incarnation: str | None, torn: bool) -> tuple[float, Message] | None:
        cutoff = now - self.delay_s
        due = None
        while self.queue and self.queue[0][0] <= cutoff:
            due = self.queue.popleft()
        return due


class LaggedWeights:
    """The newest message at least `k` versions behind the newest received; the first weights, a torn
    load or a restarted learner take the oldest held at once."""

    def __init__(self, k: int):
        self.k = k
        self.queue: deque[tuple[float, Message]] = deque()

    def offer(self, now: float, msg: Message) -> None:
        """Keep the messages whose version may still become due (the newest received, back to K
        versions before it). A restarted learner's weights replace whatever was queued from the old one."""
        meta = msg[1]
        version = meta.get("version")
        if not (isinstance(version, int) and not isinstance(version, bool)):
            return
        if self.queue and self.queue[-1][1][1].get("incarnation") != meta.get("incarnation"):
            self.queue.clear()
        if self.queue and version <= self.queue[-1][1][1]["version"]:
            return                       # an old or repeated message: the queue is in version order
        self.queue.append((now, msg))
        target = version - self.k
        while len(self.queue) > 1 and self.queue[1][1][1]["version"] <= target:
            self.queue.popleft()         # superseded by a newer one that is also due

    def due(self, now: float, version: int, incarnation: str | None, torn: bool) -> tuple[float, Message] | None:
        if not self.queue:
            return None
        target = self.queue[-1][1][1]["version"] - self.k
        oldest = self.queue[0][1][1]
        restarted = incarnation is not None and oldest.get("incarnation") != incarnation
        if oldest["version"] <= target or version < 0 or torn or restarted:
            # due; or the first weights, a torn load or a restarted learner (whose versions must
            # replace ours at once, or its first update would wait on data it cannot get): the oldest held
            return self.queue.popleft()
        return None


def weights_gate(actors_cfg) -> DelayedWeights | LaggedWeights:
    """The gate ``actors.weights_lag_versions`` / ``actors.weights_delay_s`` ask for."""
    if actors_cfg.weights_lag_versions:
        return LaggedWeights(actors_cfg.weights_lag_versions)
    return DelayedWeights(actors_cfg.weights_delay_s)
