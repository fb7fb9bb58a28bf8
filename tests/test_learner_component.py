"""Learner and actor logic in one process, no sockets (Sample Factory's serial mode).

The actor's weights come from the learner's ListPublisher; its rollouts go straight to
``Learner.ingest``. This checks what the processes rely on, in milliseconds: versions stamped on
steps are the versions that acted, and the learner's update equals a plain PPO loop.
"""

from __future__ import annotations

import copy

import pytest
import torch
from tensordict import TensorDict

from actors.actor import Actor
from learner.checkpoint import save_checkpoint
from learner.learner import Learner, ListPublisher, RejectedMessage, make_optimizer
from shared import keys, wire
from shared.rollout import RolloutMeta
from shared.config import config_from_dict
from shared.policies import load_weights_, make_policy, weights_td


def small_config(**trainer):
    return config_from_dict({
        "trainer": {"seed": 3, "total_steps": 10_000, "buffer_size": 16, "buffer_type": "standard",
                    "eval_freq": 0, "save_freq": 0, **trainer},
        "actors": {"num_actors": 1, "num_envs": 4},
        "env": {"id": "CartPole-v1"},
        "policy": {"normalize_obs": True,
                   "actor": {"network_cfg": {"hidden_sizes": [16]}},
                   "critic": {"network_cfg": {"hidden_sizes": [16]}}},
        "algorithm": {"cfg": {"learning_rate": 3e-3, "n_epochs": 3, "batch_size": 16, "gamma": 0.97,
                              "gae_lambda": 0.9}},
    }, source="test")


class PublisherSource:
    """The actor's view of a ListPublisher: the newest published message."""

    def __init__(self, publisher: ListPublisher):
        self.publisher = publisher

    def newest(self, timeout_ms: int = 0):
        if not self.publisher.published:
            return None
        td, meta = self.publisher.published[-1]
        return td.clone(), dict(meta)


class _Sent:
    done = True  # stands in for a zmq.MessageTracker whose frames were already copied


class CaptureSink:
    """Decodes what the actor sends (through the real codec) and keeps it."""

    def __init__(self):
        self.messages: list[tuple[TensorDict, dict]] = []

    def send(self, frames, timeout_ms):
        td, meta = wire.decode([bytes(f) for f in frames])
        self.messages.append((td.clone(), meta))
        return _Sent()


def wired(cfg) -> tuple[Learner, ListPublisher, CaptureSink, Actor]:
    """A learner that has published version 0, and actor 0 reading its publisher in-process."""
    pub = ListPublisher()
    learner = Learner(cfg, run_dir=None, publisher=pub)
    learner.publish()
    sink = CaptureSink()
    return learner, pub, sink, Actor(cfg, 0, PublisherSource(pub), sink)


def serial_run(cfg, updates: int):
    """Drive one actor and the learner in lock-step; return the learner, the rollouts it trained
    on, and every published (weights, meta)."""
    learner, pub, sink, actor = wired(cfg)
    trained = []
    for _ in range(updates):
        assert actor.step_once()
        td, meta = sink.messages[-1]
        learner.ingest(td, meta)
        batch = learner.take_batch(timeout_s=0)
        assert batch is not None
        trained.append(batch[0].clone())
        learner.update_once(*batch)
    return learner, trained, pub.published, actor


def test_version_stamp_is_the_version_that_acted():
    cfg = small_config(buffer_type="vla", buffer_capacity=4, max_policy_lag=10)
    learner, trained, published, _ = serial_run(cfg, updates=5)
    weights = {meta["version"]: td for td, meta in published}
    policy = make_policy(cfg, learner.spec)
    for rollout in trained:
        rollout = rollout[0]                                  # [N, T] (k = 1 rollout per update)
        v = int(rollout[keys.POLICY_VERSION][0, 0])
        assert (rollout[keys.POLICY_VERSION] == v).all()      # weights change only at rollout boundaries
        load_weights_(policy, weights[v])
        with torch.no_grad():
            logp, _, value = policy.evaluate_actions(rollout)
        torch.testing.assert_close(logp, rollout[keys.LOG_PROB])
        torch.testing.assert_close(value, rollout[keys.VALUE])
        # ... and not the version after it (no off-by-one)
        load_weights_(policy, weights[v + 1])
        with torch.no_grad():
            logp_next, _, _ = policy.evaluate_actions(rollout)
        assert not torch.allclose(logp_next, rollout[keys.LOG_PROB])
    versions = [int(r[0][keys.POLICY_VERSION][0, 0]) for r in trained]
    assert versions == sorted(versions) and versions[0] == 0


