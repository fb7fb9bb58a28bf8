"""``trainer.keep_best`` (the evaluator's ``checkpoints/best.pt``) and ``launch/evaluate.py`` (a
checkpoint measured on held-out episodes): what is kept and when, resume, failures that must not
end the evaluator, the eval message's best fields, and the evaluation script's figures and errors."""

from __future__ import annotations

import json
import math

import pytest
import torch

from launch.evaluate import HELD_OUT, main as evaluate_main, run_evaluation
from learner.checkpoint import load_checkpoint, save_checkpoint
from learner.evaluator import BestKeeper, eval_score, evaluate
from learner.ingest import RejectedMessage, check_eval
from shared.config import config_from_dict, save_config
from shared.envs import make_env
from shared.policies import frozen_digest, make_policy, published_state

CONF = {"image_size": 16, "vocab_size": 8, "proprio_dim": 4, "action_dim": 2, "hidden": 32}


def cartpole_cfg(seed: int = 1):
    return config_from_dict({"trainer": {"seed": seed}, "env": {"id": "CartPole-v1"}}, source="test")


def reach_cfg(seed: int = 1):
    """A VLA policy with a frozen base (vision and language) that a seed initialises."""
    return config_from_dict({
        "trainer": {"seed": seed}, "env": {"id": "tandem/Reach-v0"},
        "policy": {"name": "vla", "vla_config": {"model_class": "shared.policies.tiny_vla.TinyVLA",
                                                 "model_config": CONF, "freeze": ["vision.", "language."]}},
    }, source="test")


def policy_for(cfg, num_envs: int = 4):
    env = make_env(cfg.env.id, num_envs, cfg.env.cfg)
    try:
        return make_policy(cfg, env.spec).eval()
    finally:
        env.close()


def perturb_(policy, scale: float = 0.5) -> None:
    with torch.no_grad():
        for p in policy.parameters():
            if p.requires_grad:
                p.add_(scale * torch.randn_like(p))


def test_eval_score_prefers_success_then_return():
    assert eval_score([1.0, 0.0, 3.0], [True, False, True]) == ("success_rate", pytest.approx(2 / 3))
    assert eval_score([1.0, 0.0, 5.0], []) == ("return_mean", 2.0)
    assert math.isnan(eval_score([], [])[1])


def test_best_is_kept_only_when_beaten(tmp_path):
    policy = policy_for(cartpole_cfg())
    keeper = BestKeeper(tmp_path, enabled=True)
    path = tmp_path / "checkpoints" / "best.pt"
    assert keeper.offer(policy, [10.0, 20.0], [], version=3, env_steps=300, seed=11)
    kept = load_checkpoint(path)          # weights_only=True
    assert kept["version"] == 3 and kept["env_steps"] == 300
    assert kept["eval"] == {"metric": "return_mean", "score": 15.0, "episodes": 2, "seed": 11,
                            "time": kept["eval"]["time"]}
    assert set(kept["policy"]) == set(published_state(policy))
    assert kept["base_digest"] == frozen_digest(policy)
    first = {k: v.clone() for k, v in kept["policy"].items()}

    perturb_(policy)
    assert not keeper.offer(policy, [15.0, 15.0], [], version=5, env_steps=500, seed=11)   # a tie is not better
    assert not keeper.offer(policy, [1.0], [], version=6, env_steps=600, seed=11)
    assert not keeper.offer(policy, [float("nan")], [], version=7, env_steps=700, seed=11)
    unchanged = load_checkpoint(path)
    assert unchanged["version"] == 3
    assert all(torch.equal(unchanged["policy"][k], first[k]) for k in first)

    assert keeper.offer(policy, [40.0], [], version=8, env_steps=800, seed=11)
    newer = load_checkpoint(path)
    assert newer["version"] == 8 and newer["eval"]["score"] == 40.0
    assert any(not torch.equal(newer["policy"][k], first[k]) for k in first)
    assert (keeper.version, keeper.score) == (8, 40.0)
    assert not list((tmp_path / "checkpoints").glob("*.tmp"))


def test_disabled_or_no_run_dir_writes_nothing(tmp_path):
    policy = policy_for(cartpole_cfg())
    assert not BestKeeper(tmp_path, enabled=False).offer(policy, [1.0], [], version=1, env_steps=1, seed=0)
    assert not BestKeeper(None, enabled=True).offer(policy, [1.0], [], version=1, env_steps=1, seed=0)
    assert not (tmp_path / "checkpoints").exists()


