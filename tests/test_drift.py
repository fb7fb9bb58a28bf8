"""The drift ratio (learner/drift.py): its prefix sums by hand, its ratio on synthetic Gaussian policies
that drift consistently (about the lag L) or in random directions (about 1), and its figures in a real
learner's log."""

from __future__ import annotations

import json
import math

import pytest
import torch
from tensordict import TensorDict

from learner.drift import DriftMeter, KLHistory, behaviour_kl, drift_stats, spaced_rows, update_kl
from shared import keys

pytestmark = pytest.mark.timeout(60)


def test_kl_history_sums_the_recorded_versions():
    history = KLHistory()
    for version, kl in ((3, 0.1), (4, 0.2), (5, 0.4)):
        history.record(version, kl)
    path = history.path_kl(torch.tensor([3, 4, 5, 6, 2]), current=6)
    torch.testing.assert_close(path[:4], torch.tensor([0.7, 0.6, 0.4, 0.0], dtype=torch.float64))
    assert math.isnan(path[4])                                        # version 2's KL was never recorded
    assert torch.isnan(history.path_kl(torch.tensor([5]), current=7)).all()   # nor version 6's
    history.record(9, 1.0)                                            # a gap (a restart): the record starts again
    assert history.first == 9 and torch.isnan(history.path_kl(torch.tensor([5]), current=10)).all()
    assert history.path_kl(torch.tensor([9]), current=10).item() == pytest.approx(1.0)
    short = KLHistory(keep=2)
    for version in range(5):
        short.record(version, float(version))
    assert short.first == 3 and short.path_kl(torch.tensor([3]), current=5).item() == pytest.approx(7.0)


def test_drift_stats_by_hand():
    kl = torch.tensor([0.0, 0.4, 0.9, 5.0], dtype=torch.float64)
    path = torch.tensor([0.0, 0.2, 0.3, math.nan], dtype=torch.float64)   # the last sample's path is unknown
    lags = torch.tensor([0, 1, 2, 3])
    out = drift_stats(kl, path, lags)
    assert out["drift_kl_behaviour"] == pytest.approx(0.65) and out["drift_kl_path"] == pytest.approx(0.25)
    assert out["drift_ratio"] == pytest.approx(2.6) and out["drift_ratio_consistent"] == pytest.approx(5 / 3)
    assert drift_stats(kl[:1], path[:1], lags[:1]) == {}              # fresh samples only: nothing to say
    assert spaced_rows(10, 4).tolist() == [0, 3, 6, 9] and spaced_rows(3, 4).tolist() == [0, 1, 2]


def test_k3_estimates_match_the_gaussian_kl():
    """KL(mu || pi) from mu's samples, and KL(pi_a || pi_b) from mu's samples weighted by pi_a/mu, against
    the closed form |m_a - m_b|^2 / 2 for unit-variance Gaussians."""
    g = torch.Generator().manual_seed(0)
    mu, pi_a, pi_b = (torch.distributions.Normal(torch.full((4,), m), 1.0) for m in (0.0, 0.2, 0.3))
    a = mu.mean + torch.randn(200_000, 4, generator=g)
    logp = {name: d.log_prob(a).sum(-1) for name, d in (("mu", mu), ("a", pi_a), ("b", pi_b))}
    assert behaviour_kl(logp["a"], logp["mu"]).mean().item() == pytest.approx(4 * 0.2 ** 2 / 2, rel=0.03)
    assert update_kl(logp["a"], logp["b"], logp["mu"]) == pytest.approx(4 * 0.1 ** 2 / 2, rel=0.05)