def plain_ppo(cfg, init_policy, rollouts):
    """A straightforward single-process PPO over the given rollouts (CleanRL-style), written
    independently of learner/ppo.py and learner/advantages.py. Returns weights after each update."""
    a = cfg.algorithm.cfg
    policy = copy.deepcopy(init_policy)
    opt = make_optimizer(policy, a.learning_rate, a.adam_eps)
    gen = torch.Generator().manual_seed(cfg.trainer.seed)
    out = []
    for i, data in enumerate(rollouts):
        flat = data.reshape(-1, data.shape[-1])
        r, v, nv = flat[keys.REWARD], flat[keys.VALUE], flat[keys.NEXT_VALUE]
        term, done = flat[keys.TERMINATED].float(), flat[keys.DONE].float()
        adv = torch.zeros_like(r)
        last = torch.zeros(r.shape[0])
        for t in reversed(range(r.shape[1])):
            delta = r[:, t] + a.gamma * nv[:, t] * (1 - term[:, t]) - v[:, t]
            last = delta + a.gamma * a.gae_lambda * (1 - done[:, t]) * last
            adv[:, t] = last
        b_obs, b_act = flat[keys.OBS].reshape(-1, 4), flat[keys.ACTION].reshape(-1)
        b_logp, b_adv, b_ret = flat[keys.LOG_PROB].reshape(-1), adv.reshape(-1), (adv + v).reshape(-1)
        if a.anneal_lr:
            for g in opt.param_groups:
                g["lr"] = a.learning_rate * (1 - i * b_obs.shape[0] / cfg.trainer.total_steps)
        n = b_obs.shape[0]
        for _ in range(a.n_epochs):
            perm = torch.randperm(n, generator=gen)
            for s in range(0, n, a.batch_size):
                mb = perm[s:s + a.batch_size]
                x = policy.obs_norm(b_obs[mb])
                logits = policy.actor(x)
                logp_all = torch.log_softmax(logits, -1)
                newlogp = logp_all.gather(-1, b_act[mb].unsqueeze(-1)).squeeze(-1)
                entropy = -(logp_all.exp() * logp_all).sum(-1)
                ratio = (newlogp - b_logp[mb]).exp()
                mb_adv = b_adv[mb]
                mb_adv = (mb_adv - mb_adv.mean()) / (mb_adv.std() + 1e-8)
                pg = torch.max(-mb_adv * ratio, -mb_adv * ratio.clamp(1 - a.clip_coef, 1 + a.clip_coef)).mean()
                vloss = 0.5 * ((policy.critic(x).squeeze(-1) - b_ret[mb]) ** 2).mean()
                loss = pg - a.ent_coef * entropy.mean() + a.vf_coef * vloss
                opt.zero_grad()
                loss.backward()
                torch.nn.utils.clip_grad_norm_(policy.parameters(), a.max_grad_norm)
                opt.step()
        with torch.no_grad():
            policy.obs_norm.update(b_obs)
        out.append(copy.deepcopy(policy.state_dict()))
    return out


@pytest.mark.parametrize("anneal", [False, True])
def test_standard_mode_equals_plain_ppo(anneal):
    cfg = small_config()
    cfg.algorithm.cfg.anneal_lr = anneal
    torch.manual_seed(cfg.trainer.seed)
    pub = ListPublisher()
    learner = Learner(cfg, run_dir=None, publisher=pub)
    init = copy.deepcopy(learner.policy)
    learner.publish()
    sink = CaptureSink()
    actor = Actor(cfg, 0, PublisherSource(pub), sink)
    trained = []
    after = []
    for _ in range(4):
        assert actor.step_once()
        learner.ingest(*sink.messages[-1])
        data, infos = learner.take_batch(timeout_s=0)
        trained.append(data[0].clone())
        learner.update_once(data, infos)
        after.append(copy.deepcopy(learner.policy.state_dict()))
    reference = plain_ppo(cfg, init, trained)
    for i, (ours, ref) in enumerate(zip(after, reference)):
        for k in ref:
            torch.testing.assert_close(ours[k], ref[k], rtol=1e-5, atol=1e-6, msg=lambda m: f"update {i}, {k}: {m}")
    # the actor's copy was loaded from the learner's weights: identical to version 3's
    ours_v3 = pub.published[-2][0]
    for k, v in weights_td(actor.policy).items(include_nested=True, leaves_only=True):
        torch.testing.assert_close(v, ours_v3[k])


