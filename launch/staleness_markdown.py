"""The staleness report's text: ``report.md``'s tables (a row per run, seeds, correction × lag) and
its figure sections."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from staleness_runs import FINAL_EVALS, LAG_DROP_REASONS, Run, group_stats, lag_setting, seed_groups

MISSING = "—"


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
        setting = lag_setting(run)
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


NOT_REACHED = "not reached"


def _fmt_spread(spread: dict[str, Any], axis: str) -> str:
    """A slowdown cell: the mean over the seeds that reached the threshold, (min–max) over several, and
    how many reached it when not all did; "not reached" when none did. Env steps (`axis`) are whole."""
    if not spread.get("reached"):
        return NOT_REACHED
    fmt = (lambda x: f"{x:,.0f}") if axis == "env_steps" else _fmt_float
    text = fmt(spread["mean"])
    if spread["reached"] > 1:
        text += f" ({fmt(spread['min'])}–{fmt(spread['max'])})"
    if spread["reached"] < spread["runs"]:
        text += f", {spread['reached']}/{spread['runs']} reached"
    return text


def _fmt_ratio(spread: dict[str, Any]) -> str:
    """The × reference cell: mean (min–max) of each seed's value over the reference group's mean."""
    if not spread.get("reached"):
        return NOT_REACHED
    ratio = spread.get("ratio")
    if ratio is None:
        return MISSING   # the reference group never reached this threshold
    text = f"{ratio['mean']:.2f}×"
    if spread["reached"] > 1:
        text += f" ({ratio['min']:.2f}–{ratio['max']:.2f})"
    if spread["reached"] < spread["runs"]:
        text += f", {spread['reached']}/{spread['runs']}"
    return text


def slowdown_table(result: dict[str, Any]) -> list[str]:
    """Markdown: the "Slowdown" section from :func:`staleness_runs.slowdown`'s `result`, a table of env
    steps and one of wall time to each threshold, with the ratio to the reference group."""
    lines = ["## Slowdown", ""]
    if "thresholds" not in result:
        return lines + [f"No slowdown table: {result.get('note', 'no evaluations')}.", ""]
    base, keys = result["random_return"], list(result["thresholds"])
    shares = " and ".join(f"{float(k):.0%}" for k in keys)
    what = f"of the way from a random policy's return ({base:g}) to" if base is not None else "of"
    values = ", ".join(f"{float(k):.0%}: {_fmt_float(v)}" for k, v in result["thresholds"].items())
    lines += [f"Env steps and wall time each run group takes to reach {shares} {what} the reference group's final "
              f"return (reference **{_cell(result['reference'])}**: {_fmt_float(result['reference_final_return'])}, "
              f"the mean over its seeds of the mean of their last {FINAL_EVALS} evaluations); thresholds {values}.",
              "",
              "A threshold crossed between two evaluations is placed by linear interpolation between them (in env "
              "steps and in wall time alike), not at the next evaluation; a run whose first evaluation already "
              "reaches it is placed there. Wall time runs from the run's start to the publication of the version "
              "evaluated. Each cell is the mean over the seeds that reached the threshold, with (min–max) over "
              "several seeds and \"k/n reached\" where some never did; × reference divides each seed's value by "
              "the reference group's mean. \"not reached\": no seed of the group got there.", ""]
    for axis, title in (("env_steps", "env steps"), ("wall_s", "wall (s)")):
        header = ["group", "correction", "runs", "mean lag"]
        for key in keys:
            header += [f"{title} to {float(key):.0%}", f"× reference ({float(key):.0%})"]
        lines += ["| " + " | ".join(header) + " |", "|---|---|" + "---:|" * (len(header) - 2)]
        for group in result["groups"]:
            row = [_cell(group["label"]), group["correction"], str(len(group["runs"])), _fmt_float(group["mean_lag"])]
            for key in keys:
                row += [_fmt_spread(group[axis][key], axis), _fmt_ratio(group[axis][key])]
            lines.append("| " + " | ".join(row) + " |")
        lines.append("")
    return lines


def markdown(runs: Sequence[Run], figures: Sequence[tuple[str, str, str]],
              random_return: float | None = None, slowdown: dict[str, Any] | None = None) -> str:
    """report.md's text; `figures` are (file name, section title, caption); `slowdown` is
    :func:`staleness_runs.slowdown`'s result (its section is left out when None)."""
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
    if slowdown is not None:
        lines += slowdown_table(slowdown)
    lines += ["## Figures", ""]
    for name, title, caption in figures:
        lines += [f"### {title}", "", f"![{title}]({name})", "", caption, ""]
    return "\n".join(lines)

