"""benchmarks/lag_sensitivity.py: the fixed-lag emulation really acts with the weights it claims."""

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

import lag_sensitivity  # noqa: E402

CONFIG = ROOT / "configs" / "cartpole_ppo.json"


def test_parse_cases():
    assert lag_sensitivity.parse_cases("1:0, 4:4,") == [(1, 0), (4, 4)]
    for bad in ("", "1", "a:b", "0:1", "1:-1", "1:2:3"):
        with pytest.raises(ValueError, match="--cases"):
            lag_sensitivity.parse_cases(bad)


def test_lag_and_round_robin(monkeypatch):
    """Rollout u is acted by version max(0, u - L) of actor u mod A, and every rollout is trained once."""
    from actors.rollout import Collector
    seen = []
    real = Collector.collect

    def spy(self, version, *a, **k):
        seen.append((id(self), version))
        return real(self, version, *a, **k)

    monkeypatch.setattr(Collector, "collect", spy)
    out = lag_sensitivity.run_case(CONFIG, ["algorithm.cfg.n_epochs=1"], actors=2, lag=3, seed=1, steps=1024,
                                   num_envs=4, buffer_size=16)
    updates = 1024 // 64
    assert out["updates"] == updates and out["env_steps"] == 1024 and out["dropped"] == 0
    assert [v for _, v in seen] == [max(0, u - 3) for u in range(updates)]
    collectors = [c for c, _ in seen]
    assert collectors[0::2] == [collectors[0]] * (updates // 2) and collectors[1::2] == [collectors[1]] * (updates // 2)
    assert collectors[0] != collectors[1]
    assert out["lag_mean"] == pytest.approx(sum(min(u, 3) for u in range(updates)) / updates)


def test_deterministic():
    kw = dict(actors=2, lag=2, seed=3, steps=512, num_envs=4, buffer_size=16)
    a = lag_sensitivity.run_case(CONFIG, ["algorithm.cfg.n_epochs=2"], **kw)
    b = lag_sensitivity.run_case(CONFIG, ["algorithm.cfg.n_epochs=2"], **kw)
    assert a == b


def test_main_prints_table(capsys, tmp_path):
    code = lag_sensitivity.main(["--cases", "1:0,2:1", "--seeds", "1", "--steps", "256", "--num-envs", "4",
                                 "--buffer-size", "16", "--set", "algorithm.cfg.n_epochs=1",
                                 "--json", str(tmp_path / "o.json")])
    assert code == 0
    out = capsys.readouterr().out
    assert "vs first" in out and "1.00x" in out and (tmp_path / "o.json").exists()


def test_one_rollout_from_each_actor(monkeypatch):
    """per_update "actors": every update trains a rollout of T/A steps from each actor, all acted by
    version max(0, u - L)."""
    from actors.rollout import Collector
    seen = []
    real = Collector.collect

    def spy(self, version, *a, **k):
        seen.append((id(self), version, self.num_steps))
        return real(self, version, *a, **k)

    monkeypatch.setattr(Collector, "collect", spy)
    out = lag_sensitivity.run_case(CONFIG, ["algorithm.cfg.n_epochs=1"], actors=4, lag=1, seed=1, steps=1024,
                                   num_envs=4, buffer_size=16, per_update="actors")
    updates = 1024 // 64
    assert out["updates"] == updates and out["env_steps"] == 1024 and out["dropped"] == 0
    assert len(seen) == 4 * updates and {n for _, _, n in seen} == {4}
    for u in range(updates):
        group = seen[4 * u:4 * u + 4]
        assert len({c for c, _, _ in group}) == 4 and {v for _, v, _ in group} == {max(0, u - 1)}
    with pytest.raises(ValueError, match="multiple"):
        lag_sensitivity.run_case(CONFIG, [], actors=3, lag=1, seed=1, steps=64, num_envs=4, buffer_size=16,
                                 per_update="actors")