def test_standard_mode_refuses_stale_rollouts():
    cfg = small_config()
    learner, _, _, actor = serial_run(cfg, updates=2)
    stale = actor.collector.collect(version=0)[0].clone()
    learner.ingest(stale, RolloutMeta(actor=0, seq=99).to_meta())
    assert learner.counts["dropped_lag"] == 1 and len(learner.buffer) == 0


def test_schema_mismatch_refused_naming_actor_and_never_locks_the_id_out():
    cfg = small_config(buffer_type="vla")
    cfg.actors.num_actors = 8
    learner = Learner(cfg, run_dir=None, publisher=ListPublisher())
    bad = learner.template.clone()
    bad.set(keys.OBS, torch.zeros(4, 16, 5))
    with pytest.raises(RejectedMessage, match=r"actor 7: .*observation.*\[4, 16, 5\].*\[4, 16, 4\]"):
        learner.ingest(bad, RolloutMeta(actor=7, seq=0).to_meta())
    # A forged first message under actor 7's id must not lock the real actor 7 out.
    learner.ingest(learner.template.clone(), RolloutMeta(actor=7, seq=1).to_meta())
    assert len(learner.buffer) == 1
    learner.buffer.take(1)
    learner.env_steps = 0
    nan = learner.template.clone()
    nan[keys.REWARD][0, 0] = float("nan")
    with pytest.raises(RejectedMessage, match="actor 2: .*reward.*NaN"):
        learner.ingest(nan, RolloutMeta(actor=2, seq=0).to_meta())
    with pytest.raises(RejectedMessage, match="valid 'actor' id"):
        learner.ingest(learner.template.clone(), {"kind": "rollout", "actor": "x"})
    with pytest.raises(RejectedMessage, match="kind 'weights'"):
        learner.ingest(learner.template.clone(), {"kind": "weights", "actor": 0})
    assert len(learner.buffer) == 0 and learner.env_steps == 0


def test_vla_lag_filter_drops_and_counts():
    cfg = small_config(buffer_type="vla", buffer_capacity=4, max_policy_lag=1)
    learner, _, _, actor = serial_run(cfg, updates=3)            # learner now at version 3
    old = actor.collector.collect(version=1)[0].clone()            # lag 2 > 1
    learner.ingest(old, RolloutMeta(actor=0, seq=50).to_meta())
    ok = actor.collector.collect(version=2)[0].clone()             # lag 1
    learner.ingest(ok, RolloutMeta(actor=0, seq=51).to_meta())
    assert learner.counts["dropped_lag"] == 1 and len(learner.buffer) == 1


def test_checkpoint_resume_restores_everything(tmp_path):
    cfg = small_config()
    learner, _, _, actor = serial_run(cfg, updates=2)
    path = save_checkpoint(tmp_path / "checkpoints", learner.state_dict(), learner.version)
    assert path.exists()
    resumed = Learner(cfg, run_dir=tmp_path, publisher=ListPublisher(), resume=True)
    assert (resumed.version, resumed.env_steps, resumed.updates) == (learner.version, learner.env_steps, learner.updates)
    for k, v in learner.policy.state_dict().items():
        torch.testing.assert_close(resumed.policy.state_dict()[k], v)
    assert torch.equal(resumed.generator.get_state(), learner.generator.get_state())
    # the next update is identical on both
    rollout = actor.collector.collect(version=learner.version)[0].clone()
    for l in (learner, resumed):
        l.ingest(rollout.clone(), RolloutMeta(actor=0, seq=9).to_meta())
        l.update_once(*l.take_batch(timeout_s=0))
    for k, v in learner.policy.state_dict().items():
        torch.testing.assert_close(resumed.policy.state_dict()[k], v)


