"""Issue 46 (CPU part): rollouts through a same-host ring of learner-owned slots
(``actors.rollout_transport: "ring"``, ``shared/rollout_ring.py``).

The protocol (ownership, no reuse before release, generations, a dead producer's slots, a full
ring), hostile headers through the learner's intake (hypothesis), the attach-time checks of the
ring file, the config's refusal off-host, and, slow: the launcher with the ring (same env steps,
nothing left behind) and a standard-mode run that trains the same weights as with ZeroMQ.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tensordict import TensorDict

from learner.learner import Learner, ListPublisher
from shared import keys, wire
from shared.config import ConfigError, config_from_dict
from shared.rollout_ring import FREE, READY, WRITING, RingFull, RingProducer, RolloutRing, default_path
from shared.wire import WireError
from tests.hostile import rollout_meta, valid_rollout
from tests.test_learner_component import small_config


def _template(n: int = 2, t: int = 3) -> TensorDict:
    return TensorDict({"observation": torch.zeros(n, t, 4), "action": torch.zeros(n, t, dtype=torch.int64),
                       "done": torch.zeros(n, t, dtype=torch.bool),
                       "nested": TensorDict({"x": torch.zeros(n, t, 2, dtype=torch.float16)}, batch_size=[n, t])},
                      batch_size=[n, t])


def _filled(seed: int) -> TensorDict:
    g = torch.Generator().manual_seed(seed)
    td = _template()
    td["observation"].copy_(torch.randn(td["observation"].shape, generator=g))
    td["action"].copy_(torch.randint(0, 5, td["action"].shape, generator=g))
    td["done"].copy_(torch.rand(td["done"].shape, generator=g) < 0.5)
    td["nested", "x"].copy_(torch.randn(2, 3, 2, generator=g).half())
    return td


@pytest.fixture
def ring():
    rings = []

    def make(template=None, rings_n: int = 2, slots: int = 2) -> RolloutRing:
        r = RolloutRing(template if template is not None else _template(), rings_n, slots,
                        default_path(f"test-{uuid.uuid4().hex[:8]}"))
        rings.append(r)
        return r
    yield make
    for r in rings:
        r.close()
        assert not r.path.exists()


def _state(r: RolloutRing, actor: int, slot: int) -> int:
    return int(r.ctl[actor, slot, 0])


# ============================================================================ the protocol

def test_slot_ownership_round_trip(ring):
    r = ring()
    p = RingProducer(str(r.path), 1, 2, 2, _template())
    slot = p.claim(1.0)
    assert _state(r, 1, slot) == WRITING
    with pytest.raises(WireError, match="not ready"):       # the learner never reads a slot being written
        r.take(1, {"slot": slot, "generation": 1, "epoch": p.epoch, "nonce": r.nonce})
    src = _filled(0)
    header = p.write(slot, src)
    assert _state(r, 1, slot) == READY and header["generation"] == 1
    got = r.take(1, header)
    assert (got == src).all()
    assert _state(r, 1, slot) == FREE                        # released after the copy
    with pytest.raises(WireError, match="not ready"):        # the same header twice: nothing to take
        r.take(1, header)
    with pytest.raises(WireError, match="no ring"):          # another actor id has no claim on it
        r.take(2, header)
    # the ring has another actor's ring beside ours, untouched
    assert int(r.ctl[0, :, 0].abs().sum()) == 0
    p.close()


def test_stale_generation_is_refused_when_the_slot_is_ready_again(ring):
    r = ring(slots=1)
    p = RingProducer(str(r.path), 0, 2, 1, _template())
    old = p.write(p.claim(1.0), _filled(1))
    r.take(0, old)
    new = p.write(p.claim(1.0), _filled(2))
    assert new["slot"] == old["slot"] and new["generation"] == old["generation"] + 1
    with pytest.raises(WireError, match="stale"):
        r.take(0, old)
    assert _state(r, 0, 0) == READY                           # a refused header touches nothing
    assert (r.take(0, new) == _filled(2)).all()
    p.close()


def test_no_slot_is_reused_before_the_learner_releases_it(ring):
    r = ring(slots=2)
    p = RingProducer(str(r.path), 0, 2, 2, _template())
    h = [p.write(p.claim(1.0), _filled(i)) for i in range(2)]
    t0 = time.monotonic()
    with pytest.raises(RingFull, match="all 2 rollout ring slots stayed taken"):
        p.claim(0.2)
    assert time.monotonic() - t0 >= 0.2
    assert [_state(r, 0, s) for s in range(2)] == [READY, READY]
    r.take(0, h[1])
    assert p.claim(1.0) == h[1]["slot"]                       # the released slot, and only it
    assert (r.take(0, h[0]) == _filled(0)).all()              # the other was never overwritten
    p.close()


def test_a_full_ring_waits_and_stops_cleanly_on_the_stop_check(ring):
    r = ring(slots=1)
    p = RingProducer(str(r.path), 0, 2, 1, _template())
    p.write(p.claim(1.0), _filled(0))
    calls = []
    t0 = time.monotonic()
    assert p.claim(30.0, should_stop=lambda: calls.append(1) or len(calls) > 3) is None
    assert time.monotonic() - t0 < 5 and len(calls) == 4
    p.close()


def test_a_dead_producers_slots_are_reclaimed(ring):
    r = ring(slots=3)
    dead = RingProducer(str(r.path), 0, 2, 3, _template())
    left_ready = dead.write(dead.claim(1.0), _filled(0))       # header never sent: the actor died
    writing = dead.claim(1.0)                                   # died while writing this one
    dead.close()
    assert _state(r, 0, left_ready["slot"]) == READY and _state(r, 0, writing) == WRITING
    fresh = RingProducer(str(r.path), 0, 2, 3, _template())     # the restarted actor attaches
    assert fresh.epoch == dead.epoch + 1
    assert _state(r, 0, writing) == FREE                        # freed by the producer at attach
    assert _state(r, 0, left_ready["slot"]) == READY            # the learner's to free
    mine = fresh.write(fresh.claim(1.0), _filled(5))
    assert r.reclaim() == 1 and r.reclaimed == 1                # the learner sees the new epoch
    assert _state(r, 0, left_ready["slot"]) == FREE and _state(r, 0, mine["slot"]) == READY
    assert r.reclaim() == 0                                     # once per epoch change
    with pytest.raises(WireError, match="not ready|stale"):     # the dead actor's header, arriving late
        r.take(0, left_ready)
    assert (r.take(0, mine) == _filled(5)).all()
    fresh.close()


def test_the_first_header_of_a_new_producer_reclaims_too(ring):
    r = ring(slots=1)
    dead = RingProducer(str(r.path), 0, 2, 1, _template())
    dead.write(dead.claim(1.0), _filled(0))
    dead.close()
    fresh = RingProducer(str(r.path), 0, 2, 1, _template())
    # the only slot is READY from the dead producer: the fresh one waits until the learner looks
    with pytest.raises(RingFull):
        fresh.claim(0.05)
    r.reclaim()      # what the receiver thread does every turn (Intake.idle)
    h = fresh.write(fresh.claim(1.0), _filled(1))
    assert (r.take(0, h) == _filled(1)).all()
    fresh.close()


def test_a_second_producer_with_the_same_id_stops_the_first(ring):
    r = ring()
    first = RingProducer(str(r.path), 0, 2, 2, _template())
    second = RingProducer(str(r.path), 0, 2, 2, _template())
    with pytest.raises(RuntimeError, match="another actor with this id attached"):
        first.claim(1.0)
    assert second.claim(1.0) is not None
    first.close()
    second.close()


# ============================================================================ attaching: the file is untrusted

def test_attach_checks_the_file(ring, tmp_path):
    r = ring()
    good = str(r.path)
    cases = [
        ("/tmp/" + r.path.name, "is not a tandem-\\*.rollouts file"),
        (str(r.path.with_name("other.rollouts")), "is not a tandem"),
        (str(r.path.with_name("tandem-missing.rollouts")), "cannot open.*same host|cannot open"),
        (123, "not a file path"),
    ]
    for path, match in cases:
        with pytest.raises(WireError, match=match):
            RingProducer(path, 0, 2, 2, _template())
    with pytest.raises(WireError, match="rings"):
        RingProducer(good, 0, 3, 2, _template())
    with pytest.raises(WireError, match="slots"):
        RingProducer(good, 0, 2, 3, _template())
    with pytest.raises(WireError, match="slot size|layout"):
        RingProducer(good, 0, 2, 2, _template(n=3))
    other = _template()
    other["action"] = torch.zeros(2, 3, dtype=torch.int32)
    other["done2"] = torch.zeros(2, 3, dtype=torch.bool)      # same size, another layout
    with pytest.raises(WireError, match="layout|slot size"):
        RingProducer(good, 0, 2, 2, other)
    with pytest.raises(WireError, match="no ring"):
        RingProducer(good, 2, 2, 2, _template())
    link = r.path.with_name(f"tandem-link{uuid.uuid4().hex[:6]}.rollouts")
    os.symlink(good, link)
    try:
        with pytest.raises(WireError, match="cannot open"):
            RingProducer(str(link), 0, 2, 2, _template())
    finally:
        link.unlink()
    short = r.path.with_name(f"tandem-short{uuid.uuid4().hex[:6]}.rollouts")
    short.write_bytes(r.path.read_bytes()[:-64])               # the right header, the wrong size
    try:
        with pytest.raises(WireError, match="bytes, the header gives"):
            RingProducer(str(short), 0, 2, 2, _template())
    finally:
        short.unlink()


# ============================================================================ through the learner's intake

def _ring_learner() -> tuple[Learner, RolloutRing]:
    cfg = small_config(buffer_type="vla", buffer_size=8)
    cfg.actors.num_envs = 4
    cfg.actors.num_actors = 2
    cfg.trainer.total_steps = 10**9
    learner = Learner(cfg, run_dir=None, publisher=ListPublisher())
    r = RolloutRing(learner.template, 2, 2, default_path(f"test-{uuid.uuid4().hex[:8]}"))
    learner.intake.ring = r
    learner.publish()
    return learner, r


def _header_frames(meta: dict, header, td: TensorDict | None = None) -> list[bytes]:
    return [bytes(f) for f in wire.encode(td if td is not None else TensorDict({}, batch_size=[]),
                                          **meta, ring=header)]


def test_intake_takes_a_ring_rollout_and_runs_every_check():
    learner, r = _ring_learner()
    p = RingProducer(str(r.path), 1, 2, 2, learner.template)
    try:
        td = valid_rollout(learner.template, learner.spec, learner.version, seed=1)
        h = p.write(p.claim(1.0), td)
        assert learner.intake.handle(_header_frames(rollout_meta(1, 0, learner.version), h), "test")
        assert len(learner.buffer) == 1 and _state(r, 1, h["slot"]) == FREE
        assert (learner.buffer._slots[0] == td).all()
        # a rollout that fails the value checks: refused like one off the wire, and its slot is freed
        bad = valid_rollout(learner.template, learner.spec, learner.version, seed=2)
        bad[keys.REWARD][0, 0] = float("nan")
        h = p.write(p.claim(1.0), bad)
        assert not learner.intake.handle(_header_frames(rollout_meta(1, 1, learner.version), h), "test")
        assert learner.counts["rejected"] == 1 and _state(r, 1, h["slot"]) == FREE
        # a newer version than the learner's, and bool bytes other than 0/1: refused too
        newer = valid_rollout(learner.template, learner.spec, learner.version + 1, seed=3)
        h = p.write(p.claim(1.0), newer)
        assert not learner.intake.handle(_header_frames(rollout_meta(1, 2, learner.version), h), "test")
        assert learner.counts["rejected"] == 2
        slot = p.claim(1.0)
        h = p.write(slot, valid_rollout(learner.template, learner.spec, learner.version, seed=4))
        raw = p._slot_bytes_view(p._payload, 1, slot)
        done_off = next(e[3] for e in p.layout if e[0] == [keys.DONE])
        raw[done_off] = 7   # a bool byte no bool holds: refused (by the byte check, or as done != term | trunc)
        assert not learner.intake.handle(_header_frames(rollout_meta(1, 3, learner.version), h), "test")
        assert learner.counts["malformed"] + learner.counts["rejected"] == 3 and _state(r, 1, slot) == FREE
        malformed = learner.counts["malformed"]
        # tensors beside a ring header, a header from the wrong actor, a learner without a ring
        h = p.write(p.claim(1.0), td)
        assert not learner.intake.handle(_header_frames(rollout_meta(1, 4, learner.version), h, td), "test")
        assert not learner.intake.handle(_header_frames(rollout_meta(0, 4, learner.version), h), "test")
        assert learner.counts["malformed"] == malformed + 2 and _state(r, 1, h["slot"]) == READY
        learner.intake.ring = None
        assert not learner.intake.handle(_header_frames(rollout_meta(1, 4, learner.version), h), "test")
        assert learner.counts["malformed"] == malformed + 3
        learner.intake.ring = r
        assert learner.intake.handle(_header_frames(rollout_meta(1, 4, learner.version), h), "test")
        assert len(learner.buffer) == 2
    finally:
        p.close()
        r.close()


_any = st.one_of(st.none(), st.booleans(), st.integers(-2**70, 2**70), st.floats(), st.text(max_size=5),
                 st.binary(max_size=5), st.lists(st.integers(), max_size=3))


def test_hostile_ring_headers_are_refused_and_counted():
    """Fuzzed header fields (and actor ids) never raise out of the intake, are counted as malformed,
    and never release or take a slot they do not name exactly."""
    learner, r = _ring_learner()
    p = RingProducer(str(r.path), 0, 2, 2, learner.template)
    good = p.write(p.claim(1.0), valid_rollout(learner.template, learner.spec, learner.version, seed=0))
    fields = ("slot", "generation", "epoch", "nonce")
    seen = {"cases": 0}

    @settings(max_examples=300, deadline=None, database=None, derandomize=True,
              suppress_health_check=list(HealthCheck))
    @given(changes=st.dictionaries(st.sampled_from([*fields, "extra"]),
                                   st.one_of(_any, st.integers(0, 4)), min_size=1, max_size=3),
           drop=st.sets(st.sampled_from(fields), max_size=2), actor=st.one_of(st.just(0), _any),
           whole=st.one_of(st.none(), _any))
    def case(changes, drop, actor, whole):
        header = {k: v for k, v in {**good, **changes}.items() if k not in drop}
        if whole is not None:
            header = whole
        if header == good and actor == 0 and type(actor) is int:
            return
        seen["cases"] += 1
        before = learner.counts["malformed"] + learner.counts["rejected"]
        meta = {**rollout_meta(0, 0, learner.version), "actor": actor}
        try:
            frames = _header_frames(meta, header)
        except WireError:
            return                          # not encodable: cannot come off the wire either
        assert not learner.intake.handle(frames, "fuzz")
        assert learner.counts["malformed"] + learner.counts["rejected"] == before + 1
        assert _state(r, 0, good["slot"]) == READY and len(learner.buffer) == 0

    try:
        case()
        assert seen["cases"] > 100
        assert learner.intake.handle(_header_frames(rollout_meta(0, 0, learner.version), good), "test")
        assert _state(r, 0, good["slot"]) == FREE and len(learner.buffer) == 1
    finally:
        p.close()
        r.close()


# ============================================================================ config

def _cfg(**over):
    raw = {"actors": {"num_actors": 2, "rollout_transport": "ring", **over.pop("actors", {})},
           "learner": over.pop("learner", {})}
    return config_from_dict(raw, source="ring.json")


def test_config_refuses_the_ring_where_actors_may_be_on_another_host():
    assert _cfg().actors.rollout_transport == "ring"
    assert config_from_dict({}, source="x").actors.rollout_transport == "zmq"      # the default: unchanged
    with pytest.raises(ConfigError, match=r"ring.json.*rollout_transport.*learner.host is '0.0.0.0'"):
        _cfg(learner={"host": "0.0.0.0"})
    with pytest.raises(ConfigError, match=r"rollout_transport.*CURVE"):
        _cfg(learner={"curve_secret_key": "a", "curve_authorized_keys": "b"},
             actors={"curve_secret_key": "c", "curve_server_key": "d"})
    with pytest.raises(ConfigError, match=r"rollout_transport.*2 ranks"):
        _cfg(learner={"devices": ["cpu", "cpu"]})


# ============================================================================ through the launcher (slow)

ROOT = Path(__file__).resolve().parents[1]


def _ring_files() -> set[str]:
    base = Path("/dev/shm") if Path("/dev/shm").is_dir() else Path(os.environ.get("TMPDIR", "/tmp"))
    return {p.name for p in base.glob("tandem-*.rollouts")}


def _launch(tmp_path: Path, name: str, *args: str):
    from tests.test_integration import launch, run_to_the_end
    out = tmp_path / name
    return out, run_to_the_end(launch(tmp_path, out, "--no-eval", *args, name=name), out)


def _digest(run_dir: Path, version: int | None = None) -> str:
    """SHA-256 of the policy in the run's newest checkpoint, or in the one of `version`."""
    from tests.test_integration import load_ckpt, newest_checkpoint
    path = newest_checkpoint(run_dir) if version is None else run_dir / "checkpoints" / f"ckpt_{version:08d}.pt"
    policy = load_ckpt(path)["policy"]
    h = hashlib.sha256()
    for k, v in sorted(policy.items()):
        h.update(k.encode())
        h.update(v.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


@pytest.mark.slow
def test_a_killed_learners_ring_file_is_removed_by_the_launcher(tmp_path):
    from tests.test_integration import launch, tandem_processes
    out = tmp_path / "killed"
    run = launch(tmp_path, out, "--no-eval", "--steps", "10000000", "--set", "actors.rollout_transport=ring", name="killed")
    try:
        seen: list[dict] = []

        def endpoints() -> bool:
            try:
                seen.append(json.loads((out / "endpoints.json").read_text()))
            except (OSError, ValueError):
                return False
            return True
        assert run.wait(120, until=endpoints) is None, run.output()   # the learner is up (not ended)
        ep = seen[-1]
        assert Path(ep["rollout_ring"]).exists(), run.output()
        learner = [p for p in tandem_processes(out) if "-m learner" in " ".join(p.cmdline())]
        assert learner
        learner[0].kill()   # maybe while the launcher still starts the actors: it must notice all the same
        rc = run.wait(30)
        assert rc is not None and rc != 0, run.output()
        run.assert_all_gone(out)
    finally:
        run.stop()
    assert not Path(ep["rollout_ring"]).exists(), "the launcher left a killed learner's ring file"


@pytest.mark.slow
def test_a_killed_actor_is_replaced_and_its_new_life_sends_through_the_ring(tmp_path):
    """vla mode with one slot per actor: a replaced actor must get its slot back (freed at attach if
    it was being written, by the learner at the new epoch if it was ready) or it could never send."""
    from tests.test_faults import _procs, _publish_count, _stop
    from tests.test_integration import consumes, launch, read_jsonl
    run_dir = tmp_path / "run"
    run = launch(tmp_path, run_dir, "--no-eval", "--actors", "2", "--steps", "10000000", "--set", "trainer.eval_freq=0",
                 "--set", "trainer.buffer_type=vla", "--set", "actors.rollout_transport=ring",
                 "--set", "actors.rollout_ring_slots=1", name="restart")
    try:
        assert run.wait(120, until=lambda: _publish_count(run_dir) >= 3) is None, run.output()
        victim, = _procs(run, "--actor-id 1")
        victim.kill()
        killed_at = time.time()

        def new_life_consumed() -> bool:
            return any(e["actor"] == 1 and e["seq"] == 0 and e["time"] > killed_at
                       for e in consumes(read_jsonl(run_dir / "versions.jsonl")))

        assert run.wait(90, until=new_life_consumed) is None, run.output()
        _stop(run, run_dir)
    finally:
        run.stop()
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["rejected"] == 0, summary


@pytest.mark.slow
def test_standard_mode_trains_the_same_weights_through_the_ring(tmp_path):
    """Fixed seed, standard mode (the learner sorts each batch by actor and seq): the weights of a
    version are the same to the bit whichever transport carried the rollouts. Compared at the newest
    version both runs saved (a checkpoint every update), not at the end: whether the last rollout
    arrives before the step budget stops the run is a race, so one run may train one update more.

    The ring run is also the launcher's run with the ring: it trains every env step of its budget,
    refuses nothing, and leaves no ring file in shared memory (one run for both: each launch is
    three process start-ups)."""
    steps = 10240
    common = ("--steps", str(steps), "--set", "trainer.buffer_type=standard", "--set", "trainer.save_freq=512")
    zmq_out, _ = _launch(tmp_path, "zmq", *common)
    before = _ring_files()
    ring_out, seen = _launch(tmp_path, "ring", *common, "--set", "actors.rollout_transport=ring")
    assert seen and seen[0]["rollout_ring"].endswith(".rollouts"), seen
    summary = json.loads((ring_out / "summary.json").read_text())
    assert summary["exit_code"] == 0 and summary["env_steps"] == steps, summary
    assert summary["malformed"] == 0 and summary["rejected"] == 0, summary
    consumed = [json.loads(x) for x in (ring_out / "versions.jsonl").read_text().splitlines()]
    assert sum(e["env_steps"] for e in consumed if e["event"] == "consume") == steps
    assert _ring_files() <= before, "a rollout ring file was left in shared memory"
    assert not Path(seen[0]["rollout_ring"]).exists()

    saved = [{int(p.stem.split("_")[1]) for p in (out / "checkpoints").glob("ckpt_*.pt")}
             for out in (zmq_out, ring_out)]
    common_version = max(saved[0] & saved[1])
    assert common_version >= 18, saved
    assert _digest(ring_out, common_version) == _digest(zmq_out, common_version)


# ============================================================================ CUDA (a GPU machine only)

def _child_env() -> dict:
    """The project first, and whatever PYTHONPATH already holds (wheels carried to a GPU machine)."""
    return {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)}


