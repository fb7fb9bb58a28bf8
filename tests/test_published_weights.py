"""Only what trains travels (issue 13): weights messages and checkpoints carry the trainable
tensors, each once, and a process whose frozen base differs from the learner's is refused."""

from __future__ import annotations

import json

import pytest
import torch

from actors.actor import Actor
from learner.learner import Learner, ListPublisher
from shared import wire
from shared.config import config_from_dict
from tests.test_learner_component import CaptureSink, PublisherSource

CONF = {"image_size": 16, "vocab_size": 8, "proprio_dim": 4, "action_dim": 2, "hidden": 32}


def vla_config(freeze: list[str], seed: int = 1):
    return config_from_dict({
        "trainer": {"seed": seed, "total_steps": 10_000, "buffer_size": 8, "buffer_type": "standard",
                    "eval_freq": 0, "save_freq": 0},
        "actors": {"num_actors": 1, "num_envs": 4},
        "env": {"id": "tandem/Reach-v0"},
        "policy": {"name": "vla", "vla_config": {"model_class": "shared.policies.tiny_vla.TinyVLA",
                                                 "model_config": CONF, "freeze": freeze}},
        "algorithm": {"cfg": {"n_epochs": 1, "batch_size": 32}},
    }, source="test")


def _trainable_bytes(policy) -> int:
    return sum(p.numel() * p.element_size() for p in policy.parameters() if p.requires_grad)


def test_weights_message_holds_exactly_the_trainable_tensors_once(tmp_path):
    learner = Learner(vla_config(freeze=["vision.", "language."]), run_dir=tmp_path,
                      publisher=ListPublisher())
    policy = learner.policy
    # the value head is the model itself: its parameters appear twice in state_dict(), once on the wire
    assert len(policy.state_dict()) > len(dict(policy.named_parameters()))
    frozen = [n for n, p in policy.named_parameters() if not p.requires_grad]
    assert frozen and all(n.startswith(("model.vision.", "model.language.", "critic.vision.", "critic.language.")) for n in frozen)
    learner.publish()
    td, meta = learner.publisher.published[-1]
    frames = wire.encode(td, **meta)
    data_bytes = sum(memoryview(f).nbytes for f in frames[1:])
    assert data_bytes == _trainable_bytes(policy)            # nothing frozen, nothing twice
    assert meta["base_digest"] == learner.base_digest
    full = sum(t.numel() * t.element_size() for t in policy.state_dict().values())
    print(f"\n[weights] trainable {data_bytes} B on the wire, full state_dict {full} B")
    # checkpoints hold the same tensors (the base comes back from model_path) and resume exactly
    path = learner.save()
    state = torch.load(path, weights_only=True)
    assert set(state["policy"]) == {n for n, p in policy.named_parameters() if p.requires_grad}
    resumed = Learner(vla_config(freeze=["vision.", "language."]), run_dir=tmp_path,
                      publisher=ListPublisher(), resume=True)
    for k, v in policy.state_dict().items():
        assert torch.equal(resumed.policy.state_dict()[k], v), k


def test_an_actor_with_another_base_is_refused_with_both_digests(caplog):
    learner = Learner(vla_config(freeze=["vision."], seed=1), run_dir=None, publisher=ListPublisher())
    learner.publish()
    other = vla_config(freeze=["vision."], seed=2)       # another random base: another frozen vision tower
    actor = Actor(other, 0, PublisherSource(learner.publisher), CaptureSink(), learner_timeout_s=1.0)
    assert actor.base_digest != learner.base_digest
    assert actor.run() == 1 and actor.failed and actor.version == -1
    text = caplog.text
    assert learner.base_digest[:16] in text and actor.base_digest[:16] in text and "refused" in text
    # and the learner refuses rollouts acted with another base, whoever sends them
    same = Actor(vla_config(freeze=["vision."], seed=1), 0, PublisherSource(learner.publisher), CaptureSink())
    assert same.base_digest == learner.base_digest and same.step_once()
    td, meta = same.sink.messages[-1]
    import pytest
    from learner.ingest import RejectedMessage
    with pytest.raises(RejectedMessage, match="acts with another base model"):
        learner.ingest(td, {**meta, "base_digest": actor.base_digest})
    learner.ingest(td, meta)
    assert len(learner.buffer) == 1


@pytest.mark.slow
def test_action_token_vla_with_lora_trains_through_the_launcher(tmp_path):
    """The tiny PaliGemma action-token policy with LoRA, as separate learner, actor and evaluator
    processes: every process builds the same base (digests agree: nothing refused), and what
    travels and what is checkpointed is the LoRA tensors and the value head only. (One actor: a
    second would build the same base once more.)"""
    from tests.test_integration import ROOT, launch, read_jsonl
    run_dir = tmp_path / "run"
    run = launch(tmp_path, run_dir, "--config", str(ROOT / "configs" / "vla_tokens_reach_smoke.json"),
                 "--actors", "1", "--steps", "2048")
    try:
        assert run.wait(240) == 0, run.output()
    finally:
        run.stop()
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["rejected"] == summary["malformed"] == 0 and summary["version"] >= 3, summary
    assert "last_eval/return_mean" in summary
    assert len([e for e in read_jsonl(run_dir / "versions.jsonl") if e["event"] == "consume"]) >= 3
    ckpt = sorted((run_dir / "checkpoints").glob("ckpt_*.pt"))[-1]
    state = torch.load(ckpt, weights_only=True)
    assert state["policy"] and all("lora_" in k or "value_head." in k for k in state["policy"])