def test_hostile_meta_never_reaches_the_logs_or_breaks_the_learner(tmp_path):
    from learner.logs import RunLogger
    cfg = small_config(buffer_type="vla")
    logger = RunLogger(tmp_path, use_tensorboard=False)
    learner = Learner(cfg, run_dir=None, publisher=ListPublisher(), logger=logger)
    learner.publish()
    td = learner.template.clone()
    learner.ingest(td, {"kind": "rollout", "actor": 0, "seq": b"\x00bytes", "time": "yesterday",
                        "episode_returns": [1.0, "x", float("nan")], "episode_lengths": [3, 4]})
    assert len(learner.buffer) == 1 and list(learner.stats.episodes) == [(1.0, 3)]
    for bad in ({"returns": ["x"], "lengths": [1], "version": 0, "env_steps": 0},
                {"returns": [1.0], "lengths": [1, 2], "version": 0, "env_steps": 0},
                {"returns": [1.0], "lengths": [1], "version": "0", "env_steps": 0},
                {"returns": [1.0], "lengths": [1], "version": 0, "env_steps": 0, "video_frames_pending": -1},
                {"returns": [1.0], "lengths": [1], "version": 0, "env_steps": 0, "video_frames_pending": 1e9}):
        with pytest.raises(RejectedMessage, match="malformed eval result"):
            learner.intake.eval_result({"kind": "eval", **bad})
    # the rollout socket takes no evaluation results, however well-formed (anyone can reach it)
    good = {"kind": "eval", "returns": [1.0], "lengths": [1], "version": 0, "env_steps": 0}
    with pytest.raises(RejectedMessage, match="only from the evaluator's own socket"):
        learner.ingest(TensorDict({}, []), good)
    learner.intake.eval_token = "s3cret"
    with pytest.raises(RejectedMessage, match="evaluator token"):
        learner.intake.eval_result({**good, "token": "guess"})
    learner.intake.eval_result({**good, "token": "s3cret"})
    assert learner.evals.get_nowait()["returns"] == [1.0]
    learner.intake.eval_result({**good, "token": "s3cret", "final": True, "video_frames_pending": 600})
    assert learner.evals.get_nowait()["video_frames_pending"] == 600   # the learner waits for deferred videos
    learner.update_once(*learner.take_batch(timeout_s=0))      # logs a consume event with seq None
    logger.close()
    import json
    lines = [json.loads(l) for l in (tmp_path / "versions.jsonl").read_text().splitlines()]
    assert any(l["event"] == "consume" and l["seq"] is None for l in lines)


def test_actor_abandons_a_rollout_on_stop_and_never_loads_weights_mid_rollout():
    cfg = small_config(buffer_type="vla", buffer_size=400)
    cfg.actors.weights_at = "rollout"    # weights only at rollout boundaries (step: tests/test_inflight.py)
    pub = ListPublisher()
    learner = Learner(cfg, run_dir=None, publisher=pub)
    learner.publish()

    class Scripted(PublisherSource):
        calls = 0

        def newest(self, timeout_ms=0):
            self.calls += 1
            if self.calls == 50:     # mid-rollout: newer weights arrive ...
                learner.version += 1
                learner.publish()
            if self.calls == 120:    # ... then a stop
                return TensorDict({}, []), {"kind": "stop"}
            return super().newest(timeout_ms)

    sink = CaptureSink()
    actor = Actor(cfg, 0, Scripted(pub), sink)
    assert actor.step_once() is False
    assert sink.messages == [] and actor.stop_event.is_set()
    assert actor.version == 0                       # the mid-rollout weights were kept, not loaded
    assert [m[1]["version"] for _, m in actor._incoming] == [1]


