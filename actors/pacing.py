"""``lag_policy: pace``, the actor's side: how many of its rollouts may wait unconsumed at the
learner, and how many do, as far as the learner's credits say.

The learner counts each actor's rollouts it has consumed or dropped and sends the counts with its
credits (:mod:`shared.transport`); an actor waits while ``max_inflight`` of its rollouts are still
unconsumed, instead of producing data that would be too old by the time it is trained on.
"""

from __future__ import annotations

import math

from shared.config import Config


def max_inflight(cfg: Config) -> int:
    """lag_policy "pace": an actor's rollouts unconsumed at the learner, at most. Enough in flight
    that the learner always has a full batch (n x ceil(k/n) >= k), no more than the lag allows, and
    no more than the learner's buffer holds (or pacing would still end in overwrites)."""
    k, n = cfg.rollouts_per_update, cfg.actors.num_actors
    capacity = max(cfg.trainer.buffer_capacity, k)
    return max(math.ceil(k / n), min(math.ceil(max(1, cfg.trainer.max_policy_lag) * k / n), capacity // n))


class Credits:
    """One actor's rollouts sent and not yet consumed or dropped by the learner.

    The learner's count for an actor id goes on across that id's restarts, and ours (``seq``) across
    the learner's: both count from the first credit this actor sees, and from the next one again
    after a learner restart (:meth:`restart`)."""

    def __init__(self, cfg: Config, actor_id: int):
        self.actor_id, self.max_inflight = actor_id, max_inflight(cfg)
        self._consumed_base: int | None = None       # the learner's count for this id when we started
        self._seq_base = 0                           # our seq when that count was taken

    def restart(self, seq: int) -> None:
        """A new learner life: its counts start again, and ours from `seq`."""
        self._consumed_base, self._seq_base = None, seq

    def inflight(self, weights, seq: int, incarnation: str | None) -> int:
        """Our rollouts sent (`seq` of them) and not yet consumed or dropped, by the counts `weights`
        (the actor's weights source) last heard from the learner life `incarnation` (ours)."""
        consumed = getattr(weights, "consumed", None)
        if not (isinstance(consumed, list) and self.actor_id < len(consumed)
                and isinstance(consumed[self.actor_id], int)):
            return 0
        source = getattr(weights, "consumed_from", None)
        if source is not None and incarnation is not None and source != incarnation:
            return 0                         # another life of the learner counted these: not ours to wait on
        if self._consumed_base is None:      # counts from earlier lives of this actor id (or of the learner)
            self._consumed_base = consumed[self.actor_id]
        return (seq - self._seq_base) - (consumed[self.actor_id] - self._consumed_base)
