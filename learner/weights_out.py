"""Weights out: versioned weights messages to the actors, and admission credits between them.

:class:`WeightsOut` is the learner's one sender of weights. It owns the transport choice
(``learner.weights_transport``): the whole message through the publisher (ZeroMQ, or an in-process
sink), or, with ``shm``, a header through the publisher and the tensors through a shared-memory ring
(``shared/shm_weights.py``) that actors on this host read in place. Every message carries the version,
the learner life (``incarnation``), the frozen base's digest, the env steps so far and, per actor,
the rollouts the learner has finished with (``consumed``), which is what ``lag_policy: pace`` admits on.
"""

from __future__ import annotations

import hashlib
import time
from pathlib import Path
from typing import Any, Protocol

import torch
from tensordict import TensorDict, TensorDictBase

from shared.policies import weights_td
from shared.shm_weights import ShmWeightsWriter, default_path

KEEP_PUBLISH_TIMES = 1000   # versions whose publication time is kept (weight-sync delays of late actors)


class Publisher(Protocol):
    def publish(self, td: TensorDictBase, **meta: Any) -> None: ...

    def send_control(self, **meta: Any) -> None: ...


class ListPublisher:
    """In-process publisher for tests: keeps every (weights, meta) it was given (weights cloned), and
    control messages (stop, credit) apart, as the socket does (they never replace the weights)."""

    def __init__(self):
        self.published: list[tuple[TensorDictBase, dict]] = []
        self.controls: list[dict] = []

    def publish(self, td: TensorDictBase, **meta: Any) -> None:
        self.published.append((td.clone(), meta))

    def send_control(self, **meta: Any) -> None:
        self.controls.append(meta)


class WeightsOut:
    """Publishes `policy`'s trained tensors as versioned weights messages.

    Args:
        publisher: the socket (``shared/transport.py``) or an in-process sink.
        policy: the learner's policy; only its published state travels (``shared/policies``).
        device: where the policy lives (a GPU policy is copied to the host once per message).
        incarnation, base_digest: this learner life's id and the frozen base's digest, in every message.
        shm_slots: with a number, the tensors go through a shared-memory ring of that many slots named
            after `run_dir`; None sends them in the message.
        shm_device: the ring's copies in this device's memory, shared by CUDA IPC
            (``learner.weights_transport: "cuda_ipc"``); None keeps them in the shared-memory file.
    """

    def __init__(self, publisher: Publisher, policy: torch.nn.Module, device: torch.device, incarnation: str,
                 base_digest: str, shm_slots: int | None = None, run_dir: Path | None = None,
                 shm_device: torch.device | None = None):
        self.publisher, self.policy, self.device = publisher, policy, device
        self.incarnation, self.base_digest = incarnation, base_digest
        self.publish_times: dict[int, float] = {}   # version -> wall time it was published (recent ones)
        self._credit_sent: list[int] = []
        self._credit_time = 0.0
        self.version = -1   # the last version published: credits name it (where a paced rollout starts)
        self.shm_writer = None
        if shm_slots is not None:
            tag = hashlib.sha1(str(run_dir or id(self)).encode()).hexdigest()[:12]
            self.shm_writer = ShmWeightsWriter(weights_td(policy), default_path(tag), shm_slots, device=shm_device)

    def publish(self, version: int, env_steps: int, finished: list[int], final: bool = False) -> None:
        """One weights message for `version` (`final`: the last one, re-sending the current version)."""
        # A copy: ZeroMQ may still be reading these bytes when the next optimiser step runs.
        now = time.time()
        if self.shm_writer is not None:
            # One copy into the shared-memory ring (it also is the snapshot); the message says where
            # and goes first, so that actors copy each chunk while the next one is written.
            where = self.shm_writer.begin(version)
            weights, extra = TensorDict({}, batch_size=[]), where
        else:
            weights = weights_td(self.policy)
            weights, extra = (weights.clone() if self.device.type == "cpu" else weights.cpu()), {}
        self.version = version
        if not final:
            self.publish_times[version] = now
            for old in [v for v in self.publish_times if v < version - KEEP_PUBLISH_TIMES]:
                del self.publish_times[old]
        self._credit_sent, self._credit_time = finished, now
        # `consumed`: per actor, its rollouts the learner has consumed or dropped (lag_policy "pace").
        self.publisher.publish(weights, kind="weights", version=version, incarnation=self.incarnation,
                               base_digest=self.base_digest, env_steps=env_steps, final=final, time=now,
                               consumed=finished, **extra)
        if self.shm_writer is not None:
            self.shm_writer.write_body(weights_td(self.policy), version)

    def send_credit(self, finished: list[int], min_interval_s: float = 0.2) -> None:
        """Tell actors about rollouts finished (mostly dropped ones) since the last message, so that
        none waits for a credit only the next update would bring; at most every `min_interval_s`."""
        now = time.time()
        if finished != self._credit_sent and now - self._credit_time >= min_interval_s:
            # `version`: the newest the learner has published. An actor whose credit this is acts its
            # next rollout with it at least (actors.inference "server" asks the server for it).
            self.publisher.send_control(kind="credit", consumed=finished, time=now, incarnation=self.incarnation,
                                        version=self.version)
            self._credit_sent, self._credit_time = finished, now