def test_values_that_would_break_the_update_are_refused():
    cfg = small_config(buffer_type="vla")
    learner = Learner(cfg, run_dir=None, publisher=ListPublisher())
    meta = RolloutMeta(actor=0, seq=0).to_meta()
    cases = [(keys.ACTION, 5, r"'action' outside 0\.\.1"), (keys.LOG_PROB, 3.0, r"sample_log_prob' > 0"),
             (keys.LOG_PROB, -1000.0, r"sample_log_prob' < -103\.3, the least a sampled discrete action"),
             (keys.TRUNCATED, True, r"'done' differs from 'terminated' \| 'truncated'"),
             (keys.POLICY_VERSION, -3, r"negative versions"),
             (keys.REWARD, 1e30, r"'reward' holds values beyond")]
    for key, value, match in cases:
        bad = learner.template.clone()
        bad[key][0, 0] = value
        with pytest.raises(RejectedMessage, match=match):
            learner.ingest(bad, meta)
    with pytest.raises(RejectedMessage, match="valid 'actor' id"):
        learner.ingest(learner.template.clone(), {**meta, "actor": 1})   # num_actors is 1
    assert len(learner.buffer) == 0


def test_published_weights_are_a_snapshot():
    cfg = small_config()
    pub = ListPublisher()
    learner = Learner(cfg, run_dir=None, publisher=pub)

    class Keep:  # keeps what it was given, without cloning (as zero-copy ZeroMQ would)
        got = []

        def publish(self, td, **meta):
            self.got.append(td)

    learner.publisher = Keep()
    learner.publish()
    before = {k: v.clone() for k, v in Keep.got[0].items(include_nested=True, leaves_only=True)}
    with torch.no_grad():
        for p in learner.policy.parameters():
            p.add_(1.0)
    for k, v in Keep.got[0].items(include_nested=True, leaves_only=True):
        assert torch.equal(v, before[k]), k


def test_standard_mode_actor_uses_weights_that_arrived_mid_rollout():
    cfg = small_config(buffer_size=50)
    pub = ListPublisher()
    learner = Learner(cfg, run_dir=None, publisher=pub)
    learner.publish()
    sink = CaptureSink()
    actor = Actor(cfg, 0, PublisherSource(pub), sink, learner_timeout_s=2.0)
    assert actor.step_once()
    learner.ingest(*sink.messages[-1])
    learner.update_once(*learner.take_batch(timeout_s=0))     # v1 published

    class Drained:  # a socket: each message is delivered once
        def __init__(self):
            self.seen = 0

        def newest(self, timeout_ms=0):
            if self.seen < len(pub.published):
                self.seen = len(pub.published)
                return pub.published[-1]
            return None

    actor.weights = Drained()
    actor._between_steps()                                    # v1 arrives "mid-rollout": queued
    assert len(actor._incoming) == 1 and actor.version == 0
    assert actor.step_once() and not actor.failed             # no 2 s wait for a version it holds
    assert sink.messages[-1][1]["policy_version"] == 1


def test_learner_threads_auto_counts_the_cores_the_actors_leave(monkeypatch):
    from learner.learner import learner_threads
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: set(range(8)), raising=False)
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    cfg = small_config()
    assert learner_threads(cfg) == 1                               # the default: one thread
    cfg.learner.torch_threads = 3
    assert learner_threads(cfg) == 3
    cfg.learner.torch_threads = "auto"
    assert learner_threads(cfg) == 8                               # standard: the actors wait for the update
    cfg.trainer.buffer_type, cfg.actors.num_actors = "vla", 3
    assert learner_threads(cfg) == 5                               # vla: three cores are collecting
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    assert learner_threads(cfg) == 2                               # shared by two learner ranks
    cfg.actors.num_actors = 20
    assert learner_threads(cfg) == 1                               # never fewer than one


def test_time_totals_add_up_what_actors_report_and_ignore_implausible_values():
    cfg = small_config(buffer_type="vla", buffer_capacity=4, max_policy_lag=10)
    learner, _, _, actor = serial_run(cfg, updates=3)
    totals = learner.time_totals
    assert totals["update_wall_s"] > 0 and totals["update_cpu_s"] > 0
    assert 0 < totals["collect_cpu_s"] <= totals["collect_wall_s"] + 0.05
    before = dict(totals)
    td, meta = actor.sink.messages[-1]
    for bad in (-1.0, float("nan"), float("inf"), 1e12, "3", None, True, [1.0]):
        learner.ingest(td.clone(), {**meta, "collect_s": bad, "collect_cpu_s": bad})
    assert learner.time_totals["collect_cpu_s"] == before["collect_cpu_s"]
    assert learner.time_totals["collect_wall_s"] == before["collect_wall_s"]


