"""Staleness report for Tandem runs: how old the data was that the learner trained on, and what it cost.

Usage::

    python launch/staleness.py RUN_DIR [RUN_DIR ...] [--out DIR] [--labels L1,L2,...]

Reads each run directory's ``config.json``, ``versions.jsonl``, ``metrics.jsonl`` and (optional)
``summary.json`` and writes ``report.md`` plus the PNG figures below into ``--out`` (default:
``RUN_DIR/staleness_report`` for one run, ``./staleness_report`` for several). A run's label is its
directory name unless ``--labels`` gives one per run. Missing files or events give a note in the report
and on the figure, never an error; a line that is not valid JSON (the truncated last line of a killed run)
is skipped. The exit status is 2, with the path on stderr, when a RUN_DIR does not exist or has neither
``versions.jsonl`` nor ``metrics.jsonl``.

Policy lag is the learner's version when it used a sample minus the policy version that produced it.
Times are wall-clock seconds since the run started (its first ``versions.jsonl`` line, the publication of
version 0). Each run keeps one colour in every figure except ``return_vs_lag.png``, coloured by correction.

Figures:

- ``lag_histogram.png``: distribution of the policy lag of every consumed sample, as a fraction of the
  run's consumed samples (one step histogram per run, integer bins).
- ``lag_over_time.png``: mean lag of each consumed rollout against time (faint points), with a rolling mean
  over 20 rollouts.
- ``return_vs_steps.png`` / ``return_vs_time.png``: evaluation return against env steps and against time:
  a line per run with a ±1 std band over episodes or, where a setting was run with several seeds, a line
  per setting (mean over seeds, ±1 std band over seeds, each seed faint).
- ``actor_throughput.png``: env steps/s the learner received from each actor (consumed or dropped), in bins
  of 5% of the run; one panel per run, one line style per actor.
- ``sync_delay.png``: weight-sync delay (from the learner publishing a version to an actor first acting with
  it), as a histogram and over time.
- ``offpolicy_health.png``: per update, the effective sample size of the importance weights, the mean
  |log pi_k/mu|, KL(mu || pi_k) at the update's start and the KL the update moved, against env steps;
- ``dropped_episode_bias.png``: mean episode length of the episodes that ended in consumed vs dropped
  rollouts, to show whether dropping favours short or long episodes.
- ``return_vs_lag.png``: final return (mean of the last 3 evaluations) against the sample-weighted mean lag,
  one marker per run, coloured by the off-policy correction; runs of one correction are joined in lag order.
"""

from __future__ import annotations

import argparse
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

import matplotlib
import numpy as np
from matplotlib.axes import Axes
from matplotlib.colors import to_rgb
from matplotlib.figure import Figure
from matplotlib.patches import Patch
from matplotlib.ticker import MaxNLocator

matplotlib.use("Agg")
import matplotlib.pyplot as plt

DPI = 120
MAX_PIXELS = 6_000_000  # a figure of a large sweep (a panel per run) is saved at a lower dpi than DPI
ROLLING_WINDOW = 20  # rollouts in the rolling mean of lag_over_time.png
THROUGHPUT_BINS = 20  # bins of 5% of the run in actor_throughput.png
FINAL_EVALS = 3  # evaluations averaged into a run's final return
LAG_DROP_REASONS = ("lag", "stale")
MISSING = "—"
ACTOR_STYLES = ("-", "--", ":", "-.")
CORRECTION_MARKERS = ("o", "s", "^", "D", "v", "P", "X")

Colour = tuple[float, float, float]


class RunDirError(Exception):
    """A path given as a run directory is not one."""


def _num(value: Any) -> float | None:
    """`value` as a finite float, or None for anything else (missing, null, NaN, a string, a bool)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        return None
    return float(value)


def _read_jsonl(path: Path) -> tuple[list[dict[str, Any]], int]:
    """The JSON objects of a JSON-lines file and how many non-empty lines were skipped as not JSON objects."""
    records, skipped = [], 0
    for line in path.read_text(errors="replace").splitlines():
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            record = None
        if isinstance(record, dict):
            records.append(record)
        else:
            skipped += 1
    return records, skipped


def _rollout_lag_mean(rollout: dict[str, Any]) -> float | None:
    """A rollout's mean sample lag (its maximum ``lag`` in older runs without ``lag_mean``)."""
    mean = _num(rollout.get("lag_mean"))
    return mean if mean is not None else _num(rollout.get("lag"))


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
    lag = _rollout_lag_mean(rollout)
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
        node: Any = self.config
        for key in keys:
            if not isinstance(node, dict) or node.get(key) is None:
                return default
            node = node[key]
        return node

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
        return [s for s in self._events("sync") if _num(s.get("delay_s")) is not None]

    @cached_property
    def evals(self) -> list[dict[str, Any]]:
        """``metrics.jsonl`` evaluation lines, in the order written."""
        return [m for m in self.metrics if _num(m.get("eval/return_mean")) is not None]

    @cached_property
    def start(self) -> float | None:
        """Unix time the run started: its earliest ``versions.jsonl`` time, else its earliest metrics time."""
        for records in (self.versions, self.metrics):
            times = [t for t in (_num(r.get("time")) for r in records) if t is not None]
            if times:
                return min(times)
        return None

    def since_start(self, record: dict[str, Any], key: str = "time") -> float | None:
        """Seconds from the run's start to `record[key]`, or None when either is unknown."""
        t = _num(record.get(key))
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
            mean, n = _num(r.get("episode_length_mean")), r.get("episodes", 1)
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
        wall = _num(self.summary.get("wall_s"))
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


