"""Actor process: steps the simulator, runs the inference copy of the policy, pushes rollouts.

It does not train, checkpoint or log losses; those belong to the learner. Weights are taken only
at rollout boundaries, so every step of a rollout is acted by the version stamped on it.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from pathlib import Path
from typing import Protocol

import torch
import zmq
from tensordict import TensorDictBase

from actors.emulated_device import device_for
from actors.pacing import Credits
from actors.inference_topology import endpoint_path, server_of
from actors.remote_policy import InferenceRefused, InferenceStopped, InferenceUnavailable, RemotePolicy
from actors.rollout import Collector, EnvParts, sends_bootstrap_obs
from actors.rollout_sender import RolloutSender, RolloutSink, SendFailed
from actors.weights_loader import WeightsLoader
from shared import keys
from shared.chunks import actions_per_call, env_steps_of
from shared.config import Config, weights_at
from shared.envs import make_env
from shared.instructions import instruction_tokenizer
from shared.rollout import RolloutMeta, actor_seed, group_seeds, policy_layout
from shared.rollout_ring import attach_producer
from shared.policies import frozen_digest, has_critic, make_policy
from shared.security import client_from_config
from shared.teardown import stop_on_signals
from shared.transport import RESEND_AFTER_S, RolloutPusher, WeightsSubscriber

log = logging.getLogger("tandem.actor")


class WeightsSource(Protocol):
    def newest(self, timeout_ms: int = 0) -> tuple[TensorDictBase, dict] | None: ...

    # optional: ask(version, incarnation, weights=True): the learner re-sends what a wait lacks (shared.transport)


class Actor:
    """One actor: env + policy copy + collector, wired to a weights source and a rollout sink.

    ``run`` loops: take the newest weights (every `sync_every` rollouts; in standard mode wait for
    a version newer than the last rollout's), collect, send. It ends on a stop message, on
    `stop_event`, or when the learner has been unreachable for `learner_timeout_s`.
    """

    def __init__(self, cfg: Config, actor_id: int, weights: WeightsSource, sink: RolloutSink,
                 device: str | None = None, stop_event: threading.Event | None = None,
                 learner_timeout_s: float = 120.0, lock_dir: str | Path | None = None,
                 rollout_ring: str | None = None, remote: RemotePolicy | None = None):
        self.cfg, self.actor_id = cfg, actor_id
        self.device = torch.device(device or cfg.actors.devices[actor_id % len(cfg.actors.devices)])
        self.weights, self.sink = weights, sink
        self.stop_event = stop_event or threading.Event()
        self.learner_timeout_s = learner_timeout_s
        seed = actor_seed(cfg, actor_id)
        torch.manual_seed(seed)
        # with a server, actors.server_splits parts of the envs, each with its own request in flight
        k = cfg.actors.server_splits if remote is not None else 1
        self.env_device = torch.device(cfg.env.device or self.device)
        envs = [make_env(cfg.env.id, cfg.actors.num_envs // k, cfg.env.cfg, self.env_device,
                         tokenizer=instruction_tokenizer(cfg)) for _ in range(k)]
        self.env = envs[0] if k == 1 else EnvParts(envs)
        # actors.inference "server": the policy is the device's inference server (actors/inference.py);
        # this process only steps its envs, and holds no copy of the model
        self.remote = remote
        if remote is not None:
            self.policy, self.base_digest = remote, remote.base_digest
            remote.should_stop = self._between_steps
        else:
            self.policy = make_policy(cfg, self.env.spec).to(self.device).eval()
            self.base_digest = frozen_digest(self.policy)   # the frozen base it loaded: must be the learner's
        slow = not cfg.actors.slow_actor_ids or actor_id in cfg.actors.slow_actor_ids
        if cfg.actors.emulated_devices and lock_dir is None:
            raise ValueError("actors.emulated_devices needs a directory for the devices' lock files (the run "
                             "directory: give the actor --run-dir or --endpoints)")
        self.emulated_device = device_for(cfg.actors.emulated_devices, actor_id, lock_dir or ".")
        local = remote is None   # a server applies the emulated latency to its batches itself
        self.collector = Collector(self.env, self.policy, cfg.trainer.buffer_size, seed=seed,
                                   step_delay_s=cfg.actors.slowdown_s if slow else 0.0,
                                   inference_latency_s=cfg.actors.inference_latency_s if local else 0.0,
                                   inference_latency_per_env_s=cfg.actors.inference_latency_per_env_s if local else 0.0,
                                   device_lock=self.emulated_device,
                                   bootstrap_obs=sends_bootstrap_obs(cfg, has_critic(self.policy)),
                                   actions_per_call=actions_per_call(cfg, self.policy),
                                   gamma=cfg.algorithm.cfg.gamma)
        # actors.rollout_transport "ring": rollouts go into our slots of the learner's ring, the message
        # carries only the header (shared/rollout_ring.py); the file is checked here, before any rollout
        ring = attach_producer(cfg, self.env.spec, has_critic(self.policy), actor_id, rollout_ring,
                               policy_layout(self.policy))
        self.sender = RolloutSender(sink, ring, self.stop_event, lambda: self._poll(0), learner_timeout_s)
        self.seq = 0
        self.rollouts_since_sync = 0
        self.failed = False   # set when the actor gives up on an unreachable learner
        self._last_acted = -1
        # The weights this copy holds, and those seen but not loaded yet: the gate says which is due
        # (actors/weights_gate.py: the newest at once, or held back by the study knobs).
        # (With a server it loads nothing: the version and incarnation are those its replies carry.)
        self.loader = WeightsLoader(self.policy if remote is None else None, self.device, cfg.actors,
                                    self.base_digest, f"actor {actor_id}")
        self._synced: list[list] = []                # [[version, received, first acted]] for the next rollout
        self.credits = Credits(cfg, actor_id)        # lag_policy pace: our rollouts the learner has not consumed
        self.pace = cfg.trainer.buffer_type != "standard" and cfg.trainer.lag_policy == "pace"
        # no study knob holds weights back: the server loads an announced version as soon as it has it
        # (with weights_lag_versions or weights_delay_s it loads it late on purpose, and a paced actor
        # asking for it would wait for what the learner cannot publish without its rollouts)
        self._plain_gate = not cfg.actors.weights_lag_versions and not cfg.actors.weights_delay_s
        # in-flight weight updates: vla mode only (standard mode trains each version on its own data)
        self.in_flight = weights_at(cfg) == "step"

    # ------------------------------------------------------------------ weights
    def _poll(self, timeout_ms: int = 0) -> bool:
        """Queue the newest weights message, if any. Returns False when the learner asks us to stop."""
        msg = self.weights.newest(timeout_ms)
        if msg is None:
            return True
        if msg[1].get("kind") == "stop":
            log.info("actor %d: stop requested by the learner", self.actor_id)
            self.stop_event.set()
            return False
        if self.remote is None:   # with a server, the server takes the weights
            self.loader.offer(msg)
        return True

    # The loader's state, read and written under the names the rest of the actor (and its tests) use.
    version = property(lambda self: self.loader.version, lambda self, v: setattr(self.loader, "version", v))
    incarnation = property(lambda self: self.loader.incarnation,
                           lambda self, v: setattr(self.loader, "incarnation", v))
    _torn = property(lambda self: self.loader.torn, lambda self, v: setattr(self.loader, "torn", v))
    _new_version = property(lambda self: self.loader.new_version,
                            lambda self, v: setattr(self.loader, "new_version", v))
    _received_at = property(lambda self: self.loader.received_at)

    @property
    def _incoming(self):
        """Weights messages received and not loaded yet (the gate's queue), oldest first."""
        return self.loader.gate.queue

    def _load_due(self) -> None:
        """Load the newest queued weights that are due (if newer than ours): at least
        `weights_delay_s` old, or `weights_lag_versions` behind the newest received."""
        outcome = self.loader.load_due()
        if outcome == "refused_base":
            self.failed = True
            self.stop_event.set()
        elif outcome == "new_learner":
            self._last_acted = -1                       # standard mode: act with its version at once
            self.credits.restart(self.seq)              # pacing counts start again

    def _give_up(self, why: str) -> bool:
        """The learner has been unreachable for `learner_timeout_s`: log, mark failed, stop. Returns False."""
        return self._fail(f"{why} for {self.learner_timeout_s:.0f} s")

    def _fail(self, why: str) -> bool:
        """Log `why`, mark the actor failed and stop it. Returns False."""
        log.error("actor %d: %s; exiting", self.actor_id, why)
        self.failed = True
        self.stop_event.set()
        return False

    def _asker(self, weights: bool):
        """For a wait on the learner: a function that, every :data:`RESEND_AFTER_S` of the wait, asks
        the learner again for its newest credits and (`weights`) its newest weights if newer than the
        newest we have received, in case ZeroMQ dropped the message we wait for at a high-water mark
        (it does so without a word). A credit wait asks for credits alone: a lost weights message
        there costs a version, never a stall, and weights re-sent go to every actor."""
        ask = getattr(self.weights, "ask", None)     # in-process sources (tests) lose nothing
        next_at = time.monotonic() + RESEND_AFTER_S

        def maybe_ask() -> None:
            nonlocal next_at
            if ask is not None and time.monotonic() >= next_at:
                ask(*self.loader.newest_received(), weights=weights)
                next_at = time.monotonic() + RESEND_AFTER_S
        return maybe_ask

    def _wait_for_version(self, newer_than: int) -> bool:
        """Block until weights newer than `newer_than` are loaded (or stop). False on stop/timeout."""
        incarnation = self.incarnation
        self._load_due()
        deadline = time.monotonic() + self.learner_timeout_s
        ask = self._asker(weights=True)
        # A restarted learner's weights end the wait whatever their version (see _load_due).
        while self.version <= newer_than and (incarnation is None or self.incarnation == incarnation):
            if self.stop_event.is_set() or not self._poll(timeout_ms=100):
                return False
            self._load_due()
            ask()
            if time.monotonic() > deadline:
                return self._give_up(f"no weights newer than version {newer_than} from the learner")
        return True

    # ------------------------------------------------------------------ main loop
    def _send(self, rollout: TensorDictBase, stats, index: int) -> bool:
        meta = RolloutMeta.of(self.actor_id, self.seq, stats, policy_version=self.version,
                              incarnation=self.incarnation, env_steps=env_steps_of(rollout), base_digest=self.base_digest,
                              synced=self._synced, time=time.time())
        self._synced = []
        try:
            sent = self.sender.send(rollout, meta.to_meta(), index)
        except SendFailed as e:
            return self._give_up(str(e)) if e.timed_out else self._fail(str(e))
        if sent:
            self.seq += 1
        return sent

    def _between_steps(self) -> bool:
        """Asked between env steps: True to abandon the rollout (stop signal or stop message).
        With ``weights_at: rollout``, weights that arrive mid-rollout wait for the next rollout
        boundary; with ``step`` they are loaded by :meth:`_refresh`, right after this."""
        return self.stop_event.is_set() or not self._poll(0)

    def _refresh(self) -> int | None:
        """``weights_at: step``: load the newest due weights between two env steps (the collector
        is not inside the policy now) and return the version the next step acts with. A load that
        left the policy torn waits for the next whole version: no step acts with a mixed model."""
        self._load_due()
        if self._torn and not self._wait_for_version(self.version):
            return None               # stopped or gave up while waiting: the rollout is abandoned
        if self._new_version:         # the weight-sync delay ends at the first action with it
            self._synced.append([self.version, self._received_at, time.time()])
            self._new_version = False
        return self.version

    def _inflight(self) -> int:
        """This actor's rollouts sent but not yet consumed or dropped by the learner, as far as we know."""
        return self.credits.inflight(self.weights, self.seq, self.incarnation)

    def _wait_for_credit(self) -> bool:
        """lag_policy "pace": wait while `max_inflight` of our rollouts are still unconsumed at the
        learner, instead of producing data that would be too old by the time it is trained on."""
        deadline = time.monotonic() + self.learner_timeout_s
        ask = self._asker(weights=False)
        while self._inflight() >= self.credits.max_inflight:
            if self.stop_event.is_set() or not self._poll(timeout_ms=50):
                return False
            ask()
            if time.monotonic() > deadline:
                return self._give_up("the learner consumed none of our rollouts")
        return True

    def step_once(self) -> bool:
        """Take weights if due, collect one rollout and send it. Returns False when the actor should stop.

        In standard mode the actor first waits for a version newer than the one its previous
        rollout was acted by: the learner trains only on its current version's data.
        """
        if self.remote is not None:
            return self._step_served()
        newer_than = self._last_acted if self.cfg.trainer.buffer_type == "standard" else -1
        if self._torn:
            newer_than = max(newer_than, self.version)
        if self.version <= newer_than and not self._wait_for_version(newer_than):
            return False
        if self.pace and not self._wait_for_credit():
            return False
        if self.rollouts_since_sync >= self.cfg.actors.sync_every:
            if not self._poll(0):
                return False
            self._load_due()
            self.rollouts_since_sync = 0
        if self._torn and not self._wait_for_version(self.version):
            return False
        if self._new_version:   # the weight-sync delay ends here: the first action with this version
            self._synced.append([self.version, self._received_at, time.time()])
            self._new_version = False
        self.sender.wait_storage_free(self.collector.next_index)
        seeds = group_seeds(self.cfg, self.actor_id, self.seq)
        out = self.collector.collect(self.version, reset_seeds=seeds, should_stop=self._between_steps,
                                     refresh=self._refresh if self.in_flight else None)
        if out is None:
            return False
        rollout, stats, index = out
        self._last_acted = self.version
        if not self._send(rollout, stats, index):
            return False
        self.rollouts_since_sync += 1
        return True

    def _step_served(self) -> bool:
        """:meth:`step_once` with an inference server acting: the versions come with its replies
        (standard mode asks it for the version the learner trains next; lag_policy pace for the newest
        the learner announced, which the credit allowing this rollout names)."""
        if not self._poll(0) or (self.pace and not self._wait_for_credit()):
            return False
        if self.cfg.trainer.buffer_type == "standard":
            self.remote.min_version = self._last_acted + 1
        elif self.pace and self._plain_gate:   # the newest version announced, as a local actor loads it first
            announced = getattr(self.weights, "announced", None)
            if announced is not None:
                self.remote.min_version, self.remote.min_incarnation = announced
        self.sender.wait_storage_free(self.collector.next_index)
        seeds = group_seeds(self.cfg, self.actor_id, self.seq)
        try:
            out = self.collector.collect(self.version, reset_seeds=seeds, should_stop=self._between_steps)
        except InferenceStopped:
            return False
        except InferenceUnavailable as e:
            return self._give_up(str(e))
        except InferenceRefused as e:   # our envs gave observations the policy cannot act on
            return self._fail(str(e))
        if out is None:
            return False
        rollout, stats, index = out
        r = self.remote
        if self.incarnation is not None and r.incarnation != self.incarnation:   # the learner restarted
            self.credits.restart(self.seq)
        self.loader.version, self.loader.incarnation = r.version, r.incarnation
        # standard mode: a rollout of several versions (new weights mid-rollout) the learner drops as
        # stale, and trains next on the newest's data: ask for that one again, not the one after
        whole = bool(rollout[keys.POLICY_VERSION].eq(r.version).all())
        self._last_acted = r.version if whole else r.version - 1
        self._synced, r.synced = r.synced, []
        return self._send(rollout, stats, index)

    def run(self) -> int:
        if self.remote is not None:   # the server's replies bring the weights: nothing to wait for here
            log.info("actor %d: acting through the inference server (%s), envs on %s", self.actor_id,
                     self.remote.path, self.env_device)
        elif self._wait_for_version(-1):
            log.info("actor %d: running on %s%s with weights version %d", self.actor_id, self.device,
                     f" (envs on {self.env_device})" if self.env_device != self.device else "", self.version)
        else:
            return 1 if self.failed else 0
        while not self.stop_event.is_set() and self.step_once():
            pass
        return 1 if self.failed else 0

    def close(self) -> None:
        self.loader.close()
        if self.remote is not None:
            self.remote.close()
        self.sender.close()
        self.env.close()
        if self.emulated_device is not None:
            self.emulated_device.close()


def run_actor_process(cfg: Config, actor_id: int, endpoints: dict[str, str], device: str | None = None,
                      learner_timeout_s: float = 120.0, lock_dir: str | Path | None = None) -> int:
    """Entry point of one actor process: sockets, signal handling, run, clean close."""
    torch.set_num_threads(cfg.actors.torch_threads)
    if cfg.actors.nice:
        os.nice(cfg.actors.nice)
    stop = threading.Event()
    stop_on_signals(stop)
    curve = client_from_config(cfg)   # bad key files fail here, before any socket exists
    ctx = zmq.Context()
    # with an inference server, the server takes the weights: the actor needs only stop and credits
    sub = WeightsSubscriber(ctx, endpoints["weights"], curve=curve, weights=cfg.actors.inference != "server")
    # Several learner ranks: actor i sends its rollouts to rank i % W (learner/distributed.py).
    by_rank = endpoints.get("rollouts_by_rank")
    push = RolloutPusher(ctx, by_rank[actor_id % len(by_rank)] if by_rank else endpoints["rollouts"], curve=curve)
    actor = remote = None
    try:
        if cfg.actors.inference == "server":
            if lock_dir is None:
                raise ValueError("actors.inference \"server\" needs the run directory (give the actor --run-dir or "
                                 "--endpoints): the servers' endpoint files are there")
            remote = RemotePolicy.connect(ctx, endpoint_path(lock_dir, server_of(cfg, actor_id)), actor_id,
                                          timeout_s=learner_timeout_s, curve=curve, stop=stop)
            if remote is None:
                return 0    # stopped while waiting for the server
        actor = Actor(cfg, actor_id, sub, push, device=device, stop_event=stop,
                      learner_timeout_s=learner_timeout_s, lock_dir=lock_dir,
                      rollout_ring=endpoints.get("rollout_ring"), remote=remote)
        return actor.run()
    finally:
        if actor is not None:
            actor.close()
        elif remote is not None:
            remote.close()
        sub.close()
        push.close()
        ctx.term()
