"""The staleness report's data: each run directory's logs (read by ``shared/run_dir.py``) and the
statistics derived from them (lags, drops, sync delays, final return, seed groups).

Part of ``launch/staleness.py``; see its docstring for what the report shows.
"""

from __future__ import annotations

import json
import math
import re
import sys
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from shared.run_dir import CONFIG, METRICS, SUMMARY, VERSIONS, RunDir, RunDirError, setting  # noqa: E402

FINAL_EVALS = 3  # evaluations averaged into a run's final return
LAG_DROP_REASONS = ("lag", "stale")
MAX_NAMED_LINES = 5  # skipped lines named in a run's note


def finite(value: Any) -> float | None:
    """`value` as a finite float, or None for anything else (missing, null, NaN, a string, a bool)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        return None
    return float(value)




def rollout_lag_mean(rollout: dict[str, Any]) -> float | None:
    """A rollout's mean sample lag (its maximum ``lag`` in older runs without ``lag_mean``)."""
    mean = finite(rollout.get("lag_mean"))
    return mean if mean is not None else finite(rollout.get("lag"))


def _lag_pairs(rollout: dict[str, Any]) -> list[tuple[int, int]]:
    """(lag, sample count) pairs of one consumed rollout: its ``lag_hist``, or in older runs all of its
    ``env_steps`` at ``lag_mean`` rounded (at ``lag``, the rollout's maximum, when even that is missing)."""
    hist = rollout.get("lag_hist")
    if isinstance(hist, list) and hist:
        pairs = []
        for entry in hist:
            if isinstance(entry, list) and len(entry) == 2 and all(isinstance(x, int) for x in entry):
                pairs.append((entry[0], entry[1]))
        return pairs
    lag = rollout_lag_mean(rollout)
    steps = rollout.get("env_steps")
    if lag is None or not isinstance(steps, int):
        return []
    return [(round(lag), steps)]