def test_pace_tells_actors_their_rollouts_are_taken_before_the_update_runs():
    """With lag_policy pace the credit for consumed rollouts goes out when the update takes them,
    not with the next weights: an actor may collect during the update (a pipeline, lag 1)."""
    cfg = small_config(buffer_type="vla", buffer_capacity=4, max_policy_lag=1, lag_policy="pace")
    learner, pub, sink, actor = wired(cfg)
    assert actor.step_once()
    learner.ingest(*sink.messages[-1])
    order = []
    pub.send_control = lambda **meta: order.append(("control", meta))
    publish = pub.publish
    pub.publish = lambda td, **meta: (order.append(("weights", meta)), publish(td, **meta))
    learner.update_once(*learner.take_batch(timeout_s=0))
    kinds = [k for k, _ in order]
    assert kinds == ["control", "weights"]
    assert order[0][1]["kind"] == "credit" and order[0][1]["consumed"] == [1]
    assert order[0][1]["version"] == 0 and order[1][1]["version"] == 1   # where the next rollout starts


def test_the_learner_trains_every_full_batch_received_before_it_stops():
    """When the run's env steps are all in, the learner stops taking rollouts and trains on every
    full batch it holds (vla mode used to drop the last round when it arrived during an update);
    a partial batch is left for the shutdown's count of drops."""
    from types import SimpleNamespace
    from learner.process import LearnerRun
    cfg = small_config(buffer_type="vla", total_steps=3 * 64, max_policy_lag=8, buffer_capacity=8)
    learner, pub, sink, actor = wired(cfg)
    for _ in range(3):                       # three rollouts of 4 envs x 16 steps, all acted by version 0
        assert actor.step_once()
        learner.ingest(*sink.messages[-1])
    assert learner.finished and learner.updates == 0 and len(learner.buffer) == 3
    LearnerRun._drain(SimpleNamespace(learner=learner))
    assert learner.updates == 3 and len(learner.buffer) == 0 and not learner.accepting
    assert actor.step_once()                 # beyond the budget: neither stored nor counted
    learner.ingest(*sink.messages[-1])
    assert len(learner.buffer) == 0 and learner.env_steps == 3 * 64
    LearnerRun._drain(SimpleNamespace(learner=learner))
    assert learner.updates == 3


def test_a_lone_learner_process_takes_no_rollout_past_the_budget_before_its_loop_looks():
    """The receiver thread closes the intake itself when the env steps reach trainer.total_steps, so
    a rollout that arrives before the loop sees the run finished is neither counted nor stored (CI
    once saw 4352 env steps received for a 4096-step run). The serial runner keeps deciding its own end."""
    cfg = small_config(buffer_type="vla", total_steps=2 * 64, max_policy_lag=8, buffer_capacity=8)
    learner, pub, sink, actor = wired(cfg)
    learner.budget_closes_intake = True                  # as LearnerRun sets it for one rank
    for _ in range(3):
        assert actor.step_once()
        learner.ingest(*sink.messages[-1])
    assert learner.env_steps == 2 * 64 and len(learner.buffer) == 2 and learner.counts["rollouts"] == 2
    assert learner.accepting                             # the loop has not looked yet
    learner.budget_closes_intake = False                 # the serial runner: it stops where it chooses
    learner.ingest(*sink.messages[-1])
    assert learner.env_steps == 3 * 64 and len(learner.buffer) == 3


