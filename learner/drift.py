"""The drift ratio: does the policy drift in one direction across updates, or move at random?

At the start of update k the learner trains pi_k on samples acted by older versions v (the behaviour
policy mu = pi_v). How far mu is from pi_k, KL(mu || pi_k), depends on how the updates in between
added up. Compare it with the sum of what each of those updates moved on its own,
``sum_{j=v}^{k-1} KL(pi_j || pi_{j+1})``:

- updates that push the same way add up like a straight line: after L of them the KL is about L^2
  times one update's, so the ratio is about L (precisely ``E[L^2] / E[L]`` over the samples, logged as
  ``drift_ratio_consistent``);
- updates in random directions add up like a random walk: the KL grows like L, and the ratio is about 1.

A ratio near L says lag costs quadratically and smaller updates help by their square; a ratio near 1
says the stale data is about as far off as the per-update KLs add to, whatever their direction.

How it is measured (:class:`DriftMeter`, called by PPO before each update's correction):

- each update keeps a fixed subsample of its batch (:data:`DRIFT_SAMPLES` rows, evenly spaced, no
  random draw: training is unchanged), with mu and log pi_k on it;
- at the start of update k+1 it evaluates pi_{k+1} on that subsample, which gives KL(pi_k || pi_{k+1})
  (the update's move and the observation normaliser's after it) and stores it per version in a
  :class:`KLHistory` of prefix sums;
- on update k+1's own subsample, KL(mu || pi_{k+1}) is averaged over the stale samples and divided by
  the mean over the same samples of the per-update KLs from each sample's version to k+1.

KLs are Schulman's k3 estimator on mu's samples: ``rho - 1 - log rho``, rho = pi/mu, unbiased for
KL(mu || pi). KL(pi_j || pi_{j+1}) is the same estimator on pi_j's ratio pi_{j+1}/pi_j, each sample
weighted by pi_j/mu (self-normalised), because the samples come from mu, not from pi_j.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
from tensordict import TensorDictBase

from learner.minibatch import log_ratio
from shared import keys

DRIFT_SAMPLES = 512      # rows of each batch the drift is measured on (at most 2x this evaluated per update)
HISTORY_VERSIONS = 4096  # per-update KLs kept; a sample older than this has no path sum and is left out

LogProbFn = Callable[[TensorDictBase], torch.Tensor]


def behaviour_kl(logp_now: torch.Tensor, logp_behaviour: torch.Tensor) -> torch.Tensor:
    """Per sample, the k3 estimate of KL(mu || pi): ``rho - 1 - log rho`` with ``rho = pi / mu``, on
    samples drawn from mu. Its mean is unbiased. Shapes: ``[n]`` in, ``[n]`` out (float64)."""
    log_rho = log_ratio(logp_now, logp_behaviour).double()
    return log_rho.exp() - 1 - log_rho


def update_kl(logp_before: torch.Tensor, logp_after: torch.Tensor, logp_behaviour: torch.Tensor) -> float:
    """KL(pi_before || pi_after) estimated on samples drawn from mu (not pi_before): the k3 estimate of
    the ratio pi_after/pi_before, each sample weighted by pi_before/mu, the weights normalised to sum
    to 1. On fresh samples (mu = pi_before) it is the plain k3 mean. Shapes: ``[n]`` log-probs."""
    weight = log_ratio(logp_before, logp_behaviour).double().exp()
    k3 = behaviour_kl(logp_after, logp_before)
    return float((weight * k3).sum() / weight.sum())


class KLHistory:
    """What each update moved, KL(pi_j || pi_{j+1}) for version j, as prefix sums over consecutive
    versions: the sum over any range of versions is one subtraction.

    A version recorded out of order (the first after a resume, whose earlier updates this learner never
    measured) starts the record again from that version; sums reaching further back are unknown.
    """

    def __init__(self, keep: int = HISTORY_VERSIONS):
        self.keep = keep
        self.first: int | None = None     # the version whose KL is the first term of the sums
        self._cumulative = [0.0]          # [i]: sum of the KLs of versions first .. first + i - 1

    @property
    def next_version(self) -> int | None:
        """The version whose KL :meth:`record` expects next (None before the first)."""
        return None if self.first is None else self.first + len(self._cumulative) - 1

    def record(self, version: int, kl: float) -> None:
        """Record KL(pi_version || pi_{version+1})."""
        if version != self.next_version:
            self.first, self._cumulative = version, [0.0]
        self._cumulative.append(self._cumulative[-1] + kl)
        if len(self._cumulative) > self.keep + 1:
            drop = len(self._cumulative) - self.keep - 1
            self._cumulative = self._cumulative[drop:]   # differences of prefix sums are unchanged
            self.first += drop

    def path_kl(self, versions: torch.Tensor, current: int) -> torch.Tensor:
        """Per sample of version v, ``sum_{j=v}^{current-1} KL(pi_j || pi_{j+1})``: 0 for v = current,
        NaN where a term is not recorded. Shapes: ``[n]`` int in, ``[n]`` float64 out."""
        out = torch.full(versions.shape, math.nan, dtype=torch.float64)
        versions = versions.cpu()
        out[versions == current] = 0.0
        if self.first is None or not self.first <= current <= self.next_version:
            return out
        cumulative = torch.tensor(self._cumulative, dtype=torch.float64)
        known = (versions >= self.first) & (versions < current)
        out[known] = cumulative[current - self.first] - cumulative[versions[known] - self.first]
        return out


def drift_stats(kl_behaviour: torch.Tensor, path_kl: torch.Tensor, lags: torch.Tensor) -> dict[str, float]:
    """The drift ratio of one update's stale samples whose path is known, from per-sample KL(mu || pi_k)
    estimates, path sums (:meth:`KLHistory.path_kl`) and lags. Returns ``drift_kl_behaviour`` and
    ``drift_kl_path`` (their means), ``drift_ratio`` (their quotient, where the path is not 0) and
    ``drift_ratio_consistent`` (what a consistent drift at a constant per-update KL gives on these lags,
    ``E[L^2] / E[L]``); {} when no stale sample has a known path. Shapes: ``[n]`` each."""
    use = (lags > 0) & torch.isfinite(path_kl)
    if not bool(use.any()):
        return {}
    lag = lags[use].double()
    kl, path = float(kl_behaviour[use].mean()), float(path_kl[use].mean())
    out = {"drift_kl_behaviour": kl, "drift_kl_path": path,
           "drift_ratio_consistent": float((lag ** 2).mean() / lag.mean())}
    if path > 0:
        out["drift_ratio"] = kl / path
    return out


def spaced_rows(n: int, count: int) -> torch.Tensor:
    """`count` (at most `n`) row indices spread evenly over ``0..n-1``: no random draw."""
    if n <= count:
        return torch.arange(n)
    return torch.linspace(0, n - 1, count).round().long()


@dataclass
class _Probe:
    """One update's subsample: its rows, the behaviour log-prob mu and log pi_version on them."""

    rows: TensorDictBase
    logp_behaviour: torch.Tensor
    logp_policy: torch.Tensor
    version: int