def _read_json(path: Path, notes: list[str]) -> dict[str, Any]:
    """A JSON object file, or {} with a note when it is missing or unreadable."""
    if not path.is_file():
        notes.append(f"{path.name} missing")
        return {}
    try:
        data = json.loads(path.read_text(errors="replace"))
    except json.JSONDecodeError:
        data = None
    if not isinstance(data, dict):
        notes.append(f"{path.name} is not a JSON object; ignored")
        return {}
    return data


def load_run(path: str | Path, label: str | None = None) -> Run:
    """Read one run directory. `label` defaults to the directory's name.

    Raises RunDirError when `path` is not a directory or has neither ``versions.jsonl`` nor ``metrics.jsonl``;
    any other missing file, or a line that is not a JSON object, becomes a note on the returned run.
    """
    path = Path(path)
    if not path.is_dir():
        raise RunDirError(f"{path}: no such run directory")
    if not (path / "versions.jsonl").is_file() and not (path / "metrics.jsonl").is_file():
        raise RunDirError(f"{path}: neither versions.jsonl nor metrics.jsonl found; not a Tandem run directory")
    run = Run(path=path, label=label or path.resolve().name)
    run.config = _read_json(path / "config.json", run.notes)
    if (path / "summary.json").is_file():
        run.summary = _read_json(path / "summary.json", run.notes)
    for name in ("versions", "metrics"):
        file = path / f"{name}.jsonl"
        if not file.is_file():
            run.notes.append(f"{file.name} missing")
            continue
        records, skipped = _read_jsonl(file)
        setattr(run, name, records)
        if skipped:
            run.notes.append(f"skipped {skipped} line(s) of {file.name} that are not valid JSON")
    return run


# ===================================================================================================== figures
def _run_colours(n: int) -> list[Colour]:
    """One distinct colour per run (tab10, or tab20 beyond 10 runs)."""
    cmap = plt.get_cmap("tab10" if n <= 10 else "tab20")
    return [to_rgb(cmap(i % cmap.N)) for i in range(n)]


def _shade(colour: Colour, i: int, n: int) -> Colour:
    """`colour` lightened for the `i`-th of `n` items (the first unchanged), to tell actors of one run apart."""
    mix = 0.55 * i / max(n - 1, 1)
    r, g, b = (c + (1 - c) * mix for c in colour)
    return r, g, b


def _note(ax: Axes, text: str) -> None:
    """Write `text` in the middle of an axes that has nothing to show."""
    ax.text(0.5, 0.5, text, transform=ax.transAxes, ha="center", va="center", fontsize=10, color="0.35",
            wrap=True)


def _note_missing(ax: Axes, runs: Sequence[Run], has_data: Callable[[Run], bool], what: str) -> None:
    """Say on `ax` which runs have no data: `what` in the middle when none has, else the runs in a corner."""
    lacking = [r.label for r in runs if not has_data(r)]
    if len(lacking) == len(runs):
        _note(ax, what)
    elif lacking:
        ax.text(0.01, 0.01, f"{what}: {', '.join(lacking)}", transform=ax.transAxes, ha="left", va="bottom",
                fontsize=8, color="0.35")


LEGEND_INSIDE_MAX = 12   # legend entries drawn inside the axes; more go beside them


def _finish(ax: Axes, title: str, xlabel: str, ylabel: str) -> None:
    """Title, axis labels, grid and (when anything is labelled) a legend."""
    ax.set_title(title)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.grid(True, alpha=0.3)
    n = len(ax.get_legend_handles_labels()[0])
    if n > LEGEND_INSIDE_MAX:   # beside the axes, in columns, instead of over the curves
        ax.legend(fontsize="x-small", loc="upper left", bbox_to_anchor=(1.01, 1.0), ncol=math.ceil(n / 28),
                  borderaxespad=0.0)
    elif n:
        ax.legend(fontsize="small")


def _rolling_mean(y: np.ndarray, window: int) -> np.ndarray:
    """Trailing mean over `window` points (over the points so far for the first ones)."""
    c = np.cumsum(np.insert(y, 0, 0.0))
    idx = np.arange(1, len(y) + 1)
    lo = np.maximum(idx - window, 0)
    return (c[idx] - c[lo]) / (idx - lo)