def test_critic_thread_resolves_where_it_applies_and_has_a_core(monkeypatch):
    from learner.learner import Learner, ListPublisher, uses_critic_thread
    from shared.policies import make_policy
    from learner.learner import env_spec_of
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: {0, 1}, raising=False)
    cfg = small_config()
    policy = make_policy(cfg, env_spec_of(cfg))
    assert not uses_critic_thread(cfg, policy)                       # the default: off
    cfg.learner.critic_thread = "auto"
    assert uses_critic_thread(cfg, policy)                           # standard mode, two cores
    cfg.trainer.buffer_type = "vla"
    assert not uses_critic_thread(cfg, policy)                       # one actor collects: one core left
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: {0, 1, 2}, raising=False)
    assert uses_critic_thread(cfg, policy)
    assert not uses_critic_thread(cfg, policy, ranks=object())       # DDP: never
    cfg.learner.critic_thread = True
    assert uses_critic_thread(cfg, policy)
    learner = Learner(cfg, run_dir=None, publisher=ListPublisher())
    assert learner.cpu.critic_thread is not None
    cfg.policy.name = "actor_only"
    assert not uses_critic_thread(cfg, make_policy(cfg, env_spec_of(cfg)))   # no critic


def test_critic_thread_idle_runs_the_value_loss_there_only_while_the_next_batch_waits(monkeypatch):
    """"idle": on with no core to spare (the actors collect on it), but a minibatch's value loss goes to
    the thread only while a whole next batch is in the buffer (the actors then wait for the learner)."""
    import threading

    from learner.learner import Learner, ListPublisher, env_spec_of, uses_critic_thread
    from shared.policies import make_policy
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: {0, 1}, raising=False)
    cfg = small_config()
    cfg.trainer.buffer_type, cfg.trainer.buffer_capacity = "vla", 4
    cfg.learner.critic_thread = "idle"
    policy = make_policy(cfg, env_spec_of(cfg))
    assert uses_critic_thread(cfg, policy)                      # no core to spare, but idle asks for none
    assert not uses_critic_thread(cfg, policy, ranks=object())  # DDP: never
    cfg.learner.device = "meta"
    assert not uses_critic_thread(cfg, policy)                  # off the CPU: quietly off, as auto
    cfg.learner.device = "cpu"
    learner, _, _, actor = wired(cfg)
    assert learner.cpu.critic_thread is not None and learner.cpu.critic_when is not None
    seen = []
    get_value = learner.policy.get_value
    monkeypatch.setattr(learner.policy, "get_value",
                        lambda td: seen.append(threading.current_thread() is threading.main_thread()) or get_value(td))
    k = cfg.rollouts_per_update

    for waiting, seq in ((0, 0), (k, 100)):                    # the next batch absent, then waiting
        batch = _batch_then_waiting(learner, actor, k, waiting, seq)
        seen.clear()
        stats = learner.update_once(*batch)
        assert seen and all(seen) == (waiting == 0) and (not any(seen)) == (waiting > 0), (waiting, seen)
        assert stats["side_share"] == (0.0 if waiting == 0 else 1.0)
    cfg.trainer.buffer_type = "standard"                        # the actors wait for every update: no gate
    assert Learner(cfg, run_dir=None, publisher=ListPublisher()).cpu.critic_when is None


@pytest.mark.parametrize("patch,why", [
    ({"algorithm": {"name": "grpo", "cfg": {"group_size": 2, "batch_size": 32}}, "policy": {"name": "actor_only"}},
     "grpo"),
    ({"learner": {"devices": ["cpu", "cpu"]}, "actors": {"num_actors": 2}}, "2 ranks"),
])
def test_critic_thread_true_where_it_cannot_apply_is_a_config_error(patch, why):
    from shared.config import ConfigError, config_from_dict
    raw = {"trainer": {"buffer_size": 16}, "actors": {"num_envs": 4}, "env": {"id": "CartPole-v1"},
           "learner": {"critic_thread": True}, "algorithm": {"cfg": {"batch_size": 32}}}
    for block, values in patch.items():
        raw[block] = {**raw.get(block, {}), **values}
    with pytest.raises(ConfigError, match=rf"learner\.critic_thread: true needs .*{why}"):
        config_from_dict(raw, source="t.json")
    for quiet in ("auto", "idle"):
        raw["learner"]["critic_thread"] = quiet
        config_from_dict(raw, source="t.json")                      # quietly off there
    raw["learner"]["critic_thread"] = "yes"
    with pytest.raises(ConfigError, match=r"learner\.critic_thread"):
        config_from_dict(raw, source="t.json")