_CUDA_CHILD = r"""
import sys, torch, msgpack
from tensordict import TensorDict
from shared.rollout_ring import RingProducer
path = sys.argv[1]
t = TensorDict({"observation": torch.zeros(2, 3, 4), "action": torch.zeros(2, 3, dtype=torch.int64),
                "done": torch.zeros(2, 3, dtype=torch.bool),
                "nested": TensorDict({"x": torch.zeros(2, 3, 2, dtype=torch.float16)}, batch_size=[2, 3])},
               batch_size=[2, 3])
p = RingProducer(path, 0, 2, 2, t)
src = t.clone()
src["observation"].fill_(1.5); src["action"].fill_(3); src["done"].fill_(True); src["nested", "x"].fill_(-2)
h = p.write(p.claim(5.0), src.to("cuda"))
sys.stdout.write(msgpack.packb(h).hex())
p.close()
"""


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_ring_round_trip_through_ipc():
    """The learner's device memory, written by another process through CUDA IPC."""
    import msgpack
    r = RolloutRing(_template(), 2, 2, default_path(f"test-{uuid.uuid4().hex[:8]}"), device="cuda:0")
    try:
        out = subprocess.run([sys.executable, "-c", _CUDA_CHILD, str(r.path)], capture_output=True, text=True,
                             timeout=120, cwd=ROOT, env=_child_env())
        assert out.returncode == 0, out.stderr
        h = msgpack.unpackb(bytes.fromhex(out.stdout.strip()))
        got = r.take(0, h)
        assert got.device.type == "cuda"
        assert bool((got["observation"] == 1.5).all()) and bool((got["action"] == 3).all())
        assert bool(got["done"].all()) and bool((got["nested", "x"] == -2).all())
        assert _state(r, 0, h["slot"]) == FREE
    finally:
        r.close()