def plot_lag_histogram(runs: Sequence[Run], colours: Sequence[Colour]) -> Figure:
    """Figure 1: per-sample policy lag distribution of consumed data, one step histogram per run."""
    fig, ax = plt.subplots(figsize=(8, 5))
    for run, colour in zip(runs, colours):
        hist = run.lag_histogram
        total = sum(hist.values())
        if not total:
            continue
        top = max(hist)
        fractions = np.array([hist.get(lag, 0) / total for lag in range(top + 1)])
        ax.stairs(fractions, np.arange(top + 2) - 0.5, color=colour, linewidth=1.8,
                  label=f"{run.label} (mean {run.mean_lag:.2f})")
    _note_missing(ax, runs, lambda r: bool(r.lag_histogram), "no consumed rollouts recorded")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    _finish(ax, "Policy lag of consumed samples", "policy lag (learner versions behind)",
            "fraction of consumed samples")
    return fig


def plot_lag_over_time(runs: Sequence[Run], colours: Sequence[Colour]) -> Figure:
    """Figure 2: mean lag of each consumed rollout against time, raw points and a rolling mean."""
    fig, ax = plt.subplots(figsize=(8, 5))
    shown: set[int] = set()  # id() of the runs drawn
    for run, colour in zip(runs, colours):
        points = sorted((t, lag) for t, lag in ((run.since_start(r), _rollout_lag_mean(r)) for r in run.consumed)
                        if t is not None and lag is not None)
        if not points:
            continue
        t, lag = np.array(points).T
        ax.scatter(t, lag, s=6, color=colour, alpha=0.2, linewidths=0)
        ax.plot(t, _rolling_mean(lag, ROLLING_WINDOW), color=colour, linewidth=1.8, label=run.label)
        shown.add(id(run))
    _note_missing(ax, runs, lambda r: id(r) in shown, "no consumed rollouts recorded")
    _finish(ax, f"Mean lag per consumed rollout (line: rolling mean over {ROLLING_WINDOW})",
            "wall time since start (s)", "mean policy lag (versions)")
    return fig


def _eval_time(run: Run, evaluation: dict[str, Any]) -> float | None:
    """Seconds since the run started of an evaluation line (its ``wall_s`` when it has no ``time``)."""
    t = run.since_start(evaluation)
    return t if t is not None else _num(evaluation.get("wall_s"))


def _eval_curve(run: Run, by_time: bool) -> np.ndarray | None:
    """``[3, n]``: x (env steps or seconds), return mean and return std of each evaluation, sorted by x."""
    rows = []
    for e in run.evals:
        x = _eval_time(run, e) if by_time else _num(e.get("env_steps"))
        if x is not None:
            std = _num(e.get("eval/return_std"))
            rows.append((x, float(e["eval/return_mean"]), math.nan if std is None else std))
    return np.array(sorted(rows)).T if rows else None


def _plot_return(runs: Sequence[Run], colours: Sequence[Colour], by_time: bool) -> Figure:
    """Figures 3: evaluation return against env steps (`by_time` False) or wall time.

    Runs that differ only in their seed (:func:`seed_groups`) are drawn as one line when any setting
    has several: at each evaluation index, the mean over the seeds of x and of the return, with a
    band of ±1 std over the seeds; each seed is a thin faint line. Otherwise a line per run, its
    band ±1 std over the evaluation's episodes."""
    groups = seed_groups(runs)
    by_seed = any(len(members) > 1 for _, members in groups)
    fig, ax = plt.subplots(figsize=(10, 5) if len(groups if by_seed else runs) > LEGEND_INSIDE_MAX else (8, 5))
    shown: set[int] = set()  # id() of the runs drawn
    if by_seed:
        for (label, members), colour in zip(groups, _run_colours(len(groups))):
            curves = [(r, c) for r in members if (c := _eval_curve(r, by_time)) is not None]
            if not curves:
                continue
            for run, c in curves:
                ax.plot(c[0], c[1], color=colour, linewidth=0.7, alpha=0.3)
                shown.add(id(run))
            n = min(c.shape[1] for _, c in curves)     # the evaluations every seed reached
            xs = np.stack([c[0, :n] for _, c in curves])
            ys = np.stack([c[1, :n] for _, c in curves])
            x, mean, std = xs.mean(0), ys.mean(0), ys.std(0)
            ax.plot(x, mean, color=colour, linewidth=1.8, marker="o", markersize=3,
                    label=f"{label} (n={len(curves)})" if len(curves) > 1 else label)
            if len(curves) > 1:
                ax.fill_between(x, mean - std, mean + std, color=colour, alpha=0.15, linewidth=0)
        band = "line: mean over seeds, band: ±1 std over seeds"
    else:
        for run, colour in zip(runs, colours):
            c = _eval_curve(run, by_time)
            if c is None:
                continue
            x, mean, std = c
            ax.plot(x, mean, color=colour, linewidth=1.8, marker="o", markersize=3, label=run.label)
            if not np.isnan(std).all():
                ax.fill_between(x, mean - std, mean + std, color=colour, alpha=0.15, linewidth=0)
            shown.add(id(run))
        band = "band: ±1 std over episodes"
    _note_missing(ax, runs, lambda r: id(r) in shown, "no evaluations recorded")
    xlabel = "wall time since start (s)" if by_time else "env steps"
    _finish(ax, f"Evaluation return vs {'wall time' if by_time else 'env steps'} ({band})", xlabel,
            "evaluation return (mean over episodes)")
    return fig


