"""In-flight weight updates (``actors.weights_at: step``): an actor takes a newer version between
env steps, every step records the version that acted and its exact log-prob, a torn load is never
acted with, and standard mode stays on-policy."""

from __future__ import annotations

import pytest
import torch
from tensordict import TensorDict

import actors.actor
import actors.weights_loader
from actors.actor import Actor
from learner.learner import Learner, ListPublisher
from shared import keys
from shared.config import ConfigError, config_from_dict
from shared.policies import load_weights_
from tests.test_learner_component import CaptureSink, PublisherSource, small_config


def _setup(weights_at="step", buffer_type="vla"):
    cfg = small_config(buffer_type=buffer_type, max_policy_lag=8, buffer_capacity=8)
    cfg.actors.weights_at = weights_at
    pub = ListPublisher()
    learner = Learner(cfg, run_dir=None, publisher=pub)
    learner.publish()
    sink = CaptureSink()
    actor = Actor(cfg, 0, PublisherSource(pub), sink)
    return cfg, learner, pub, actor, sink


def _new_version(learner, scale=0.3, seed=0):
    """The learner publishes a visibly different next version (as an update would)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in learner.policy.parameters():
            p.add_(torch.randn(p.shape, generator=g) * scale)
    learner.version += 1
    learner.publish()
    return {k: v.clone() for k, v in learner.policy.state_dict().items()}


def _publish_at_step(actor, learner, step_no, on_publish=None):
    """Make the learner publish a new version right after the actor's env step `step_no`."""
    real_step, calls, states = actor.env.step, [0], []

    def step(action):
        out = real_step(action)
        calls[0] += 1
        if calls[0] == step_no:
            states.append(_new_version(learner))
            if on_publish:
                on_publish()
        return out

    actor.env.step = step
    return states


def _log_probs_under(policy_state, cfg, actor, td):
    from shared.policies import make_policy
    policy = make_policy(cfg, actor.env.spec)
    policy.load_state_dict(policy_state)
    with torch.no_grad():
        return policy.eval().evaluate_actions(td.reshape(-1))[0].view(td.shape)


@pytest.mark.parametrize("weights_at", ["step", "rollout"])
def test_new_weights_are_taken_between_steps_and_each_step_keeps_its_version(weights_at):
    cfg, learner, pub, actor, sink = _setup(weights_at)
    v0 = {k: v.clone() for k, v in learner.policy.state_dict().items()}
    assert actor.step_once()                    # takes version 0
    states = _publish_at_step(actor, learner, step_no=5)
    assert actor.step_once()
    td, meta = sink.messages[-1]
    t = cfg.trainer.buffer_size
    versions = td[keys.POLICY_VERSION]
    if weights_at == "step":
        # steps 0..4 of this rollout were acted before version 1 existed; it is loaded before step 5
        assert versions[:, :5].eq(0).all() and versions[:, 5:].eq(1).all()
        assert meta["synced"] and meta["synced"][0][0] == 1     # the sync delay ends at its first action
    else:
        assert versions.eq(0).all()             # the whole rollout on the version it started with
    # every step's log-prob is exactly that of the version that acted
    old, new = _log_probs_under(v0, cfg, actor, td), _log_probs_under(states[0], cfg, actor, td)
    expect = torch.where(versions == 1, new, old)
    torch.testing.assert_close(td[keys.LOG_PROB], expect, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(old[:, 5:], new[:, 5:])          # the versions do differ: the test can tell
    # the learner accounts per sample: this rollout is acted by two versions
    learner.ingest(td, meta)
    assert learner.buffer.take(1).infos[0]["version_counts"] == (
        [(0, 5 * cfg.actors.num_envs), (1, (t - 5) * cfg.actors.num_envs)] if weights_at == "step"
        else [(0, t * cfg.actors.num_envs)])


def test_a_torn_load_is_never_acted_with(monkeypatch):
    """The load of version 1 is torn (the policy holds garbage): the actor waits for version 2
    and acts with it; no step is taken with the torn weights."""
    cfg, learner, pub, actor, sink = _setup("step")
    assert actor.step_once()
    real_load = actors.weights_loader.load_published_
    torn_versions = []

    def load(policy, td, meta, shm, device):
        if meta["version"] == 1:
            torn_versions.append(1)
            with torch.no_grad():                       # half a copy: NaN in the live weights
                next(policy.parameters()).fill_(float("nan"))
            _new_version(learner, seed=1)              # the learner moves on meanwhile
            return False
        return real_load(policy, td, meta, shm, device)

    monkeypatch.setattr(actors.weights_loader, "load_published_", load)
    _publish_at_step(actor, learner, step_no=3)
    assert actor.step_once()
    td, _ = sink.messages[-1]
    versions = td[keys.POLICY_VERSION]
    assert torn_versions == [1]
    assert versions[:, :3].eq(0).all() and versions[:, 3:].eq(2).all()
    assert torch.isfinite(td[keys.LOG_PROB]).all() and torch.isfinite(td[keys.VALUE]).all()
    v2 = {k: v.clone() for k, v in learner.policy.state_dict().items()}
    torch.testing.assert_close(td[keys.LOG_PROB][:, 3:], _log_probs_under(v2, cfg, actor, td)[:, 3:],
                               rtol=1e-5, atol=1e-5)


def test_standard_mode_ignores_step_and_stays_on_policy():
    cfg, learner, pub, actor, sink = _setup("step", buffer_type="standard")
    assert not actor.in_flight
    assert actor.step_once()
    _new_version(learner)                                   # version 1: the next rollout's
    _publish_at_step(actor, learner, step_no=4)             # version 2 arrives mid-rollout: not taken
    assert actor.step_once()
    assert sink.messages[-1][0][keys.POLICY_VERSION].eq(1).all()


def test_step_and_sync_every_cannot_be_combined():
    with pytest.raises(ConfigError, match="weights_at"):
        config_from_dict({"trainer": {"buffer_type": "vla"}, "actors": {"weights_at": "step", "sync_every": 4}},
                         source="test")
    with pytest.raises(ConfigError, match="weights_at"):
        config_from_dict({"actors": {"weights_at": "sometimes"}}, source="test")


@pytest.mark.parametrize("buffer_type,weights_at,sync_every,expected", [
    ("vla", "auto", 1, "step"),          # the default: in-flight updates in vla mode
    ("vla", "auto", 4, "rollout"),       # holding weights for several rollouts asks for rollout boundaries
    ("vla", "rollout", 1, "rollout"),
    ("vla", "step", 1, "step"),
    ("standard", "auto", 1, "rollout"),  # standard mode trains every version on its own data
    ("standard", "step", 1, "rollout"),
])
def test_auto_takes_weights_between_steps_in_vla_mode_unless_sync_every_holds_them(buffer_type, weights_at,
                                                                                     sync_every, expected):
    from shared.config import weights_at as resolve
    cfg = config_from_dict({"trainer": {"buffer_type": buffer_type},
                            "actors": {"weights_at": weights_at, "sync_every": sync_every}}, source="test")
    assert resolve(cfg) == expected
    assert config_from_dict({}, source="test").actors.weights_at == "auto"


def test_the_actor_follows_the_resolved_setting():
    for weights_at, in_flight in (("auto", True), ("rollout", False)):
        cfg, learner, pub, actor, sink = _setup(weights_at)
        assert actor.in_flight is in_flight
