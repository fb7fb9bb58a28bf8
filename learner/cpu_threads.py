"""CPU-thread scheduling of the learner's update, in one place: the update itself is device-neutral.

On a CPU learner sharing a few cores with its actors, three settings decide where the update's work
runs (``learner.torch_threads``, ``learner.critic_thread``):

* :func:`learner_threads`: the update's intra-op threads (``"auto"``: the cores the actors leave).
* ``"idle"`` threads: one thread, widened to every core for the minibatches taken while the next
  batch already waits (the actors have nothing to collect then).
* a critic thread: PPO's value loss and its backward on a second thread, beside the policy loss (the
  same gradients, bit for bit).

:class:`CpuThreads` holds what a learner resolved from them and gives the update its hooks.
"""

from __future__ import annotations

import os
import weakref
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from typing import Callable

import torch

from shared.config import Config
from shared.policies import has_critic


def learner_threads(cfg: Config) -> int:
    """``learner.torch_threads`` as a number: "auto" resolves to the cores this process may use, less
    one per actor in vla mode (they collect while the learner trains; in standard mode they wait for
    every update), shared among the learner ranks on this host (torchrun's LOCAL_WORLD_SIZE); at least 1."""
    threads = cfg.learner.torch_threads
    if threads == "idle":
        return 1                     # raised per minibatch while the actors idle: idle_threads()
    if threads != "auto":
        return int(threads)
    return max(1, _cores_left_to_learner(cfg) // _local_ranks())


def idle_threads(cfg: Config) -> int | None:
    """``learner.torch_threads`` "idle": the intra-op threads for a minibatch taken while the actors
    have nothing to collect (every core this process may use, shared among the local learner ranks);
    None for any other setting."""
    if cfg.learner.torch_threads != "idle":
        return None
    return max(1, _usable_cores() // _local_ranks())


def _local_ranks() -> int:
    """Learner ranks on this host (torchrun's LOCAL_WORLD_SIZE), at least 1."""
    try:
        return max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    except ValueError:
        return 1


def _usable_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:           # not on Linux
        return os.cpu_count() or 1


def _cores_left_to_learner(cfg: Config) -> int:
    """The cores this process may use, less one per actor in vla mode (they collect while the
    learner trains; in standard mode they wait for every update)."""
    return _usable_cores() - (0 if cfg.trainer.buffer_type == "standard" else cfg.actors.num_actors)


def uses_critic_thread(cfg: Config, policy: torch.nn.Module, ranks=None) -> bool:
    """``learner.critic_thread`` resolved: does the PPO update run the value loss on a second thread
    (for "idle", at least at times: ``Learner.critic_when`` says when)?"""
    choice = cfg.learner.critic_thread
    applies = (cfg.algorithm.name == "ppo" and ranks is None and hasattr(policy, "evaluate_actor")
               and has_critic(policy))
    if choice not in ("auto", "idle"):
        return bool(choice) and applies
    if not applies or torch.device(cfg.learner.device).type != "cpu":
        return False
    return choice == "idle" or _cores_left_to_learner(cfg) >= 2


class CpuThreads:
    """What one learner resolved: its critic thread (or None), when to use it, and the idle widening.

    Args:
        cfg, policy, ranks: the learner's (a critic thread needs PPO with a separate critic, one rank).
        batch_waiting: whether the next batch already waits (the actors are idle then).
    """

    def __init__(self, cfg: Config, policy: torch.nn.Module, ranks, batch_waiting: Callable[[], bool]):
        self.batch_waiting = batch_waiting
        # learner.critic_thread: the value loss's forward and backward on a second thread
        self.critic_thread = None
        if uses_critic_thread(cfg, policy, ranks):
            threads = learner_threads(cfg)
            self.critic_thread = ThreadPoolExecutor(1, thread_name_prefix="critic", initializer=torch.set_num_threads,
                                                    initargs=(threads,))
            weakref.finalize(self, self.critic_thread.shutdown, wait=False)
        # "idle" in vla mode: the thread only while the next batch already waits (the actors idle)
        self.critic_when = None
        if self.critic_thread is not None and cfg.learner.critic_thread == "idle" and cfg.trainer.buffer_type != "standard":
            self.critic_when = batch_waiting
        # learner.torch_threads "idle": more intra-op threads for the minibatches taken while the
        # next batch already waits (the actors idle; in standard mode they always do)
        self.idle_threads = idle_threads(cfg)
        self._minibatches = self._wide_minibatches = 0
        # the intra-op threads of each minibatch of the current update, as [threads, count] runs: a
        # record keeps them (CPU float sums depend on the thread count), and a replay sets
        # `replay_schedule` to run the update's minibatches on the same threads
        self.schedule: list[list[int]] = []
        self.replay_schedule: list[int] | None = None

    @contextmanager
    def update(self):
        """Around one update: yields the ``before_minibatch`` hook (None unless ``torch_threads``
        is "idle"), and leaves one intra-op thread behind, so the actors may collect again."""
        self._minibatches = self._wide_minibatches = 0
        self.schedule = []
        widen = self.before_minibatch if self.idle_threads is not None else None
        try:
            yield widen
        finally:
            if widen is not None and torch.get_num_threads() != 1:
                torch.set_num_threads(1)

    def before_minibatch(self) -> None:
        """``learner.torch_threads`` "idle": every usable core while the next batch already waits,
        else one thread. Resizing the thread pool has a cost, so only a change of state switches."""
        if self.replay_schedule:
            threads = self.replay_schedule.pop(0)
            wide = threads != 1
        else:
            wide = self.batch_waiting()
            threads = self.idle_threads if wide else 1
        if torch.get_num_threads() != threads:
            torch.set_num_threads(threads)
        self._minibatches += 1
        self._wide_minibatches += wide
        if self.schedule and self.schedule[-1][0] == threads:
            self.schedule[-1][1] += 1
        else:
            self.schedule.append([threads, 1])

    def wide_share(self) -> float:
        """The share of this update's minibatches that ran on every core."""
        return self._wide_minibatches / max(self._minibatches, 1)
