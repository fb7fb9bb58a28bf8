"""Staleness accounting and tools: exact lag numbers in versions.jsonl, sync delays, pacing,
delayed weights, off-policy corrections inside the learner, record/replay and the report."""

from __future__ import annotations

import json
import math
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from tensordict import TensorDict

from actors.actor import Actor
from learner.learner import Learner, ListPublisher
from learner.logs import RunLogger
from runners.serial import SerialRunner
from shared import keys
from shared.run_dir import RunDir, RunDirError
from tests.test_learner_component import CaptureSink, PublisherSource, small_config

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "launch"))
import replay as replay_tool  # noqa: E402
import staleness as report_tool  # noqa: E402


def _vla_learner(tmp_path, record=False, **algo):
    cfg = small_config(buffer_type="vla", max_policy_lag=3, buffer_capacity=8, record=record)
    for k, v in algo.items():
        setattr(cfg.algorithm.cfg, k, v)
    tmp_path.mkdir(parents=True, exist_ok=True)
    logger = RunLogger(tmp_path, use_tensorboard=False)
    learner = Learner(cfg, tmp_path, ListPublisher(), logger=logger)
    learner.publish()
    return cfg, learner


def _rollout(cfg, learner, versions: torch.Tensor):
    """One real rollout (a real actor acting with the learner's weights), restamped with `versions`
    ([N, T]): a deterministic fake actor whose steps were acted by known versions."""
    sink = CaptureSink()
    actor = Actor(cfg, 0, PublisherSource(learner.publisher), sink)
    assert actor.step_once()
    td, meta = sink.messages[-1]
    td[keys.POLICY_VERSION] = versions.clone()
    return td, meta


def _weights_after_stale_updates(cfg, learner, updates: int) -> dict[str, torch.Tensor]:
    """The learner's weights after `updates` updates, each on the same version-0 rollout (stale
    from the second on)."""
    n, t = cfg.actors.num_envs, cfg.trainer.buffer_size
    td, meta = _rollout(cfg, learner, torch.zeros(n, t, dtype=torch.int64))
    for _ in range(updates):
        learner.ingest(td.clone(), meta)
        learner.update_once(*learner.take_batch(timeout_s=0))
    return {k: v.clone() for k, v in learner.policy.state_dict().items()}


def test_versions_jsonl_lag_numbers_match_the_versions_used(tmp_path):
    cfg, learner = _vla_learner(tmp_path)
    n, t = cfg.actors.num_envs, cfg.trainer.buffer_size
    expected = []                # (event, lag histogram) in the order the lines are written
    for step in range(6):
        # versions spread over the last three, different per env and step: lags 0..3 at consumption
        v = learner.version
        versions = (v - (torch.arange(n * t).reshape(n, t) * 7 + step) % 3).clamp(min=0)
        td, meta = _rollout(cfg, learner, versions)
        learner.ingest(td, {**meta, "seq": step})
        batch = learner.take_batch(timeout_s=0)
        assert batch is not None
        lags = (learner.version - versions).flatten()
        expected.append(("consume", [[int(x), int((lags == x).sum())] for x in lags.unique()]))
        learner.update_once(*batch)
    # a rollout that is too old when it arrives: dropped for lag, and its lags are logged too
    old = torch.zeros(n, t, dtype=torch.int64)
    td, meta = _rollout(cfg, learner, old)
    learner.ingest(td, {**meta, "seq": 99})
    expected.append(("drop", [[learner.version, n * t]]))
    lines = RunDir(tmp_path).versions(("consume", "drop"))
    assert [x["event"] for x in lines] == [e for e, _ in expected]
    for line, (_, hist) in zip(lines, expected):
        assert sorted(line["lag_hist"]) == hist
        lags = [lag for lag, c in hist for _ in range(c)]
        assert line["lag"] == max(lags) and line["lag_min"] == min(lags)
        assert line["lag_mean"] == pytest.approx(sum(lags) / len(lags))
        assert line["learner_version"] - line["policy_version"] == line["lag"]
    assert lines[-1]["reason"] == "lag"
    # the TensorBoard/metrics lag numbers are the same samples' numbers
    metrics = [m for m in RunDir(tmp_path).metrics() if "lag/mean" in m]
    for m, (_, hist) in zip(metrics, expected):
        lags = [lag for lag, c in hist for _ in range(c)]
        assert m["lag/mean"] == pytest.approx(sum(lags) / len(lags)) and m["lag/max"] == max(lags)