class DriftMeter:
    """The drift ratio of each update (see the module's docstring), from the policy's log-probs.

    Args:
        log_prob: the current policy's log-prob of each row's action, without gradients
            (``CurrentPolicy.evaluate``'s first result); rows are 1-D TensorDicts of the batch.
        samples: rows of each batch measured (:data:`DRIFT_SAMPLES`).
    """

    def __init__(self, log_prob: LogProbFn, samples: int = DRIFT_SAMPLES):
        self.log_prob, self.samples = log_prob, samples
        self.history = KLHistory()
        self._last: _Probe | None = None

    def measure(self, batch: TensorDictBase, lags: torch.Tensor) -> dict[str, float]:
        """At the start of an update, before anything rewrites the batch's log-probs: record what the
        previous update moved, keep this batch's subsample, and return the drift figures
        (:func:`drift_stats`, plus ``drift_kl_update``, the previous update's KL) for the log.

        `batch` holds the update's samples with their ``policy_version``; `lags` their lags, in the
        order of ``batch.reshape(-1)``. Returns {} where the lags do not match the batch."""
        flat = batch.reshape(-1)
        if lags.numel() != flat.numel():
            return {}
        idx = spaced_rows(flat.numel(), self.samples).to(flat.device)
        rows = flat[idx]
        versions = rows[keys.POLICY_VERSION].reshape(-1).cpu()
        row_lags = lags.reshape(-1)[idx.cpu()].cpu()
        current = int(versions[0] + row_lags[0])
        previous = self._last
        if previous is not None and set(previous.rows.keys(True, True)) != set(rows.keys(True, True)):
            previous = None   # batches of another layout (cannot happen in one run): nothing to compare
        both = torch.cat([previous.rows, rows]) if previous is not None else rows
        logp = self.log_prob(both).reshape(-1)
        out: dict[str, float] = {}
        if previous is not None:
            n_old = previous.rows.numel()
            if previous.version == current - 1:   # else an update was not measured (a restart): no KL
                kl = update_kl(previous.logp_policy, logp[:n_old], previous.logp_behaviour)
                self.history.record(previous.version, kl)
                out["drift_kl_update"] = kl
            logp = logp[n_old:]
        mu = rows[keys.LOG_PROB].reshape(-1)
        self._last = _Probe(rows, mu.clone(), logp, current)
        out.update(drift_stats(behaviour_kl(logp, mu).cpu(), self.history.path_kl(versions, current), row_lags))
        return out
