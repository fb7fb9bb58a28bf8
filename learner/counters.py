"""The learner's counters and recent-episode statistics, shared by the receiver thread and the main loop.

One object, one lock: the receiver thread (``learner/ingest.py``) adds what arrives, the main loop
adds what it trains on or drops, and readers take a consistent :meth:`RunCounters.snapshot`.
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from typing import Any

COUNT_KEYS = ("rollouts", "dropped_lag", "overwritten", "dropped_other", "malformed", "rejected", "skipped_steps",
              "failed_updates", "updates_cut_short", "dropped_uninformative")
DROP_KEYS = {"lag": "dropped_lag", "stale": "dropped_lag", "overwritten": "overwritten",
             "uninformative": "dropped_uninformative"}   # else dropped_other
RECENT = 100   # episodes the train/ statistics average over
MAX_FAILED_UPDATES = 10   # updates in a row with no finite optimiser step before the run stops

log = logging.getLogger("tandem.learner")


class RunCounters:
    """Counts of what happened to every message and rollout, env steps, time totals, and the last
    ``RECENT`` episodes' returns, lengths, successes and env metrics.

    Args:
        num_actors: sizes the per-actor lists.
    """

    def __init__(self, num_actors: int):
        self.lock = threading.Lock()
        self.counts: dict[str, int] = dict.fromkeys(COUNT_KEYS, 0)
        # Where the time goes, in seconds over the run: the updates' wall and CPU time (every thread of
        # the learner process while it updates), and what the actors report of their collection (wall,
        # and the CPU time of the thread that steps the envs and runs the policy).
        self.time_totals = {"update_wall_s": 0.0, "update_cpu_s": 0.0, "collect_wall_s": 0.0, "collect_cpu_s": 0.0}
        self.env_steps = 0                              # env steps received (trained on or dropped)
        self.finished_per_actor = [0] * num_actors      # rollouts consumed, dropped or refused, per actor (pacing)
        self.steps_per_actor = [0] * num_actors         # env steps received, per actor
        self.episodes: deque[tuple[float, int]] = deque(maxlen=RECENT)
        self.successes: deque[bool] = deque(maxlen=RECENT)
        self.metrics: deque[dict[str, float]] = deque(maxlen=RECENT)
        self.sync_delays: list[float] = []              # weight-sync delays since the last take_sync_delays()
        self.first_rollout_time: float | None = None    # wall clock of the first and last rollout received
        self.last_rollout_time: float | None = None

    # ------------------------------------------------------------------ writers (any thread)
    def count(self, key: str, n: int = 1) -> int:
        """Add `n` to counter `key` (created at 0); returns its new value."""
        with self.lock:
            self.counts[key] = self.counts.get(key, 0) + n
            return self.counts[key]

    def count_drop(self, reason: str) -> None:
        self.count(DROP_KEYS.get(reason, "dropped_other"))

    def finish(self, actor: int) -> None:
        """One of `actor`'s rollouts is done with (consumed, dropped or refused)."""
        with self.lock:
            self.finished_per_actor[actor] += 1

    def add_times(self, **seconds: float) -> None:
        with self.lock:
            for k, v in seconds.items():
                self.time_totals[k] += v

    def add_rollout(self, actor: int, env_steps: int, now: float, times: dict[str, float],
                    episodes: list[tuple[float, int]], successes: list[bool], metrics: list[dict]) -> None:
        """A rollout received: its env steps, the actor's collection times, and the episodes it ended
        (already checked and bounded by the caller)."""
        with self.lock:
            for k, v in times.items():
                self.time_totals[k] += v
            self.env_steps += env_steps
            self.steps_per_actor[actor] += env_steps
            self.counts["rollouts"] += 1
            if self.first_rollout_time is None:
                self.first_rollout_time = now
            self.last_rollout_time = now
            self.successes.extend(successes)
            self.metrics.extend(metrics)
            self.episodes.extend(episodes)

    def add_sync_delay(self, delay_s: float) -> None:
        with self.lock:
            self.sync_delays.append(delay_s)

    # ------------------------------------------------------------------ readers
    def finished(self) -> list[int]:
        with self.lock:
            return list(self.finished_per_actor)

    def take_sync_delays(self) -> list[float]:
        """The delays reported since the last call (and forget them)."""
        with self.lock:
            delays, self.sync_delays = self.sync_delays, []
            return delays

    def snapshot(self) -> dict[str, Any]:
        """A consistent copy of everything, taken under the lock."""
        with self.lock:
            return {"counts": dict(self.counts), "time_totals": dict(self.time_totals), "env_steps": self.env_steps,
                    "finished_per_actor": list(self.finished_per_actor),
                    "steps_per_actor": list(self.steps_per_actor), "episodes": list(self.episodes),
                    "successes": list(self.successes), "metrics": list(self.metrics)}


class SkippedSteps:
    """Optimiser steps skipped for a non-finite loss or gradient, counted in `counters`. An update
    that took no step at all still publishes (standard-mode actors wait for a new version), with the
    same weights; only a run whose updates keep failing stops (:data:`MAX_FAILED_UPDATES` in a row),
    with the reason."""

    def __init__(self, counters: RunCounters):
        self.counters, self.failed_in_a_row = counters, 0

    def note(self, stats: dict[str, float], update: int, version: int) -> None:
        """Update number `update` (from 1) gave `stats`; the learner was at `version`."""
        skipped, steps = int(stats.get("skipped_steps", 0)), int(stats.get("steps", 0))
        self.counters.count("skipped_steps", skipped)
        if skipped:
            log.warning("update %d: skipped %d of %d optimiser steps (non-finite loss or gradient); the weights "
                        "stay as they were for those", update, skipped, skipped + steps)
        failed = bool(skipped and not steps)
        if failed:
            self.counters.count("failed_updates")
        self.failed_in_a_row = self.failed_in_a_row + 1 if failed else 0
        if self.failed_in_a_row >= MAX_FAILED_UPDATES:
            raise FloatingPointError(
                f"{self.failed_in_a_row} updates in a row took no optimiser step: every minibatch had a non-finite "
                f"loss or gradient (version {version}). The data or the config (learning_rate, clip_coef, "
                f"max_grad_norm, reward scale) is breaking the update; the last good weights are in the checkpoints.")
