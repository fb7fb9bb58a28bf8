"""Issue 12, done-when 2 (the learner's half): structure-aware fuzzing of ingest followed by an update.

Each hypothesis case takes a valid rollout of the learner's current version, mutates it field by
field and frame by frame (``tests/hostile.py``), hands the frames to ``learner.intake.handle`` (the
receiver thread's entry point, which must never raise) and, whenever the buffer holds a batch, runs
an update. Nothing but a refusal may come out of ingest, no update may raise, and the weights must
stay finite. ``TANDEM_FUZZ_INGEST`` sets the case count (default 5,000).
"""

from __future__ import annotations

import os
import random
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from learner.learner import Learner, ListPublisher
from shared import wire
from tests.hostile import mutated_message, rollout_meta, schema_attacks, valid_rollout
from tests.test_learner_component import small_config

ROOT = Path(__file__).resolve().parents[1]
CASES = int(os.environ.get("TANDEM_FUZZ_INGEST", "5000"))


def _tiny_learner(algo: str) -> Learner:
    cfg = small_config(buffer_type="vla", buffer_size=8)
    cfg.actors.num_envs = 4
    cfg.algorithm.cfg.n_epochs = 1
    cfg.algorithm.cfg.batch_size = 32
    if algo == "grpo":
        from shared.config import config_from_dict
        cfg = config_from_dict({
            "trainer": {"seed": 3, "total_steps": 10**9, "buffer_size": 8, "buffer_type": "vla", "eval_freq": 0,
                        "save_freq": 0},
            "actors": {"num_actors": 1, "num_envs": 4},
            "env": {"id": "Pendulum-v1"},
            "policy": {"name": "actor_only", "critic": None, "actor": {"network_cfg": {"hidden_sizes": [16]}}},
            "algorithm": {"name": "grpo", "cfg": {"group_size": 2, "n_epochs": 1, "batch_size": 16,
                                                  "kl_coef": 0.05}}}, source="fuzz")
    else:
        cfg.trainer.total_steps = 10**9
    return Learner(cfg, run_dir=None, publisher=ListPublisher())


def _finite(learner: Learner) -> bool:
    return all(bool(torch.isfinite(v).all()) for v in learner.policy.state_dict().values()
               if v.dtype.is_floating_point)


@pytest.mark.slow
@pytest.mark.parametrize("algo", ["ppo", "grpo"])
def test_fuzzed_ingest_then_update_never_raises_and_weights_stay_finite(algo):
    learner = _tiny_learner(algo)
    learner.publish()
    stats = {"cases": 0, "taken": 0, "updates": 0}

    @settings(max_examples=CASES // 2, deadline=None, database=None, derandomize=True,
              suppress_health_check=list(HealthCheck))
    @given(rnd=st.randoms(use_true_random=False), seq=st.integers(0, 2**31), clean=st.integers(0, 9))
    def case(rnd: random.Random, seq: int, clean: int) -> None:
        stats["cases"] += 1
        base = valid_rollout(learner.template, learner.spec, learner.version, seed=seq)
        meta = rollout_meta(0, seq, learner.version)
        frames = ([bytes(f) for f in wire.encode(base, **meta)] if clean == 0   # one in ten goes in unchanged
                  else mutated_message(base, meta, rnd))
        stats["taken"] += learner.intake.handle(frames, "fuzz")   # never raises: handle is total
        batch = learner.take_batch(timeout_s=0)
        if batch is not None:
            learner.update_once(*batch)
            stats["updates"] += 1
            assert _finite(learner), f"non-finite weights after update {learner.updates}"

    case()
    print(f"\n[fuzz] {algo}: {stats['cases']} ingest cases, {stats['taken']} taken, {stats['updates']} updates, "
          f"counts {learner.counts}")
    assert stats["cases"] >= CASES // 2 and stats["updates"] > 0
    assert learner.counts["malformed"] + learner.counts["rejected"] > stats["cases"] // 3


@pytest.mark.parametrize("algo", ["ppo", "grpo"])
def test_every_schema_attack_is_refused_and_valid_data_trains(algo):
    learner = _tiny_learner(algo)
    for name, td in schema_attacks(learner.template, learner.spec, learner.version):
        frames = [bytes(f) for f in wire.encode(td, **rollout_meta(0, 1, learner.version))]
        assert not learner.intake.handle(frames, "test"), name
    assert learner.counts["rejected"] == len(schema_attacks(learner.template, learner.spec, 0))
    assert learner.intake.handle([bytes(f) for f in wire.encode(
        valid_rollout(learner.template, learner.spec, 0), **rollout_meta(0, 2, 0))], "test")
    learner.update_once(*learner.take_batch(timeout_s=0))
    assert _finite(learner) and learner.version == 1


