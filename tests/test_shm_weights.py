"""Weights through shared memory: exact round trip, torn reads detected, the learner/actor path, and
a real run that leaves no shared-memory file behind."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
import torch
from tensordict import TensorDict

from actors.actor import Actor
from learner.learner import Learner, ListPublisher
from shared.policies import weights_td
from shared.shm_weights import ShmWeightsReader, ShmWeightsWriter, load_published_
from tests.test_learner_component import CaptureSink, PublisherSource, small_config

ROOT = Path(__file__).resolve().parents[1]


def _td(seed: int) -> TensorDict:
    g = torch.Generator().manual_seed(seed)
    return TensorDict({"w": torch.randn(7, 5, generator=g).to(torch.bfloat16), "b": torch.randn(3, generator=g),
                       "norm": {"count": torch.tensor(seed, dtype=torch.int64)}}, batch_size=[])


def test_round_trip_is_exact_and_torn_reads_are_detected(tmp_path):
    writer = ShmWeightsWriter(_td(0), tmp_path / "w.weights", slots=2)
    reader = ShmWeightsReader()
    try:
        metas = [writer.write(_td(v), v) for v in range(2)]
        for v, meta in enumerate(metas):
            got = {}
            assert reader.copy_into(lambda views: got.update(td=views.clone()), meta, v)
            for k, t in _td(v).items(include_nested=True, leaves_only=True):
                assert torch.equal(got["td"][k], t) and got["td"][k].dtype == t.dtype
        writer.write(_td(2), 2)                     # reuses slot 0: version 0 is gone
        assert not reader.copy_into(lambda views: None, metas[0], 0)

        def rewritten_while_copying(views):         # the writer laps the reader mid-copy
            writer.write(_td(3), 3)
        assert not reader.copy_into(rewritten_while_copying, metas[1], 1)
    finally:
        reader.close()
        writer.close()
    assert not (tmp_path / "w.weights").exists()


@pytest.mark.parametrize("transport", ["shm", "cuda_ipc"])
def test_learner_publishes_through_shm_and_actor_loads_it(transport, request):
    cfg = small_config(buffer_type="vla")
    cfg.learner.weights_transport = transport
    if transport == "cuda_ipc":      # the CPU stand-in (the config checks want CUDA; the protocol runs here)
        request.getfixturevalue("device_standin")
    pub = ListPublisher()
    learner = Learner(cfg, run_dir=None, publisher=pub)
    try:
        learner.publish()
        td, meta = pub.published[-1]
        assert td.is_empty() and meta["shm"] and meta["version"] == 0      # only the control message
        assert meta.get("device", False) is (transport == "cuda_ipc")
        sink = CaptureSink()
        actor = Actor(cfg, 0, PublisherSource(pub), sink)
        assert actor.step_once()
        learner.ingest(*sink.messages[-1])
        learner.update_once(*learner.take_batch(timeout_s=0))              # publishes v1 into the ring
        assert actor.step_once() and actor.version == 1
        for k, t in weights_td(learner.policy).items(include_nested=True, leaves_only=True):
            assert torch.equal(weights_td(actor.policy)[k], t)
        actor.close()
        fresh = Actor(cfg, 0, PublisherSource(pub), CaptureSink())
        reader = ShmWeightsReader()
        assert load_published_(fresh.policy, *pub.published[-1], reader, "cpu")
        reader.close()
    finally:
        learner.shm_writer.close()


@pytest.mark.slow
def test_run_with_shm_weights_trains_and_leaves_nothing(tmp_path):
    run = tmp_path / "run"
    before = set(Path("/dev/shm").glob("tandem-*")) if Path("/dev/shm").is_dir() else set()
    # one actor and the evaluator: two processes read the learner's weights from shared memory
    p = subprocess.run(["bash", str(ROOT / "launch" / "run_local.sh"), "--steps", "6000", "--actors", "1", "--out", str(run),
                        "--set", "learner.weights_transport=shm", "--set", "trainer.eval_freq=3000"],
                       cwd=ROOT, capture_output=True, text=True, timeout=180, start_new_session=True)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    summary = json.loads((run / "summary.json").read_text())
    assert summary["updates"] >= 5 and summary["exit_code"] == 0
    assert summary.get("last_eval/return_mean") is not None           # the evaluator read the ring too
    after = set(Path("/dev/shm").glob("tandem-*")) if Path("/dev/shm").is_dir() else set()
    assert after <= before, f"left behind: {after - before}"


def test_streaming_reader_copies_while_the_writer_writes(tmp_path, monkeypatch):
    import threading

    import shared.shm_weights as shm
    monkeypatch.setattr(shm, "CHUNK_BYTES", 64)            # many chunks: the reader really waits on progress
    big = TensorDict({"a": torch.arange(4096, dtype=torch.float32), "b": {"c": torch.randn(33, 7)}}, batch_size=[])
    writer = ShmWeightsWriter(big, tmp_path / "s.weights", slots=2)
    reader = ShmWeightsReader()
    try:
        meta = writer.begin(0)                               # announced before a byte is written
        dst = big.clone().zero_()
        result = {}
        t = threading.Thread(target=lambda: result.update(ok=reader.stream_into(dst, meta, 0, timeout_s=10)))
        t.start()
        writer.write_body(big, 0)
        t.join(10)
        assert result["ok"] and (dst == big).all()
        meta1 = writer.begin(1)
        writer.begin(3)                                      # laps slot 1 before it was written: torn
        assert not reader.stream_into(big.clone(), meta1, 1, timeout_s=1)
    finally:
        reader.close()
        writer.close()


# ===================================================== weights in device memory ("cuda_ipc")

@pytest.fixture
def device_standin(monkeypatch):
    """The CPU stand-in for CUDA IPC: the writer's "device" payload is a CPU tensor, and its handle
    a key into this process's registry. Everything else (the file's header and slot headers, the
    seqlock, the reader's checks) is the code that runs with a CUDA payload."""
    import msgpack

    from shared import shm_weights
    from shared.wire import WireError
    registry: dict[int, torch.Tensor] = {}

    def pack(payload: torch.Tensor) -> bytes:
        registry[len(registry)] = payload
        return msgpack.packb({"standin": len(registry) - 1})

    def open_(blob: bytes, nbytes: int, what: str) -> torch.Tensor:
        key = msgpack.unpackb(blob).get("standin")
        if key not in registry or registry[key].numel() != nbytes:
            raise WireError(f"{what}: bad CUDA handle")
        return registry[key]
    monkeypatch.setattr(shm_weights, "pack_cuda_handle", pack)
    monkeypatch.setattr(shm_weights, "open_cuda_handle", open_)
    return registry