def test_resume_keeps_the_bar_a_new_run_does_not(tmp_path):
    policy = policy_for(cartpole_cfg())
    assert BestKeeper(tmp_path, True).offer(policy, [50.0], [], version=4, env_steps=400, seed=0)
    resumed = BestKeeper(tmp_path, True, resume=True)
    assert (resumed.score, resumed.version, resumed.metric) == (50.0, 4, "return_mean")
    assert not resumed.offer(policy, [30.0], [], version=9, env_steps=900, seed=0)
    assert load_checkpoint(tmp_path / "checkpoints" / "best.pt")["version"] == 4
    fresh = BestKeeper(tmp_path, True, resume=False)      # an earlier run's file: the first evaluation replaces it
    assert fresh.score is None
    assert fresh.offer(policy, [30.0], [], version=1, env_steps=100, seed=0)
    assert load_checkpoint(tmp_path / "checkpoints" / "best.pt")["version"] == 1


def test_unreadable_best_on_resume_is_replaced(tmp_path):
    (tmp_path / "checkpoints").mkdir()
    (tmp_path / "checkpoints" / "best.pt").write_bytes(b"not a checkpoint")
    keeper = BestKeeper(tmp_path, True, resume=True)
    assert keeper.score is None
    assert keeper.offer(policy_for(cartpole_cfg()), [1.0], [], version=2, env_steps=10, seed=0)
    assert load_checkpoint(tmp_path / "checkpoints" / "best.pt")["version"] == 2


def test_a_failed_write_is_counted_not_raised(tmp_path):
    (tmp_path / "checkpoints").write_text("a file where the directory should be")
    keeper = BestKeeper(tmp_path, True)
    assert not keeper.offer(policy_for(cartpole_cfg()), [1.0], [], version=2, env_steps=10, seed=0)
    assert keeper.failures == 1 and keeper.score is None


def _eval_meta(**extra):
    return {"sender": "evaluator", "returns": [1.0, 2.0], "lengths": [3, 4], "version": 5, "env_steps": 50, **extra}


def test_eval_message_best_fields_are_checked():
    assert "best_score" not in check_eval(_eval_meta())
    ok = check_eval(_eval_meta(best=True, best_version=5, best_score=0.75))
    assert (ok["best"], ok["best_version"], ok["best_score"]) == (True, 5, 0.75)
    for bad in ({"best_score": "high", "best_version": 5, "best": True},
                {"best_score": float("nan"), "best_version": 5, "best": True},
                {"best_score": 0.5, "best": True},
                {"best_score": 0.5, "best_version": 5.5, "best": False},
                {"best_score": 0.5, "best_version": 5, "best": 1}):
        with pytest.raises(RejectedMessage, match="best_score"):
            check_eval(_eval_meta(**bad))


def test_config_key_and_its_check():
    assert config_from_dict({}, source="t").trainer.keep_best is False
    assert config_from_dict({"trainer": {"keep_best": True}}, source="t").trainer.keep_best is True
    with pytest.raises(Exception, match="trainer.keep_best"):
        config_from_dict({"trainer": {"keep_best": "yes"}}, source="cfg.json")


# ---------------------------------------------------------------- launch/evaluate.py
def make_run(tmp_path, cfg, policy, name="run"):
    """A run directory as the learner leaves it: its config and a checkpoint of `policy`."""
    run = tmp_path / name
    run.mkdir()
    save_config(cfg, run / "config.json")
    state = {"policy": {k: v.detach().clone() for k, v in published_state(policy).items()},
             "base_digest": frozen_digest(policy), "version": 7, "env_steps": 1234}
    save_checkpoint(run / "checkpoints", state, 7)
    return run


def test_evaluate_script_matches_the_evaluator_on_the_same_episodes(tmp_path):
    cfg = reach_cfg()
    policy = policy_for(cfg)
    torch.manual_seed(3)
    perturb_(policy)
    run = make_run(tmp_path, cfg, policy)
    out_json = tmp_path / "eval.json"
    assert evaluate_main([str(run), "--episodes", "24", "--batch", "10", "--json", str(out_json)]) == 0
    out = json.loads(out_json.read_text())
    assert out["episodes"] == 24 and out["version"] == 7 and out["env_steps"] == 1234
    assert out["seed"] == 1 + HELD_OUT and [b["seed"] for b in out["per_batch"]] == [1 + HELD_OUT + k for k in range(3)]
    assert [b["episodes"] for b in out["per_batch"]] == [10, 10, 4]
    # the same episodes, played by the same weights through the evaluator's own function
    successes = []
    for k, n in enumerate((10, 10, 4)):
        env = make_env(cfg.env.id, n, cfg.env.cfg)
        successes += evaluate(policy, env, n, seed=1 + HELD_OUT + k).successes
        env.close()
    assert out["success_rate"] == pytest.approx(sum(successes) / len(successes))
    assert 0 <= out["success_ci95"] <= 1