def plot_return_vs_steps(runs: Sequence[Run], colours: Sequence[Colour]) -> Figure:
    """Figure 3a: evaluation return against env steps."""
    return _plot_return(runs, colours, by_time=False)


def plot_return_vs_time(runs: Sequence[Run], colours: Sequence[Colour]) -> Figure:
    """Figure 3b: evaluation return against wall time since the run started."""
    return _plot_return(runs, colours, by_time=True)


def plot_actor_throughput(runs: Sequence[Run], colours: Sequence[Colour]) -> Figure:
    """Figure 4: env steps/s received from each actor over time, in bins of 5% of the run; a panel per run."""
    ncols = 1 if len(runs) <= 3 else 2 if len(runs) <= 12 else 4
    nrows = math.ceil(len(runs) / ncols)
    width, height = (8, 3.2) if ncols <= 2 else (5.5, 2.8)
    fig, axes = plt.subplots(nrows, ncols, figsize=(width * ncols, height * nrows), squeeze=False)
    for ax in axes.flat[len(runs):]:
        ax.set_visible(False)
    for ax, run, colour in zip(axes.flat, runs, colours):
        rows = []
        for r in (*run.consumed, *run.dropped):
            t = run.since_start(r, "received") if _num(r.get("received")) is not None else run.since_start(r)
            if t is not None and isinstance(r.get("actor"), int) and isinstance(r.get("env_steps"), int):
                rows.append((r["actor"], t, r["env_steps"]))
        span = max((t for _, t, _ in rows), default=0.0)
        title = run.label
        if span <= 0:
            _note(ax, "no rollouts with timestamps recorded")
        else:
            edges = np.linspace(0.0, span, THROUGHPUT_BINS + 1)
            actors = sorted({a for a, _, _ in rows})
            for i, actor in enumerate(actors):
                times = [t for a, t, _ in rows if a == actor]
                steps = [n for a, _, n in rows if a == actor]
                rate = np.histogram(times, bins=edges, weights=steps)[0] / (edges[1] - edges[0])
                ax.stairs(rate, edges, color=_shade(colour, i, len(actors)), linewidth=1.6,
                          linestyle=ACTOR_STYLES[i % len(ACTOR_STYLES)], label=f"actor {actor}")
            title += f": {sum(n for _, _, n in rows) / span:,.0f} env steps/s from {len(actors)} actor(s)"
        _finish(ax, title, "wall time since start (s)", "env steps/s")
    fig.suptitle("Env steps received per actor (consumed + dropped)")
    return fig


def plot_sync_delay(runs: Sequence[Run], colours: Sequence[Colour]) -> Figure:
    """Figure 5: weight-sync delay in ms, a histogram (fraction of sync events) and the delays over time."""
    fig, (hist_ax, time_ax) = plt.subplots(1, 2, figsize=(13, 5))
    pooled = [ms for run in runs for ms in run.sync_delays_ms]
    if pooled:
        edges = np.histogram_bin_edges(pooled, bins=30)
        for run, colour in zip(runs, colours):
            d = np.array(run.sync_delays_ms)
            if not d.size:
                continue
            hist_ax.hist(d, bins=edges, weights=np.full(d.size, 1 / d.size), histtype="step", color=colour,
                         linewidth=1.8, label=f"{run.label} (mean {d.mean():.1f} ms)")
            points = [(run.since_start(s), 1000 * float(s["delay_s"])) for s in run.syncs]
            points = [p for p in points if p[0] is not None]
            if points:
                t, ms = np.array(points).T
                time_ax.scatter(t, ms, s=10, color=colour, alpha=0.6, linewidths=0, label=run.label)
    for ax in (hist_ax, time_ax):
        _note_missing(ax, runs, lambda r: bool(r.syncs), "no sync events recorded")
    _finish(hist_ax, "Weight-sync delay distribution", "sync delay (ms)", "fraction of sync events")
    _finish(time_ax, "Weight-sync delay over time", "wall time since start (s)", "sync delay (ms)")
    fig.suptitle("Delay from the learner publishing weights to an actor first acting with them")
    return fig


OFFPOLICY_PANELS = (("offpolicy/ess", "effective sample size (share of the batch)"),
                    ("offpolicy/log_ratio_abs", "mean |log pi_k / mu|"),
                    ("offpolicy/kl_behaviour", "KL(mu || pi_k) at the update's start"),
                    ("loss/approx_kl", "approx. KL moved by the update"))