_CUDA_DEAD_CHILD = r"""
import os, signal, sys, torch, msgpack
from tensordict import TensorDict
from shared.rollout_ring import RingProducer
from tests.test_rollout_ring import _filled, _template
path, seed, die, device = sys.argv[1], int(sys.argv[2]), sys.argv[3] == "die", sys.argv[4]
p = RingProducer(path, 0, 2, 3, _template())
h = p.write(p.claim(5.0), _filled(seed).to(device))
if die:
    p.claim(5.0)                                  # killed while writing this one
sys.stdout.write(msgpack.packb({"header": h, "epoch": p.epoch}).hex())
sys.stdout.flush()
if die:
    os.kill(os.getpid(), signal.SIGKILL)
p.close()
"""


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_killed_cuda_producers_slots_are_reclaimed(device="cuda:0"):
    """An actor SIGKILLed with one slot READY (its header never sent) and one WRITING, in device
    memory: its restart frees the WRITING slot, the learner the READY one, the dead header is
    refused, and the new life's rollout arrives intact through CUDA IPC."""
    import msgpack
    r = RolloutRing(_template(), 2, 3, default_path(f"test-{uuid.uuid4().hex[:8]}"), device=device)

    def child(seed: int, die: bool) -> tuple[int, dict]:
        out = subprocess.run([sys.executable, "-c", _CUDA_DEAD_CHILD, str(r.path), str(seed), "die" if die else "live", device],
                             capture_output=True, text=True, timeout=120, cwd=ROOT,
                             env=_child_env())
        got = msgpack.unpackb(bytes.fromhex(out.stdout.strip())) if out.stdout.strip() else None
        assert got is not None, (out.returncode, out.stderr)
        return out.returncode, got

    try:
        rc, dead = child(0, die=True)
        assert rc == -9
        states = sorted(_state(r, 0, s) for s in range(3))
        assert states == sorted([READY, WRITING, FREE]), states
        rc, fresh = child(7, die=False)
        assert rc == 0 and fresh["epoch"] == dead["epoch"] + 1
        assert r.reclaim() == 1                                    # the dead life's READY slot
        with pytest.raises(WireError, match="not ready|stale"):
            r.take(0, dead["header"])
        got = r.take(0, fresh["header"])
        assert got.device == torch.device(device)
        assert (got.cpu() == _filled(7)).all()
        assert [_state(r, 0, s) for s in range(3)] == [FREE, FREE, FREE]
    finally:
        r.close()
    assert not r.path.exists()