@dataclass
class Run:
    """One run directory's logs, and the statistics the report derives from them."""

    path: Path
    label: str
    config: dict[str, Any] = field(default_factory=dict)
    summary: dict[str, Any] = field(default_factory=dict)
    versions: list[dict[str, Any]] = field(default_factory=list)
    metrics: list[dict[str, Any]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)  # problems met while loading: missing files, skipped lines

    def setting(self, *keys: str, default: Any = None) -> Any:
        """The config value at `keys` (e.g. ``"actors", "sync_every"``), or `default` if any level is missing."""
        return setting(self.config, *keys, default=default)

    @property
    def weights_at(self) -> str:
        """When the actors took new weights, resolved as ``shared.config.weights_at`` does: "step"
        or "rollout" ("auto" is step in vla mode with sync_every 1; runs from before the key existed
        took weights at rollout boundaries)."""
        if self.setting("trainer", "buffer_type") == "standard":
            return "rollout"
        value = self.setting("actors", "weights_at", default="rollout")
        if value == "auto":
            return "step" if self.setting("actors", "sync_every", default=1) == 1 else "rollout"
        return str(value)

    @property
    def correction(self) -> str:
        """The off-policy correction of the algorithm ("none" when not configured)."""
        return str(self.setting("algorithm", "cfg", "correction", default="none"))

    def _events(self, name: str) -> list[dict[str, Any]]:
        return [v for v in self.versions if v.get("event") == name]

    @cached_property
    def consumed(self) -> list[dict[str, Any]]:
        """``consume`` events: rollouts the learner trained on."""
        return self._events("consume")

    @cached_property
    def dropped(self) -> list[dict[str, Any]]:
        """``drop`` events: rollouts received but never trained on (``reason`` says why)."""
        return self._events("drop")

    @cached_property
    def syncs(self) -> list[dict[str, Any]]:
        """``sync`` events with a delay: an actor first acting with a newly published version."""
        return [s for s in self._events("sync") if finite(s.get("delay_s")) is not None]

    @cached_property
    def evals(self) -> list[dict[str, Any]]:
        """``metrics.jsonl`` evaluation lines, in the order written."""
        return [m for m in self.metrics if finite(m.get("eval/return_mean")) is not None]

    @cached_property
    def start(self) -> float | None:
        """Unix time the run started: its earliest ``versions.jsonl`` time, else its earliest metrics time."""
        for records in (self.versions, self.metrics):
            times = [t for t in (finite(r.get("time")) for r in records) if t is not None]
            if times:
                return min(times)
        return None

    def since_start(self, record: dict[str, Any], key: str = "time") -> float | None:
        """Seconds from the run's start to `record[key]`, or None when either is unknown."""
        t = finite(record.get(key))
        return None if t is None or self.start is None else t - self.start

    @cached_property
    def lag_histogram(self) -> dict[int, int]:
        """Consumed samples per policy lag, over the whole run."""
        hist: Counter[int] = Counter()
        for rollout in self.consumed:
            for lag, count in _lag_pairs(rollout):
                hist[lag] += count
        return dict(sorted(hist.items()))

    @property
    def mean_lag(self) -> float | None:
        """Sample-weighted mean policy lag of all consumed data."""
        total = sum(self.lag_histogram.values())
        return sum(lag * n for lag, n in self.lag_histogram.items()) / total if total else None

    @property
    def max_lag(self) -> int | None:
        """Largest policy lag of any consumed sample."""
        lags = list(self.lag_histogram) + [r["lag"] for r in self.consumed if isinstance(r.get("lag"), int)]
        return max(lags, default=None)

    def lag_quantile(self, q: float) -> int | None:
        """Smallest lag at or below which at least a fraction `q` of the consumed samples lie."""
        total = sum(self.lag_histogram.values())
        cumulative = 0
        for lag, n in self.lag_histogram.items():
            cumulative += n
            if total and cumulative >= q * total:
                return lag
        return None

    @property
    def multi_version_share(self) -> float | None:
        """Share of consumed rollouts acted by more than one weight version (in-flight weight
        updates, ``actors.weights_at: step``): their ``lag_hist`` has more than one entry."""
        hists = [r.get("lag_hist") for r in self.consumed if isinstance(r.get("lag_hist"), list)]
        if not hists:
            return None
        return sum(1 for h in hists if len(h) > 1) / len(hists)

    def drop_share(self, reasons: Iterable[str]) -> float | None:
        """Share of the rollouts received (consumed or dropped) that were dropped for one of `reasons`."""
        received = len(self.consumed) + len(self.dropped)
        if not received:
            return None
        wanted = set(reasons)
        return sum(1 for d in self.dropped if d.get("reason") in wanted) / received

    @staticmethod
    def episode_length(rollouts: Sequence[dict[str, Any]]) -> tuple[float | None, int, int]:
        """(mean length, episodes, rollouts) of the episodes that ended in `rollouts`: each rollout's
        ``episode_length_mean`` weighted by its ``episodes``; rollouts with no ended episode do not count."""
        total = 0.0
        episodes = used = 0
        for r in rollouts:
            mean, n = finite(r.get("episode_length_mean")), r.get("episodes", 1)
            if mean is None or not isinstance(n, int) or n <= 0:
                continue
            total += mean * n
            episodes += n
            used += 1
        return (total / episodes if episodes else None), episodes, used

    @property
    def sync_delays_ms(self) -> list[float]:
        """Weight-sync delay of each sync event, in milliseconds."""
        return [1000 * float(s["delay_s"]) for s in self.syncs]

    @property
    def mean_sync_delay_ms(self) -> float | None:
        """Mean weight-sync delay over all sync events, in milliseconds."""
        delays = self.sync_delays_ms
        return sum(delays) / len(delays) if delays else None

    def median(self, key: str) -> float | None:
        """The median over ``metrics.jsonl`` lines of `key` (e.g. ``offpolicy/drift_ratio``), or None."""
        values = [v for v in (finite(m.get(key)) for m in self.metrics) if v is not None]
        return float(np.median(values)) if values else None

    @property
    def final_return(self) -> float | None:
        """Mean evaluation return of the last (up to) 3 evaluations."""
        last = [float(e["eval/return_mean"]) for e in self.evals[-FINAL_EVALS:]]
        return sum(last) / len(last) if last else None

    def _latest(self, key: str) -> int | None:
        """`key` from ``summary.json``, else its largest value in metrics or in publish/resume events."""
        if isinstance(self.summary.get(key), int):
            return self.summary[key]
        values = [r[key] for r in self.metrics if isinstance(r.get(key), int)]
        values += [v[key] for v in self.versions
                   if v.get("event") in ("publish", "resume") and isinstance(v.get(key), int)]
        return max(values, default=None)

    @property
    def env_steps(self) -> int | None:
        """Env steps the learner received (summary, else the latest logged count)."""
        return self._latest("env_steps")

    @property
    def updates(self) -> int | None:
        """Optimiser updates the learner made (summary, else the latest logged count)."""
        return self._latest("updates")

    @property
    def wall_s(self) -> float | None:
        """Run length in seconds: ``summary.json``'s ``wall_s``, else the last logged time minus the start."""
        wall = finite(self.summary.get("wall_s"))
        if wall is not None:
            return wall
        times = [self.since_start(r) for r in (*self.versions, *self.metrics)]
        return max((t for t in times if t is not None), default=None)

    def data_notes(self) -> list[str]:
        """Loading problems and absent events, as sentences for the report."""
        notes = list(self.notes)
        if not self.consumed:
            notes.append("no consumed rollouts recorded")
        if not self.evals:
            notes.append("no evaluations recorded")
        if not self.syncs:
            notes.append("no sync events recorded")
        if not self.dropped:
            notes.append("nothing dropped")
        if self.consumed and self.episode_length(self.consumed)[1] == 0:
            notes.append("no episode lengths recorded in consumed rollouts")
        return notes