def plot_offpolicy_health(runs: Sequence[Run], colours: Sequence[Colour]) -> Figure:
    """How far each update's data was from the policy it trained: ESS, |log pi_k/mu|, KL to mu at the
    start and the KL the update moved, against env steps (``metrics.jsonl``; the first three are
    logged with an off-policy correction)."""
    fig, axes = plt.subplots(1, len(OFFPOLICY_PANELS), figsize=(5 * len(OFFPOLICY_PANELS), 4.5))
    for ax, (key, label) in zip(axes, OFFPOLICY_PANELS):
        for run, colour in zip(runs, colours):
            points = [(m.get("env_steps"), m.get(key)) for m in run.metrics]
            points = [(x, y) for x, y in points if _num(x) is not None and _num(y) is not None]
            if points:
                x, y = np.array(points, dtype=float).T
                ax.plot(x, y, color=colour, linewidth=1.2, label=run.label)
        _note_missing(ax, runs, lambda r, k=key: any(_num(m.get(k)) is not None for m in r.metrics),
                      f"no {key} logged (plain PPO without recomputed values logs none)")
        _finish(ax, label, "env steps", key)
    fig.suptitle("Staleness health per update: a falling ESS and a rising KL come before a collapse")
    return fig


def plot_dropped_episode_bias(runs: Sequence[Run], colours: Sequence[Colour]) -> Figure:
    """Figure 6: mean episode length in consumed vs dropped rollouts, a pair of bars per run with counts."""
    fig, ax = plt.subplots(figsize=(max(8.0, 1.6 * len(runs) + 2), 5))
    width = 0.38
    heights = []
    for i, (run, colour) in enumerate(zip(runs, colours)):
        for kind, offset, rollouts, hatch, alpha in (("consumed", -width / 2, run.consumed, None, 0.9),
                                                     ("dropped", width / 2, run.dropped, "//", 0.45)):
            mean, episodes, used = Run.episode_length(rollouts)
            x = i + offset
            if mean is None:
                text = f"nothing {kind}" if not rollouts else "no episode lengths"
                ax.text(x, 0, text, rotation=90, ha="center", va="bottom", fontsize=8, color="0.35")
                continue
            ax.bar(x, mean, width, color=colour, alpha=alpha, hatch=hatch, edgecolor=colour)
            ax.annotate(f"{mean:.1f}\n{episodes} ep / {used} ro", (x, mean), xytext=(0, 3),
                        textcoords="offset points", ha="center", va="bottom", fontsize=7)
            heights.append(mean)
    if heights:
        ax.set_ylim(0, 1.25 * max(heights))
    else:
        _note(ax, "no episode lengths recorded")
    crowded = len(runs) > 3
    ax.set_xlim(-0.7, len(runs) - 0.3)
    ax.set_xticks(range(len(runs)), [r.label for r in runs], rotation=20 if crowded else 0,
                  ha="right" if crowded else "center")
    ax.legend(handles=[Patch(facecolor="0.4", label="consumed"),
                       Patch(facecolor="0.8", hatch="//", edgecolor="0.4", label="dropped")], fontsize="small")
    ax.set_title("Episode length in consumed vs dropped rollouts")
    ax.set_xlabel("run (above bars: mean length, episodes (ep) / rollouts (ro) counted)")
    ax.set_ylabel("mean episode length (env steps)")
    ax.grid(True, axis="y", alpha=0.3)
    return fig


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


MAX_POINT_LABELS = 6   # return_vs_lag names each point by its run group only up to this many points


def plot_return_vs_lag(runs: Sequence[Run], colours: Sequence[Colour]) -> Figure:
    """Figure 7: final return against sample-weighted mean lag, coloured by correction (`colours`, the
    run colours, are not used here). Runs that differ only in their seed are one point: the mean, with
    a bar of +-1 std over seeds; each seed is a small faint marker. A sawtooth lag (``sync_every``) and a
    constant one (``weights_lag_versions``, dashed, hollow markers) are separate lines. Up to
    ``MAX_POINT_LABELS`` points each carry their run group's name; beyond that the labels would
    overlap, and the legend (correction) and the x axis (lag) name every point."""
    fig, ax = plt.subplots(figsize=(8, 5))
    by_correction: dict[tuple[str, bool], list[tuple[float, float, float, float, int, str, list[Run]]]] = {}
    for label, members in seed_groups(runs):
        stats = group_stats(members)
        if stats is not None:
            held = bool((_lag_setting(members[0]) or (0, 1))[0])
            by_correction.setdefault((members[0].correction, held), []).append((*stats, label, list(members)))
    cmap = plt.get_cmap("Dark2")
    index = {c: i for i, c in enumerate(sorted({c for c, _ in by_correction}))}
    for (correction, held), points in sorted(by_correction.items()):
        points.sort(key=lambda p: p[0])
        i = index[correction]
        colour, marker = cmap(i % cmap.N), CORRECTION_MARKERS[i % len(CORRECTION_MARKERS)]
        for *_, members in points:
            xs = [r.mean_lag for r in members if r.mean_lag is not None and r.final_return is not None]
            ys = [r.final_return for r in members if r.mean_lag is not None and r.final_return is not None]
            ax.scatter(xs, ys, color=colour, marker=marker, s=18, alpha=0.3, linewidths=0)
        lag, ret, std, _, _, _, _ = zip(*points)
        ax.errorbar(lag, ret, yerr=std, color=colour, marker=marker, markersize=8, linewidth=1.6, capsize=4,
                    linestyle="--" if held else "-", markerfacecolor="white" if held else colour,
                    label=f"{correction} (constant lag)" if held else correction)
        if sum(len(p) for p in by_correction.values()) <= MAX_POINT_LABELS:   # more would overlap: the legend
            for x, y, _, _, n, label, _ in points:                              # and the x axis say it all
                ax.annotate(label + (f" (n={n})" if n > 1 else ""), (x, y), xytext=(5, 5),
                            textcoords="offset points", fontsize=8)
    _note_missing(ax, runs, lambda r: r.mean_lag is not None and r.final_return is not None,
                  "not shown (no consumed rollouts or no evaluations)")
    _finish(ax, f"Final return vs mean policy lag (final: mean of last {FINAL_EVALS} evals; bars: ±1 std over seeds)",
            "mean policy lag of consumed samples (versions)", "final evaluation return")
    if by_correction:
        ax.get_legend().set_title("correction")
    return fig


