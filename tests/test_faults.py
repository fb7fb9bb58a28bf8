"""Fault suite: real processes on loopback, killed, flooded, overloaded and probed without keys.

Every test stops what it started in bounded time (``Started.stop``: SIGTERM to the group, then
SIGKILL) and checks that nothing of the run is left running.
"""

from __future__ import annotations

import json
import os
import random
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import msgpack
import psutil
import pytest

from tests.test_integration import (RUN_TIMEOUT_S, Started, _alive, _sigterm_and_wait, consumes, launch,
                                    load_ckpt, newest_checkpoint, publishes, read_jsonl)
from tests.test_wire import edit_entry, edit_header, header_of, replace_frame, valid_frames, with_header

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[1]


def _publish_count(run_dir: Path) -> int:
    try:
        return (run_dir / "versions.jsonl").read_text().count('"event":"publish"')
    except OSError:
        return 0


def _procs(run: Started, needle: str) -> list[psutil.Process]:
    out = []
    for p in run.snapshot():
        try:
            if _alive(p) and needle in " ".join(p.cmdline()):
                out.append(p)
        except psutil.Error:
            pass
    return out


def _learner_pid(run_dir: Path) -> int:
    return json.loads((run_dir / "endpoints.json").read_text())["pid"]


def _stop(run: Started, run_dir: Path, timeout_s: float = 15) -> int:
    os.kill(run.proc.pid, signal.SIGTERM)
    try:
        rc = run.proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        pytest.fail(f"launcher still running {timeout_s} s after SIGTERM:\n{run.output()}")
    run.assert_all_gone(run_dir, timeout_s=5)
    return rc


def _port_free(endpoint: str) -> bool:
    host, port = endpoint.removeprefix("tcp://").rsplit(":", 1)
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, int(port)))
            return True
        except OSError:
            return False


# ------------------------------------------------------------------------------------ crashes

def test_sigkill_actor_is_replaced_and_learning_goes_on_then_sigterm_stops_everything(tmp_path):
    """A SIGKILLed actor is restarted by the launcher and its new life trains with current weights;
    then SIGTERM to the launcher stops everything within 15 s (the learner, both actors, the
    replacement among them, and the evaluator), exit 143, the learner's final checkpoint and
    summary.json naming SIGTERM. (One run for what were two tests, this one and
    test_integration's SIGTERM test: each launch is four process start-ups.)"""
    run_dir = tmp_path / "run"
    run = launch(tmp_path, run_dir, "--actors", "2", "--steps", "10000000")      # the evaluator on
    try:
        assert run.wait(120, until=lambda: _publish_count(run_dir) >= 3) is None, run.output()
        victim, = _procs(run, "--actor-id 1")
        victim.kill()
        killed_at = time.time()
        v_kill = _publish_count(run_dir)

        def replaced_and_trained() -> bool:
            events = read_jsonl(run_dir / "versions.jsonl")
            back = [e for e in consumes(events) if e["actor"] == 1 and e["time"] > killed_at]
            return bool(back) and _publish_count(run_dir) >= v_kill + 3

        assert run.wait(90, until=replaced_and_trained) is None, run.output()
        new, = _procs(run, "--actor-id 1")
        assert new.pid != victim.pid
        assert "restart" in run.output().lower(), run.output()
        cmdlines = [" ".join(p.cmdline()) for p in run.snapshot() if _alive(p)]
        assert any("-m learner" in c for c in cmdlines) and sum("-m actors" in c for c in cmdlines) == 2, cmdlines
        stop_s = _sigterm_and_wait(run, run_dir)     # exit 128 + SIGTERM, nothing of the run left
    finally:
        run.stop()
    assert stop_s < 15
    events = read_jsonl(run_dir / "versions.jsonl")
    versions = [e["version"] for e in publishes(events, final=False)]
    assert versions == list(range(len(versions)))          # never backwards, never skipped
    back = [e for e in consumes(events) if e["actor"] == 1 and e["time"] > killed_at]
    # the killed life's last rollout, sent before the kill, may still be consumed after it: the new
    # life is the one whose seq starts again at 0, acting with current weights
    new_life = [e for e in back if e["seq"] == 0]
    assert new_life and new_life[0]["policy_version"] >= v_kill - 1, back[:3]
    ckpt = load_ckpt(newest_checkpoint(run_dir))
    assert ckpt["version"] >= 2
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["stopped_by"] == "SIGTERM" and summary["version"] == ckpt["version"], summary
    assert "SIGTERM" in (tmp_path / "launch.out").read_text()


