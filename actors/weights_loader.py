"""A policy copy that takes the learner's weights: whole versions only, newest first, never torn.

Both holders of an acting copy use it: an actor with its own policy (``actors.inference: local``,
:mod:`actors.actor`) and an inference server that acts for many actors (``server``,
:mod:`actors.inference_server`). What arrives on the weights socket is offered to the gate
(:mod:`actors.weights_gate`); :meth:`WeightsLoader.load_due` loads the message that is due, if it
is newer than what the copy holds or comes from a restarted learner, and refuses a learner whose
frozen base model differs from ours.
"""

from __future__ import annotations

import logging
import time
from typing import Literal

import torch
from torch import nn

from actors.weights_gate import weights_gate
from shared import wire
from shared.shm_weights import ShmWeightsReader, load_published_

log = logging.getLogger("tandem.actor")

Outcome = Literal["loaded", "new_learner", "refused_base"] | None


class WeightsLoader:
    """The weights state of one acting policy copy.

    Args:
        policy: the copy (loaded in place).
        device: where it runs.
        actors_cfg: ``cfg.actors`` (the gate's study knobs).
        base_digest: the digest of the frozen base this copy loaded (the learner's must match).
        who: how log lines name the holder ("actor 3", "inference server 0").

    Attributes:
        version: the version the copy holds (-1: none yet).
        incarnation: the learner life whose weights it holds.
        torn: a load stopped half-way or read a rewritten shared-memory slot: never act with it.
        received_at: when the loaded version arrived.
        new_version: a version loaded and not acted with yet (the holder clears it).
    """

    def __init__(self, policy: nn.Module, device: torch.device, actors_cfg, base_digest: str, who: str):
        self.policy, self.device, self.base_digest, self.who = policy, device, base_digest, who
        self.gate = weights_gate(actors_cfg)
        self.shm = ShmWeightsReader()       # maps the learner's ring when weights come that way
        self.version = -1
        self.incarnation: str | None = None
        self.torn = False
        self.received_at = 0.0
        self.new_version = False

    def offer(self, msg) -> None:
        """Queue a weights message (``(td, meta)``) from the weights socket."""
        self.gate.offer(time.time(), msg)

    def newest_received(self) -> tuple[int, str | None]:
        """(version, incarnation) of the newest weights received: queued (a study knob's gate holds
        them back on purpose), else the loaded ones. What to tell the learner we have when asking it
        again for newer weights (``shared.transport.WeightsSubscriber.ask``)."""
        if self.gate.queue:
            meta = self.gate.queue[-1][1][1]
            version, incarnation = meta.get("version"), meta.get("incarnation")
            if isinstance(version, int) and not isinstance(version, bool):
                return version, incarnation if isinstance(incarnation, str) else None
        return self.version, self.incarnation

    def load_due(self) -> Outcome:
        """Load the newest queued weights that are due (if newer than ours, or from a restarted
        learner). Returns "loaded", "new_learner" (loaded, from another learner life), "refused_base"
        (the learner's frozen base differs: the holder must stop) or None (nothing loaded)."""
        due = self.gate.due(time.time(), self.version, self.incarnation, self.torn)
        if due is None:
            return None
        received, (td, meta) = due
        version, incarnation = meta.get("version"), meta.get("incarnation")
        if meta.get("kind") != "weights" or not (isinstance(version, int) and not isinstance(version, bool)
                                                 and version >= 0):
            return None
        # A restarted learner (a new incarnation) counts from its checkpoint's version, which may be
        # lower than ours: its versions replace ours, whatever the numbers.
        new_learner = (isinstance(incarnation, str) and self.incarnation is not None
                       and incarnation != self.incarnation)
        if version <= self.version and not new_learner:
            return None
        base = meta.get("base_digest")
        if base is not None and base != self.base_digest:
            log.error("%s: refused: the learner's base model (frozen weights digest %s) differs from ours (%s); "
                      "both must load the same policy.vla_config.model_path", self.who, str(base)[:16],
                      self.base_digest[:16])
            return "refused_base"
        try:
            loaded = load_published_(self.policy, td, meta, self.shm, self.device)
        except (ValueError, wire.WireError) as e:   # checked before any copy: ours are untouched
            log.warning("%s: weights v%d not loaded: %s", self.who, version, e)
            return None
        except Exception as e:   # anything else may have stopped a copy half-way: never act with it
            log.warning("%s: weights v%d not loaded: %s", self.who, version, e)
            self.torn = True
            return None
        if not loaded:
            log.warning("%s: shared-memory weights v%d were rewritten while read; waiting for the next",
                        self.who, version)
            self.torn = True
            return None
        if new_learner:
            log.info("%s: the learner restarted (incarnation %s, version %d; ours was %s, version %d): "
                     "taking its versions from here", self.who, incarnation, version, self.incarnation, self.version)
        if isinstance(incarnation, str):
            self.incarnation = incarnation
        self.version, self.received_at, self.new_version = version, received, True
        self.torn = False
        return "new_learner" if new_learner else "loaded"

    def close(self) -> None:
        self.shm.close()