FigureFn = Callable[[Sequence[Run], Sequence[Colour]], Figure]
# (file name, section title, plotter, caption)
FIGURES: tuple[tuple[str, str, FigureFn, str], ...] = (
    ("lag_histogram.png", "Policy lag distribution", plot_lag_histogram,
     "Fraction of consumed samples at each policy lag (learner version minus acting version)."),
    ("lag_over_time.png", "Lag over time", plot_lag_over_time,
     (f"Mean lag of each consumed rollout (points) and its rolling mean over {ROLLING_WINDOW} rollouts, "
      "against wall time since the run started.")),
    ("return_vs_steps.png", "Return vs env steps", plot_return_vs_steps,
     ("Evaluation return against env steps. Settings run over several seeds: a line per setting (the mean "
      "over seeds, a ±1 std band over seeds, each seed faint); otherwise a line per run, with a ±1 std band "
      "over the evaluation's episodes.")),
    ("return_vs_time.png", "Return vs wall time", plot_return_vs_time,
     "Evaluation return against wall time since the run started, drawn as return vs env steps is."),
    ("actor_throughput.png", "Actor throughput", plot_actor_throughput,
     "Env steps/s the learner received from each actor (consumed or dropped), in bins of 5% of the run."),
    ("sync_delay.png", "Weight-sync delay", plot_sync_delay,
     "Delay from the learner publishing a version to an actor first acting with it: distribution and over time."),
    ("offpolicy_health.png", "Staleness health per update", plot_offpolicy_health,
     ("Per update: the effective sample size of the importance weights pi_k/mu as a share of the batch, the "
      "mean |log pi_k/mu|, KL(mu || pi_k) when the update starts, and the approximate KL the update moved.")),
    ("dropped_episode_bias.png", "Episode length of dropped data", plot_dropped_episode_bias,
     ("Mean length of episodes ending in consumed vs dropped rollouts; a gap means dropping favours short or "
      "long episodes.")),
    ("return_vs_lag.png", "Return vs lag", plot_return_vs_lag,
     (f"Final return (mean of the last {FINAL_EVALS} evaluations) against sample-weighted mean lag, by "
      "off-policy correction.")),
)


# ====================================================================================================== report
def _fmt_value(x: Any) -> str:
    """A config value for the table."""
    if x is None:
        return MISSING
    if isinstance(x, float):
        return f"{x:g}"
    return str(x)


def _fmt_float(x: float | None) -> str:
    """A measured quantity with precision suited to its size."""
    if x is None:
        return MISSING
    if abs(x) >= 1000:
        return f"{x:,.0f}"
    return f"{x:.1f}" if abs(x) >= 10 else f"{x:.2f}"


def _fmt_share(x: float | None) -> str:
    return MISSING if x is None else f"{100 * x:.1f}%"


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


TABLE_HEADER = ("run", "env", "buffer", "sync every", "weights at", "weights delay (s)", "weights lag (versions)",
                "lag policy", "correction",
                "env steps", "updates", "wall (s)", "final return", "mean lag", "max lag", "p95 lag",
                "rollouts with >1 version",
                "dropped (lag)", "overwritten", "sync delay (ms)", "episode length consumed / dropped")