def test_sigkill_learner_stops_the_run_and_resume_restores_every_counter(tmp_path):
    run_dir = tmp_path / "run"
    run = launch(tmp_path, run_dir, "--no-eval", "--actors", "2", "--steps", "10000000", "--set", "trainer.eval_freq=0",
                 "--set", "trainer.save_freq=1024", name="first")
    try:
        def two_checkpoints() -> bool:
            return len(list((run_dir / "checkpoints").glob("ckpt_*.pt"))) >= 2 if (run_dir / "checkpoints").is_dir() \
                else False

        assert run.wait(120, until=two_checkpoints) is None, run.output()
        os.kill(_learner_pid(run_dir), signal.SIGKILL)
        try:
            rc = run.proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            pytest.fail(f"launcher still running 20 s after the learner died:\n{run.output()}")
        assert rc != 0, run.output()
        run.assert_all_gone(run_dir, timeout_s=5)
    finally:
        run.stop()
    for path in (run_dir / "checkpoints").glob("*"):
        assert path.suffix in (".pt", ".sha256"), f"a temporary file was left: {path}"   # a checkpoint, its digest
        if path.suffix == ".sha256":
            assert path.with_suffix("").is_file(), f"a digest without its checkpoint: {path}"
        else:
            load_ckpt(path)                                # every checkpoint is whole
    ckpt = load_ckpt(newest_checkpoint(run_dir))
    n_before = len(read_jsonl(run_dir / "versions.jsonl"))
    m_before = len(read_jsonl(run_dir / "metrics.jsonl"))

    second = launch(tmp_path, run_dir, "--no-eval", "--resume", "--actors", "2", "--steps", str(ckpt["env_steps"] + 3000),
                    "--set", "trainer.eval_freq=0", "--set", "trainer.save_freq=1024", name="second")
    try:
        assert second.wait(RUN_TIMEOUT_S) == 0, second.output()
        second.assert_all_gone(run_dir)
    finally:
        second.stop()
    after = read_jsonl(run_dir / "versions.jsonl")[n_before:]
    resume, = [e for e in after if e["event"] == "resume"]
    assert (resume["version"], resume["env_steps"], resume["updates"]) == \
        (ckpt["version"], ckpt["env_steps"], ckpt["updates"])
    lines = [m for m in read_jsonl(run_dir / "metrics.jsonl")[m_before:] if "loss/policy" in m]
    assert lines[0]["version"] == ckpt["version"] + 1 and lines[0]["updates"] == ckpt["updates"] + 1
    # the optimiser state came back too: Adam's step count continues
    final = load_ckpt(newest_checkpoint(run_dir))
    steps = [s["step"] for s in final["optimizer"]["state"].values()]
    assert all(float(s) > float(ckpt["optimizer"]["state"][0]["step"]) for s in steps)


# ------------------------------------------------------------------------------------ bad input

def malformed_messages(n: int, seed: int = 0) -> list[list[bytes]]:
    """`n` hostile messages of many kinds: random bytes, mutated headers, wrong lengths, huge shapes.
    (tests/test_hostile.py sends 10,000 of them to a training run, before its other attacks.)"""
    rng = random.Random(seed)
    base = valid_frames()

    def rand_bytes(k: int) -> bytes:
        return bytes(rng.getrandbits(8) for _ in range(k))

    makers = [
        lambda: [rand_bytes(rng.randint(0, 64))],
        lambda: [rand_bytes(rng.randint(1, 32)) for _ in range(rng.randint(2, 5))],
        lambda: edit_header(base, v=rng.choice([0, 2, 99, "1", None])),
        lambda: edit_entry(base, 0, dtype=rng.choice(["float128", "object", "", 7, "torch.float32"])),
        lambda: edit_entry(base, 0, shape=[2, 3, rng.choice([2**40, 2**62, -4])]),
        lambda: edit_entry(base, 1, shape=[2**31, 2**31]),
        lambda: edit_header(base, batch=[rng.randint(3, 9), 3]),
        lambda: replace_frame(base, rng.randint(1, len(base) - 1), rand_bytes(rng.randint(0, 20))),
        lambda: base[:-1],
        lambda: [*base, rand_bytes(8)],
        lambda: with_header(base, rng.choice([1, "x", [1, 2], None, {"tensors": "no"}])),
        lambda: [bytes(base[0])[:rng.randint(1, len(base[0]) - 1)], *base[1:]],
        lambda: edit_header(base, tensors=[["a", "float32", [2, 3, 4]]] * 300),
        lambda: [msgpack.packb({**header_of(base), "meta": {"x": "y" * 10}}) + rand_bytes(3), *base[1:]],
    ]
    return [makers[i % len(makers)]() for i in range(n)]


def _rss(pid: int) -> int:
    return psutil.Process(pid).memory_info().rss


