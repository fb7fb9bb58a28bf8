"""Rollout collection: steps a :class:`BatchedEnv` with the actor's policy copy into a
pre-allocated ``[N, T]`` rollout. No sockets here; :mod:`actors.actor` sends what this fills.

Storage is plain tensors written with one indexed copy per key per step (TensorDict indexing in
the step loop costs more than the env step for small envs); the TensorDict view is built once per
rollout. Two storages alternate so one can be filled while ZeroMQ still reads the other.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable

import torch
from tensordict import TensorDict
from torch import nn

from actors.emulated_device import EmulatedInference, SlowEnv
from shared import keys
from shared.envs.base import BatchedEnv
from shared.rollout import rollout_template, sends_bootstrap_obs  # noqa: F401  (the schema, re-exported)


@dataclass
class RolloutStats:
    episode_returns: list[float] = field(default_factory=list)
    episode_lengths: list[int] = field(default_factory=list)
    episode_successes: list[bool] = field(default_factory=list)
    episode_metrics: list[dict[str, float]] = field(default_factory=list)
    collect_s: float = 0.0
    collect_cpu_s: float = 0.0   # CPU time of the collecting thread (policy and env steps, not sleeps)
    inference_s: float = 0.0
    env_s: float = 0.0


class Collector:
    """Fills rollouts from `env` with `policy` (the actor's own copy, never shared).

    Args:
        env: the actor's batched env.
        policy: TensorDict-in/TensorDict-out policy with a critic (``value`` in its output).
        num_steps: T, steps per env per rollout.
        num_buffers: storages used in turn (2: fill one while the other is being sent).
        step_delay_s: extra sleep per env step (a slow actor for tests and studies).
        inference_latency_s: extra latency per acting policy call (a stand-in for a large model),
            plus `inference_latency_per_env_s` for each env in the call.
        device_lock: an emulated inference device (:mod:`actors.emulated_device`) held for each
            acting call, forward pass and latency together; None: this actor's alone.
    """

    def __init__(self, env: BatchedEnv, policy: nn.Module, num_steps: int, seed: int,
                 num_buffers: int = 2, step_delay_s: float = 0.0, inference_latency_s: float = 0.0,
                 bootstrap_obs: bool = False, inference_latency_per_env_s: float = 0.0, device_lock=None):
        # The study knobs wrap the env and the policy (actors/emulated_device.py): the loop below is
        # the same with them or without.
        if step_delay_s:
            env = SlowEnv(env, step_delay_s)
        if inference_latency_s or inference_latency_per_env_s or device_lock is not None:
            policy = EmulatedInference(policy, inference_latency_s, device_lock, per_env_s=inference_latency_per_env_s)
        self.env, self.policy, self.num_steps = env, policy, num_steps
        # Rollouts are assembled where the policy runs (a GPU simulator's tensors never leave the
        # device mid-rollout) and copied once per rollout into pinned host memory for sending.
        self.device = next(policy.parameters()).device
        # An inference server's replies say which version acted at each step (actors/inference.py).
        self.stamps_versions = getattr(policy, "stamps_versions", False)
        pin = self.device.type == "cuda"
        self.with_value = getattr(policy, "critic", None) is not None
        self.bootstrap_obs = bootstrap_obs and self.with_value
        self._host = [rollout_template(env.spec, env.num_envs, num_steps, "cpu", pin_memory=pin,
                                       with_value=self.with_value, with_bootstrap_obs=self.bootstrap_obs)
                      for _ in range(num_buffers)]
        self._dev = (rollout_template(env.spec, env.num_envs, num_steps, self.device, with_value=self.with_value,
                                      with_bootstrap_obs=self.bootstrap_obs)
                     if self.device.type != "cpu" else None)
        self._next = 0
        self.obs = env.reset(seed=seed).to(self.device)
        self.env_steps = 0

    @property
    def next_index(self) -> int:
        """The storage the next :meth:`collect` fills."""
        return self._next

    @torch.inference_mode()
    def collect(self, version: int, reset_seeds: list[int] | None = None,
                should_stop: Callable[[], bool] | None = None,
                refresh: Callable[[], int | None] | None = None) -> tuple[TensorDict, RolloutStats, int] | None:
        """Fill the next storage with T steps, the first acted by weight version `version`. With
        `reset_seeds` (one per env), every env is reset first with its seed (GRPO groups).
        `should_stop` is asked between steps (a slow model must not delay shutdown by a whole
        rollout); when it says yes the partial rollout is abandoned and None returned.
        `refresh` (in-flight weight updates) is called before every step after the first; it may
        load newer weights into the policy and returns the version the next step acts with (None:
        abandon the rollout). Each step's ``policy_version`` is the version that chose its action.

        Returns ``(rollout, stats, index)``: the rollout aliases storage ``index``, which the
        caller must not let be refilled while it is still being sent.
        """
        t0, c0 = time.perf_counter(), time.thread_time()
        idx, out = self._claim_storage(reset_seeds)
        obs_b, act_b, logp_b = out[keys.OBS], out[keys.ACTION], out[keys.LOG_PROB]
        ver_b = out[keys.POLICY_VERSION]
        rew_b, term_b, trunc_b = out[keys.REWARD], out[keys.TERMINATED], out[keys.TRUNCATED]
        val_b = out[keys.VALUE] if self.with_value else None
        nval_b = out[keys.NEXT_VALUE] if self.with_value else None
        if nval_b is not None:
            nval_b.zero_()
        boot_b = out[keys.BOOTSTRAP_OBS] if self.bootstrap_obs else None
        if boot_b is not None:
            boot_b.zero_()
        stats = RolloutStats()
        n = self.env.num_envs
        for t in range(self.num_steps):
            if should_stop is not None and should_stop():
                return None
            if refresh is not None:
                if t > 0:
                    version = refresh()
                    if version is None:      # stopped while waiting for whole weights: abandon
                        return None
                ver_b[:, t] = version
            ti = time.perf_counter()
            td = self.policy(TensorDict({keys.OBS: self.obs}, batch_size=[n]))
            action = td[keys.ACTION]
            if self.stamps_versions:
                ver_b[:, t] = td[keys.POLICY_VERSION]
            te = time.perf_counter()
            step = self.env.step(action)
            stats.inference_s += te - ti
            stats.env_s += time.perf_counter() - te
            if step.reward.device != self.device:   # CPU simulators (gymnasium) with a GPU policy
                step = self._to_device(step)
            obs_b[:, t] = self.obs
            act_b[:, t] = action
            logp_b[:, t] = td[keys.LOG_PROB]
            if val_b is not None:
                val_b[:, t] = td[keys.VALUE]
            rew_b[:, t] = step.reward
            term_b[:, t] = step.terminated
            trunc_b[:, t] = step.truncated
            if step.episode_returns:
                self._episodes_ended(step, t, stats, nval_b, boot_b)
            self.obs = step.obs
        self._finish_values(out, term_b, trunc_b, val_b, nval_b, boot_b)
        if refresh is None and not self.stamps_versions:
            ver_b.fill_(version)
        self._to_host(out, idx)
        self.env_steps += n * self.num_steps
        stats.collect_s = time.perf_counter() - t0
        stats.collect_cpu_s = time.thread_time() - c0
        return self._host[idx], stats, idx

    def _claim_storage(self, reset_seeds: list[int] | None) -> tuple[int, TensorDict]:
        """The index of the storage this rollout fills and where it is assembled (that storage, or
        the device-side one); with `reset_seeds`, every env is reset first with its seed."""
        idx = self._next
        self._next = (self._next + 1) % len(self._host)
        out = self._dev if self._dev is not None else self._host[idx]
        if reset_seeds is not None:
            self.obs = self.env.reset(seed=reset_seeds).to(self.device)
        return idx, out

    def _to_device(self, step):
        """`step`'s tensors on the policy's device (a CPU simulator with a GPU policy)."""
        return step._replace(obs=step.obs.to(self.device, non_blocking=True),
                             final_obs=step.final_obs.to(self.device, non_blocking=True),
                             reward=step.reward.to(self.device, non_blocking=True),
                             terminated=step.terminated.to(self.device, non_blocking=True),
                             truncated=step.truncated.to(self.device, non_blocking=True))

    def _episodes_ended(self, step, t: int, stats: RolloutStats, nval_b: torch.Tensor | None,
                        boot_b: torch.Tensor | None) -> None:
        """Step `t` ended episodes: their stats, and for truncated ones the value (and, with
        bootstrap observations, the observation) to bootstrap from."""
        stats.episode_returns += step.episode_returns
        stats.episode_lengths += step.episode_lengths
        stats.episode_successes += list(step.episode_successes)
        stats.episode_metrics += list(step.episode_metrics)
        trunc = step.truncated & ~step.terminated
        if nval_b is not None and bool(trunc.any()):
            # Truncated steps bootstrap from V(final observation), not from the reset
            # observation the env returned: that one belongs to the next episode.
            final = TensorDict({keys.OBS: step.final_obs[trunc]}, batch_size=[int(trunc.sum())])
            nval_b[trunc, t] = self.policy.get_value(final)
            if boot_b is not None:
                boot_b[trunc, t] = step.final_obs[trunc]

    def _finish_values(self, out: TensorDict, term_b: torch.Tensor, trunc_b: torch.Tensor,
                       val_b: torch.Tensor | None, nval_b: torch.Tensor | None, boot_b: torch.Tensor | None) -> None:
        """``done``, and V(s_{t+1}) for steps that did not end an episode: the next step's value,
        and for the last step the value of the observation after it (kept too with bootstrap
        observations)."""
        done_b = out[keys.DONE]
        torch.logical_or(term_b, trunc_b, out=done_b)
        if val_b is not None:
            last = self.policy.get_value(TensorDict({keys.OBS: self.obs}, batch_size=[self.env.num_envs]))
            following = torch.cat([val_b[:, 1:], last.unsqueeze(1)], dim=1)
            nval_b.copy_(torch.where(done_b, nval_b, following))
        if boot_b is not None:   # the observation after the last step, where that step did not end an episode
            open_end = ~done_b[:, -1]
            boot_b[open_end, -1] = self.obs[open_end]

    def _to_host(self, out: TensorDict, idx: int) -> None:
        """Copy a rollout assembled on the device into host storage `idx` (pinned), and wait for it."""
        if self._dev is not None:
            self._host[idx].update_(out, non_blocking=True)
            if self.device.type == "cuda":
                torch.cuda.current_stream(self.device).synchronize()