def test_device_ring_round_trip_torn_reads_and_a_small_file(device_standin, tmp_path):
    writer = ShmWeightsWriter(_td(0), tmp_path / "d.weights", slots=2, device="cpu")
    reader = ShmWeightsReader()
    try:
        # the file holds headers only: the payload is in the "device" memory
        assert (tmp_path / "d.weights").stat().st_size == 4096 + 2 * 64
        metas = [writer.write(_td(v), v) for v in range(2)]
        assert all(m["device"] is True for m in metas)
        for v, meta in enumerate(metas):
            own = _td(99)
            assert reader.stream_into(own, meta, v)
            for k, t in _td(v).items(include_nested=True, leaves_only=True):
                assert torch.equal(own[k], t) and own[k].dtype == t.dtype
            got = {}
            assert reader.copy_into(lambda views: got.update(td=views.clone()), meta, v)
            assert torch.equal(got["td"]["w"], _td(v)["w"])
        writer.write(_td(2), 2)                     # reuses slot 0: version 0 is gone
        assert not reader.stream_into(_td(99), metas[0], 0)

        def rewritten_while_copying(views):
            writer.write(_td(3), 3)
        assert not reader.copy_into(rewritten_while_copying, metas[1], 1)
    finally:
        reader.close()
        writer.close()
    assert not (tmp_path / "d.weights").exists()


