"""The staleness report's figures: one function per PNG, each drawing every run (see
``launch/staleness.py``'s docstring for what each shows), and :data:`FIGURES`, their file names,
titles and captions."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import matplotlib
import numpy as np
from matplotlib.axes import Axes
from matplotlib.colors import to_rgb
from matplotlib.figure import Figure
from matplotlib.patches import Patch
from matplotlib.ticker import FuncFormatter, MaxNLocator

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from staleness_runs import (FINAL_EVALS, Run, finite, group_stats, lag_setting, rollout_lag_mean,  # noqa: E402
                            seed_groups, slowdown)

DPI = 120
MAX_PIXELS = 6_000_000  # a figure of a large sweep (a panel per run) is saved at a lower dpi than DPI
ROLLING_WINDOW = 20  # rollouts in the rolling mean of lag_over_time.png
THROUGHPUT_BINS = 20  # bins of 5% of the run in actor_throughput.png
ACTOR_STYLES = ("-", "--", ":", "-.")
CORRECTION_MARKERS = ("o", "s", "^", "D", "v", "P", "X")

Colour = tuple[float, float, float]


def run_colours(n: int) -> list[Colour]:
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
        names = ", ".join(lacking) if len(lacking) <= 3 else f"{', '.join(lacking[:2])} and {len(lacking) - 2} more"
        head, _, why = what.partition(" (")   # "no KEY logged (why)": one short line each
        text = "\n".join([head, f"({why}" if why else "", names]).replace("\n\n", "\n")
        note = ax.text(0.02, 0.02, text, transform=ax.transAxes, ha="left", va="bottom", fontsize=7, color="0.35")
        note.set_in_layout(False)   # a long note must not shrink the axes under tight_layout


LEGEND_INSIDE_MAX = 12   # legend entries drawn inside the axes; more go beside them


def _steps_label(x: float, _pos=None) -> str:
    """An env-step tick: 0, 500, 25k, 1.5M."""
    if abs(x) >= 1e6:
        return f"{x / 1e6:g}M"
    return f"{x / 1e3:g}k" if abs(x) >= 1e3 else f"{x:g}"


STEPS_FORMAT = FuncFormatter(_steps_label)


def _finish(ax: Axes, title: str, xlabel: str, ylabel: str) -> None:
    """Title, axis labels, grid and (when anything is labelled) a legend."""
    ax.set_title(title)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    if xlabel == "env steps":   # 200k, not 200000: six-digit tick labels run into each other
        ax.xaxis.set_major_formatter(STEPS_FORMAT)
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
        points = sorted((t, lag) for t, lag in ((run.since_start(r), rollout_lag_mean(r)) for r in run.consumed)
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
    return t if t is not None else finite(evaluation.get("wall_s"))


def _eval_curve(run: Run, by_time: bool) -> np.ndarray | None:
    """``[3, n]``: x (env steps or seconds), return mean and return std of each evaluation, sorted by x."""
    rows = []
    for e in run.evals:
        x = _eval_time(run, e) if by_time else finite(e.get("env_steps"))
        if x is not None:
            std = finite(e.get("eval/return_std"))
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
        for (label, members), colour in zip(groups, run_colours(len(groups))):
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
            t = run.since_start(r, "received") if finite(r.get("received")) is not None else run.since_start(r)
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


# (key, title, key drawn dashed in the same colour or None, note where no run logged the key)
NO_CORRECTION = "plain PPO without recomputed values logs none"
NO_DRIFT = "logged by PPO on stale data; older runs lack it"
OFFPOLICY_PANELS = (("offpolicy/ess", "effective sample size (share of the batch)", None, NO_CORRECTION),
                    ("offpolicy/log_ratio_abs", "mean |log pi_k / mu|", None, NO_CORRECTION),
                    ("offpolicy/kl_behaviour", "KL(mu || pi_k) at the update's start", None, NO_CORRECTION),
                    ("loss/approx_kl", "approx. KL moved by the update", None, NO_CORRECTION),
                    ("offpolicy/drift_ratio", "drift ratio (dashed: consistent drift; 1: random moves)",
                     "offpolicy/drift_ratio_consistent", NO_DRIFT),
                    ("offpolicy/drift_kl_behaviour", "KL(mu || pi_k) (dashed: per-update KLs summed)",
                     "offpolicy/drift_kl_path", NO_DRIFT))


def _per_update(run: Run, key: str) -> np.ndarray | None:
    """``[2, n]``: env steps and `key` of every metrics.jsonl line that has both, or None."""
    points = [(m.get("env_steps"), m.get(key)) for m in run.metrics]
    points = [(x, y) for x, y in points if finite(x) is not None and finite(y) is not None]
    return np.array(points, dtype=float).T if points else None


def plot_offpolicy_health(runs: Sequence[Run], colours: Sequence[Colour]) -> Figure:
    """How far each update's data was from the policy it trained: ESS, |log pi_k/mu|, KL to mu at the
    start and the KL the update moved (the first three are logged with an off-policy correction), and
    the drift ratio with its terms (PPO on stale data), against env steps (``metrics.jsonl``)."""
    ncols = 3
    nrows = math.ceil(len(OFFPOLICY_PANELS) / ncols)
    fig, axes = plt.subplots(nrows, ncols, figsize=(5.5 * ncols, 4.5 * nrows), squeeze=False)
    for ax, (key, label, dashed, missing) in zip(axes.flat, OFFPOLICY_PANELS):
        for run, colour in zip(runs, colours):
            for name, style, text in ((key, "-", run.label), (dashed, "--", None)):
                curve = _per_update(run, name) if name is not None else None
                if curve is not None:
                    ax.plot(curve[0], curve[1], color=colour, linewidth=1.2, linestyle=style, label=text)
        if key == "offpolicy/drift_ratio":
            ax.axhline(1.0, color="0.3", linewidth=1.0, linestyle=":")
        _note_missing(ax, runs, lambda r, k=key: any(finite(m.get(k)) is not None for m in r.metrics),
                      f"no {key} logged ({missing})")
        _finish(ax, label, "env steps", key)
    for ax in axes.flat[len(OFFPOLICY_PANELS):]:
        ax.set_visible(False)
    fig.suptitle("Staleness health per update: a falling ESS and a rising KL come before a collapse; "
                 "a drift ratio near the lag means the updates push one way")
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
            held = bool((lag_setting(members[0]) or (0, 1))[0])
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


FRACTION_COLOURS = ("#4c72b0", "#dd8452", "#55a868", "#c44e52")   # one per threshold in slowdown.png


def _slowdown_panel(ax: Axes, result: dict[str, Any], axis: str) -> None:
    """One panel of slowdown.png: per group, a bar per threshold at the mean ratio to the reference
    (min–max over the seeds that reached it), "not reached" where none did."""
    groups, keys = result["groups"], list(result["thresholds"])
    width = 0.8 / max(len(keys), 1)
    for i, key in enumerate(keys):
        colour = FRACTION_COLOURS[i % len(FRACTION_COLOURS)]
        label: str | None = f"{float(key):.0%} of the reference's return"   # on the first bar drawn only
        for j, group in enumerate(groups):
            spread, x = group[axis][key], j + (i - (len(keys) - 1) / 2) * width
            ratio = spread.get("ratio")
            if not spread.get("reached") or ratio is None:
                ax.text(x, 1.0, "not reached" if not spread.get("reached") else "reference never did",
                        rotation=90, ha="center", va="bottom", fontsize=7, color=colour)
                continue
            ax.bar(x, ratio["mean"], width, color=colour, alpha=0.85, label=label,
                   yerr=[[ratio["mean"] - ratio["min"]], [ratio["max"] - ratio["mean"]]], capsize=3)
            label = None
            if spread["reached"] < spread["runs"]:
                ax.annotate(f"{spread['reached']}/{spread['runs']}", (x, ratio["max"]), xytext=(0, 2),
                            textcoords="offset points", ha="center", va="bottom", fontsize=7)
    ax.axhline(1.0, color="0.3", linewidth=1.0, linestyle="--")
    crowded = len(groups) > 3
    ax.set_xticks(range(len(groups)), [g["label"] for g in groups], rotation=30 if crowded else 0,
                  ha="right" if crowded else "center", fontsize=8 if crowded else 10)
    ax.set_xlim(-0.7, len(groups) - 0.3)
    what = "env steps" if axis == "env_steps" else "wall time"
    _finish(ax, f"{what.capitalize()} to the threshold, × the reference's (bars: min–max over seeds)",
            "run group", f"{what} / reference's {what}")


def plot_slowdown(runs: Sequence[Run], colours: Sequence[Colour], result: dict[str, Any] | None = None) -> Figure:
    """How much later each run group reaches 50% and 80% of the reference group's final return, in
    env steps (top) and wall time (bottom), as a ratio to the reference (:func:`staleness_runs.slowdown`;
    `result` is its output, computed here with the default reference when None; `colours` unused:
    one colour per threshold)."""
    if result is None:
        result = slowdown(runs)
    n = len(result["groups"])
    fig, axes = plt.subplots(2, 1, figsize=(max(8.0, 0.9 * n + 3), 9))
    if "thresholds" not in result:
        for ax in axes:
            _note(ax, f"no slowdown: {result.get('note', 'no evaluations')}")
        return fig
    for ax, axis in zip(axes, ("env_steps", "wall_s")):
        _slowdown_panel(ax, result, axis)
    fig.suptitle(f"Slowdown against {result['reference']} (dashed: the reference, 1×)")
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
      "mean |log pi_k/mu|, KL(mu || pi_k) when the update starts, and the approximate KL the update moved; "
      "then the drift ratio, KL(mu || pi_k) over the per-update KLs KL(pi_j || pi_j+1) summed from each "
      "sample's version to k (dashed: what a consistent drift in one direction gives, about the lag; "
      "dotted: 1, what moves in random directions give), and its two terms.")),
    ("dropped_episode_bias.png", "Episode length of dropped data", plot_dropped_episode_bias,
     ("Mean length of episodes ending in consumed vs dropped rollouts; a gap means dropping favours short or "
      "long episodes.")),
    ("return_vs_lag.png", "Return vs lag", plot_return_vs_lag,
     (f"Final return (mean of the last {FINAL_EVALS} evaluations) against sample-weighted mean lag, by "
      "off-policy correction.")),
    ("slowdown.png", "Slowdown", plot_slowdown,
     ("Env steps (top) and wall time (bottom) each run group took to reach 50% and 80% of the reference "
      "group's final return, divided by the reference's: the bar is the mean over seeds, the whisker the "
      "min–max; 1× (dashed) is the reference. The table under \"Slowdown\" has the numbers.")),
)



def figure_dpi(fig: Figure) -> float:
    """DPI, or less for a figure that would exceed MAX_PIXELS at DPI (a panel-per-run figure of a
    72-run sweep was 2.4 MB): every figure stays a picture a README can show."""
    w, h = fig.get_size_inches()
    return min(DPI, math.sqrt(MAX_PIXELS / (w * h)))
