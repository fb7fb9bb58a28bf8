"""actors.inference "server": replies equal a local policy's, every step records the version that
acted across a weight swap, a dead or silent actor does not stall the others, malformed requests are
dropped and counted (fuzzed), and the queue is bounded. In-process: the server runs on a thread with
a real ROUTER socket on loopback; the launcher tests are in tests/test_integration.py."""

from __future__ import annotations

import random
import threading
import time
from pathlib import Path

import pytest
import torch
import zmq
from hypothesis import HealthCheck, given, settings, strategies as st
from tensordict import TensorDict

from actors.inference import bind_router
from actors.inference_requests import RequestChecker
from actors.inference_server import InferenceServer
from actors.inference_topology import endpoint_path, server_devices, server_of, served_actors, write_endpoint
from actors.remote_policy import InferenceRefused, InferenceStopped, RemotePolicy
from actors.rollout import Collector, EnvParts
from actors.weights_loader import WeightsLoader
from shared import keys, wire
from shared.config import ConfigError, config_from_dict
from shared.envs import env_spec, make_env
from shared.policies import frozen_digest, make_policy, observation_bounds, weights_td
from tests.hostile import mutated_message

ROOT = Path(__file__).resolve().parents[1]
ENV = "Pendulum-v1"   # continuous actions: log-probs and values tell versions apart


class Weights:
    """A stand-in for the learner's weights socket: what was published, newest last."""

    def __init__(self):
        self.queue: list = []
        self.lock = threading.Lock()

    def publish(self, policy, version: int, incarnation: str = "L1") -> None:
        with self.lock:
            self.queue.append((weights_td(policy).clone(), {"kind": "weights", "version": version,
                                                             "incarnation": incarnation}))

    def newest(self, timeout_ms: int = 0):
        with self.lock:
            if not self.queue:
                return None
            msg, self.queue = self.queue[-1], []
            return msg


def _cfg(**actors):
    base = {"num_actors": 2, "num_envs": 4, "inference": "server", "server_max_wait_ms": 200.0}
    return config_from_dict({"env": {"id": ENV}, "trainer": {"buffer_type": "vla", "buffer_size": 8},
                             "algorithm": {"name": "ppo", "cfg": {"batch_size": 32}},
                             "actors": {**base, **actors}}, source="test")


class Served:
    """A server on a thread (real ROUTER socket), and RemotePolicies for its actors."""

    def __init__(self, tmp_path, curve=None, progress=None, unix=False, **actors):
        self.cfg = cfg = _cfg(**actors)
        self.spec = env_spec(ENV)
        torch.manual_seed(0)
        self.policy = make_policy(cfg, self.spec).eval()
        self.learner = make_policy(cfg, self.spec)          # what publishes the weights
        self.weights = Weights()
        self.loader = WeightsLoader(self.policy, torch.device("cpu"), cfg.actors, frozen_digest(self.policy), "server")
        self.ctx = zmq.Context()
        self.path = endpoint_path(tmp_path, 0)
        if curve is not None:
            curve.start(self.ctx)
        self.curve = curve
        self.sock, endpoint = bind_router(self.ctx, "127.0.0.1", self.path, curve)
        write_endpoint(self.path, endpoint, True, self.loader.base_digest)
        self.stop = threading.Event()
        self.server = InferenceServer(cfg, 0, self.policy, self.loader, self.weights, self.sock, self.spec, self.stop,
                                      progress=progress)
        if unix:   # actors.server_transport "unix", as run_server_process sets it up
            from actors.unix_channel import ServerChannels, socket_path
            self.sock = self.server.sock = ServerChannels(self.sock, socket_path(tmp_path, 0),
                                                          self.server.checker.max_bytes)
            write_endpoint(self.path, endpoint, True, self.loader.base_digest, self.sock.path)
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.remotes: list[RemotePolicy] = []

    def start(self) -> "Served":
        self.thread.start()
        return self

    def remote(self, actor: int, timeout_s: float = 10.0, curve=None) -> RemotePolicy:
        r = RemotePolicy.connect(self.ctx, self.path, actor, timeout_s=timeout_s, curve=curve)
        self.remotes.append(r)
        return r

    def local(self, version_weights: dict) -> torch.nn.Module:
        p = make_policy(self.cfg, self.spec).eval()
        p.load_state_dict(version_weights)
        return p

    def close(self) -> None:
        self.stop.set()
        if self.thread.ident is not None:
            self.thread.join(timeout=10)
        alive = self.thread.is_alive()
        for r in self.remotes:
            r.close()
        self.sock.close(linger=0)
        self.loader.close()
        if self.curve is not None:
            self.curve.stop()
        self.ctx.term()
        assert not alive, "the server thread did not stop"


@pytest.fixture
def served(tmp_path):
    s = Served(tmp_path)
    yield s
    s.close()


def _obs(n: int, seed: int) -> TensorDict:
    g = torch.Generator().manual_seed(seed)
    return TensorDict({keys.OBS: torch.randn(n, 3, generator=g)}, batch_size=[n])


@pytest.mark.parametrize("transport", ["zmq", "unix"])
def test_replies_equal_the_local_policy_for_the_same_observations_and_seed(tmp_path, transport):
    served = Served(tmp_path, unix=transport == "unix")
    try:
        _replies_equal_local(served)
        assert type(served.remotes[0].sock).__name__ == ("UnixDealer" if transport == "unix" else "Socket")
    finally:
        served.close()


def _replies_equal_local(served):
    served.weights.publish(served.learner, 0)
    served.start()
    w0 = {k: v.clone() for k, v in served.learner.state_dict().items()}
    local, remote = served.local(w0), served.remote(0)
    td = _obs(4, seed=1)
    torch.manual_seed(123)
    got = remote(td)
    torch.manual_seed(123)
    with torch.no_grad():
        want = local(td.clone())
    for k in (keys.ACTION, keys.LOG_PROB, keys.VALUE):
        torch.testing.assert_close(got[k], want[k], rtol=0, atol=0)
    assert got[keys.POLICY_VERSION].eq(0).all() and remote.version == 0 and remote.incarnation == "L1"
    torch.testing.assert_close(remote.get_value(td), local.get_value(td), rtol=0, atol=0)


