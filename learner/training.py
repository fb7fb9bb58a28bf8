"""The training part of one learner update: the algorithm's prepare and update on a batch, with
the learning rate annealed over the run, the CPU-thread hooks between minibatches, the policy
wrapped in DDP where there are several learner ranks, and a stop request that cuts the update
short. :class:`~learner.learner.Learner` owns one and calls it from ``update_once``; it runs on
the learner's main thread only.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable

import torch
from tensordict import TensorDictBase

from learner.counters import RunCounters
from learner.cpu_threads import CpuThreads
from learner.minibatch import EpochHooks
from shared.config import Config
from shared.console import say

if TYPE_CHECKING:
    from learner.distributed import Ranks


class Training:
    """Trains `policy` with `algorithm` (:class:`~learner.ppo.PPO` or :class:`~learner.grpo.GRPO`)
    and `optimizer`, one batch at a time. Counts updates cut short in `stats`."""

    def __init__(self, cfg: Config, policy: torch.nn.Module, optimizer: torch.optim.Optimizer, algorithm,
                 cpu: CpuThreads, stats: RunCounters, ranks: Ranks | None = None):
        self.cfg, self.policy, self.optimizer, self.algorithm = cfg, policy, optimizer, algorithm
        self.cpu, self.stats, self.ranks = cpu, stats, ranks
        self._ddp = None

    def run(self, flat: TensorDictBase, lags: torch.Tensor, reward_std: float | None, *, env_steps_trained: int,
            update: int, should_stop: Callable[[], bool] | None) -> dict[str, float]:
        """The algorithm's prepare and update on `flat` ``[B, T]``, update number `update` (1-based),
        after `env_steps_trained` env steps; `should_stop` is asked between minibatches (one rank only:
        DDP ranks take the same steps)."""
        a = self.cfg.algorithm.cfg
        if a.anneal_lr:
            self._anneal_lr(env_steps_trained)
        self.policy.train()
        with self.cpu.update() as widen:
            hooks = EpochHooks(sync_mean=self._sync_mean, side_when=self.cpu.critic_when, before_minibatch=widen,
                               should_stop=should_stop if self.ranks is None else None)
            prepared = self.algorithm.prepare(flat, lags, reward_std)
            stats = self.algorithm.update(flat, self._update_policy(), hooks)
            stats.update(prepared)
        if widen is not None:
            stats["idle_threads_share"] = self.cpu.wide_share()
        if stats.get("stopped"):
            self.stats.count("updates_cut_short")
            say(f"[learner] stop requested: update {update} cut short after {int(stats['steps'])} "
                f"optimiser steps ({int(stats['epochs'])} of {a.n_epochs} epochs begun)")
        return stats

    def _anneal_lr(self, env_steps_trained: int) -> None:
        """The learning rate, linearly down to 0 at ``trainer.total_steps``."""
        a = self.cfg.algorithm.cfg
        frac = max(0.0, 1.0 - env_steps_trained / self.cfg.trainer.total_steps)
        for g in self.optimizer.param_groups:
            if torch.is_tensor(g["lr"]):   # a captured step reads it from the device: fill in place
                g["lr"].fill_(a.learning_rate * frac)
            else:
                g["lr"] = a.learning_rate * frac

    def _update_policy(self):
        """The policy the update loops train: wrapped in DDP when there are several learner ranks."""
        if self.ranks is None:
            return self.policy
        if self._ddp is None:
            from learner.distributed import DDPPolicy
            find_unused = self.algorithm.name == "grpo" or self.cfg.policy.name == "vla"
            self._ddp = DDPPolicy(self.policy, self.ranks, find_unused=find_unused)
        return self._ddp

    def _sync_mean(self, t: torch.Tensor) -> torch.Tensor:
        return t if self.ranks is None else self.ranks.all_reduce_sum(t) / self.ranks.world