def test_torch_threads_idle_widens_only_the_minibatches_taken_while_the_next_batch_waits(monkeypatch):
    """"idle": one intra-op thread, every usable core for a minibatch only while a whole next batch is
    in the buffer (the actors wait for the learner), back to one after the update; in standard mode
    the actors always wait, so every minibatch is wide."""
    import torch

    from learner.cpu_threads import idle_threads, learner_threads
    from learner.learner import Learner, ListPublisher
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: {0, 1, 2}, raising=False)
    cfg = small_config()
    cfg.trainer.buffer_type, cfg.trainer.buffer_capacity = "vla", 4
    assert idle_threads(cfg) is None                            # the default (1): never widened
    cfg.learner.torch_threads = "idle"
    assert learner_threads(cfg) == 1 and idle_threads(cfg) == 3
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    assert idle_threads(cfg) == 1                               # two local ranks share three cores
    monkeypatch.delenv("LOCAL_WORLD_SIZE")
    learner, _, _, actor = wired(cfg)
    seen = []
    set_threads = torch.set_num_threads
    monkeypatch.setattr(torch, "set_num_threads", lambda n: seen.append(n) or set_threads(1))
    monkeypatch.setattr(torch, "get_num_threads", lambda: seen[-1] if seen else 1)
    k = cfg.rollouts_per_update

    try:
        for waiting, seq in ((0, 0), (k, 100)):                 # the next batch absent, then waiting
            batch = _batch_then_waiting(learner, actor, k, waiting, seq)
            seen.clear()
            stats = learner.update_once(*batch)
            assert seen == ([] if waiting == 0 else [3, 1]), (waiting, seen)   # switched once each way
            assert stats["idle_threads_share"] == (0.0 if waiting == 0 else 1.0)
            # the threads of each minibatch, as [threads, count] runs: what a record keeps
            assert len(learner.cpu.schedule) == 1 and learner.cpu.schedule[0][0] == (1 if waiting == 0 else 3)
        cfg.trainer.buffer_type = "standard"
        std = Learner(cfg, run_dir=None, publisher=ListPublisher())
        seen.clear()
        std.cpu.before_minibatch()
        assert seen == [3]
        # a replay gives the recorded threads, minibatch by minibatch, whatever the actors do now
        std.cpu.replay_schedule, std.cpu.schedule = [1, 3, 3], []
        seen[:] = [3]                                           # running wide now
        for _ in range(3):
            std.cpu.before_minibatch()
        assert seen == [3, 1, 3] and std.cpu.schedule == [[1, 1], [3, 2]] and std.cpu.replay_schedule == []
    finally:
        set_threads(1)


def test_torch_threads_idle_with_a_critic_thread_is_a_config_error():
    from shared.config import ConfigError, config_from_dict
    raw = {"trainer": {"buffer_size": 16}, "actors": {"num_envs": 4}, "env": {"id": "CartPole-v1"},
           "learner": {"torch_threads": "idle", "critic_thread": "idle"}, "algorithm": {"cfg": {"batch_size": 32}}}
    with pytest.raises(ConfigError, match=r"t\.json.*learner\.torch_threads: \"idle\" and learner\.critic_thread"):
        config_from_dict(raw, source="t.json")
    raw["learner"]["critic_thread"] = False
    assert config_from_dict(raw, source="t.json").learner.torch_threads == "idle"
    raw["learner"]["torch_threads"] = "busy"
    with pytest.raises(ConfigError, match=r"learner\.torch_threads"):
        config_from_dict(raw, source="t.json")


def _feed(learner, actor, n, seq):
    """`n` rollouts collected by `actor` with the learner's current version, ingested as actor 0's."""
    for i in range(n):
        learner.ingest(actor.collector.collect(version=learner.version)[0].clone(),
                       RolloutMeta(actor=0, seq=seq + i).to_meta())


def _batch_then_waiting(learner, actor, k, waiting, seq):
    """A batch of `k` rollouts taken from the buffer, then `waiting` more left in it (the next batch
    already waits when ``waiting >= k``): the state the learner's idle gates look at."""
    _feed(learner, actor, k, seq)
    batch = learner.take_batch(timeout_s=1.0)
    _feed(learner, actor, waiting, seq + 50)
    return batch