def test_token_ids_outside_the_vlas_vocabulary_are_refused_at_the_intake():
    """A rollout whose instruction ids lie outside the action-token model's vocabulary would reach
    its embedding in the update (on CUDA a sticky device assert; on the CPU an IndexError that ends
    the learner): the intake refuses it, naming the leaf, and valid data still trains."""
    from shared.config import load_config
    cfg = load_config(ROOT / "configs" / "vla_tokens_reach_smoke.json",
                      ["trainer.total_steps=1000000000", "actors.num_envs=2", "trainer.buffer_size=4",
                       "algorithm.cfg.batch_size=8", "algorithm.cfg.n_epochs=1", "trainer.rollouts_per_update=1"])
    learner = Learner(cfg, run_dir=None, publisher=ListPublisher())
    assert learner.intake.obs_bounds == {"instruction": (0, 512)}          # the tiny PaliGemma's vocabulary
    for key in ("observation", "bootstrap_observation"):
        td = valid_rollout(learner.template, learner.spec, 0)
        if key not in td.keys():
            continue
        td[key, "instruction"][0, 1, 0] = 512
        frames = [bytes(f) for f in wire.encode(td, **rollout_meta(0, 1, 0))]
        assert not learner.intake.handle(frames, "test"), key
    assert learner.counts["rejected"] >= 1
    assert learner.intake.handle([bytes(f) for f in wire.encode(
        valid_rollout(learner.template, learner.spec, 0), **rollout_meta(0, 2, 0))], "test")
    learner.update_once(*learner.take_batch(timeout_s=0))
    assert learner.version == 1


def test_a_minibatch_with_a_non_finite_gradient_takes_no_step():
    """The last line of defence: data that passed every check but still breaks the loss leaves the
    weights as they were, counted; the run goes on."""
    learner = _tiny_learner("ppo")
    td = valid_rollout(learner.template, learner.spec, 0)
    learner.ingest(td, rollout_meta(0, 0, 0))
    data, infos = learner.take_batch(timeout_s=0)
    before = {k: v.detach().clone() for k, v in learner.policy.named_parameters()}
    adam_before = {k: v.clone() for k, v in learner.optimizer.state_dict()["state"].items()}
    original = learner.policy.evaluate_actions

    def poisoned(mb):
        logp, ent, value = original(mb)
        return logp, ent, value * float("nan")

    learner.policy.evaluate_actions = poisoned
    stats = learner.update_once(data, infos)
    assert stats["skipped_steps"] > 0 and stats["steps"] == 0
    assert learner.counts["failed_updates"] == 1 and learner.version == 1   # published, unchanged weights
    for k, v in learner.policy.named_parameters():   # (the normaliser's statistics still move: data, not weights)
        assert torch.equal(v, before[k]), k
    assert learner.optimizer.state_dict()["state"].keys() == adam_before.keys()
    learner.policy.evaluate_actions = original
    learner.ingest(valid_rollout(learner.template, learner.spec, 1), rollout_meta(0, 1, 1))
    stats = learner.update_once(*learner.take_batch(timeout_s=0))
    assert stats["skipped_steps"] == 0 and stats["steps"] > 0 and learner.skips.failed_in_a_row == 0


def test_updates_that_keep_failing_stop_the_run_with_a_clear_message():
    from learner.counters import MAX_FAILED_UPDATES
    learner = _tiny_learner("ppo")
    learner.policy.evaluate_actions = lambda mb, f=learner.policy.evaluate_actions: tuple(
        x * float("nan") if x is not None else x for x in f(mb))
    with pytest.raises(FloatingPointError, match=f"{MAX_FAILED_UPDATES} updates in a row took no optimiser step"):
        for i in range(MAX_FAILED_UPDATES):
            learner.ingest(valid_rollout(learner.template, learner.spec, learner.version, seed=i),
                           rollout_meta(0, i, learner.version))
            learner.update_once(*learner.take_batch(timeout_s=0))
