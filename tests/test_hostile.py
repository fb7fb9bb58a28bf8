"""Issue 12, done-when 1: every hostile class sent to a running learner over real sockets.

A CartPole run (vla mode, two real actors, the evaluator on) is attacked on its rollout socket, in
two rounds. First 10,000 malformed messages (``tests.test_faults.malformed_messages``: random bytes,
broken headers, wrong lengths, huge shapes): each is counted exactly once, training goes on, the
learner's memory stays within 10%. Then the 60-byte zero-size giant-shape header, rollouts that fit
the schema but carry what no policy produces, forged evaluation results, and 10,000 seeded mutations
of valid rollouts (``tests/hostile.py``), some of them forged under the real actors' ids. Training
must go on for at least 10 more versions, every message must be accounted for (malformed, refused,
or a consume/drop line of its own in versions.jsonl), every weights message the learner publishes
throughout must hold finite numbers only, and once stopped the run frees its ports. (One run for
both rounds: each launch is four process start-ups.)
"""

from __future__ import annotations

import json
import random
import time

import msgpack
import pytest
import torch
from tensordict import TensorDict

from shared.rollout import rollout_template
from learner.learner import env_spec_of
from shared import wire
from shared.config import load_config
from tests.hostile import FORGER_SEQ, mutated_message, rollout_meta, schema_attacks, valid_rollout
from tests.test_faults import _learner_pid, _port_free, _rss, malformed_messages
from tests.test_integration import CONFIG, launch, read_jsonl

pytestmark = pytest.mark.slow
N_MUTATIONS = 10_000
N_MALFORMED = 10_000


def _events(run_dir, event: str) -> list[dict]:
    try:
        return [e for e in read_jsonl(run_dir / "versions.jsonl") if e.get("event") == event]
    except (OSError, json.JSONDecodeError):
        return []


def _last_version(run_dir) -> int:
    pubs = _events(run_dir, "publish")
    return pubs[-1]["version"] if pubs else -1


def _forged_accounted(run_dir) -> int:
    """consume/drop lines of forged rollouts (seq >= FORGER_SEQ): one per accepted forgery."""
    lines = _events(run_dir, "consume") + _events(run_dir, "drop")
    return sum(1 for e in lines if isinstance(e.get("seq"), int) and e["seq"] >= FORGER_SEQ)


def giant_zero_size_messages() -> list[list[bytes]]:
    """The issue's 60-byte message and its relatives: 0 bytes of data, element counts that overflow."""
    out = []
    for shape in ([2**40 - 1, 2**40 - 1, 0], [0, 2**40 - 1, 2**40 - 1], [2**39, 0, 2**39, 2**39], [0] + [2**39] * 15):
        header = {"v": wire.PROTOCOL_VERSION, "batch": [], "meta": {"kind": "rollout", "actor": 0},
                  "tensors": [[["observation"], "float32", shape]]}
        out.append([msgpack.packb(header, use_bin_type=True), b""])
    return out


def _check_weights(sub, checked: list[int], nonfinite: list) -> None:
    """Read every message waiting on `sub`: each weights message's version goes to `checked`, and to
    `nonfinite` with the keys of its tensors that are not finite."""
    while sub.poll(0):
        topic, *frames = sub.recv_multipart()     # shared/transport.py: a topic frame, then the wire frames
        assert topic in (b"w", b"c"), topic
        td, meta = wire.decode(frames)
        if meta.get("kind") != "weights":
            continue
        bad = [k for k, v in td.items(include_nested=True, leaves_only=True)
               if v.dtype.is_floating_point and not bool(torch.isfinite(v).all())]
        checked.append(meta["version"])
        if bad:
            nonfinite.append((meta["version"], bad))


def _connect(ctx, run_dir):
    """An outsider's sockets on the run: SUB to its weights, PUSH to its rollouts."""
    import zmq
    endpoints = json.loads((run_dir / "endpoints.json").read_text())
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.LINGER, 0)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(endpoints["weights"])
    push = ctx.socket(zmq.PUSH)
    push.setsockopt(zmq.LINGER, 0)
    push.setsockopt(zmq.SNDTIMEO, 30_000)
    push.connect(endpoints["rollouts"])
    return sub, push


def _attack(push, run_dir, template, spec, after_each) -> dict[str, int]:
    """Send every hostile message to the run: giant, schema attacks under the real actors' ids,
    forged evaluations and mutated rollouts. Calls `after_each()` after each one. Returns how many of
    each kind were sent."""
    sent = {"giant": 0, "schema": 0, "eval": 0, "mutated": 0}

    def send(kind: str, frames) -> None:
        push.send_multipart(frames)   # blocks at the learner's high-water mark: none is lost
        sent[kind] += 1
        after_each()

    for frames in giant_zero_size_messages():
        send("giant", frames)
    seq = FORGER_SEQ
    version = _last_version(run_dir)
    for _name, td in schema_attacks(template, spec, version):
        for actor in (0, 1):     # under the real actors' ids
            send("schema", [bytes(f) for f in wire.encode(td, **rollout_meta(actor, seq, version))])
            seq += 1
    forged = {"returns": [12345.0], "lengths": [500], "version": version, "env_steps": 1, "final": True}
    for extra in ({}, {"sender": "evaluator"}, {"token": "0" * 32}):
        send("eval", [bytes(f) for f in wire.encode(TensorDict({}, []), kind="eval", **forged, **extra)])
    rng = random.Random(12)
    for i in range(N_MUTATIONS):
        if i % 500 == 0:
            version = max(_last_version(run_dir), 0)
            base = valid_rollout(template, spec, version, seed=i)
        send("mutated", mutated_message(base, rollout_meta(rng.randrange(2), seq, version), rng))
        seq += 1
    return sent