def test_device_announcements_that_do_not_fit_the_file_are_refused(device_standin, tmp_path):
    from shared.wire import WireError
    host = ShmWeightsWriter(_td(0), tmp_path / "h.weights", slots=2)
    dev = ShmWeightsWriter(_td(0), tmp_path / "d.weights", slots=2, device="cpu")
    reader = ShmWeightsReader()
    try:
        h_meta, d_meta = host.write(_td(1), 1), dev.write(_td(1), 1)
        cases = {"a device flag that is not a bool": {**d_meta, "device": "yes"},
                 "a device flag on a host file": {**h_meta, "device": True},
                 "a slot past the device ring": {**d_meta, "slot": 2}}
        for why, meta in cases.items():
            with pytest.raises(WireError):
                reader.stream_into(_td(99), meta, 1)
            reader.close()
        # the device file read as a host file: bounded reads of the header area, never the payload's version
        try:
            assert not reader.stream_into(_td(99), {k: v for k, v in d_meta.items() if k != "device"}, 1, timeout_s=0.1)
        except WireError:
            pass
        reader.close()
        words = dev._buf[:40].view(torch.int64)
        for i, bad in ((0, 7), (2, 0), (3, 1 << 50), (4, 1 << 20)):   # magic, slots, payload, handle length
            saved = int(words[i])
            words[i] = bad
            with pytest.raises(WireError):
                reader.stream_into(_td(99), d_meta, 1)
            reader.close()
            words[i] = saved
        assert reader.stream_into(own := _td(99), d_meta, 1) and torch.equal(own["b"], _td(1)["b"])
    finally:
        reader.close()
        host.close()
        dev.close()


def test_config_refuses_cuda_ipc_where_a_process_is_not_on_cuda():
    from shared.config import ConfigError, config_from_dict
    raw = json.loads((ROOT / "configs" / "cartpole_ppo.json").read_text())
    raw["learner"] = {**raw.get("learner", {}), "weights_transport": "cuda_ipc", "device": "cuda:0"}
    raw["trainer"]["eval_device"] = "cuda:0"
    raw["actors"]["devices"] = ["cuda:0", "cpu"]
    with pytest.raises(ConfigError, match=r"actors.devices\[1\] 'cpu'"):
        config_from_dict(raw, source="t")
    raw["actors"]["devices"] = ["cuda:0"]
    config_from_dict(raw, source="t")


_CUDA_READER = r"""
import sys, torch
from shared.shm_weights import ShmWeightsReader, check_announcement
from tests.test_shm_weights import _td
import json
meta = json.loads(sys.argv[1])
own = _td(99).to("cuda:0")
check_announcement(meta, own)
ok = ShmWeightsReader().stream_into(own, meta, meta["version"])
print(json.dumps({"ok": ok, "w": own["w"].float().sum().item(), "b": own["b"].sum().item(),
                  "count": int(own["norm", "count"])}))
"""


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_ipc_weights_reach_another_process_device_to_device():
    """The learner's device ring, read by a process that had not touched CUDA (the handle opens
    after CUDA's lazy init), device to device; the file is removed at close."""
    import os
    import sys
    import uuid

    from shared.shm_weights import default_path
    writer = ShmWeightsWriter(_td(0), default_path(f"test-{uuid.uuid4().hex[:8]}"), slots=2, device="cuda:0")
    try:
        meta = {**writer.write(_td(5).to("cuda:0"), 5), "version": 5}
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)}
        out = subprocess.run([sys.executable, "-c", _CUDA_READER, json.dumps(meta)], capture_output=True, text=True,
                             timeout=120, cwd=ROOT, env=env)
        assert out.returncode == 0, out.stderr
        got = json.loads(out.stdout.strip().splitlines()[-1])
        want = _td(5)
        assert got["ok"] and got["count"] == 5
        assert got["w"] == pytest.approx(want["w"].float().sum().item(), rel=1e-6)
        assert got["b"] == pytest.approx(want["b"].sum().item(), rel=1e-6)
    finally:
        writer.close()
    assert not writer.path.exists()
