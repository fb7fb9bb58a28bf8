"""Rollout collection: steps a :class:`BatchedEnv` with the actor's policy copy into a
pre-allocated ``[N, T]`` rollout. No sockets here; :mod:`actors.actor` sends what this fills.

Storage is plain tensors written with one indexed copy per key per step (TensorDict indexing in
the step loop costs more than the env step for small envs); the TensorDict view is built once per
rollout. Two storages alternate so one can be filled while ZeroMQ still reads the other.

With an inference server and ``actors.server_splits`` k > 1 the actor's envs are k
:class:`EnvParts` stepped in turn, each with its own request at the server (double-buffered
sampling): while the server acts for one part the actor steps another, so the round trip is
hidden behind env steps instead of added to every one.
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
from shared.chunks import chunk_size, executed_sum
from shared.envs.base import BatchedEnv, StepResult
from shared.rollout import policy_layout, rollout_template, sends_bootstrap_obs  # noqa: F401  (the schema, re-exported)


class EnvParts:
    """k batched envs stepped as one :class:`BatchedEnv` of all their envs (env i of part j is env
    ``start_j + i`` of the whole), or part by part (``parts`` and ``slices``) by a collector that
    overlaps one part's inference with another's env step. An int reset seed gives the whole's env i
    ``seed + i`` as one env would; a list is split among the parts."""

    def __init__(self, parts: list[BatchedEnv]):
        if not parts:
            raise ValueError("EnvParts needs at least one env")
        self.parts = list(parts)
        self.spec, self.device = parts[0].spec, parts[0].device
        self.slices, start = [], 0
        for p in self.parts:
            self.slices.append(slice(start, start + p.num_envs))
            start += p.num_envs
        self.num_envs = start

    def reset(self, seed: int | list[int] | None = None):
        outs = []
        for p, sl in zip(self.parts, self.slices):
            part_seed = seed[sl] if isinstance(seed, list) else None if seed is None else seed + sl.start
            outs.append(p.reset(seed=part_seed))
        return torch.cat(outs)

    @property
    def partial_steps(self) -> bool:
        return all(getattr(p, "partial_steps", False) for p in self.parts)

    def step(self, action: torch.Tensor, active: torch.Tensor | None = None) -> StepResult:
        if active is None:
            return merge_steps([p.step(action[sl]) for p, sl in zip(self.parts, self.slices)])
        return merge_steps([p.step(action[sl], active=active[sl]) for p, sl in zip(self.parts, self.slices)])

    def close(self) -> None:
        for p in self.parts:
            p.close()


def merge_steps(steps: list[StepResult]) -> StepResult:
    """Several parts' step results as one, in order."""
    if len(steps) == 1:
        return steps[0]
    cat = lambda name: torch.cat([getattr(s, name) for s in steps])   # noqa: E731
    joined = lambda name: [x for s in steps for x in getattr(s, name)]   # noqa: E731
    return StepResult(obs=cat("obs"), reward=cat("reward"), terminated=cat("terminated"),
                      truncated=cat("truncated"), final_obs=cat("final_obs"),
                      episode_returns=joined("episode_returns"), episode_lengths=joined("episode_lengths"),
                      episode_successes=joined("episode_successes"), episode_metrics=joined("episode_metrics"))


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
        actions_per_call: an action-chunk policy (shared/chunks.py): how many of each call's H actions
            the envs execute (0: all H); a rollout row is then one call. Ignored for one-action policies.
        gamma: the discount applied within an executed chunk (the row's reward is
            ``sum_j gamma^j r_j``): the learner's ``algorithm.cfg.gamma``.
    """

    def __init__(self, env: BatchedEnv, policy: nn.Module, num_steps: int, seed: int,
                 num_buffers: int = 2, step_delay_s: float = 0.0, inference_latency_s: float = 0.0,
                 bootstrap_obs: bool = False, inference_latency_per_env_s: float = 0.0, device_lock=None,
                 actions_per_call: int = 0, gamma: float = 0.99):
        # The study knobs wrap the env and the policy (actors/emulated_device.py): the loop below is
        # the same with them or without.
        if step_delay_s:   # env parts: each part is slow by its share, a whole step by the full delay
            env = (EnvParts([SlowEnv(p, step_delay_s / len(env.parts)) for p in env.parts])
                   if isinstance(env, EnvParts) else SlowEnv(env, step_delay_s))
        if inference_latency_s or inference_latency_per_env_s or device_lock is not None:
            policy = EmulatedInference(policy, inference_latency_s, device_lock, per_env_s=inference_latency_per_env_s)
        self.env, self.policy, self.num_steps = env, policy, num_steps
        # Rollouts are assembled where the policy runs (a GPU simulator's tensors never leave the
        # device mid-rollout) and copied once per rollout into pinned host memory for sending.
        self.device = next(policy.parameters()).device
        # An inference server's replies say which version acted at each step (actors/inference_server.py).
        self.stamps_versions = getattr(policy, "stamps_versions", False)
        # env parts and a policy that takes requests without waiting for them: overlap the two
        self.pipelined = isinstance(env, EnvParts) and len(env.parts) > 1 and hasattr(policy, "submit")
        pin = self.device.type == "cuda"
        self.with_value = getattr(policy, "critic", None) is not None
        self.bootstrap_obs = bootstrap_obs and self.with_value
        layout = policy_layout(policy)
        self.chunk, self.extras, self.gamma = layout["chunk"], list(layout["extras"]), float(gamma)
        self.actions_per_call = min(actions_per_call or self.chunk, self.chunk)
        self._host = [rollout_template(env.spec, env.num_envs, num_steps, "cpu", pin_memory=pin,
                                       with_value=self.with_value, with_bootstrap_obs=self.bootstrap_obs, **layout)
                      for _ in range(num_buffers)]
        self._dev = (rollout_template(env.spec, env.num_envs, num_steps, self.device, with_value=self.with_value,
                                      with_bootstrap_obs=self.bootstrap_obs, **layout)
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
        if self.with_value:
            out[keys.NEXT_VALUE].zero_()
        if self.bootstrap_obs:
            out[keys.BOOTSTRAP_OBS].zero_()
        stats = RolloutStats()
        steps = self._steps_in_parts if self.pipelined else self._steps
        if not steps(out, version, stats, should_stop, refresh):
            return None
        self._finish_values(out)
        if refresh is None and not self.stamps_versions:
            out[keys.POLICY_VERSION].fill_(version)
        self._to_host(out, idx)
        self.env_steps += (self.env.num_envs * self.num_steps if self.chunk == 1
                           else int(self._host[idx][keys.EXECUTED].sum()))
        stats.collect_s = time.perf_counter() - t0
        stats.collect_cpu_s = time.thread_time() - c0
        return self._host[idx], stats, idx

    def _steps(self, out: TensorDict, version: int, stats: RolloutStats, should_stop, refresh) -> bool:
        """The T steps of :meth:`collect`, all envs at once; False when the rollout is abandoned."""
        ver_b = out[keys.POLICY_VERSION]
        n = self.env.num_envs
        whole, bufs = slice(None), dict(out.items())
        for t in range(self.num_steps):
            if should_stop is not None and should_stop():
                return False
            if refresh is not None:
                if t > 0:
                    version = refresh()
                    if version is None:      # stopped while waiting for whole weights: abandon
                        return False
                ver_b[:, t] = version
            ti = time.perf_counter()
            td = self.policy(TensorDict({keys.OBS: self.obs}, batch_size=[n]))
            te = time.perf_counter()
            step, executed = self._execute(self.env, td[keys.ACTION])
            stats.inference_s += te - ti
            stats.env_s += time.perf_counter() - te
            self.obs = self._record(bufs, whole, t, self.obs, td, step, stats, executed)
        return True

    def _steps_in_parts(self, out: TensorDict, version: int, stats: RolloutStats, should_stop, refresh) -> bool:
        """:meth:`_steps` with the env in parts, each with its own request at the server: a part's
        next request goes out as soon as it has stepped, and is answered while the others step.
        Requests go out part by part in step order, so the versions the replies carry never go back."""
        policy, parts, slices = self.policy, self.env.parts, self.env.slices
        bufs = dict(out.items())
        obs = [self.obs[sl] for sl in slices]
        asked = [policy.submit("act", TensorDict({keys.OBS: o}, batch_size=[o.shape[0]])) for o in obs]
        try:
            for t in range(self.num_steps):
                if should_stop is not None and should_stop():
                    return False
                for j, (env, sl) in enumerate(zip(parts, slices)):
                    ti = time.perf_counter()
                    td = policy.result(asked[j])
                    te = time.perf_counter()
                    step, executed = self._execute(env, td[keys.ACTION])
                    stats.inference_s += te - ti
                    stats.env_s += time.perf_counter() - te
                    obs[j] = self._record(bufs, sl, t, obs[j], td, step, stats, executed)
                    if t + 1 < self.num_steps:
                        asked[j] = policy.submit("act", TensorDict({keys.OBS: obs[j]}, batch_size=[obs[j].shape[0]]))
        finally:
            self.obs = torch.cat(obs)
            policy.cancel()       # an abandoned rollout's requests: their replies are not waited for
        return True

    def _execute(self, env, action: torch.Tensor) -> tuple[StepResult, torch.Tensor | None]:
        """Step `env` with one call's `action`: one env step, or for an action chunk ``[n, H, ...]``
        the first ``actions_per_call`` of it (a macro step, :func:`execute_chunk`). Returns the step
        and, for a chunk, how many actions each env executed."""
        if self.chunk == 1:
            return env.step(action), None
        return execute_chunk(env, action, self.actions_per_call, self.gamma)

    def _record(self, b: dict, sl: slice, t: int, obs, td: TensorDict, step, stats: RolloutStats,
                executed: torch.Tensor | None = None):
        """Write step `t` of the envs `sl` (the acting policy's output `td`, the env's `step`; for an
        action chunk, the macro step and the actions each env `executed`) into the rollout's tensors
        `b` (by key: no TensorDict lookups in the step loop); returns the observation the next step
        acts on."""
        if step.reward.device != self.device:   # CPU simulators (gymnasium) with a GPU policy
            step = self._to_device(step)
        b[keys.OBS][sl, t] = obs
        b[keys.ACTION][sl, t] = td[keys.ACTION]
        if executed is None:
            b[keys.LOG_PROB][sl, t] = td[keys.LOG_PROB]
        else:
            executed = executed.to(self.device)
            b[keys.EXECUTED][sl, t] = executed
            b[keys.LOG_PROB][sl, t] = executed_sum(td[keys.LOG_PROB], executed)
            for name in self.extras:
                b[name][sl, t] = td[name]
        if self.stamps_versions:
            b[keys.POLICY_VERSION][sl, t] = td[keys.POLICY_VERSION]
        if self.with_value:
            b[keys.VALUE][sl, t] = td[keys.VALUE]
        b[keys.REWARD][sl, t] = step.reward
        b[keys.TERMINATED][sl, t] = step.terminated
        b[keys.TRUNCATED][sl, t] = step.truncated
        if step.episode_returns:
            self._episodes_ended(step, t, stats, b[keys.NEXT_VALUE][sl] if self.with_value else None,
                                 b[keys.BOOTSTRAP_OBS][sl] if self.bootstrap_obs else None)
        return step.obs

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
        """`step`'s tensors on the policy's device: a CPU simulator with a GPU policy, or a GPU simulator
        whose policy acts on the CPU (an inference server's actor: its collector runs on the CPU).
        Without waiting only towards a GPU: a copy to the host with ``non_blocking`` may return before
        its bytes have arrived, and the host reads them at once (rewards recorded, observations sent)."""
        wait = self.device.type != "cuda"
        return step._replace(obs=step.obs.to(self.device, non_blocking=not wait),
                             final_obs=step.final_obs.to(self.device, non_blocking=not wait),
                             reward=step.reward.to(self.device, non_blocking=not wait),
                             terminated=step.terminated.to(self.device, non_blocking=not wait),
                             truncated=step.truncated.to(self.device, non_blocking=not wait))

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

    def _finish_values(self, out: TensorDict) -> None:
        """``done``, and V(s_{t+1}) for steps that did not end an episode: the next step's value,
        and for the last step the value of the observation after it (kept too with bootstrap
        observations)."""
        done_b = out[keys.DONE]
        torch.logical_or(out[keys.TERMINATED], out[keys.TRUNCATED], out=done_b)
        if self.with_value:
            val_b, nval_b = out[keys.VALUE], out[keys.NEXT_VALUE]
            last = self._values(self.obs)
            following = torch.cat([val_b[:, 1:], last.unsqueeze(1)], dim=1)
            nval_b.copy_(torch.where(done_b, nval_b, following))
        if self.bootstrap_obs:   # the observation after the last step, where that step did not end an episode
            open_end = ~done_b[:, -1]
            out[keys.BOOTSTRAP_OBS][open_end, -1] = self.obs[open_end]

    def _values(self, obs: torch.Tensor) -> torch.Tensor:
        """V(`obs`) of every env; with env parts one request per part, all in flight at once: a server's
        forward pass is sized to a part's request (``actors.server_max_batch``), not to all our envs."""
        if not self.pipelined:
            return self.policy.get_value(TensorDict({keys.OBS: obs}, batch_size=[obs.shape[0]]))
        try:
            asked = [self.policy.submit("value", TensorDict({keys.OBS: obs[sl]}, batch_size=[sl.stop - sl.start]))
                     for sl in self.env.slices]
            return torch.cat([self.policy.result(rid)[keys.VALUE] for rid in asked])
        finally:
            self.policy.cancel()     # nothing left in flight, replies taken or not (a stop while waiting)

    def _to_host(self, out: TensorDict, idx: int) -> None:
        """Copy a rollout assembled on the device into host storage `idx` (pinned), and wait for it."""
        if self._dev is not None:
            self._host[idx].update_(out, non_blocking=True)
            if self.device.type == "cuda":
                torch.cuda.current_stream(self.device).synchronize()


def execute_chunk(env, action: torch.Tensor, n: int, gamma: float) -> tuple[StepResult, torch.Tensor]:
    """Execute the first `n` actions of the chunk `action` (``[N, H, *action]``) in `env`, one env step
    each, as one macro step. An env whose episode ends stops executing its chunk there:

    - an env that can step a subset of its envs (``partial_steps``: ``step(action, active=mask)``
      leaves the inactive ones as they are) goes on stepping the others to `n`;
    - otherwise the call ends for every env at the step where any episode ended (the others will
      have executed fewer actions than `n`; nothing is stepped with an action chosen for another
      episode).

    Returns the macro step (reward ``sum_j gamma^j r_j`` over each env's executed steps; terminated,
    truncated and ``final_obs`` of the step that ended its episode, if one did; ``obs`` what the next
    call acts on) and the actions each env executed, ``[N]`` int64, 1..n.
    """
    partial = bool(getattr(env, "partial_steps", False))
    num = action.shape[0]
    active = executed = reward = term = trunc = final_obs = None
    returns, lengths, successes, metrics = [], [], [], []
    discount = 1.0
    for j in range(n):
        step = env.step(action[:, j]) if j == 0 or not partial else env.step(action[:, j], active=active)
        if j == 0:
            dev = step.reward.device
            active = torch.ones(num, dtype=torch.bool, device=dev)
            executed = torch.zeros(num, dtype=torch.int64, device=dev)
            reward = torch.zeros(num, dtype=step.reward.dtype, device=dev)
            term, trunc = torch.zeros_like(active), torch.zeros_like(active)
            final_obs = step.final_obs.clone()
        reward += discount * torch.where(active, step.reward, torch.zeros_like(step.reward))
        executed += active.to(torch.int64)
        ended = (step.terminated | step.truncated) & active
        term |= step.terminated & active
        trunc |= step.truncated & active
        final_obs[active] = step.final_obs[active]
        returns += step.episode_returns
        lengths += step.episode_lengths
        successes += list(step.episode_successes)
        metrics += list(step.episode_metrics)
        discount *= gamma
        active = active & ~ended
        if not bool(active.any()) or (not partial and bool(ended.any())):
            break
    macro = StepResult(obs=step.obs, reward=reward, terminated=term, truncated=trunc, final_obs=final_obs,
                       episode_returns=returns, episode_lengths=lengths, episode_successes=successes,
                       episode_metrics=metrics)
    return macro, executed
