"""The actor's side of issue 12, in one process: weights messages that do not fit never stop an
actor, and a restarted learner (a new incarnation) is followed even when its version is lower."""

from __future__ import annotations

import random

import torch

from actors.actor import Actor
from learner.learner import Learner, ListPublisher
from shared.policies import weights_td
from tests.test_learner_component import CaptureSink, PublisherSource, small_config


class Scripted:
    """A weights source that returns the queued messages one by one (then the last, forever)."""

    def __init__(self, messages):
        self.messages = list(messages)
        self.consumed = None
        self.consumed_from = None

    def newest(self, timeout_ms=0):
        if not self.messages:
            return None
        td, meta = self.messages.pop(0) if len(self.messages) > 1 else self.messages[0]
        if isinstance(meta.get("consumed"), list):
            self.consumed, self.consumed_from = meta["consumed"], meta.get("incarnation")
        return td.clone(), dict(meta)


def test_a_restarted_learner_with_a_lower_version_is_followed_at_once():
    cfg = small_config()                     # standard mode: the actor waits for a newer version
    old = Learner(cfg, run_dir=None, publisher=ListPublisher())
    old.version = 7
    old.publish()
    source = PublisherSource(old.publisher)
    sink = CaptureSink()
    actor = Actor(cfg, 0, source, sink, learner_timeout_s=2.0)
    assert actor.step_once() and actor.version == 7 and actor.incarnation == old.incarnation
    assert sink.messages[-1][1]["incarnation"] == old.incarnation
    # the learner dies; a new one resumes from an older checkpoint, at version 5
    new = Learner(cfg, run_dir=None, publisher=old.publisher)
    new.version = 5
    new.publish(event="resume")
    assert actor.step_once(), "the actor waited for a version > 7 instead of taking the new learner's"
    assert actor.version == 5 and actor.incarnation == new.incarnation and not actor.failed
    td, meta = sink.messages[-1]
    assert int(td["policy_version"].max()) == 5 and meta["incarnation"] == new.incarnation
    new.ingest(td, meta)                     # acted by the new learner's weights: trained on
    assert len(new.buffer) == 1
    stale_td, stale_meta = sink.messages[0]  # acted by the old learner's v7: dropped, not mistaken for fresh
    stale_td = stale_td.clone()
    stale_td["policy_version"].fill_(5)
    new.ingest(stale_td, stale_meta)
    assert len(new.buffer) == 1 and new.counts["dropped_other"] == 1


def test_pacing_credits_restart_with_a_new_learner():
    cfg = small_config(buffer_type="vla", lag_policy="pace", max_policy_lag=1, buffer_capacity=8)
    old = Learner(cfg, run_dir=None, publisher=ListPublisher())
    old.publish()
    w, meta_old = old.publisher.published[-1]
    source = Scripted([(w, meta_old)])
    actor = Actor(cfg, 0, source, CaptureSink(), learner_timeout_s=0.5)
    assert actor.credits.max_inflight == 1
    assert actor.step_once()
    assert actor._inflight() == 1            # the old learner never consumed it: it died
    new = Learner(cfg, run_dir=None, publisher=ListPublisher())
    new.publish(event="resume")
    source.messages = [new.publisher.published[-1]]
    assert actor.step_once(), "the actor waited for credits that belonged to the dead learner"
    assert actor.incarnation == new.incarnation and actor._inflight() == 1


def test_weights_that_do_not_fit_never_stop_an_actor():
    cfg = small_config(buffer_type="vla")
    learner = Learner(cfg, run_dir=None, publisher=ListPublisher())
    good = weights_td(learner.policy).clone()
    rng = random.Random(0)
    bad_messages = []
    for i in range(60):
        td, meta = good.clone(), {"kind": "weights", "version": i + 1, "incarnation": learner.incarnation}
        leaves = sorted(td.keys(include_nested=True, leaves_only=True), key=str)
        key = rng.choice(leaves)
        op = i % 6
        if op == 0:
            td.del_(key)
        elif op == 1:
            t = td.get(key)
            td.del_(key)
            td.set(key, torch.zeros(*t.shape, 2, dtype=t.dtype) if t.dim() else torch.zeros(3))
        elif op == 2:
            td.set("junk", torch.zeros(2))
        elif op == 3:
            meta["version"] = rng.choice([None, "7", -3, 2.5, True, [1]])
        elif op == 4:
            meta.update(shm="/dev/shm/tandem-nope", slot=rng.choice([-1, 10**12, "x"]), layout="garbage")
        else:
            t = td.get(key)
            td.del_(key)
            td.set(key, t.to(torch.float64) if t.dtype != torch.float64 else t.float())
        bad_messages.append((td, meta))
    learner.publish()
    source = Scripted([learner.publisher.published[-1], *bad_messages,
                       (good, {"kind": "weights", "version": 99, "incarnation": learner.incarnation})])
    actor = Actor(cfg, 0, source, CaptureSink())
    assert actor._wait_for_version(-1) and actor.version == 0
    before = {k: v.clone() for k, v in actor.policy.state_dict().items()}
    for _ in range(len(bad_messages)):
        actor._poll(0)
        actor._load_due()
        assert actor.version == 0 and not actor._torn
        for k, v in actor.policy.state_dict().items():     # no half-applied update, ever
            assert torch.equal(v, before[k]), k
    actor._poll(0)
    actor._load_due()
    assert actor.version == 99
    actor.close()