def test_sync_delay_is_publish_to_first_action(tmp_path):
    cfg, learner = _vla_learner(tmp_path)
    published = learner.publish_times[0]
    td, meta = _rollout(cfg, learner, torch.zeros(cfg.actors.num_envs, cfg.trainer.buffer_size, dtype=torch.int64))
    (version, received, acted), = meta["synced"]       # the actor reports the version it started with
    assert version == 0 and published <= received <= acted
    learner.ingest(td, meta)
    sync = RunDir(tmp_path).versions("sync")
    assert len(sync) == 1 and sync[0]["delay_s"] == pytest.approx(acted - published)
    # ill-typed reports from a peer are ignored, never logged or fatal
    learner.intake.note_syncs(0, [["x", 1, 2], [0, "a", 1.0], [10**9, 1.0, 2.0], "junk"])
    assert len(RunDir(tmp_path).versions("sync")) == 1


def test_delayed_weights_are_loaded_only_once_old_enough():
    cfg = small_config(buffer_type="vla")
    cfg.actors.weights_delay_s = 0.3
    pub = ListPublisher()
    learner = Learner(cfg, run_dir=None, publisher=pub)
    learner.publish()
    actor = Actor(cfg, 0, PublisherSource(pub), CaptureSink())
    t0 = time.time()
    assert actor._wait_for_version(-1)
    assert actor.version == 0 and time.time() - t0 >= 0.3


def test_pace_waits_for_the_learner_instead_of_running_ahead():
    cfg = small_config(buffer_type="vla", lag_policy="pace", max_policy_lag=2, buffer_capacity=8)
    pub = ListPublisher()
    learner = Learner(cfg, run_dir=None, publisher=pub)
    learner.publish()

    class Source(PublisherSource):      # also carries the learner's per-actor counts, as the socket does
        consumed = None

        def newest(self, timeout_ms=0):
            msg = super().newest(timeout_ms)
            if msg is not None:
                self.consumed = msg[1].get("consumed")
            return msg

    sink = CaptureSink()
    actor = Actor(cfg, 0, Source(pub), sink, learner_timeout_s=0.5)
    assert actor.credits.max_inflight == 2      # ceil(max_policy_lag x k / num_actors), k = 1
    assert actor.step_once() and actor.step_once()
    assert actor._inflight() == 2
    assert not actor.step_once() and actor.failed and len(sink.messages) == 2   # waited; nobody consumed
    # once the learner consumes one, the actor may send one more
    actor.failed = False
    actor.stop_event.clear()
    learner.ingest(*sink.messages[0])
    learner.update_once(*learner.take_batch(timeout_s=0))
    assert actor.step_once() and len(sink.messages) == 3


@pytest.mark.parametrize("correction,lam,vtrace_advantage", [
    ("is", 1.0, "impala"), ("is", 0.9, "impala"), ("vtrace", 1.0, "impala"), ("appo", 1.0, "impala"),
    ("vtrace", 0.9, "gae"), ("appo", 0.9, "gae"), ("mask", 0.9, "impala"), ("ewma", 0.9, "impala")])
