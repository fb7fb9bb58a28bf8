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