def _optional_object(run_dir: RunDir, name: str, read: Callable[[], dict[str, Any] | None],
                     notes: list[str]) -> dict[str, Any]:
    """``config.json`` or ``summary.json``, or {} with a note when it is missing or malformed."""
    if not run_dir.has(name):
        notes.append(f"{name} missing")
        return {}
    try:
        return read() or {}
    except RunDirError as e:
        notes.append(f"{name} ignored: {str(e).removeprefix(f'{run_dir.path / name}: ')}")
        return {}


def _skipped_note(name: str, lines: list[int]) -> str:
    shown = ", ".join(map(str, lines[:MAX_NAMED_LINES])) + (", ..." if len(lines) > MAX_NAMED_LINES else "")
    return f"skipped {len(lines)} line(s) of {name} that are not valid JSON (line {shown})"


def load_run(path: str | Path, label: str | None = None) -> Run:
    """Read one run directory. `label` defaults to the directory's name.

    Raises RunDirError when `path` is not a directory or has neither ``versions.jsonl`` nor ``metrics.jsonl``;
    any other missing file, or a line that is not a JSON object (anywhere: a report over many runs reads
    leniently), becomes a note on the returned run.
    """
    run_dir = RunDir(path)
    if not run_dir.has(VERSIONS) and not run_dir.has(METRICS):
        raise RunDirError(f"{run_dir.path}: neither {VERSIONS} nor {METRICS} found; not a Tandem run directory")
    run = Run(path=run_dir.path, label=label or run_dir.path.resolve().name)
    run.config = _optional_object(run_dir, CONFIG, run_dir.config, run.notes)
    if run_dir.has(SUMMARY):
        run.summary = _optional_object(run_dir, SUMMARY, run_dir.summary, run.notes)
    for name, read in ((VERSIONS, run_dir.versions), (METRICS, run_dir.metrics)):
        if not run_dir.has(name):
            run.notes.append(f"{name} missing")
            continue
        setattr(run, name.removesuffix(".jsonl"), read(lenient=True))
        if run_dir.skipped[name]:
            run.notes.append(_skipped_note(name, run_dir.skipped[name]))
    return run