def test_corrections_equal_plain_ppo_on_policy(tmp_path, correction, lam, vtrace_advantage):
    """On-policy data (standard mode): every correction gives plain PPO's first update. Advantage
    normalisation is off on both sides, since plain PPO normalises per minibatch and the corrections
    once per batch (test_corrections_normalise_once_per_batch_before_weighting). V-trace and APPO only
    at lambda = 1 with IMPALA's policy-gradient advantage r + gamma v_{s+1} - V(s), which is not GAE's
    for lambda < 1 (their value targets still are); at any lambda with vtrace_advantage "gae". ewma with its decay near 1, so that its proximal
    policy stays at the weights that acted."""
    results = []
    for corr in ("none", correction):
        cfg = small_config()
        cfg.algorithm.cfg.gae_lambda = lam
        cfg.algorithm.cfg.correction = corr
        cfg.algorithm.cfg.norm_adv = False
        cfg.algorithm.cfg.ewma_decay = 0.999999
        cfg.algorithm.cfg.vtrace_advantage = vtrace_advantage
        runner = SerialRunner(cfg)
        for rollout, meta in runner.collect():
            runner.learner.ingest(rollout, meta)
        stats, = runner.train()
        runner.close()
        results.append(runner.learner.policy.state_dict())
        if corr == "mask":
            assert stats["masked_frac"] == 0.0
    for k in results[0]:
        torch.testing.assert_close(results[0][k], results[1][k], rtol=1e-4, atol=1e-5)


def test_corrections_differ_on_stale_data_and_report_weights(tmp_path):
    stats = {}
    for corr in ("none", "vtrace"):
        cfg, learner = _vla_learner(tmp_path / corr, correction=corr, recompute_values=False)
        td, meta = _rollout(cfg, learner, torch.zeros(cfg.actors.num_envs, cfg.trainer.buffer_size,
                                                        dtype=torch.int64))
        for _ in range(3):             # the learner moves on: the rollout is now 3 versions old
            learner.ingest(td.clone(), meta)
            learner.update_once(*learner.take_batch(timeout_s=0))
        learner.ingest(td.clone(), meta)
        stats[corr] = learner.update_once(*learner.take_batch(timeout_s=0))
    assert "rho_mean" not in stats["none"]
    assert stats["vtrace"]["rho_mean"] != pytest.approx(1.0, abs=1e-4)
    assert 0 <= stats["vtrace"]["rho_clipped_frac"] <= 1


def _gae_of_update(learner, td, meta, monkeypatch):
    """The advantages and value targets `update_once` trains on, captured from ppo_update."""
    import learner.ppo as ppo_module
    seen = {}
    real = ppo_module.ppo_update

    def spy(policy, optimizer, batch, cfg, generator, **kwargs):
        seen["adv"], seen["target"] = batch[keys.ADVANTAGE].clone(), batch[keys.VALUE_TARGET].clone()
        return real(policy, optimizer, batch, cfg, generator, **kwargs)

    monkeypatch.setattr(ppo_module, "ppo_update", spy)
    learner.ingest(td.clone(), meta)
    stats = learner.update_once(*learner.take_batch(timeout_s=0))
    monkeypatch.setattr(ppo_module, "ppo_update", real)
    return seen, stats


@pytest.mark.parametrize("setting", [None, True, False])
def test_stale_values_are_recomputed_by_default(tmp_path, monkeypatch, setting):
    """recompute_values None (default): GAE on stale samples uses the current critic's V(s), and its
    value of the bootstrap observation after a truncation and after the last step; on fresh samples
    the actor's values, untouched. True: always recompute; False: never (and then the actors send no
    bootstrap observation)."""
    from learner.advantages import compute_gae
    from learner.advantages import current_values
    cfg, learner = _vla_learner(tmp_path, recompute_values=setting, correction="none")   # GAE's values alone
    n, t = cfg.actors.num_envs, cfg.trainer.buffer_size
    fresh, meta = _rollout(cfg, learner, torch.zeros(n, t, dtype=torch.int64))
    seen, stats = _gae_of_update(learner, fresh, meta, monkeypatch)   # version 0 data at version 0
    adv, target = compute_gae(fresh[keys.REWARD], fresh[keys.VALUE], fresh[keys.NEXT_VALUE], fresh[keys.TERMINATED],
                              fresh[keys.DONE], cfg.algorithm.cfg.gamma, cfg.algorithm.cfg.gae_lambda)
    torch.testing.assert_close(seen["adv"], adv)
    assert ("value_shift" in stats) == (setting is True)
    for _ in range(2):                                               # the learner moves on to version 3
        _gae_of_update(learner, fresh, meta, monkeypatch)
    r, d, term, gamma, lam = (fresh[keys.REWARD], fresh[keys.DONE], fresh[keys.TERMINATED], cfg.algorithm.cfg.gamma,
                              cfg.algorithm.cfg.gae_lambda)
    assert (keys.BOOTSTRAP_OBS in fresh.keys()) == (setting is not False)
    with torch.no_grad():                                            # the critic the next update starts with
        v_now = learner.policy.evaluate_actions(fresh.reshape(-1))[2].view(n, t)
        boot_now = (learner.policy.get_value(TensorDict({keys.OBS: fresh[keys.BOOTSTRAP_OBS].reshape(n * t, -1)},
                                                        [n * t])).view(n, t) if setting is not False else None)
    seen, stats = _gae_of_update(learner, fresh, meta, monkeypatch)   # version-0 data, 3 versions old
    if setting is False:
        expected = compute_gae(r, fresh[keys.VALUE], fresh[keys.NEXT_VALUE], term, d, gamma, lam)
        assert "value_shift" not in stats
    else:
        next_now = current_values(v_now, fresh[keys.NEXT_VALUE], d, boot_now, term)
        expected = compute_gae(r, v_now, next_now, term, d, gamma, lam)
        assert stats["value_shift"] > 0 and stats["bootstrap_shift"] > 0
        # the last step's bootstrap is the current critic's value of the observation after it
        open_end = ~d[:, -1]
        torch.testing.assert_close(next_now[open_end, -1], boot_now[open_end, -1])
    torch.testing.assert_close(seen["adv"], expected[0])
    torch.testing.assert_close(seen["target"], expected[1])
    assert not torch.allclose(fresh[keys.VALUE], v_now)               # the critic did move: the test can tell


