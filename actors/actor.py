"""Actor process: steps the simulator, runs the inference copy of the policy, pushes rollouts.

It does not train, checkpoint or log losses; those belong to the learner. Weights are taken only
at rollout boundaries, so every step of a rollout is acted by the version stamped on it.
"""

from __future__ import annotations

import logging
import signal
import threading
import time
from typing import Protocol

import numpy as np
import torch
import zmq
from tensordict import TensorDictBase

from actors.rollout import Collector
from shared import wire
from shared.config import Config
from shared.envs import make_env
from shared.policies import load_weights_, make_policy
from shared.transport import RolloutPusher, WeightsSubscriber

log = logging.getLogger("tandem.actor")


class WeightsSource(Protocol):
    def newest(self, timeout_ms: int = 0) -> tuple[TensorDictBase, dict] | None: ...


class RolloutSink(Protocol):
    def send(self, frames: list, timeout_ms: int) -> zmq.MessageTracker | None: ...


class Actor:
    """One actor: env + policy copy + collector, wired to a weights source and a rollout sink.

    ``run`` loops: take the newest weights (every `sync_every` rollouts; in standard mode wait for
    a version newer than the last rollout's), collect, send. It ends on a stop message, on
    `stop_event`, or when the learner has been unreachable for `learner_timeout_s`.
    """

    def __init__(self, cfg: Config, actor_id: int, weights: WeightsSource, sink: RolloutSink,
                 device: str | None = None, stop_event: threading.Event | None = None,
                 learner_timeout_s: float = 120.0):
        self.cfg, self.actor_id = cfg, actor_id
        self.device = torch.device(device or cfg.actors.devices[actor_id % len(cfg.actors.devices)])
        self.weights, self.sink = weights, sink
        self.stop_event = stop_event or threading.Event()
        self.learner_timeout_s = learner_timeout_s
        seed = cfg.trainer.seed * 100_003 + 1_000 * actor_id
        torch.manual_seed(seed)
        self.env = make_env(cfg.env.id, cfg.actors.num_envs, cfg.env.cfg, self.device)
        self.policy = make_policy(cfg, self.env.spec).to(self.device).eval()
        slow = not cfg.actors.slow_actor_ids or actor_id in cfg.actors.slow_actor_ids
        self.collector = Collector(self.env, self.policy, cfg.trainer.buffer_size, seed=seed,
                                   step_delay_s=cfg.actors.slowdown_s if slow else 0.0,
                                   inference_latency_s=cfg.actors.inference_latency_s)
        self.version = -1          # no weights yet
        self.seq = 0
        self._trackers: list[zmq.MessageTracker | None] = [None, None]
        self.rollouts_since_sync = 0
        self.failed = False   # set when the actor gives up on an unreachable learner
        self._last_acted = -1
        self._stash: tuple[TensorDictBase, dict] | None = None   # newest weights seen mid-rollout

    # ------------------------------------------------------------------ weights
    def _apply(self, msg: tuple[TensorDictBase, dict] | None) -> bool:
        """Load weights from `msg` if newer. Returns False when the message asks us to stop."""
        if msg is None:
            return True
        td, meta = msg
        if meta.get("kind") == "stop":
            log.info("actor %d: stop requested by the learner", self.actor_id)
            self.stop_event.set()
            return False
        version = meta.get("version")
        if meta.get("kind") == "weights" and isinstance(version, int) and version > self.version:
            load_weights_(self.policy, td.to(self.device))
            self.version = version
        return True

    def _wait_for_version(self, newer_than: int) -> bool:
        """Block until weights newer than `newer_than` are loaded (or stop). False on stop/timeout."""
        if self._stash is not None:  # weights that arrived during the last rollout come first
            msg, self._stash = self._stash, None
            if not self._apply(msg):
                return False
        deadline = time.monotonic() + self.learner_timeout_s
        while self.version <= newer_than:
            if self.stop_event.is_set() or not self._apply(self.weights.newest(timeout_ms=100)):
                return False
            if time.monotonic() > deadline:
                log.error("actor %d: no weights newer than version %d from the learner for %.0f s; exiting",
                          self.actor_id, newer_than, self.learner_timeout_s)
                self.failed = True
                self.stop_event.set()
                return False
        return True

    # ------------------------------------------------------------------ main loop
    def _send(self, rollout: TensorDictBase, stats, index: int) -> bool:
        frames = wire.encode(rollout, kind="rollout", actor=self.actor_id, seq=self.seq,
                             policy_version=self.version, env_steps=rollout.numel(),
                             episode_returns=stats.episode_returns, episode_lengths=stats.episode_lengths,
                             episode_successes=stats.episode_successes,
                             collect_s=stats.collect_s, inference_s=stats.inference_s, env_s=stats.env_s,
                             time=time.time())
        deadline = time.monotonic() + self.learner_timeout_s
        while not self.stop_event.is_set():
            tracker = self.sink.send(frames, timeout_ms=100)
            if tracker is not None:
                self._trackers[index] = tracker
                self.seq += 1
                return True
            if not self._apply(self.weights.newest(0)):
                return False
            if time.monotonic() > deadline:
                log.error("actor %d: the learner has not taken a rollout for %.0f s; exiting",
                          self.actor_id, self.learner_timeout_s)
                self.failed = True
                self.stop_event.set()
        return False

    def _group_seeds(self) -> list[int] | None:
        """GRPO: one seed per env, shared within each group of `group_size` envs, new for every
        group and rollout (with `reset_every_rollout`; otherwise only at the first rollout)."""
        alg = self.cfg.algorithm
        if alg.name != "grpo" or (self.seq > 0 and not alg.cfg.reset_every_rollout):
            return None
        gs = alg.cfg.group_size
        groups = self.cfg.actors.num_envs // gs
        seeds = [int(np.random.SeedSequence([self.cfg.trainer.seed, self.actor_id, self.seq, g]).generate_state(1)[0])
                 for g in range(groups)]
        return [seeds[i // gs] for i in range(groups * gs)]

    def _between_steps(self) -> bool:
        """Asked between env steps: True to abandon the rollout (stop signal or stop message).
        Weights that arrive mid-rollout are kept for the next rollout boundary, never loaded here."""
        if self.stop_event.is_set():
            return True
        msg = self.weights.newest(0)
        if msg is not None:
            if msg[1].get("kind") == "stop":
                return not self._apply(msg)
            self._stash = msg
        return False

    def _wait_storage_free(self, index: int) -> None:
        tracker = self._trackers[index]
        while tracker is not None and not tracker.done and not self.stop_event.is_set():
            try:
                tracker.wait(0.1)
            except zmq.NotDone:
                pass
        self._trackers[index] = None

    def step_once(self) -> bool:
        """Take weights if due, collect one rollout and send it. Returns False when the actor should stop.

        In standard mode the actor first waits for a version newer than the one its previous
        rollout was acted by: the learner trains only on its current version's data.
        """
        newer_than = self._last_acted if self.cfg.trainer.buffer_type == "standard" else -1
        if self.version <= newer_than and not self._wait_for_version(newer_than):
            return False
        if self.rollouts_since_sync >= self.cfg.actors.sync_every:
            msg = self.weights.newest(0) or self._stash   # anything still queued is newer than the stash
            self._stash = None
            if not self._apply(msg):
                return False
            self.rollouts_since_sync = 0
        self._wait_storage_free(self.collector.next_index)
        out = self.collector.collect(self.version, reset_seeds=self._group_seeds(), should_stop=self._between_steps)
        if out is None:
            return False
        rollout, stats, index = out
        self._last_acted = self.version
        if not self._send(rollout, stats, index):
            return False
        self.rollouts_since_sync += 1
        return True

    def run(self) -> int:
        if not self._wait_for_version(-1):
            return 1 if self.failed else 0
        log.info("actor %d: running on %s with weights version %d", self.actor_id, self.device, self.version)
        while not self.stop_event.is_set() and self.step_once():
            pass
        return 1 if self.failed else 0

    def close(self) -> None:
        self.env.close()


def run_actor_process(cfg: Config, actor_id: int, endpoints: dict[str, str], device: str | None = None,
                      learner_timeout_s: float = 120.0) -> int:
    """Entry point of one actor process: sockets, signal handling, run, clean close."""
    torch.set_num_threads(cfg.actors.torch_threads)
    stop = threading.Event()

    def _on_signal(signum, frame):  # only set a flag: never raise inside a ZeroMQ call
        stop.set()

    signal.signal(signal.SIGINT, _on_signal)
    signal.signal(signal.SIGTERM, _on_signal)
    ctx = zmq.Context()
    sub = WeightsSubscriber(ctx, endpoints["weights"])
    push = RolloutPusher(ctx, endpoints["rollouts"])
    actor = None
    try:
        actor = Actor(cfg, actor_id, sub, push, device=device, stop_event=stop,
                      learner_timeout_s=learner_timeout_s)
        return actor.run()
    finally:
        if actor is not None:
            actor.close()
        sub.close()
        push.close()
        ctx.term()
