"""An actor's rollouts on their way to the learner.

A rollout goes whole in one ZeroMQ message (:mod:`shared.wire`), or, with
``actors.rollout_transport: ring``, into one of the actor's slots of the learner's shared-memory
ring with only its header in the message (:mod:`shared.rollout_ring`). ZeroMQ sends the tensors
without copying them: the collector's storage a rollout aliases must not be refilled until ZeroMQ
has read it (:meth:`RolloutSender.wait_storage_free`); a ring slot's copy frees it at once.
"""

from __future__ import annotations

import threading
import time
from typing import Callable, Protocol

import zmq
from tensordict import TensorDict, TensorDictBase

from shared import wire
from shared.rollout_ring import RingFull


class RolloutSink(Protocol):
    def send(self, frames: list, timeout_ms: int) -> zmq.MessageTracker | None: ...


class SendFailed(Exception):
    """A rollout that cannot go: the learner took none, or freed no ring slot, for the actor's
    learner timeout (`timed_out`), or the actor's ring is no longer its own."""

    def __init__(self, why: str, timed_out: bool):
        super().__init__(why)
        self.timed_out = timed_out


class RolloutSender:
    """Sends an actor's rollouts to `sink`, or through `ring` (None: no ring).

    Args:
        sink: the learner's rollout socket (``send(frames, timeout_ms)``: a tracker once taken).
        ring: the actor's producer side of the learner's ring (:func:`shared.rollout_ring.attach_producer`), or None.
        stop: the actor's stop event: a send or a wait ends when it is set.
        poll: the actor's look at the weights socket, between tries (False: the learner said stop).
        timeout_s: how long the learner may take no rollout before :class:`SendFailed`.
        num_buffers: the collector's storages (a tracker is kept for each).
    """

    def __init__(self, sink: RolloutSink, ring, stop: threading.Event, poll: Callable[[], bool],
                 timeout_s: float, num_buffers: int = 2):
        self.sink, self.ring, self.stop, self.poll, self.timeout_s = sink, ring, stop, poll, timeout_s
        self._trackers: list[zmq.MessageTracker | None] = [None] * num_buffers

    def send(self, rollout: TensorDictBase, meta: dict, index: int) -> bool:
        """Send `rollout`, the collector's storage `index`, with `meta` (:class:`shared.rollout.RolloutMeta`'s).
        True once the learner's socket took it; False on stop. Raises :class:`SendFailed`."""
        if self.ring is not None:
            header = self._to_ring(rollout)
            if header is None:
                return False
            frames = wire.encode(TensorDict({}, batch_size=[]), **meta, ring=header)
        else:
            frames = wire.encode(rollout, **meta)
        deadline = time.monotonic() + self.timeout_s
        while not self.stop.is_set():
            tracker = self.sink.send(frames, timeout_ms=100)
            if tracker is not None:
                # with the ring, the header's frame is our own bytes: the rollout storage is free at once
                self._trackers[index] = tracker if self.ring is None else None
                return True
            if not self.poll():
                return False
            if time.monotonic() > deadline:
                raise SendFailed("the learner has not taken a rollout", timed_out=True)
        return False

    def _to_ring(self, rollout: TensorDictBase) -> dict | None:
        """Copy `rollout` into a free slot of our ring and return its header; None on stop."""
        try:
            slot = self.ring.claim(self.timeout_s, should_stop=lambda: self.stop.is_set() or not self.poll())
        except RingFull:
            raise SendFailed("no rollout ring slot came free (the learner released none)", timed_out=True) from None
        except RuntimeError as e:   # another actor attached to our ring: ours is no longer ours to write
            raise SendFailed(str(e), timed_out=False) from e
        if slot is None:
            return None
        return self.ring.write(slot, rollout)

    def wait_storage_free(self, index: int) -> None:
        """Until ZeroMQ has read the last rollout sent from the collector's storage `index` (or stop)."""
        tracker = self._trackers[index]
        while tracker is not None and not tracker.done and not self.stop.is_set():
            try:
                tracker.wait(0.1)
            except zmq.NotDone:
                pass
        self._trackers[index] = None

    def close(self) -> None:
        if self.ring is not None:
            self.ring.close()