def _accounted(run_dir) -> int:
    """Messages the learner has counted: malformed, rejected, and forged rollouts accepted."""
    metrics = [m for m in read_jsonl(run_dir / "metrics.jsonl") if "wire/malformed" in m]
    if not metrics:
        return 0
    return metrics[-1]["wire/malformed"] + metrics[-1]["wire/rejected"] + _forged_accounted(run_dir)


def _counted(run_dir) -> tuple[int, int]:
    """The learner's malformed and rejected counts in its newest metrics line."""
    metrics = [m for m in read_jsonl(run_dir / "metrics.jsonl") if "wire/malformed" in m]
    return (int(metrics[-1]["wire/malformed"]), int(metrics[-1]["wire/rejected"])) if metrics else (0, 0)


def test_hostile_messages_never_stop_training_and_are_all_counted(tmp_path):
    import zmq

    run_dir = tmp_path / "run"
    run = launch(tmp_path, run_dir, "--actors", "2", "--steps", "10000000", "--set", "trainer.eval_freq=2000",
                 "--set", "trainer.buffer_type=vla", "--set", "trainer.save_freq=0")
    cfg = load_config(CONFIG, ["trainer.buffer_type=vla"])
    spec = env_spec_of(cfg)
    template = rollout_template(spec, cfg.actors.num_envs, cfg.trainer.buffer_size)
    ctx = zmq.Context()
    weights_checked, nonfinite = [], []

    def check_weights(sub) -> None:
        _check_weights(sub, weights_checked, nonfinite)

    try:
        # round 1: 10,000 malformed messages, once the learner's memory has settled (20 versions)
        assert run.wait(120, until=lambda: _last_version(run_dir) >= 20) is None, run.output()
        pid = _learner_pid(run_dir)
        endpoints = json.loads((run_dir / "endpoints.json").read_text())
        rss_before = max(_rss(pid) for _ in range(5) if time.sleep(0.2) is None)
        v_before = _last_version(run_dir)
        sub, push = _connect(ctx, run_dir)
        for frames in malformed_messages(N_MALFORMED):
            push.send_multipart(frames)              # blocks at the learner's high-water mark: none is lost
            check_weights(sub)
        assert run.wait(120, until=lambda: sum(_counted(run_dir)) >= N_MALFORMED,
                        every=lambda: check_weights(sub)) is None, run.output()
        malformed_1, rejected_1 = _counted(run_dir)
        assert malformed_1 + rejected_1 == N_MALFORMED, (malformed_1, rejected_1)   # every one, exactly once
        assert malformed_1 > 9_000
        assert run.wait(60, until=lambda: _last_version(run_dir) >= v_before + 10,
                        every=lambda: check_weights(sub)) is None, "training stopped"
        rss_after = _rss(pid)

        # round 2: every hostile class
        sent = _attack(push, run_dir, template, spec, lambda: check_weights(sub))
        total = sum(sent.values())
        v_after_attack = _last_version(run_dir)
        assert run.wait(180, until=lambda: (_last_version(run_dir) >= v_after_attack + 10
                                            and _accounted(run_dir) >= N_MALFORMED + total),
                        every=lambda: check_weights(sub)) is None, run.output()
        check_weights(sub)
        push.close()
        sub.close()
        run.proc.send_signal(15)
        rc = run.proc.wait(timeout=60)
        run.assert_all_gone(run_dir, timeout_s=10)
        assert _port_free(endpoints["rollouts"]) and _port_free(endpoints["weights"])
        assert not (run_dir / "endpoints.json").exists()
    finally:
        ctx.destroy(linger=0)
        run.stop()
    summary = json.loads((run_dir / "summary.json").read_text())
    forged_lines = _forged_accounted(run_dir)
    print(f"\n[hostile] {N_MALFORMED:,} malformed messages: malformed {malformed_1}, rejected {rejected_1}; "
          f"learner RSS {rss_before / 2**20:.1f} -> {rss_after / 2**20:.1f} MiB ({rss_after / rss_before - 1:+.1%})")
    print(f"[hostile] sent {sent} = {total}: malformed {summary['malformed'] - malformed_1}, refused "
          f"{summary['rejected'] - rejected_1}, forged rollouts accepted and logged {forged_lines}; versions "
          f"{v_after_attack} -> {summary['version']}; weights messages checked finite: {len(weights_checked)}; "
          f"skipped steps {summary['skipped_steps']}")
    assert rc == 143, run.output()
    assert rss_after <= 1.10 * rss_before, f"learner RSS {rss_before / 2**20:.0f} -> {rss_after / 2**20:.0f} MiB"
    # every message counted exactly once (after SIGTERM, held forgeries leave "shutdown" drop lines)
    assert summary["malformed"] + summary["rejected"] + forged_lines == N_MALFORMED + total, summary
    assert summary["malformed"] - malformed_1 >= sent["giant"]
    assert summary["rejected"] - rejected_1 >= sent["schema"] + sent["eval"]
    assert summary["version"] >= v_after_attack + 10
    assert not nonfinite, f"non-finite weights published: {nonfinite[:3]}"
    assert len(weights_checked) >= 10
    metrics = read_jsonl(run_dir / "metrics.jsonl")
    assert not any(m.get("eval/return_mean") == 12345.0 for m in metrics), "a forged evaluation was logged"
    log = (run_dir / "logs" / "learner.log").read_text()
    assert "dropped malformed message #1 from tcp://127.0.0.1" in log   # logged with the sender's address
    assert "rejected message #1 from tcp://127.0.0.1" in log            # refusals name the sender