def table_row(run: Run) -> list[str]:
    """The report table's cells for one run, formatted."""
    consumed_len = Run.episode_length(run.consumed)[0]
    dropped_len = Run.episode_length(run.dropped)[0]
    return [
        run.label,
        _fmt_value(run.setting("env", "id")),
        _fmt_value(run.setting("trainer", "buffer_type")),
        _fmt_value(run.setting("actors", "sync_every")),
        run.weights_at,
        _fmt_value(run.setting("actors", "weights_delay_s")),
        _fmt_value(run.setting("actors", "weights_lag_versions", default=0)),
        _fmt_value(run.setting("trainer", "lag_policy")),
        run.correction,
        MISSING if run.env_steps is None else f"{run.env_steps:,}",
        MISSING if run.updates is None else f"{run.updates:,}",
        MISSING if run.wall_s is None else f"{run.wall_s:.1f}",
        _fmt_float(run.final_return),
        MISSING if run.mean_lag is None else f"{run.mean_lag:.2f}",
        _fmt_value(run.max_lag),
        _fmt_value(run.lag_quantile(0.95)),
        _fmt_share(run.multi_version_share),
        _fmt_share(run.drop_share(LAG_DROP_REASONS)),
        _fmt_share(run.drop_share(["overwritten"])),
        MISSING if run.mean_sync_delay_ms is None else f"{run.mean_sync_delay_ms:.1f}",
        f"{_fmt_float(consumed_len)} / {_fmt_float(dropped_len)}",
    ]


def _lag_setting(run: Run) -> tuple[int, int] | None:
    """How a run's lag was made: ``(actors.weights_lag_versions, actors.sync_every)``."""
    sync = run.setting("actors", "sync_every", default=1)
    held = run.setting("actors", "weights_lag_versions", default=0)
    if not isinstance(sync, int) or not isinstance(held, int):
        return None
    return held, sync


def _lag_label(setting: tuple[int, int]) -> str:
    held, sync = setting
    return f"sync {sync}" if not held else f"sync {sync}, {held} behind"


def correction_lag_table(runs: Sequence[Run], random_return: float | None = None) -> list[str]:
    """Markdown: final return (mean ± std over seeds) for each correction (rows) at each lag setting
    (columns: ``actors.sync_every``, and ``actors.weights_lag_versions`` where set, with the mean lag
    measured), and, against ``none`` at the first setting (no versions held back, the smallest
    sync_every), the share of the return kept: R / R_ref, or with `random_return` (a random policy's
    return, for tasks whose returns are negative) (R - R_random) / (R_ref - R_random).
    Empty unless there are several corrections and several lag settings."""
    cells: dict[tuple[str, tuple[int, int]], list[Run]] = {}
    for run in runs:
        setting = _lag_setting(run)
        if run.final_return is not None and setting is not None:
            cells.setdefault((run.correction, setting), []).append(run)
    corrections = sorted({c for c, _ in cells}, key=lambda c: (c != "none", c))
    settings = sorted({s for _, s in cells})
    if len(corrections) < 2 or len(settings) < 2:
        return []

    def stats(members: list[Run]) -> tuple[float, float, float | None]:
        ret = np.array([r.final_return for r in members], dtype=float)
        lags = [r.mean_lag for r in members if r.mean_lag is not None]
        return float(ret.mean()), float(ret.std()), (float(np.mean(lags)) if lags else None)

    header = "| correction | " + " | ".join(_lag_label(s) for s in settings) + " |"
    lines = ["## Correction × lag", "",
             "Final return, mean ± std over seeds (n), by `actors.sync_every` (a sawtooth lag) and "
             "`actors.weights_lag_versions` (\"N behind\": a constant lag), mean lag measured.", "",
             header, "|---|" + "---:|" * len(settings)]
    for c in corrections:
        row = []
        for s in settings:
            if (c, s) in cells:
                m, sd, lag = stats(cells[(c, s)])
                row.append(f"{m:.1f} ± {sd:.1f} ({len(cells[(c, s)])}; lag {_fmt_float(lag)})")
            else:
                row.append(MISSING)
        lines.append(f"| {c} | " + " | ".join(row) + " |")
    ref = cells.get(("none", settings[0]))
    if ref:
        r_ref = stats(ref)[0]
        base = random_return if random_return is not None else 0.0
        first = _lag_label(settings[0])
        what = (f"(R − R_random) / (R_none,{first} − R_random), R_random = {random_return:g}"
                if random_return is not None else f"R / R_none,{first}")
        lines += ["", f"Share of the return kept: {what}.", "", header, "|---|" + "---:|" * len(settings)]
        for c in corrections:
            row = [f"{(stats(cells[(c, s)])[0] - base) / (r_ref - base):.0%}" if (c, s) in cells and r_ref != base
                   else MISSING for s in settings]
            lines.append(f"| {c} | " + " | ".join(row) + " |")
    return lines + [""]


