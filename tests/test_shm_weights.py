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


def test_learner_publishes_through_shm_and_actor_loads_it():
    cfg = small_config(buffer_type="vla")
    cfg.learner.weights_transport = "shm"
    pub = ListPublisher()
    learner = Learner(cfg, run_dir=None, publisher=pub)
    try:
        learner.publish()
        td, meta = pub.published[-1]
        assert td.is_empty() and meta["shm"] and meta["version"] == 0      # only the control message
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
    p = subprocess.run(["bash", str(ROOT / "launch" / "run_local.sh"), "--steps", "6000", "--out", str(run),
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