def test_requests_from_several_actors_share_one_forward_pass(served):
    served.weights.publish(served.learner, 0)
    served.start()
    local = served.local({k: v.clone() for k, v in served.learner.state_dict().items()})
    remotes = [served.remote(0), served.remote(1)]
    results: dict[int, tuple] = {}

    def ask(i):
        td = _obs(4, seed=10 + i)
        results[i] = (td, remotes[i](td))
    threads = [threading.Thread(target=ask, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=10)
    assert served.server.counts["batches"] == 1 and served.server.counts["envs"] == 8   # one batch of both
    for td, out in results.values():       # each actor's reply is its own observations' action, log-prob, value
        with torch.no_grad():
            logp, _, value = local.evaluate_actions(TensorDict({keys.OBS: td[keys.OBS], keys.ACTION: out[keys.ACTION]},
                                                               batch_size=[4]))
        torch.testing.assert_close(out[keys.LOG_PROB], logp, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(out[keys.VALUE], value, rtol=1e-5, atol=1e-5)


def test_every_step_records_the_version_that_acted_across_a_weight_swap(served):
    """The collector through the server; version 1 is published after the 5th call. Each step's
    stamped version is the one whose weights give its log-prob and value."""
    served.weights.publish(served.learner, 0)
    served.start()
    w = {0: {k: v.clone() for k, v in served.learner.state_dict().items()}}
    with torch.no_grad():
        for p in served.learner.parameters():
            p.add_(0.3 * torch.randn_like(p))
    w[1] = {k: v.clone() for k, v in served.learner.state_dict().items()}
    remote = served.remote(0)
    calls = [0]
    real_call = remote.__call__

    class Counting:   # publish v1 once the collector has made 5 acting calls
        critic, device, stamps_versions = True, torch.device("cpu"), True

        def __call__(self, td):
            calls[0] += 1
            if calls[0] == 5:
                served.weights.publish(served.learner, 1)
            return real_call(td)

        def get_value(self, td):
            return remote.get_value(td)

        def parameters(self):
            return remote.parameters()

    env = make_env(ENV, 4)
    try:
        col = Collector(env, Counting(), num_steps=16, seed=0)
        td, _, _ = col.collect(version=-1)
    finally:
        env.close()
    versions = td[keys.POLICY_VERSION]
    assert versions[:, :4].eq(0).all() and versions[:, -1].eq(1).all(), versions[0]
    assert bool((versions[:, 1:] >= versions[:, :-1]).all())
    for v in (0, 1):
        local = served.local(w[v])
        steps = versions[0] == v
        flat = td[:, steps].reshape(-1)
        with torch.no_grad():
            logp, _, value = local.evaluate_actions(flat)
        torch.testing.assert_close(flat[keys.LOG_PROB], logp, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(flat[keys.VALUE], value, rtol=1e-5, atol=1e-5)


def test_envs_in_parts_keep_requests_in_flight_and_record_what_one_env_would(served):
    """actors.server_splits: two parts of an actor's envs, each with its own request at the server.
    The rollout is what one env of all four would have recorded for the same actions (observations,
    rewards, ends, the truncated steps' bootstrap values), both requests were in flight at once, and
    across a weight swap every step's version is the one whose weights chose its action."""
    served.weights.publish(served.learner, 0)
    w = {0: {k: v.clone() for k, v in served.learner.state_dict().items()}}
    with torch.no_grad():
        for p in served.learner.parameters():
            p.add_(0.05)
    w[1] = {k: v.clone() for k, v in served.learner.state_dict().items()}
    served.start()
    remote = served.remote(0)
    in_flight, submit = [0], remote.submit

    def counting_submit(kind, td):       # the most requests without a reply at once, and v1 mid-rollout
        rid = submit(kind, td)
        in_flight[0] = max(in_flight[0], len(remote._pending))
        if rid == 12:
            served.weights.publish(served.learner, 1)
        return rid
    remote.submit = counting_submit
    kwargs = {"max_episode_steps": 5}
    env = EnvParts([make_env(ENV, 2, kwargs), make_env(ENV, 2, kwargs)])
    whole = make_env(ENV, 4, kwargs)
    try:
        col = Collector(env, remote, num_steps=12, seed=3)
        assert col.pipelined
        td, stats, _ = col.collect(version=-1)
        assert in_flight[0] == 2 and not remote._pending and not remote._ready
        # the same actions in one env of all four envs, from the same seeds
        obs, final = whole.reset(seed=3), []
        for t in range(12):
            torch.testing.assert_close(td[keys.OBS][:, t], obs, rtol=0, atol=0)
            step = whole.step(td[keys.ACTION][:, t])
            for k, v in ((keys.REWARD, step.reward), (keys.TERMINATED, step.terminated),
                         (keys.TRUNCATED, step.truncated)):
                torch.testing.assert_close(td[k][:, t], v, rtol=0, atol=0)
            final.append(step.final_obs)
            obs = step.obs
    finally:
        env.close()
        whole.close()
    assert td[keys.TRUNCATED][:, 4].all() and td[keys.TRUNCATED][:, 9].all() and len(stats.episode_returns) == 8
    versions = td[keys.POLICY_VERSION]
    assert versions[:, 0].eq(0).all() and versions[:, -1].eq(1).all(), versions
    assert bool((versions[:, 1:] >= versions[:, :-1]).all())
    for v in (0, 1):
        local = served.local(w[v])
        acted = versions == v
        flat = td[acted]
        with torch.no_grad():
            logp, _, value = local.evaluate_actions(flat)
        torch.testing.assert_close(flat[keys.LOG_PROB], logp, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(flat[keys.VALUE], value, rtol=1e-5, atol=1e-5)
    # a truncated step bootstraps from V(its final observation), asked of the server mid-rollout by the
    # version that acted at that step or the next one
    for t in (4, 9):
        for i in range(4):
            with torch.no_grad():
                want = {int(v): served.local(w[int(v)]).get_value(TensorDict({keys.OBS: final[t][i:i + 1]},
                                                                               batch_size=[1]))[0]
                        for v in versions[i, t:t + 2]}
            got = td[keys.NEXT_VALUE][i, t]
            assert any(torch.allclose(got, x, rtol=1e-5, atol=1e-5) for x in want.values()), (t, i, got, want)


def test_a_batch_is_served_once_every_actor_has_a_request_in_it(tmp_path):
    """With env parts no batch reaches every actor's envs: it is full, and served without waiting out
    server_max_wait_ms, once each served actor has a request in it (their other parts come only after
    they have stepped the envs this batch acts for)."""
    s = Served(tmp_path, server_max_wait_ms=3000.0, server_splits=2)
    try:
        s.weights.publish(s.learner, 0)
        s.start()
        r0, r1 = s.remote(0), s.remote(1)
        t0 = time.monotonic()
        asked = [r0.submit("act", _obs(2, 0)), r1.submit("act", _obs(2, 1))]
        r0.result(asked[0])
        r1.result(asked[1])
        assert time.monotonic() - t0 < 2.0 and s.server.counts["batches"] == 1, s.server.counts
    finally:
        s.close()


class _Sizes:
    """The acting policy, recording the envs of every forward pass the server runs."""

    def __init__(self, policy):
        self.policy, self.sizes = policy, []

    def __call__(self, td):
        self.sizes.append(td.batch_size[0])
        return self.policy(td)

    def get_value(self, td):
        self.sizes.append(td.batch_size[0])
        return self.policy.get_value(td)


def test_no_forward_pass_is_larger_than_server_max_batch_with_env_parts(tmp_path):
    """actors.server_splits 2 and server_max_batch sized to one part: a rollout's last values (of
    every env, for bootstrapping) were one request of all the actor's envs, one forward pass over the
    cap, which fails on a device sized to it. Every pass keeps to the cap, and the values are the
    ones a local copy gives."""
    s = Served(tmp_path, num_actors=1, server_splits=2, server_max_batch=2)
    env = EnvParts([make_env(ENV, 2), make_env(ENV, 2)])
    try:
        s.weights.publish(s.learner, 0)
        s.server.policy = sizes = _Sizes(s.policy)
        s.start()
        remote = s.remote(0)
        sent, submit = [], remote.submit
        remote.submit = lambda kind, td: sent.append((kind, td.batch_size[0])) or submit(kind, td)
        col = Collector(env, remote, num_steps=6, seed=1)
        td, _, _ = col.collect(version=-1)
        assert sizes.sizes and max(sizes.sizes) <= 2, sizes.sizes
        assert sent[-2:] == [("value", 2), ("value", 2)], sent     # the last values: a request per part
        local = s.local({k: v.clone() for k, v in s.learner.state_dict().items()})
        with torch.no_grad():
            last = local.get_value(TensorDict({keys.OBS: col.obs}, batch_size=[4]))
        open_end = ~td[keys.DONE][:, -1]
        torch.testing.assert_close(td[keys.NEXT_VALUE][open_end, -1], last[open_end], rtol=1e-5, atol=1e-5)
    finally:
        env.close()
        s.close()


def test_a_request_larger_than_server_max_batch_is_served_in_passes_of_at_most_that(tmp_path):
    """The server's own bound, whatever its actors send: a request of all num_envs envs (the checker
    takes up to that many) with server_max_batch at half of them runs as two passes, and its reply
    is what one pass would have given."""
    s = Served(tmp_path, server_splits=2, server_max_batch=2)
    try:
        s.weights.publish(s.learner, 0)
        s.server.policy = sizes = _Sizes(s.policy)
        s.start()
        remote, td = s.remote(0), _obs(4, seed=5)
        got = remote.get_value(td)
        acted = remote(td)
        assert sizes.sizes == [2, 2, 2, 2], sizes.sizes
        local = s.local({k: v.clone() for k, v in s.learner.state_dict().items()})
        with torch.no_grad():
            torch.testing.assert_close(got, local.get_value(td), rtol=1e-5, atol=1e-5)
            logp, _, value = local.evaluate_actions(TensorDict({keys.OBS: td[keys.OBS], keys.ACTION: acted[keys.ACTION]},
                                                               batch_size=[4]))
        torch.testing.assert_close(acted[keys.LOG_PROB], logp, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(acted[keys.VALUE], value, rtol=1e-5, atol=1e-5)
    finally:
        s.close()


def test_env_parts_step_as_one_env_of_all_their_envs():
    parts, whole = EnvParts([make_env(ENV, 1), make_env(ENV, 3)]), make_env(ENV, 4)
    try:
        assert parts.num_envs == 4 and parts.slices == [slice(0, 1), slice(1, 4)]
        torch.testing.assert_close(parts.reset(seed=7), whole.reset(seed=7), rtol=0, atol=0)
        torch.testing.assert_close(parts.reset(seed=[5, 5, 6, 6]), whole.reset(seed=[5, 5, 6, 6]), rtol=0, atol=0)
        action = torch.rand(4, 1) * 4 - 2
        a, b = parts.step(action), whole.step(action)
        for x, y in zip(a[:5], b[:5]):
            torch.testing.assert_close(x, y, rtol=0, atol=0)
    finally:
        parts.close()
        whole.close()


def test_a_silent_or_dead_actor_does_not_stall_the_others(tmp_path):
    s = Served(tmp_path, server_max_wait_ms=50.0)
    try:
        s.weights.publish(s.learner, 0)
        s.start()
        gone = s.remote(0)
        gone(_obs(4, 0))                                   # actor 0 is served once ...
        frames = wire.encode(_obs(4, 1), kind="act", actor=0, id=99)
        gone.sock.send_multipart(frames)                   # ... asks again, and dies before the reply
        deadline = time.monotonic() + 5.0
        while s.server.counts["requests"] < 2 and time.monotonic() < deadline:
            time.sleep(0.001)
        assert s.server.counts["requests"] == 2, s.server.counts
        gone.close()
        alive = s.remote(1)
        t0 = time.monotonic()
        for i in range(10):                                # actor 1 alone: each batch waits at most 50 ms
            alive(_obs(4, 2 + i))
        assert time.monotonic() - t0 < 5.0
        deadline = time.monotonic() + 5.0              # the server counts a reply once it went out
        while s.server.counts["replies"] + s.server.counts["undeliverable"] < 12 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert s.server.counts["replies"] >= 11, s.server.counts
        # the dead actor's request was served: its reply went out before the socket closed, or was
        # refused (undeliverable); either way it cost actor 1 nothing
        assert s.server.counts["replies"] + s.server.counts["undeliverable"] == 12, s.server.counts
        assert s.server.counts["requests"] == 12 and not s.server.waiting
    finally:
        s.close()


class _Picky:
    """A policy that raises on an observation whose first entry is 777 (as a policy may on what it
    cannot act on: a token id out of its vocabulary, values that overflow its logits)."""

    def __init__(self, policy):
        self.policy = policy

    def _check(self, td):
        if bool((td[keys.OBS][:, 0] == 777).any()):
            raise ValueError("picky: 777 is not an observation")

    def __call__(self, td):
        self._check(td)
        return self.policy(td)

    def get_value(self, td):
        self._check(td)
        return self.policy.get_value(td)


def test_observations_the_policy_raises_on_refuse_their_request_alone_and_the_server_goes_on(tmp_path):
    s = Served(tmp_path, server_max_wait_ms=2000.0)      # both actors' requests in one batch
    try:
        s.server.policy = _Picky(s.policy)
        s.weights.publish(s.learner, 0)
        s.start()
        bad_actor, good_actor = s.remote(0), s.remote(1)
        bad = _obs(4, 0)
        bad[keys.OBS][2, 0] = 777.0
        got = {}

        def act_bad():
            try:
                bad_actor(bad)
            except InferenceRefused as e:
                got["refused"] = str(e)
        t = threading.Thread(target=act_bad)
        t.start()
        out = good_actor(_obs(4, 1))                          # served, in the batch that failed
        t.join(timeout=10)
        assert out[keys.ACTION].shape == (4, 1) and out[keys.POLICY_VERSION].eq(0).all()
        assert "picky: 777" in got["refused"] and "request 1" in got["refused"], got
        c = s.server.counts
        assert c["failed"] == 1 and c["malformed"] == 0, c
        with pytest.raises(InferenceRefused, match="picky"):  # a value request alike
            bad_actor.get_value(bad)
        good_actor.get_value(_obs(4, 2))                      # and the server still serves
        assert s.thread.is_alive() and s.server.counts["failed"] == 2
    finally:
        s.close()


def test_a_device_left_unusable_refuses_the_failed_batch_before_the_server_ends(tmp_path, monkeypatch):
    """A sticky device failure (a CUDA assert) ends the server for a restart; every request of the
    batch that failed hears so first. Left waiting, its actor would send the request again to the
    next server and end that one too, until the launcher gave up on the run."""
    s = Served(tmp_path, server_max_wait_ms=2000.0)      # both actors' requests in one batch
    try:
        s.weights.publish(s.learner, 0)
        assert s.server._take_weights()

        def dead(device=None):
            raise RuntimeError("CUDA error: device-side assert triggered")
        monkeypatch.setattr(torch.cuda, "synchronize", dead)
        monkeypatch.setattr(s.server.loader, "device", torch.device("cuda", 0))   # what _device_usable asks
        monkeypatch.setattr(s.server, "_forward", lambda kind, reqs: (_ for _ in ()).throw(RuntimeError("assert")))
        bad, good = s.remote(0), s.remote(1)
        for actor, seed in ((bad, 0), (good, 1)):
            actor.submit("act", _obs(4, seed))
        deadline = time.monotonic() + 5
        while len(s.server.waiting) < 2 and time.monotonic() < deadline:
            s.server._receive(0.05)
        batch = s.server._batch()
        assert len(batch) == 2
        with pytest.raises(RuntimeError, match="assert"):
            s.server._serve(batch)
        for actor in (bad, good):
            with pytest.raises(InferenceRefused, match="device failed"):
                actor.result(1)
        assert s.server.counts["failed"] == 2
    finally:
        s.close()


def test_a_request_waits_for_the_version_it_asks_for(served):
    """Standard mode: an actor's first request of a rollout names the version it needs; the server
    holds it (serving others meanwhile) until that version is loaded."""
    served.weights.publish(served.learner, 0)
    served.start()
    waiting, other = served.remote(0), served.remote(1)
    waiting.min_version = 1
    got = {}
    t = threading.Thread(target=lambda: got.setdefault("out", waiting(_obs(4, 0))))
    t.start()
    other(_obs(4, 1))                                       # served at version 0 meanwhile
    assert other.version == 0 and t.is_alive()
    served.weights.publish(served.learner, 1)
    t.join(timeout=10)
    assert got["out"][keys.POLICY_VERSION].eq(1).all() and waiting.min_version == -1


def test_a_request_waiting_for_a_version_is_served_soon_after_it_arrives(tmp_path):
    """While a request waits for weights, the server looks for them every few milliseconds, not only
    when its wait for more requests (100 ms) runs out: in standard mode and under pace every rollout
    starts with such a wait."""
    served = Served(tmp_path, num_actors=1)        # a batch is full with one request: no wait for others
    try:
        served.weights.publish(served.learner, 0)
        served.start()
        actor = served.remote(0)
        delays = []
        for v in range(1, 9):
            actor.min_version = v
            rid = actor.submit("act", _obs(4, v))
            deadline = time.monotonic() + 5
            while not served.server.waiting and time.monotonic() < deadline:   # held: v is not there yet
                time.sleep(0.002)
            time.sleep(0.01)
            t0 = time.monotonic()
            served.weights.publish(served.learner, v)
            out = actor.result(rid)
            delays.append(time.monotonic() - t0)
            assert out[keys.POLICY_VERSION].eq(v).all()
        assert sorted(delays)[len(delays) // 2] < 0.05, delays   # it was 90 ms: the whole 100 ms poll
    finally:
        served.close()


def test_a_paced_actor_acts_its_rollout_with_the_newest_version_the_learner_announced(served, tmp_path):
    """lag_policy pace bounds staleness by starting each rollout with the newest version, as a
    local actor loads it first. Through a server, the credit that lets a rollout start names that
    version, and the actor asks the server for it: a server that has not loaded it yet holds the
    request instead of acting with the older one (on an H100 that added a version of lag, and
    rollouts beyond max_policy_lag were dropped under pace)."""
    from actors.actor import Actor
    from tests.test_learner_component import CaptureSink
    cfg = config_from_dict({"env": {"id": ENV},
                            "trainer": {"buffer_type": "vla", "buffer_size": 8, "lag_policy": "pace"},
                            "algorithm": {"name": "ppo", "cfg": {"batch_size": 32}},
                            "actors": {"num_actors": 2, "num_envs": 4, "inference": "server"}}, source="test")
    served.weights.publish(served.learner, 0)
    served.start()
    announcer = Weights()
    announcer.consumed, announcer.consumed_from = [0, 0], "L1"
    announcer.announced = (1, "L1")                   # a credit naming v1: the server still has v0
    sink = CaptureSink()
    actor = Actor(cfg, 0, announcer, sink, remote=served.remote(0), lock_dir=tmp_path)
    try:
        done = {}
        t = threading.Thread(target=lambda: done.setdefault("ok", actor.step_once()))
        t.start()
        deadline = time.monotonic() + 10
        while not served.server.waiting and time.monotonic() < deadline:
            time.sleep(0.01)
        time.sleep(0.2)                                   # a few passes of the server's loop
        assert t.is_alive() and not sink.messages         # held for v1
        served.weights.publish(served.learner, 1)
        t.join(timeout=10)
        assert done.get("ok")
        td, _ = sink.messages[-1]
        assert td[keys.POLICY_VERSION].eq(1).all(), td[keys.POLICY_VERSION]
        assert actor.remote.min_version == -1 and actor.remote.min_incarnation is None
    finally:
        actor.close()


def test_a_paced_actor_with_weights_held_back_on_purpose_acts_with_what_the_server_has(tmp_path):
    """actors.weights_lag_versions K: the server loads a version only once K newer ones have come, on
    purpose. A paced actor must not ask it for the version its credit names: the learner cannot
    publish the newer ones without the actor's rollouts, and both would wait until the timeout."""
    from actors.actor import Actor
    from tests.test_learner_component import CaptureSink
    served = Served(tmp_path, weights_lag_versions=1)
    cfg = config_from_dict({"env": {"id": ENV},
                            "trainer": {"buffer_type": "vla", "buffer_size": 8, "lag_policy": "pace"},
                            "algorithm": {"name": "ppo", "cfg": {"batch_size": 32}},
                            "actors": {"num_actors": 1, "num_envs": 4, "inference": "server",
                                       "weights_lag_versions": 1}}, source="test")
    served.weights.publish(served.learner, 0)
    served.start()
    served.weights.publish(served.learner, 1)         # held back by the server's gate until v2 comes
    announcer = Weights()
    announcer.consumed, announcer.consumed_from, announcer.announced = [0], "L1", (1, "L1")
    actor = Actor(cfg, 0, announcer, CaptureSink(), remote=served.remote(0, timeout_s=5.0), lock_dir=tmp_path)
    try:
        assert actor.step_once()                       # served at once, not held until the timeout
        td, _ = actor.sink.messages[-1]
        assert td[keys.POLICY_VERSION].eq(0).all(), td[keys.POLICY_VERSION]
    finally:
        actor.close()
        served.close()


def test_a_standard_mode_actor_whose_rollout_mixed_two_versions_acts_next_with_the_newer(tmp_path):
    """Standard mode: the server took v1 in the middle of a rollout, which the learner drops (it
    trains v1 on v1's data only). The actor's next rollout asks for v1, the version the learner trains
    next, not v2: it used to wait for v2, sitting out the update (or timing out where every actor
    did). After a rollout of v1 alone it asks for v2 again."""
    from actors.actor import Actor
    from tests.test_learner_component import CaptureSink
    cfg = config_from_dict({"env": {"id": ENV}, "trainer": {"buffer_type": "standard", "buffer_size": 8},
                            "algorithm": {"name": "ppo", "cfg": {"batch_size": 32}},
                            "actors": {"num_actors": 1, "num_envs": 4, "inference": "server"}}, source="test")
    served = Served(tmp_path, num_actors=1)
    served.weights.publish(served.learner, 0)
    served.start()
    remote, sink = served.remote(0, timeout_s=3.0), CaptureSink()
    acts, submit = [0], remote.submit

    def publishing_submit(kind, td):     # v1 comes after the rollout's third action
        acts[0] += kind == "act"
        if acts[0] == 3 and kind == "act":
            served.weights.publish(served.learner, 1)
        return submit(kind, td)
    remote.submit = publishing_submit
    actor = Actor(cfg, 0, Weights(), sink, remote=remote, lock_dir=tmp_path)
    try:
        assert actor.step_once()
        mixed = sink.messages[-1][0][keys.POLICY_VERSION]
        assert int(mixed.min()) == 0 and int(mixed.max()) == 1, mixed
        t0 = time.monotonic()
        assert actor.step_once(), "the actor waited for v2 after its mixed rollout"
        assert time.monotonic() - t0 < 2.0 and sink.messages[-1][0][keys.POLICY_VERSION].eq(1).all()
        done = {}
        t = threading.Thread(target=lambda: done.setdefault("ok", actor.step_once()))
        t.start()
        time.sleep(0.3)
        assert t.is_alive() and len(sink.messages) == 2          # held for v2: v1's data is sent
        served.weights.publish(served.learner, 2)
        t.join(timeout=10)
        assert done.get("ok") and sink.messages[-1][0][keys.POLICY_VERSION].eq(2).all()
    finally:
        actor.close()
        served.close()


def test_a_version_asked_of_one_learner_life_is_met_by_any_version_of_the_next(served):
    """A restarted learner resumes at its checkpoint's version, lower than what the actors acted
    with: a standard-mode request for the next version of the old life is served by the new life's
    first weights (as a local actor acts with them at once), not held until the actor times out."""
    served.weights.publish(served.learner, 5, incarnation="L1")
    served.start()
    actor = served.remote(0)
    actor(_obs(4, 0))
    assert (actor.version, actor.incarnation) == (5, "L1")
    actor.min_version = 6                                    # standard mode: newer than the last rollout's
    got = {}
    t = threading.Thread(target=lambda: got.setdefault("out", actor(_obs(4, 1))))
    t.start()
    deadline = time.monotonic() + 5
    while not served.server.waiting and time.monotonic() < deadline:
        time.sleep(0.01)
    time.sleep(0.2)                                          # a few passes of the server's loop
    assert t.is_alive() and served.server.waiting            # held: v5 of L1 is not newer than 5
    served.weights.publish(served.learner, 2, incarnation="L2")   # the resumed learner, at a lower version
    t.join(timeout=10)
    assert not t.is_alive() and got["out"][keys.POLICY_VERSION].eq(2).all() and actor.incarnation == "L2"


class _Scalars:
    """A stand-in for the TensorBoard writer: the (tag, step) of every scalar."""

    def __init__(self):
        self.steps: dict[str, list[int]] = {}

    def add_scalar(self, tag, value, step):
        self.steps.setdefault(tag, []).append(step)


def test_a_restarted_servers_tensorboard_steps_go_on_from_the_last_incarnations(tmp_path):
    """The server's TensorBoard step is the batches served in the run: a restarted server reads what
    the last incarnation logged and goes on from there, so its curves do not start again at 0 over
    the old ones. A progress file that is not ours counts as none."""
    from actors.inference_server import progress_path, read_progress
    path = progress_path(tmp_path, 0)
    steps = []
    for life in range(2):
        s = Served(tmp_path / f"life{life}", progress=path)
        s.server.stats.writer = _Scalars()
        s.weights.publish(s.learner, 0)
        s.start()
        try:
            actor = s.remote(0)
            for i in range(3):
                actor(_obs(4, i))
            s.server.stats._last_log = -1e9          # log now (the thread logs on its own clock otherwise)
            deadline = time.monotonic() + 10
            while not s.server.stats.writer.steps and time.monotonic() < deadline:
                time.sleep(0.01)
        finally:
            s.close()
        steps += s.server.stats.writer.steps["inference0/batches"]
    assert len(steps) >= 2 and steps[0] >= 3 and all(b > a for a, b in zip(steps, steps[1:])), steps
    assert read_progress(path) == steps[-1]
    for junk in ("", "[]", '{"batches": -1}', '{"batches": true}', '{"batches": 1.5}', "{"):
        path.write_text(junk)
        assert read_progress(path) == 0


def test_a_remote_call_ends_on_stop_while_no_server_answers(tmp_path):
    s = Served(tmp_path)         # never started: nobody answers
    try:
        remote = s.remote(0)
        stop = threading.Event()
        remote.should_stop = stop.is_set
        threading.Timer(0.3, stop.set).start()
        with pytest.raises(InferenceStopped):
            remote(_obs(4, 0))
    finally:
        s.close()


def _valid_frames(actor: int = 0, n: int = 4) -> tuple[TensorDict, dict]:
    return _obs(n, 0), {"kind": "act", "actor": actor, "id": 1, "seq": 0}


@pytest.mark.parametrize("td, meta, why", [
    (_obs(4, 0), {"kind": "rollout", "actor": 0, "id": 1}, "kind"),
    (_obs(4, 0), {"kind": "act", "actor": 7, "id": 1}, "not one this server acts for"),
    (_obs(4, 0), {"kind": "act", "actor": 0}, "'id'"),
    (_obs(4, 0), {"kind": "act", "actor": 0, "id": 1, "min_version": -5}, "min_version"),
    (_obs(9, 0), {"kind": "act", "actor": 0, "id": 1}, "batch size"),
    (TensorDict({keys.OBS: torch.zeros(4, 5)}, [4]), {"kind": "act", "actor": 0, "id": 1}, "does not match"),
    (TensorDict({keys.OBS: torch.zeros(4, 3, dtype=torch.float64)}, [4]), {"kind": "act", "actor": 0, "id": 1},
     "does not match"),
    (TensorDict({keys.OBS: torch.full((4, 3), float("nan"))}, [4]), {"kind": "act", "actor": 0, "id": 1}, "NaN"),
    (TensorDict({keys.OBS: torch.full((4, 3), 3e38)}, [4]), {"kind": "act", "actor": 0, "id": 1}, "beyond"),
    (_obs(4, 0), {"kind": "act", "actor": 0, "id": 1, "min_version": 2, "incarnation": 7}, "'incarnation'"),
    (_obs(4, 0), {"kind": "act", "actor": 0, "id": 1, "min_version": 2, "incarnation": "L", "same_life": 1},
     "'same_life'"),
    (TensorDict({keys.OBS: torch.zeros(4, 3), "x": torch.zeros(4)}, [4]), {"kind": "act", "actor": 0, "id": 1},
     "carries only"),
])
def test_malformed_requests_are_named_dropped_and_counted(served, td, meta, why, caplog):
    served.server._take([zmq.Frame(b"sender"), *wire.encode(td, **meta)])
    assert served.server.counts["malformed"] == 1 and not served.server.waiting
    assert why in caplog.text


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(seed=st.integers(0, 2**32 - 1))
def test_fuzzed_requests_never_stop_the_server(tmp_path, seed):
    s = Served(tmp_path)
    try:
        td, meta = _valid_frames()
        frames = mutated_message(td, meta, random.Random(seed))
        s.server._take([zmq.Frame(b"fuzz"), *[zmq.Frame(f) for f in frames]])
        c = s.server.counts
        assert c["malformed"] + len(s.server.waiting) == 1       # dropped and counted, or a request it can serve
        for r in s.server.waiting:                                # what it kept is of the schema
            assert r.obs.shape[1:] == (3,) and r.obs.dtype == torch.float32 and 1 <= r.n <= 4
        s.weights.publish(s.learner, 0, incarnation="L1")
        assert s.server._take_weights()
        kept = s.server._batch()
        if kept:
            s.server._serve(kept)                                 # acting on it never raises either
        # one reply (or error reply) for each request kept, each refused here: "fuzz" is no peer
        assert c["undeliverable"] == len(kept) and c["replies"] == 0 and c["batches"] == (1 if kept else 0), c
    finally:
        s.close()


class _Endless:
    """A socket that always has one more bad request (for 3 s at most): an endless flood."""

    def __init__(self):
        self.t0, self.taken = time.monotonic(), 0

    def poll(self, timeout_ms: int = 0) -> bool:
        return time.monotonic() - self.t0 < 3.0

    def recv_multipart(self, copy: bool = True) -> list:
        self.taken += 1
        return [zmq.Frame(b"flood"), zmq.Frame(b"not a request")]


def test_an_actor_whose_request_is_refused_hears_why_at_once(served):
    served.weights.publish(served.learner, 0)
    served.start()
    actor = served.remote(0, timeout_s=60)
    bad = _obs(4, 0)
    bad[keys.OBS][1, 2] = float("nan")
    t0 = time.monotonic()
    with pytest.raises(InferenceRefused, match="NaN"):
        actor(bad)
    assert time.monotonic() - t0 < 5 and served.server.counts["malformed"] == 1


def test_an_actor_whose_request_names_a_bad_version_or_life_hears_why_at_once(served):
    """What an actor's request asks of the version (its learner life here: too long a name) is checked
    like its observations: the actor is told, not left to wait for its timeout."""
    served.weights.publish(served.learner, 0)
    served.start()
    actor = served.remote(0, timeout_s=60)
    actor.min_version, actor.min_incarnation = 1, "L" * 200
    t0 = time.monotonic()
    with pytest.raises(InferenceRefused, match="'incarnation' must be a string of at most 128"):
        actor(_obs(4, 0))
    assert time.monotonic() - t0 < 5 and served.server.counts["malformed"] == 1


@pytest.mark.parametrize("config, sets, vocabulary", [
    ("vla_tokens_reach_smoke.json", [], 512),                           # the action-token VLA
    ("vla_reach_ppo.json", ['policy.vla_config.model_path=""'], 8),     # TinyVLA, built fresh
])
def test_a_request_with_token_ids_outside_the_vocabulary_is_refused_by_the_checker(config, sets, vocabulary):
    """A VLA's instruction ids index its embedding: out of range, they are refused as the request
    arrives (on CUDA the lookup would leave the device unusable)."""
    from shared.config import load_config
    cfg = load_config(ROOT / "configs" / config, ["actors.inference=server", *sets])
    spec = env_spec(cfg.env.id, cfg.env.cfg)
    policy = make_policy(cfg, spec)
    checker = RequestChecker(spec, cfg.actors.num_envs, [0], observation_bounds(policy))
    assert checker.obs_bounds == {"instruction": (0, vocabulary)}
    obs = make_env(cfg.env.id, 2, cfg.env.cfg, "cpu").reset(seed=0)
    frames = [zmq.Frame(bytes(f)) for f in wire.encode(TensorDict({keys.OBS: obs}, [2]), kind="act", actor=0, id=5)]
    assert checker.check(b"a", frames).n == 2
    obs["instruction"][1, 0] = vocabulary + 88
    frames = [zmq.Frame(bytes(f)) for f in wire.encode(TensorDict({keys.OBS: obs}, [2]), kind="act", actor=0, id=6)]
    with pytest.raises(wire.WireError, match=rf"'instruction' holds ids from 0 to {vocabulary + 88}, outside "
                                             rf"\[0, {vocabulary}\)") as e:
        checker.check(b"a", frames)
    assert e.value.rid == 6                      # the server answers actor 0's request 6 with why


def test_a_flood_of_bad_requests_does_not_keep_batches_from_going_out(tmp_path):
    """Requests that come faster than the server can check them: each pass takes at most
    ``server_queue`` messages off the socket and then minds its deadline, so it goes on to serve."""
    s = Served(tmp_path, server_queue=64)
    try:
        real, s.server.sock = s.server.sock, _Endless()
        t = threading.Thread(target=s.server._receive, args=(0.05,), daemon=True)
        t0 = time.monotonic()
        t.start()
        t.join(timeout=2.5)
        assert not t.is_alive(), "the receive loop went on taking the flood"
        assert time.monotonic() - t0 < 1.0 and s.server.counts["malformed"] == s.server.sock.taken > 0
        s.server.sock = real
    finally:
        s.close()


def test_a_frame_larger_than_any_request_is_never_buffered(tmp_path):
    """The server's ROUTER has ZeroMQ's MAXMSGSIZE (the checker's bound): a peer that sends a larger
    frame is disconnected before the frame is buffered whole; the others are served."""
    ctx = zmq.Context()
    sock, endpoint = bind_router(ctx, "127.0.0.1", tmp_path / "ep.json", max_bytes=4096)
    peers = []
    try:
        for _ in range(2):
            d = ctx.socket(zmq.DEALER)
            d.setsockopt(zmq.LINGER, 0)
            d.connect(endpoint)
            peers.append(d)
        peers[0].send_multipart([b"h", b"x" * (1 << 20)])     # 1 MiB: refused by ZeroMQ itself
        peers[1].send_multipart([b"h", b"y" * 100])
        got = []
        deadline = time.monotonic() + 1.5     # both would be here well within this, were the large one taken
        while time.monotonic() < deadline and len(got) < 2:
            if sock.poll(100):
                got.append([bytes(f) for f in sock.recv_multipart()][1:])
        assert got == [[b"h", b"y" * 100]]
    finally:
        for d in peers:
            d.close(linger=0)
        sock.close(linger=0)
        ctx.term()


def test_a_request_never_served_expires_when_its_actor_stopped_waiting(tmp_path):
    s = Served(tmp_path)
    try:
        s.server.expire_s = 0.2
        s.weights.publish(s.learner, 0)
        assert s.server._take_weights()
        td, meta = _valid_frames()
        s.server._take([zmq.Frame(b"a"), *wire.encode(td, **{**meta, "min_version": 9})])   # v9 never comes
        assert s.server._batch() == [] and len(s.server.waiting) == 1
        time.sleep(0.3)
        s.server._next_expiry = 0.0
        assert s.server._batch() == [] and not s.server.waiting and s.server.counts["expired"] == 1
    finally:
        s.close()


def test_a_request_that_finds_the_queue_full_is_sent_again_and_served(tmp_path):
    """A full queue answers "busy"; the actor sends the request again after a pause and it is served
    once there is room (it used to wait for its timeout, 120 s). The config leaves room for every
    actor's requests, so here one actor fills it with two (as requests a gone connection left would)."""
    s = Served(tmp_path, server_queue=2)
    try:
        s.weights.publish(s.learner, 0)
        s.start()
        held, other = s.remote(0), s.remote(1, timeout_s=20)
        held.min_version = 1                                  # both hold their places until v1 comes
        rids = [held.submit("act", _obs(4, 0)), held.submit("act", _obs(4, 2))]
        deadline = time.monotonic() + 5
        while len(s.server.waiting) < 2 and time.monotonic() < deadline:
            time.sleep(0.005)
        got = {}
        t = threading.Thread(target=lambda: got.setdefault("out", other(_obs(4, 1))), daemon=True)
        t.start()
        while other.busy_replies < 2 and time.monotonic() < deadline:   # told, and sent again
            time.sleep(0.01)
        assert other.busy_replies >= 2 and s.server.counts["busy"] >= 2 and t.is_alive()
        s.weights.publish(s.learner, 1)                       # the held request is served: room again
        t.join(timeout=5)
        assert got["out"][keys.POLICY_VERSION].eq(1).all()
        assert all(held.result(r)[keys.POLICY_VERSION].eq(1).all() for r in rids)
    finally:
        s.close()


def test_the_queue_is_bounded(tmp_path):
    s = Served(tmp_path, server_queue=3)
    try:
        for i in range(5):
            td, meta = _valid_frames()
            s.server._take([zmq.Frame(b"a"), *wire.encode(td, **{**meta, "id": i})])
        assert len(s.server.waiting) == 3 and s.server.counts["busy"] == 2
    finally:
        s.close()


def test_the_config_refuses_what_a_server_cannot_do():
    two = _cfg(devices=["cpu", "cuda:0", "cpu"], num_actors=4)       # actor i: devices[i % 3]; one server per device
    assert [server_of(two, i) for i in range(4)] == [0, 1, 0, 0]
    # actors.servers_per_device: each device's actors dealt out to its servers in turn
    dealt = _cfg(devices=["cpu", "cuda:0", "cpu"], num_actors=6, servers_per_device=2)
    assert server_devices(dealt) == ["cpu", "cpu", "cuda:0", "cuda:0"]
    assert [server_of(dealt, i) for i in range(6)] == [0, 2, 1, 0, 3, 1]
    assert [served_actors(dealt, s) for s in range(4)] == [[0, 3], [2, 5], [1], [4]]
    with pytest.raises(ConfigError, match=r"servers_per_device 3: devices \['cpu'\] have only \[2\] actors"):
        _cfg(servers_per_device=3)
    with pytest.raises(ConfigError, match=r"devices \['cuda:0'\] have only \[0\] actors"):
        _cfg(devices=["cpu", "cuda:0"], num_actors=1)                # its server would serve nobody
    with pytest.raises(ConfigError, match="servers_per_device 2 needs actors.inference"):
        _cfg(servers_per_device=2, inference="local")
    for bad in ({"weights_at": "rollout"}, {"sync_every": 2}, {"emulated_devices": ["d0"]}):
        with pytest.raises(ConfigError, match="inference"):
            _cfg(**bad)
    with pytest.raises(ConfigError, match="server_splits: 4 envs .* do not split into 3"):
        _cfg(server_splits=3)
    with pytest.raises(ConfigError, match="server_splits 2 needs actors.inference"):
        _cfg(server_splits=2, inference="local")
    with pytest.raises(ConfigError, match=r"server_queue 3: a server's 2 actors can have 4 requests waiting"):
        _cfg(server_queue=3, server_splits=2)                         # two parts each: two requests each
    assert _cfg(server_queue=4, server_splits=2).actors.server_queue == 4
    with pytest.raises(ConfigError, match="server_max_batch 3: one request holds 4 envs"):
        _cfg(server_max_batch=3)                                      # a request is never split
    assert _cfg(server_max_batch=2, server_splits=2).actors.server_max_batch == 2
    grpo = {"env": {"id": ENV}, "trainer": {"buffer_type": "vla", "buffer_size": 8}, "policy": {"name": "actor_only"},
            "algorithm": {"name": "grpo", "cfg": {"batch_size": 32, "group_size": 4}},
            "actors": {"num_envs": 8, "inference": "server", "server_splits": 4}}
    with pytest.raises(ConfigError, match="parts of 2 envs split GRPO groups of 4"):
        config_from_dict(grpo, source="test")
    grpo["actors"]["server_splits"] = 2
    assert config_from_dict(grpo, source="test").actors.server_splits == 2


def test_with_curve_only_admitted_keys_are_served(tmp_path):
    from actors.remote_policy import InferenceUnavailable
    from shared.security import CurveClient, CurveServer
    server_pub, server_secret = zmq.curve_keypair()
    actor_pub, actor_secret = zmq.curve_keypair()
    s = Served(tmp_path, curve=CurveServer(server_pub, server_secret, {actor_pub}))
    try:
        s.weights.publish(s.learner, 0)
        s.start()
        admitted = s.remote(0, curve=CurveClient(actor_pub, actor_secret, server_pub))
        assert admitted(_obs(4, 0))[keys.POLICY_VERSION].eq(0).all()
        stranger_pub, stranger_secret = zmq.curve_keypair()
        for curve in (None, CurveClient(stranger_pub, stranger_secret, server_pub)):
            with pytest.raises(InferenceUnavailable):
                s.remote(1, timeout_s=1.0, curve=curve)(_obs(4, 1))
        assert s.curve.refused >= 1
    finally:
        s.close()


def test_an_actor_served_from_a_gpu_entry_steps_its_envs_where_env_device_says(served, tmp_path):
    """env.device "cpu": an actor of a CUDA entry of actors.devices whose policy is the server steps
    its torch-native envs on the CPU and never touches CUDA (on this CPU-only host, building the envs
    on cuda:0 would raise), and its rollout goes out."""
    from actors.actor import Actor
    from tests.test_learner_component import CaptureSink
    cfg = config_from_dict({"env": {"id": "tandem/Pendulum-v0", "device": "cpu"},
                            "trainer": {"buffer_type": "vla", "buffer_size": 8},
                            "algorithm": {"name": "ppo", "cfg": {"batch_size": 32}},
                            "actors": {"num_actors": 2, "num_envs": 4, "inference": "server",
                                       "devices": ["cuda:0"]}}, source="test")
    served.weights.publish(served.learner, 0)
    served.start()
    sink = CaptureSink()
    actor = Actor(cfg, 0, Weights(), sink, remote=served.remote(0), lock_dir=tmp_path)
    try:
        assert actor.device == torch.device("cuda:0") and actor.env_device == torch.device("cpu")
        assert actor.step_once()
        td, meta = sink.messages[-1]
        assert td[keys.OBS].shape[:2] == (4, 8) and int(td[keys.POLICY_VERSION].min()) == 0
        assert not torch.cuda.is_initialized()
    finally:
        actor.close()


def test_env_device_is_checked():
    with pytest.raises(ConfigError, match="env.device: unknown device 'gpu0'"):
        config_from_dict({"env": {"id": ENV, "device": "gpu0"}}, source="test")
    assert config_from_dict({"env": {"id": ENV, "device": "cuda:1"}}, source="test").env.device == "cuda:1"


def test_a_server_busy_for_seconds_still_gets_the_newest_weights():
    """An inference server in a long forward pass does not read its weights socket. Left to itself
    the socket fills, and ZeroMQ drops the newer messages: the newest version, which paced actors ask
    for, would never load. The server's subscription is drained by a thread of its own
    (DrainingSubscriber), which hands over the newest one; a stop is kept until it is taken."""
    from shared.transport import DrainingSubscriber, WeightsPublisher, WeightsSubscriber
    ctx = zmq.Context()
    pub = WeightsPublisher(ctx, "127.0.0.1")
    plain, drained = WeightsSubscriber(ctx, pub.endpoint), WeightsSubscriber(ctx, pub.endpoint)
    drain = DrainingSubscriber(drained)
    try:
        deadline = time.monotonic() + 10
        while pub.subscribers_seen < 2:
            assert time.monotonic() < deadline, "the subscribers never joined"
            pub.serve_subscriptions()
            time.sleep(0.01)
        time.sleep(0.2)
        last = 60
        for v in range(1, last + 1):                    # nobody reads meanwhile, as in a long forward pass
            pub.publish(TensorDict({"w": torch.full((1 << 20,), float(v))}, []), kind="weights", version=v,
                        incarnation="L1", consumed=[v], time=float(v))
            pub.send_control(kind="credit", consumed=[v], incarnation="L1", time=float(v))
            time.sleep(0.02)                             # a learner's pace, faster than any real one
        time.sleep(0.5)
        got, deadline = None, time.monotonic() + 10
        while (got is None or got[1]["version"] < last) and time.monotonic() < deadline:
            got = drain.newest(100) or got
        assert got is not None and got[1]["version"] == last and got[0]["w"][0].item() == last
        seen = [m[1]["version"] for m in iter(lambda: plain.newest(200), None)]
        assert seen and max(seen) < last                # what a socket read late gives: the newest was dropped
        pub.send_control(kind="stop", who="actors", incarnation="L1")
        pub.publish(TensorDict({"w": torch.zeros(4)}, []), kind="weights", version=last + 1, incarnation="L1")
        deadline = time.monotonic() + 5
        while drain.newest(100) is None or drain.newest(0)[1].get("kind") != "stop":
            assert time.monotonic() < deadline, "the stop never came"
        assert drain.newest(0)[1]["kind"] == "stop"      # kept: never replaced by later weights
    finally:
        drain.close()
        plain.close()
        drained.close()
        pub.close()
        ctx.term()


def test_a_failed_weights_reader_is_raised_to_the_server_not_waited_on():
    """If the thread reading the weights socket fails, the server hears it at its next look (and
    ends, for the launcher to restart it) instead of waiting forever for weights that cannot come."""
    from shared.transport import DrainingSubscriber

    class Broken:
        def newest(self, timeout_ms=0):
            raise zmq.ZMQError(zmq.ETERM)
    drain = DrainingSubscriber(Broken())
    try:
        with pytest.raises(RuntimeError, match="weights socket's reader failed"):
            drain.newest(2000)
    finally:
        assert drain.close()


def test_a_control_only_subscriber_gets_stops_and_credits_but_never_the_weights():
    """An actor served by an inference server subscribes to the weights socket's control topic only:
    it gets the newest credits when it joins (also when the learner published before it came), the
    credits of every later weights message (``consumed``, for lag_policy "pace") and the stop, and
    never the tensors, which a full subscriber still receives. Its joining re-sends no weights to the
    full subscribers, and a re-sent credit is never older than the weights they hold."""
    from shared.transport import CONTROL_TOPIC, WeightsPublisher, WeightsSubscriber
    ctx = zmq.Context()
    pub = WeightsPublisher(ctx, "127.0.0.1")
    subs = {"full": WeightsSubscriber(ctx, pub.endpoint)}

    def joined(n: int) -> None:
        deadline = time.monotonic() + 10
        while pub.subscribers_seen < n:
            assert time.monotonic() < deadline, "the subscribers never joined"
            pub.serve_subscriptions()
            time.sleep(0.01)
        time.sleep(0.1)

    def next_weights(sub):          # the next message newest() returns (credits are kept, not returned)
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:
            msg = sub.newest(100)
            if msg is not None:
                return msg
        raise AssertionError("no message")

    def publish(version: int, consumed: list[int]) -> None:
        pub.publish(TensorDict({"w": torch.randn(4096)}, []), kind="weights", version=version, incarnation="L1",
                    consumed=consumed, time=float(version))
    try:
        joined(1)
        pub.send_control(kind="credit", consumed=[1, 1], incarnation="L1", time=0.5)
        publish(3, [2, 5])                                 # no control-only subscriber yet
        td, meta = next_weights(subs["full"])
        assert meta["version"] == 3 and td["w"].numel() == 4096 and subs["full"].consumed == [2, 5]
        assert not pub.control_only_seen
        subs["ctrl"] = WeightsSubscriber(ctx, pub.endpoint, weights=False)
        joined(2)
        assert pub.control_only_seen
        deadline = time.monotonic() + 5
        while subs["ctrl"].consumed is None and time.monotonic() < deadline:
            assert subs["ctrl"].newest(100) is None          # a credit is kept, not returned
        assert subs["ctrl"].consumed == [2, 5] and subs["ctrl"].consumed_from == "L1"
        assert subs["ctrl"].announced == (3, "L1") == subs["full"].announced   # what a paced actor asks for
        assert subs["full"].newest(300) is None              # no weights re-sent for a control-only join
        assert subs["full"].consumed == [2, 5]               # and the re-sent credit is the newest
        subs["raw"] = WeightsSubscriber(ctx, pub.endpoint, weights=False)
        joined(3)
        publish(4, [3, 6])
        assert next_weights(subs["full"])[1]["version"] == 4
        deadline = time.monotonic() + 5
        while subs["ctrl"].consumed != [3, 6] and time.monotonic() < deadline:
            assert subs["ctrl"].newest(100) is None
        assert subs["ctrl"].consumed == [3, 6] and subs["ctrl"].announced == (4, "L1")
        pub.send_control(kind="stop", who="actors", incarnation="L1")
        assert next_weights(subs["ctrl"])[1]["kind"] == "stop"
        topics, deadline = [], time.monotonic() + 1.0
        while time.monotonic() < deadline:
            if subs["raw"].sock.poll(50):
                topics.append(subs["raw"].sock.recv_multipart()[0])
        assert topics and set(topics) == {CONTROL_TOPIC}     # credits and the stop: never the weights
    finally:
        for s in subs.values():
            s.close()
        pub.close()
        ctx.term()


def test_a_paced_request_naming_a_new_learner_life_waits_for_that_lifes_weights(tmp_path, monkeypatch):
    """After a learner restart a paced actor's credit names the new life. A server still holding the
    old life's weights used to serve it at once ('another life' meets any version), and the learner
    dropped the rollout it made as acted by the old life. It is now held for the new life's weights,
    and for at most SAME_LIFE_WAIT_S when they never come."""
    import actors.inference_server as inference_server
    monkeypatch.setattr(inference_server, "SAME_LIFE_WAIT_S", 1.0)
    served = Served(tmp_path)
    try:
        served.weights.publish(served.learner, 7, incarnation="OLD")
        served.start()
        remote = served.remote(0)
        assert int(remote(_obs(4, seed=1))[keys.POLICY_VERSION][0]) == 7 and remote.incarnation == "OLD"
        remote.min_version, remote.min_incarnation = 2, "NEW"       # the restarted learner's credit: v2 of NEW
        rid = remote.submit("act", _obs(4, seed=2))
        deadline = time.monotonic() + 5
        while not served.server.waiting and rid not in remote._ready and time.monotonic() < deadline:
            remote._send_pending()
            time.sleep(0.01)
        time.sleep(0.3)                                             # a few passes of the server's loop
        assert served.server.waiting and not remote.sock.poll(0), "served with the old life's weights at once"
        served.weights.publish(served.learner, 2, incarnation="NEW")
        served.weights.lives = ["OLD", "NEW"]                       # what its subscriber has heard, in order
        remote.result(rid)
        assert remote.version == 2 and remote.incarnation == "NEW"
        # a credit of the old life that reached the actor after the server had the new one: served at once
        remote.min_version, remote.min_incarnation = 8, "OLD"
        t0 = time.monotonic()
        remote(_obs(4, seed=4))
        assert time.monotonic() - t0 < 0.9 and remote.version == 2 and remote.incarnation == "NEW"
        # a life that never comes here: served with what the server has, after SAME_LIFE_WAIT_S
        remote.min_version, remote.min_incarnation = 0, "GONE"
        t0 = time.monotonic()
        remote(_obs(4, seed=3))
        assert 0.9 < time.monotonic() - t0 < 5.0 and remote.version == 2 and remote.incarnation == "NEW"
    finally:
        served.close()