def seed_groups(runs: Sequence[Run]) -> list[tuple[str, list[Run]]]:
    """Runs of one setting over several seeds, grouped. Labels ending in a seed suffix (``_s2``,
    ``-seed2``, as ``sweep_staleness.sh`` names runs) group by the label without it; other runs
    group by their config without ``trainer.seed`` (and where the run was written)."""
    groups: dict[str, tuple[str, list[Run]]] = {}
    for run in runs:
        stripped = re.sub(r"[_-](s|seed)\d+$", "", run.label)
        if stripped and stripped != run.label:
            key, label = "label:" + stripped, stripped
        else:
            cfg = json.loads(json.dumps(run.config))
            for name in ("seed", "output_dir", "exp_name"):
                cfg.get("trainer", {}).pop(name, None)
            key, label = "config:" + json.dumps(cfg, sort_keys=True), run.label
        groups.setdefault(key, (label, []))[1].append(run)
    return list(groups.values())


def group_stats(members: Sequence[Run]) -> tuple[float, float, float, float, int] | None:
    """(mean lag, mean final return, std of final return, std of mean lag, n) over runs with both."""
    pts = [(r.mean_lag, r.final_return) for r in members if r.mean_lag is not None and r.final_return is not None]
    if not pts:
        return None
    lag, ret = np.array(pts, dtype=float).T
    return float(lag.mean()), float(ret.mean()), float(ret.std()), float(lag.std()), len(pts)



def lag_setting(run: Run) -> tuple[int, int] | None:
    """How a run's lag was made: ``(actors.weights_lag_versions, actors.sync_every)``."""
    sync = run.setting("actors", "sync_every", default=1)
    held = run.setting("actors", "weights_lag_versions", default=0)
    if not isinstance(sync, int) or not isinstance(held, int):
        return None
    return held, sync


# ---------------------------------------------------------------------------------------- slowdown
SLOWDOWN_FRACTIONS = (0.5, 0.8)   # shares of the reference group's final return a run must reach
CROSSING_RULE = ("linear interpolation between the last evaluation below the threshold and the first at or "
                 "above it (env steps and wall time alike); the first evaluation itself when it already reaches "
                 "the threshold")
WALL_TIME_RULE = ("seconds from the run's start to the first publication of the evaluated version (to the "
                  "evaluation's own metrics.jsonl line where that is not recorded)")


class UnknownReference(ValueError):
    """``--reference`` names no run group of the report; the message lists the groups there are."""


@dataclass(frozen=True)
class EvalPoint:
    """One evaluation of a run: its env steps, seconds since the run started, and its mean return."""

    env_steps: float
    wall_s: float | None
    value: float


@dataclass(frozen=True)
class Crossing:
    """Where a run's evaluation curve first reached a threshold: env steps and wall seconds since its start."""

    env_steps: float
    wall_s: float | None


def publish_times(run: Run) -> dict[int, float]:
    """Seconds since the run started at which each version was first published (``publish`` or ``resume``)."""
    times: dict[int, float] = {}
    for event in run.versions:
        version, t = event.get("version"), run.since_start(event)
        if event.get("event") in ("publish", "resume") and isinstance(version, int) and t is not None:
            times.setdefault(version, t)
    return times