@pytest.mark.slow
def test_record_replay_report_on_a_real_run(tmp_path):
    """A small real run (learner + 2 actors, vla, sync_every 3, V-trace, --record) through the launcher;
    replaying its record twice gives identical weights, equal to the run's own final weights; the
    report tool writes every figure from it."""
    run = tmp_path / "run"
    cmd = ["bash", str(ROOT / "launch" / "run_local.sh"), "--steps", "6000", "--out", str(run), "--record",
           "--set", "trainer.buffer_type=vla", "--set", "actors.sync_every=3", "--set", "trainer.max_policy_lag=20",
           "--set", "trainer.lag_policy=pace", "--set", "algorithm.cfg.correction=vtrace",
           "--set", "trainer.eval_freq=2000", "--set", "algorithm.cfg.n_epochs=2",
           "--set", "learner.torch_threads=idle"]   # threads widened while the actors idle: recorded, replayed
    p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=180, start_new_session=True)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    index = RunDir(run).record_index()
    consumed = RunDir(run).versions("consume")
    assert sum(len(e["rollouts"]) for e in index) == len(consumed) > 0
    assert len(RunDir(run).record_threads()) == len(index)
    first = replay_tool.replay(run)
    second = replay_tool.replay(run)
    digest = replay_tool.weights_digest(first.policy)
    assert digest == replay_tool.weights_digest(second.policy)
    final = torch.load(sorted((run / "checkpoints").glob("*.pt"))[-1], weights_only=True)
    assert final["version"] == first.version

    class _Sd(torch.nn.Module):
        def state_dict(self, *a, **k):
            return final["policy"]
    assert replay_tool.weights_digest(_Sd()) == digest     # the replay is the run, bit for bit
    other = replay_tool.replay(run, ["algorithm.cfg.correction=none"])
    assert replay_tool.weights_digest(other.policy) != digest
    assert RunDir(run).versions("sync")
    # every correction on this same record, final weights evaluated: one table row for the run's lag
    import replay_corrections
    assert replay_corrections.main([str(run), "--corrections", "none appo ewma", "--episodes", "3",
                                    "--out", str(tmp_path / "rc")]) == 0
    rows = json.loads((tmp_path / "rc" / "replay.json").read_text())
    assert [r["correction"] for r in rows] == ["none", "appo", "ewma"]
    assert all(math.isfinite(r["return"]) and r["updates"] == len(index) for r in rows)
    assert len({r["mean_lag"] for r in rows}) == 1 and rows[0]["mean_lag"] > 0
    assert "| 3 |" in (tmp_path / "rc" / "replay.md").read_text()
    assert replay_corrections.main([str(run), "--corrections", "bogus"]) == 2
    written = report_tool.write_report([report_tool.load_run(run)], tmp_path / "report")
    names = {p.name for p in written}
    assert {"lag_histogram.png", "lag_over_time.png", "return_vs_steps.png", "return_vs_time.png",
            "actor_throughput.png", "sync_delay.png", "dropped_episode_bias.png", "return_vs_lag.png",
            "report.md"} <= names
    for p in written:
        assert p.stat().st_size > 1000
    assert "no sync events" not in (tmp_path / "report" / "report.md").read_text()