def test_overloaded_learner_keeps_memory_bounded_and_counts_every_drop(tmp_path):
    """An actor far faster than the learner (40 epochs an update): the buffer overwrites, the
    high-water marks hold the rest back, memory stays flat, and every rollout is accounted for. (One
    actor: it alone sends tens of rollouts an update.)"""
    run_dir = tmp_path / "run"
    run = launch(tmp_path, run_dir, "--no-eval", "--actors", "1", "--steps", "10000000", "--set", "trainer.eval_freq=0",
                 "--set", "trainer.buffer_type=vla", "--set", "algorithm.cfg.n_epochs=40",
                 "--set", "trainer.buffer_capacity=2", "--set", "trainer.lag_policy=drop")
    samples: dict[str, list[int]] = {"learner": [], "actors": []}
    try:
        assert run.wait(120, until=lambda: _publish_count(run_dir) >= 3) is None, run.output()
        pid = _learner_pid(run_dir)
        t_end = time.monotonic() + 15
        while time.monotonic() < t_end:
            samples["learner"].append(_rss(pid))
            samples["actors"].append(sum(p.memory_info().rss for p in _procs(run, "-m actors")))
            time.sleep(0.5)
        _stop(run, run_dir)
    finally:
        run.stop()
    for who, rss in samples.items():
        first, last = rss[len(rss) // 4], max(rss[len(rss) // 2:])
        print(f"\n[faults] overload: {who} RSS {first / 2**20:.1f} -> max {last / 2**20:.1f} MiB")
        assert last <= first * 1.10 + 20 * 2**20, f"{who} RSS grew {first / 2**20:.0f} -> {last / 2**20:.0f} MiB"
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["overwritten"] > 0, summary
    events = read_jsonl(run_dir / "versions.jsonl")
    accounted = [e for e in events if e["event"] in ("consume", "drop")]
    assert len(accounted) == summary["rollouts"], (len(accounted), summary)


# ------------------------------------------------------------------------------------ security

def test_curve_run_trains_and_refuses_peers_without_the_key(tmp_path):
    import zmq

    from shared.security import generate_keypair, load_secret

    keys_dir = tmp_path / "keys"
    subprocess.run([sys.executable, str(ROOT / "launch" / "make_keys.py"), str(keys_dir)], check=True,
                   capture_output=True, timeout=60)
    assert oct((keys_dir / "learner.key_secret").stat().st_mode & 0o777) == "0o600"
    _, stranger_sec = generate_keypair(tmp_path / "stranger", "stranger")
    stranger_pub, stranger_secret = load_secret(stranger_sec, "test")
    learner_pub = load_secret(keys_dir / "learner.key_secret", "test")[0]
    run_dir = tmp_path / "run"
    run = launch(tmp_path, run_dir, "--actors", "2", "--steps", "10000000", "--set", "trainer.eval_freq=1000",
                 "--set", f"learner.curve_secret_key={keys_dir}/learner.key_secret",
                 "--set", f"learner.curve_authorized_keys={keys_dir}/authorized",
                 "--set", f"actors.curve_secret_key={keys_dir}/actors.key_secret",
                 "--set", f"actors.curve_server_key={keys_dir}/learner.key")
    ctx = zmq.Context()
    try:
        assert run.wait(120, until=lambda: _publish_count(run_dir) >= 3) is None, run.output()
        endpoints = json.loads((run_dir / "endpoints.json").read_text())

        def peer(kind: int, with_key: bool) -> zmq.Socket:
            s = ctx.socket(kind)
            s.setsockopt(zmq.LINGER, 0)
            if with_key:   # a well-formed key pair the learner was never given
                s.curve_publickey, s.curve_secretkey, s.curve_serverkey = stranger_pub, stranger_secret, learner_pub
            if kind == zmq.SUB:
                s.setsockopt(zmq.SUBSCRIBE, b"")
            s.connect(endpoints["weights" if kind == zmq.SUB else "rollouts"])
            return s

        subs = [peer(zmq.SUB, False), peer(zmq.SUB, True)]
        pushes = [peer(zmq.PUSH, False), peer(zmq.PUSH, True)]
        for p in pushes:   # without a completed handshake there is no peer to send to
            try:
                p.send_multipart(valid_frames(), flags=zmq.NOBLOCK)
            except zmq.Again:
                pass
        poller = zmq.Poller()        # both subscribers listen for 3 s, side by side
        for s in subs:
            poller.register(s, zmq.POLLIN)
        got = [0, 0]
        deadline = time.monotonic() + 3
        while (left := deadline - time.monotonic()) > 0 and got == [0, 0]:
            for s, event in poller.poll(left * 1000):
                got[subs.index(s)] = event
        assert got == [0, 0], "a peer without the learner's key received weights"

        def evaluated_and_trained() -> bool:   # the evaluator, keyed by the learner, got in
            metrics = read_jsonl(run_dir / "metrics.jsonl")
            return any("eval/return_mean" in m for m in metrics) and _publish_count(run_dir) >= 6

        assert run.wait(60, until=evaluated_and_trained) is None, run.output()
        _stop(run, run_dir)
    finally:
        ctx.destroy(linger=0)
        run.stop()
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["malformed"] == 0 and summary["rejected"] == 0, summary   # nothing of theirs got in
    events = read_jsonl(run_dir / "versions.jsonl")
    assert {e["actor"] for e in consumes(events)} == {0, 1}                 # the keyed actors trained
    metrics = [m for m in read_jsonl(run_dir / "metrics.jsonl") if "wire/auth_refused" in m]
    assert metrics and metrics[-1]["wire/auth_refused"] >= 1, metrics[-1:]
    assert "refused CURVE client" in (run_dir / "logs" / "learner.log").read_text()