class GaussianSequence:
    """Policies pi_0, pi_1, ... = N(m_j, I) in `dims` dimensions, state-independent; the mean moves by
    `step` per update, along one direction (`consistent`) or a fresh random one each update."""

    def __init__(self, updates: int, dims: int, step: float, consistent: bool, seed: int):
        g = torch.Generator().manual_seed(seed)
        direction = torch.randn(updates, dims, generator=g, dtype=torch.float64)
        if consistent:
            direction[:] = direction[0]
        moves = step * direction / direction.norm(dim=1, keepdim=True)
        self.means = torch.cat([torch.zeros(1, dims, dtype=torch.float64), moves.cumsum(0)])
        self.current = 0
        self.generator = g

    def log_prob(self, rows: TensorDict, version: int | None = None) -> torch.Tensor:
        """log pi_version (default: the current policy) of each row's action."""
        mean = self.means[self.current if version is None else version]
        return torch.distributions.Normal(mean, 1.0).log_prob(rows[keys.ACTION]).sum(-1).float()

    def batch(self, version: int, n: int) -> TensorDict:
        """`n` actions acted by pi_version, with their behaviour log-prob and version."""
        action = self.means[version] + torch.randn(n, self.means.shape[1], generator=self.generator,
                                                   dtype=torch.float64)
        rows = TensorDict({keys.ACTION: action, keys.POLICY_VERSION: torch.full((n,), version)}, batch_size=[n])
        rows[keys.LOG_PROB] = self.log_prob(rows, version)
        return rows


def mean_drift_ratio(consistent: bool, lag: int, seed: int = 0, updates: int = 40, dims: int = 64,
                     samples: int = 2048) -> tuple[float, float]:
    """The drift ratio over updates 2L..`updates` of a Gaussian sequence trained at a constant `lag`
    (every sample L versions old), and the consistent-drift value the meter gives for those lags."""
    policies = GaussianSequence(updates, dims=dims, step=0.05, consistent=consistent, seed=seed)
    meter = DriftMeter(policies.log_prob, samples=samples)
    kl, path, consistent_ratio = [], [], []
    for k in range(updates):
        policies.current = k
        version = max(k - lag, 0)
        out = meter.measure(policies.batch(version, samples), torch.full((samples,), k - version))
        if k >= 2 * lag:
            kl.append(out["drift_kl_behaviour"])
            path.append(out["drift_kl_path"])
            consistent_ratio.append(out["drift_ratio_consistent"])
    return sum(kl) / sum(path), sum(consistent_ratio) / len(consistent_ratio)


@pytest.mark.parametrize("lag", [4, 8])
def test_consistent_drift_gives_a_ratio_of_about_the_lag(lag):
    ratio, consistent = mean_drift_ratio(consistent=True, lag=lag)
    assert consistent == pytest.approx(lag)
    assert ratio == pytest.approx(lag, rel=0.1)


@pytest.mark.parametrize("lag", [4, 8])
def test_random_direction_moves_give_a_ratio_of_about_one(lag):
    ratio, consistent = mean_drift_ratio(consistent=False, lag=lag)
    assert consistent == pytest.approx(lag)
    assert ratio == pytest.approx(1.0, abs=0.25)


def test_a_learner_logs_the_drift_of_stale_updates(tmp_path):
    """PPO in a real learner, trained again and again on one rollout acted by version 0: from the second
    update on, every sample is stale and the drift figures are logged. At the second update the stale
    data is one version old, so KL(mu || pi_1) and the one update's KL are the same estimate on the
    same samples: the ratio is 1."""
    from actors.actor import Actor
    from learner.learner import Learner, ListPublisher
    from learner.logs import RunLogger
    from tests.test_learner_component import CaptureSink, PublisherSource, small_config

    cfg = small_config(buffer_type="vla", max_policy_lag=8, buffer_capacity=8)
    learner = Learner(cfg, tmp_path, ListPublisher(), logger=RunLogger(tmp_path, use_tensorboard=False))
    learner.publish()
    sink = CaptureSink()
    assert Actor(cfg, 0, PublisherSource(learner.publisher), sink).step_once()
    td, meta = sink.messages[-1]
    td[keys.POLICY_VERSION] = torch.zeros_like(td[keys.POLICY_VERSION])
    stats = []
    for _ in range(4):
        learner.ingest(td.clone(), meta)
        stats.append(learner.update_once(*learner.take_batch(timeout_s=0)))
    assert "drift_ratio" not in stats[0]                              # fresh data: nothing drifted yet
    assert stats[1]["drift_ratio"] == pytest.approx(1.0, abs=1e-3)
    assert stats[1]["drift_kl_update"] > 0 and stats[3]["drift_ratio_consistent"] == pytest.approx(3.0)
    lines = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    logged = [m["offpolicy/drift_ratio"] for m in lines if "offpolicy/drift_ratio" in m]
    assert len(logged) == 3 and all(math.isfinite(r) and r > 0 for r in logged)