def test_a_refused_rollout_still_frees_a_pacing_actor():
    """Pacing counts rollouts the learner finished with: one refused at ingest is finished too."""
    cfg = small_config(buffer_type="vla", lag_policy="pace")
    learner = Learner(cfg, run_dir=None, publisher=ListPublisher())
    learner.publish()
    td, meta = _rollout(cfg, learner, torch.zeros(cfg.actors.num_envs, cfg.trainer.buffer_size, dtype=torch.int64))
    td[keys.REWARD][0, 0] = float("nan")
    with pytest.raises(Exception, match="actor 0"):
        learner.ingest(td, meta)
    assert learner.finished_counts() == [1]


def test_credit_messages_never_replace_the_weights_a_late_joiner_gets():
    import zmq

    from shared.transport import WeightsPublisher, WeightsSubscriber
    ctx = zmq.Context()
    pub = WeightsPublisher(ctx, "127.0.0.1", 0)
    try:
        pub.publish(TensorDict({"w": torch.ones(3)}, []), kind="weights", version=7)
        pub.send_control(kind="credit", consumed=[1, 2])
        sub = WeightsSubscriber(ctx, pub.endpoint)
        deadline = time.monotonic() + 10
        msg = None
        while msg is None and time.monotonic() < deadline:
            pub.serve_subscriptions()
            msg = sub.newest(timeout_ms=50)
        assert msg is not None and msg[1]["kind"] == "weights" and msg[1]["version"] == 7
        sub.close()
    finally:
        pub.close()
        ctx.destroy(linger=0)


def test_replay_corrections_keeps_results_and_resumes(tmp_path, monkeypatch):
    """replay.json is written after every result; a second call with the same --out replays only the
    (run, correction) pairs it lacks, at the same --episodes, and its table covers every run; a file
    that is not this tool's is refused with its path."""
    import replay_corrections

    runs = []
    for seed, sync in ((1, 4), (2, 4), (1, 16)):
        d = tmp_path / f"sync{sync}_s{seed}"
        d.mkdir()
        cfg = json.loads((ROOT / "configs" / "pendulum_ppo.json").read_text())
        cfg["trainer"]["seed"], cfg["actors"]["sync_every"] = seed, sync
        (d / "config.json").write_text(json.dumps(cfg))
        runs.append(d)
    calls = []

    class FakeLearner:
        updates = 7

    def fake_replay(run, sets):
        calls.append((run.name, sets[0].split("=")[1]))
        if len(calls) == 4 and fail["on"]:
            raise KeyboardInterrupt          # an interruption after three results
        return FakeLearner()

    fail = {"on": True}
    monkeypatch.setattr(replay_corrections, "record_mean_lag", lambda run: 2.0 if "sync4" in run.name else 8.0)
    monkeypatch.setattr(replay_corrections.replay_tool, "replay", fake_replay)
    monkeypatch.setattr(replay_corrections, "evaluate_final",
                        lambda learner, episodes, seed: -100.0 * len(calls))
    out = tmp_path / "rc"
    args = [str(r) for r in runs] + ["--corrections", "none is", "--episodes", "5", "--out", str(out)]
    with pytest.raises(KeyboardInterrupt):
        replay_corrections.main(args)
    kept = json.loads((out / "replay.json").read_text())
    assert [(Path(r["run"]).name, r["correction"]) for r in kept] == calls[:3]
    fail["on"] = False
    assert replay_corrections.main(args) == 0
    assert calls[4:] == [("sync4_s2", "is"), ("sync16_s1", "none"), ("sync16_s1", "is")]   # the rest only
    rows = json.loads((out / "replay.json").read_text())
    assert len(rows) == 6 and {r["episodes"] for r in rows} == {5}
    table = (out / "replay.md").read_text()
    assert "| 4 | 2.00 | 2 |" in table and "| 16 | 8.00 | 1 |" in table
    n = len(calls)
    assert replay_corrections.main(args) == 0 and len(calls) == n                     # nothing left to do
    assert replay_corrections.main(args[:-3] + ["3", "--out", str(out)]) == 0 and len(calls) == n + 6
    (out / "replay.json").write_text('{"not": "rows"}')
    assert replay_corrections.main(args) == 2