def test_evaluate_none_is_the_policy_the_config_builds(tmp_path):
    cfg = reach_cfg()
    trained = policy_for(cfg)
    perturb_(trained, 2.0)
    run = make_run(tmp_path, cfg, trained)
    base = run_evaluation(cfg, None, 20, 20, seed=5, say=lambda s: None)
    after = run_evaluation(cfg, run / "checkpoints" / "ckpt_00000007.pt", 20, 20, seed=5, say=lambda s: None)
    assert base["checkpoint"] is None and base["version"] is None
    assert base["return_mean"] != after["return_mean"]     # the checkpoint's weights were loaded
    env = make_env(cfg.env.id, 20, cfg.env.cfg)
    assert base["return_mean"] == pytest.approx(sum(evaluate(policy_for(cfg), env, 20, seed=5).returns) / 20)
    assert after["return_mean"] == pytest.approx(sum(evaluate(trained, env, 20, seed=5).returns) / 20)
    env.close()


def test_evaluate_refuses_another_base_and_names_both_digests(tmp_path, capsys):
    other = policy_for(reach_cfg(seed=2))       # another seed: another frozen base
    run = make_run(tmp_path, reach_cfg(seed=2), other)
    # the run's config is replaced by one whose base differs
    mine = tmp_path / "mine.json"
    save_config(reach_cfg(seed=1), mine)
    assert evaluate_main([str(run), "--config", str(mine), "--episodes", "4"]) == 2
    err = capsys.readouterr().err
    assert "another base model" in err and frozen_digest(other)[:16] in err
    assert frozen_digest(policy_for(reach_cfg(seed=1)))[:16] in err


@pytest.mark.parametrize("args, says", [
    (["--checkpoint", "best"], "no best checkpoint"),
    (["--checkpoint", "nowhere.pt"], "nowhere.pt: checkpoint file not found"),
    (["--episodes", "0"], "--episodes and --batch must be at least 1"),
    (["--set", "trainer.seed=\"x\""], "trainer.seed"),
])
def test_evaluate_errors_name_what_is_wrong(tmp_path, capsys, args, says):
    cfg = cartpole_cfg()
    run = make_run(tmp_path, cfg, policy_for(cfg))
    assert evaluate_main([str(run), *args]) == 2
    assert says in capsys.readouterr().err


def test_evaluate_errors_on_a_broken_or_foreign_checkpoint(tmp_path, capsys):
    cfg = cartpole_cfg()
    run = make_run(tmp_path, cfg, policy_for(cfg))
    (tmp_path / "junk.pt").write_bytes(b"junk")
    assert evaluate_main([str(run), "--checkpoint", str(tmp_path / "junk.pt")]) == 2
    assert "junk.pt: cannot load checkpoint" in capsys.readouterr().err
    torch.save({"policy": {"w": torch.zeros(3)}}, tmp_path / "foreign.pt")
    assert evaluate_main([str(run), "--checkpoint", str(tmp_path / "foreign.pt")]) == 2
    assert "foreign.pt: its policy tensors do not fit" in capsys.readouterr().err
    assert evaluate_main(["--checkpoint", "latest"]) == 2
    assert "give a run directory or --config" in capsys.readouterr().err
    empty = tmp_path / "empty"
    empty.mkdir()
    save_config(cfg, empty / "config.json")
    assert evaluate_main([str(empty)]) == 2
    assert "no checkpoint (ckpt_*.pt)" in capsys.readouterr().err


def test_learner_logs_and_prints_the_best(tmp_path):
    from learner.learner import Learner, ListPublisher
    cfg = config_from_dict({"trainer": {"keep_best": True, "eval_freq": 0, "save_freq": 0},
                            "env": {"id": "CartPole-v1"}}, source="test")
    learner = Learner(cfg, run_dir=None, publisher=ListPublisher())
    learner.log_eval(check_eval(_eval_meta()))
    assert learner.best_eval is None and "best" not in learner.progress_line()
    learner.log_eval(check_eval(_eval_meta(version=6, best=True, best_version=6, best_score=1.5)))
    assert learner.best_eval == {"version": 6, "score": 1.5, "path": "checkpoints/best.pt"}
    assert learner.last_eval["eval/best_score"] == 1.5
    assert "(best v6: 1.5)" in learner.progress_line()