def eval_points(run: Run, key: str = "eval/return_mean") -> list[EvalPoint]:
    """The run's evaluations of `key` (the mean return, or e.g. ``eval/success_rate``) in env-step order.
    Their wall time is when the evaluated version was published (when the learner had that policy),
    else the evaluation line's own time: the evaluator's delay is then left out of the comparison."""
    published = publish_times(run)
    points = []
    for e in run.evals:
        steps, value = finite(e.get("env_steps")), finite(e.get(key))
        if steps is None or value is None:
            continue
        version = e.get("version")
        wall = published.get(version) if isinstance(version, int) else None
        if wall is None:
            wall = run.since_start(e)
        if wall is None:
            wall = finite(e.get("wall_s"))
        points.append(EvalPoint(steps, wall, value))
    return sorted(points, key=lambda p: p.env_steps)


def first_crossing(points: Sequence[EvalPoint], threshold: float) -> Crossing | None:
    """Where the evaluation curve `points` (in env-step order) first reaches `threshold`, or None when
    no evaluation does.

    A threshold crossed between two evaluations is linearly interpolated: with returns ``r0 < threshold
    <= r1`` at the evaluations either side, the crossing lies the fraction ``(threshold - r0) / (r1 - r0)``
    of the way from the first to the second, in env steps and in wall time alike. When the first
    evaluation already reaches the threshold, the crossing is that evaluation (nothing earlier is known).
    Interpolation assumes the return rose steadily between the two evaluations; taking the next
    evaluation instead would round every slowdown to whole evaluation intervals.
    """
    before = None
    for point in points:
        if point.value >= threshold:
            if before is None:
                return Crossing(point.env_steps, point.wall_s)
            share = (threshold - before.value) / (point.value - before.value)
            steps = before.env_steps + share * (point.env_steps - before.env_steps)
            wall = point.wall_s
            if before.wall_s is not None and point.wall_s is not None:
                wall = before.wall_s + share * (point.wall_s - before.wall_s)
            return Crossing(steps, wall)
        before = point
    return None


def _group_lag(members: Sequence[Run]) -> float:
    lags = [r.mean_lag for r in members if r.mean_lag is not None]
    return float(np.mean(lags)) if lags else math.inf


def reference_group(groups: Sequence[tuple[str, list[Run]]], reference: str | None = None) -> tuple[str, list[Run]]:
    """The group the slowdown is measured against: the one labelled `reference` (its seed-group label, or
    the label of one of its runs), else the group with the smallest mean lag that has evaluations (lag 1
    in a sweep under ``pace``; the first such group given on a tie).

    Raises UnknownReference naming the labels there are when `reference` matches no group."""
    if reference is not None:
        for label, members in groups:
            if reference == label or any(reference == r.label for r in members):
                return label, members
        raise UnknownReference(f"--reference {reference!r} names no run group; the groups are: "
                         + ", ".join(label for label, _ in groups))
    with_evals = [g for g in groups if any(r.evals for r in g[1])] or list(groups)
    return min(with_evals, key=lambda g: _group_lag(g[1]))


def _spread(values: Sequence[float | None], reference_mean: float | None) -> dict[str, Any]:
    """Mean, min, max and std over the seeds that reached a threshold (None: not reached), and the same
    of each seed's value divided by the reference group's mean."""
    reached = np.array([v for v in values if v is not None], dtype=float)
    out: dict[str, Any] = {"runs": len(values), "reached": int(reached.size)}
    if not reached.size:
        return out
    out.update(mean=float(reached.mean()), min=float(reached.min()), max=float(reached.max()),
               std=float(reached.std()))
    if reference_mean:
        ratio = reached / reference_mean
        out["ratio"] = {"mean": float(ratio.mean()), "min": float(ratio.min()), "max": float(ratio.max()),
                        "std": float(ratio.std())}
    return out


def _run_crossings(run: Run, thresholds: dict[str, float]) -> dict[str, Crossing | None]:
    points = eval_points(run)
    return {key: first_crossing(points, value) for key, value in thresholds.items()}