def _markdown(runs: Sequence[Run], figures: Sequence[tuple[str, str, str]],
              random_return: float | None = None) -> str:
    """report.md's text; `figures` are (file name, section title, caption)."""
    lines = ["# Staleness report", "",
             "Policy lag = the learner's version when it used a sample minus the policy version that produced it.",
             "", "## Runs", ""]
    for run in runs:
        exp, seed = run.setting("trainer", "exp_name"), run.setting("trainer", "seed")
        extra = ", ".join(f"{k} {v}" for k, v in (("exp", exp), ("seed", seed)) if v is not None)
        lines.append(f"- **{_cell(run.label)}**: `{run.path}`" + (f" ({extra})" if extra else ""))
    lines += ["", "## Summary", "",
              "| " + " | ".join(TABLE_HEADER) + " |",
              "|" + "|".join("---" if i < 9 else "---:" for i in range(len(TABLE_HEADER))) + "|"]
    lines += ["| " + " | ".join(_cell(c) for c in table_row(run)) + " |" for run in runs]
    lines += ["",
              (f"Final return: mean of the last {FINAL_EVALS} evaluations. Lags are over consumed samples. "
               "Dropped (lag): share of received rollouts dropped as too old (reasons `lag` and `stale`); "
               "overwritten: share replaced in the buffer before use. Rollouts with >1 version: consumed "
               "rollouts acted by several weight versions (actors.weights_at step). Sync delay: mean over sync events. "
               "Episode length: mean over episodes ending in consumed / dropped rollouts."), ""]
    notes = [(run, run.data_notes()) for run in runs]
    if any(n for _, n in notes):
        lines += ["## Notes", ""]
        lines += [f"- **{_cell(run.label)}**: {'; '.join(n)}." for run, n in notes if n]
        lines.append("")
    grouped = [(label, members, group_stats(members)) for label, members in seed_groups(runs)]
    if any(len(m) > 1 for _, m, _ in grouped):
        lines += ["## Over seeds", "",
                  "| setting | correction | runs | mean lag | final return (mean ± std) | per seed |",
                  "|---|---|---:|---:|---:|---|"]
        for label, members, st in sorted(grouped, key=lambda g: (g[1][0].correction, g[2][0] if g[2] else 0)):
            per_seed = ", ".join(_fmt_float(r.final_return) for r in members)
            lines.append(f"| {_cell(label)} | {members[0].correction} | {len(members)} | "
                         + (f"{st[0]:.2f} | {st[1]:.1f} ± {st[2]:.1f}" if st else f"{MISSING} | {MISSING}")
                         + f" | {per_seed} |")
        lines.append("")
    lines += correction_lag_table(runs, random_return)
    lines += ["## Figures", ""]
    for name, title, caption in figures:
        lines += [f"### {title}", "", f"![{title}]({name})", "", caption, ""]
    return "\n".join(lines)


def figure_dpi(fig: Figure) -> float:
    """DPI, or less for a figure that would exceed MAX_PIXELS at DPI (a panel-per-run figure of a
    72-run sweep was 2.4 MB): every figure stays a picture a README can show."""
    w, h = fig.get_size_inches()
    return min(DPI, math.sqrt(MAX_PIXELS / (w * h)))


def write_report(runs: Sequence[Run], out_dir: str | Path, random_return: float | None = None) -> list[Path]:
    """Write every figure and ``report.md`` for `runs` into `out_dir` (created if needed).

    Returns the paths written, figures first and ``report.md`` last.
    """
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    colours = _run_colours(len(runs))
    written = []
    for name, _, plot, _ in FIGURES:
        fig = plot(runs, colours)
        fig.tight_layout()
        fig.savefig(out_dir / name, dpi=figure_dpi(fig))
        plt.close(fig)
        written.append(out_dir / name)
    report = out_dir / "report.md"
    report.write_text(_markdown(runs, [(name, title, caption) for name, title, _, caption in FIGURES], random_return))
    written.append(report)
    return written


def _default_labels(paths: Sequence[Path]) -> list[str]:
    """Run directory names, with the parent's name prefixed where two runs share a name."""
    names = [p.resolve().name for p in paths]
    counts = Counter(names)
    return [f"{p.resolve().parent.name}/{n}" if counts[n] > 1 else n for p, n in zip(paths, names)]


def main(argv: Sequence[str] | None = None) -> int:
    """Command line entry point; returns the exit status (2 when a run directory is unusable)."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("run_dirs", nargs="+", type=Path, metavar="RUN_DIR", help="Tandem run directories")
    parser.add_argument("--out", type=Path, default=None,
                        help="output directory (default: RUN_DIR/staleness_report for one run, else "
                             "./staleness_report)")
    parser.add_argument("--labels", default=None, help="comma-separated labels, one per RUN_DIR")
    parser.add_argument("--random-return", type=float, default=None,
                        help="a random policy's return on the task: the correction x lag table then gives the "
                             "return kept as (R - this) / (R_ref - this) (e.g. Pendulum-v1, whose returns are negative)")
    args = parser.parse_args(argv)
    if args.labels is not None:
        labels = [label.strip() for label in args.labels.split(",")]
        if len(labels) != len(args.run_dirs):
            parser.error(f"--labels has {len(labels)} label(s) for {len(args.run_dirs)} run dir(s)")
    else:
        labels = _default_labels(args.run_dirs)
    try:
        runs = [load_run(path, label) for path, label in zip(args.run_dirs, labels)]
    except RunDirError as e:
        print(f"staleness.py: error: {e}", file=sys.stderr)
        return 2
    out = args.out or (args.run_dirs[0] / "staleness_report" if len(runs) == 1 else Path("staleness_report"))
    written = write_report(runs, out, args.random_return)
    print(f"wrote {len(written)} files to {out}/ (see {written[-1].name})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