def test_weights_lag_versions_acts_a_constant_number_of_versions_behind():
    """actors.weights_lag_versions K with sync_every 1: the actor takes a version at every rollout,
    always the one K behind the newest it received (the first one until K exist), so every rollout
    the learner consumes is K versions old, not a sawtooth."""
    cfg = small_config(buffer_type="vla", max_policy_lag=50, buffer_capacity=8)
    cfg.actors.weights_lag_versions = 3
    pub = ListPublisher()
    learner = Learner(cfg, run_dir=None, publisher=pub)
    learner.publish()
    sink = CaptureSink()
    actor = Actor(cfg, 0, PublisherSource(pub), sink)
    acted, lags = [], []
    for _ in range(9):
        assert actor.step_once()
        td, meta = sink.messages[-1]
        acted.append(meta["policy_version"])
        lags.append(learner.version - meta["policy_version"])
        learner.ingest(td, meta)
        learner.update_once(*learner.take_batch(timeout_s=0))
        learner.publish()
    assert acted == [0, 0, 0, 0, 1, 2, 3, 4, 5]
    assert lags == [0, 1, 2, 3, 3, 3, 3, 3, 3]
    assert len(actor._incoming) <= 4                 # only the versions that may still become due are kept
    # a restarted learner (new incarnation, lower versions): its weights replace ours at once
    td, meta = pub.published[-1]
    pub.published.append((td.clone(), {**meta, "version": 1, "incarnation": "another-life"}))
    assert actor.step_once()
    assert sink.messages[-1][1]["policy_version"] == 1 and actor.incarnation == "another-life"


def test_replay_reads_the_recorded_threads_and_says_when_it_has_none(tmp_path):
    """learner.torch_threads "idle" widens the update's threads while the actors idle, and CPU float
    sums depend on the thread count: a record keeps each minibatch's threads (threads.jsonl) and the
    replay uses them; a record without them (older runs) replays on the same data, not to the same
    bits, and says so. Malformed lines name the file and line."""
    from shared.config import load_config
    idle = load_config(ROOT / "configs" / "halfcheetah_ppo.json")
    assert idle.learner.torch_threads == "idle"
    record = tmp_path / "record"
    record.mkdir()
    assert "not reproduce the run's weights bit for bit" in replay_tool.inexact_reason(idle, record)
    (record / "threads.jsonl").write_text('{"update": 1, "threads": [[2, 3], [1, 2]]}\n'
                                          '{"update": 2, "threads": [[1, 1]]}\n')
    assert replay_tool.inexact_reason(idle, record) is None
    assert RunDir(tmp_path).record_threads() == {1: [2, 2, 2, 1, 1], 2: [1]}
    fixed = load_config(ROOT / "configs" / "halfcheetah_ppo.json", ["learner.torch_threads=1"])
    assert replay_tool.inexact_reason(fixed) is None
    # said once per record, however many replays of it a sweep runs (replay_corrections.py)
    assert [replay_tool.warn_inexact(tmp_path, "why") for _ in range(3)] == [True, False, False]
    assert not replay_tool.warn_inexact(tmp_path / "other", None)
    for bad in ('{"update": 3, "threads": [[0, 1]]}', '{"update": 3}', "not json", '{"update": "3", "threads": []}'):
        (record / "threads.jsonl").write_text(bad + "\n")
        with pytest.raises(RunDirError, match=r"threads.jsonl:1"):
            RunDir(tmp_path).record_threads()
