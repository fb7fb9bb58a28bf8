"""``trainer.eval_seeds``: which episodes each in-run evaluation plays (new ones each time, or the
same ones), the config's check of the value, and that "same" gives two evaluations of one policy
identical results on Reach while "new" does not."""

from __future__ import annotations

import pytest
import torch

from learner.evaluator import eval_seed, evaluate
from shared import keys
from shared.config import ConfigError, config_from_dict
from shared.envs import make_env


class _Fixed(torch.nn.Module):
    def forward(self, td, deterministic=True):
        obs = td[keys.OBS]
        # heads for the centre: whether it passes the named target depends on the episode drawn
        td.set(keys.ACTION, (obs["proprio"][:, :2] * -1.0).clamp(-1, 1))
        return td


def test_eval_seed_new_and_same():
    assert [eval_seed(7, k) for k in range(3)] == [1_000_010, 1_000_011, 1_000_012]
    assert [eval_seed(7, k, "new") for k in range(3)] == [1_000_010, 1_000_011, 1_000_012]
    assert [eval_seed(7, k, "same") for k in range(3)] == [1_000_010] * 3
    with pytest.raises(ValueError, match="trainer.eval_seeds: 'fixed'"):
        eval_seed(7, 0, "fixed")


def test_config_takes_same_and_names_a_bad_value():
    assert config_from_dict({}, source="test").trainer.eval_seeds == "new"
    assert config_from_dict({"trainer": {"eval_seeds": "same"}}, source="test").trainer.eval_seeds == "same"
    with pytest.raises(ConfigError, match="trainer.eval_seeds") as e:
        config_from_dict({"trainer": {"eval_seeds": "fixed"}}, source="cfg.json")
    assert "cfg.json" in str(e.value)


@pytest.mark.parametrize("mode", ["new", "same"])
def test_same_replays_the_episodes_new_draws_others(mode):
    env, policy = make_env("tandem/Reach-v0", 32), _Fixed()
    first = evaluate(policy, env, 32, seed=eval_seed(1, 0, mode))
    later = evaluate(policy, env, 32, seed=eval_seed(1, 5, mode))
    same = (first.returns, first.lengths, first.successes) == (later.returns, later.lengths, later.successes)
    assert same == (mode == "same")


class _Noisy(torch.nn.Module):
    """Deterministic in name only, as π0 is: its action starts from Gaussian noise drawn with torch's
    global generator."""

    def forward(self, td, deterministic=True):
        obs = td[keys.OBS]
        noise = torch.randn(obs["proprio"].shape[0], 2)
        td.set(keys.ACTION, (obs["proprio"][:, :2] * -1.0 + 0.5 * noise).clamp(-1, 1))
        return td


def test_the_seed_fixes_a_policys_own_noise_and_leaves_the_callers_random_state_alone():
    env, policy = make_env("tandem/Reach-v0", 32), _Noisy()
    torch.manual_seed(123)
    first = evaluate(policy, env, 32, seed=11)
    after_first = torch.rand(4)   # the caller's generator is where it was: the evaluation drew nothing from it
    torch.manual_seed(999)
    again = evaluate(policy, env, 32, seed=11)
    other = evaluate(policy, env, 32, seed=12)
    assert (first.returns, first.lengths) == (again.returns, again.lengths)
    assert first.returns != other.returns
    torch.manual_seed(123)
    assert torch.equal(after_first, torch.rand(4))