def slowdown(runs: Sequence[Run], reference: str | None = None, random_return: float | None = None,
             fractions: Sequence[float] = SLOWDOWN_FRACTIONS) -> dict[str, Any]:
    """How much later each run group reaches a share of the reference group's final return, in env
    steps and in wall time (the report's "Slowdown" table and ``slowdown.png``; ``report.json``'s
    ``slowdown``).

    The threshold for a fraction f is ``R_random + f * (R_ref - R_random)``: R_ref is the mean final
    return over the reference group's seeds (:func:`reference_group`), R_random is `random_return` (0
    when not given; give a random policy's return for tasks whose returns are negative). Each run's
    crossing is :func:`first_crossing` of its evaluations. Per group and fraction, ``env_steps`` and
    ``wall_s`` hold the mean, min, max and std over the seeds that reached it, ``reached`` of ``runs``,
    and ``ratio``: each seed's value divided by the reference group's mean value, summarised alike.
    A seed that never reaches the threshold has ``null`` there and counts only in ``runs``.
    Returns a JSON-ready dict; its ``note`` says why there are no thresholds when there are none.

    Raises UnknownReference when `reference` names no group.
    """
    if not runs:
        return {"groups": [], "note": "no runs"}
    groups = seed_groups(runs)
    ref_label, ref_members = reference_group(groups, reference)
    finals = [r.final_return for r in ref_members if r.final_return is not None]
    base = random_return if random_return is not None else 0.0
    out: dict[str, Any] = {"reference": ref_label,
                           "reference_final_return": float(np.mean(finals)) if finals else None,
                           "random_return": random_return, "fractions": list(fractions), "crossing": CROSSING_RULE,
                           "wall_time": WALL_TIME_RULE, "groups": []}
    if not finals:
        out["note"] = f"the reference group {ref_label} has no evaluations, so no threshold can be set"
        return out
    if out["reference_final_return"] <= base:
        out["note"] = (f"the reference group {ref_label} has no final return above {base:g}, so no threshold "
                       "can be set" + ("" if random_return is not None else " (give --random-return for "
                                                                              "negative returns)"))
        return out
    thresholds = {f"{f:g}": base + f * (out["reference_final_return"] - base) for f in fractions}
    out["thresholds"] = thresholds
    crossings = {label: [_run_crossings(r, thresholds) for r in members] for label, members in groups}
    out["groups"] = [_group_slowdown(label, members, crossings[label], crossings[ref_label])
                     for label, members in groups]
    return out


def _axis_mean(crossed: Sequence[dict[str, Crossing | None]], key: str, axis: str) -> float | None:
    """The mean env steps or wall seconds (`axis`) at which the runs of `crossed` reached threshold `key`."""
    values = [getattr(c[key], axis) for c in crossed if c[key] is not None]
    values = [v for v in values if v is not None]
    return float(np.mean(values)) if values else None


def _group_slowdown(label: str, members: Sequence[Run], crossed: Sequence[dict[str, Crossing | None]],
                    ref_crossed: Sequence[dict[str, Crossing | None]]) -> dict[str, Any]:
    """One group's entry of :func:`slowdown`: its runs' crossings and, per axis and threshold, their spread."""
    lag = _group_lag(members)
    group: dict[str, Any] = {"label": label, "correction": members[0].correction,
                             "mean_lag": None if math.isinf(lag) else lag, "runs": [], "env_steps": {}, "wall_s": {}}
    for run, reached in zip(members, crossed):
        group["runs"].append({"label": run.label, "final_return": run.final_return,
                              "reached": {k: None if c is None else {"env_steps": c.env_steps, "wall_s": c.wall_s}
                                          for k, c in reached.items()}})
    for key in (crossed[0] if crossed else {}):
        for axis in ("env_steps", "wall_s"):
            values = [None if c[key] is None else getattr(c[key], axis) for c in crossed]
            group[axis][key] = _spread(values, _axis_mean(ref_crossed, key, axis))
    return group
