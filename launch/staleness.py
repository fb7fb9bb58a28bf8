"""Staleness report for Tandem runs: how old the data was that the learner trained on, and what it cost.

Usage::

    python launch/staleness.py RUN_DIR [RUN_DIR ...] [--out DIR] [--labels L1,L2,...] [--reference LABEL]
        [--random-return R]

Reads each run directory's ``config.json``, ``versions.jsonl``, ``metrics.jsonl`` and (optional)
``summary.json`` (through ``shared/run_dir.py``) and writes ``report.md`` and ``report.json`` into
``--out``, with the PNG figures below in its ``figures/`` subfolder (default ``--out``:
``RUN_DIR/staleness_report`` for one run, ``./staleness_report`` for several). A run's label is its
directory name unless ``--labels`` gives one per run. Missing files or events give a note in the report
and on the figure, never an error; a line that is not a JSON object (the truncated last line of a killed
run, or a damaged line anywhere) is skipped, and the note names it. The exit status is 2, with the
reason on stderr, when a RUN_DIR does not exist or has neither ``versions.jsonl`` nor ``metrics.jsonl``,
or when ``--reference`` names no run group.

Policy lag is the learner's version when it used a sample minus the policy version that produced it.
Times are wall-clock seconds since the run started (its first ``versions.jsonl`` line, the publication of
version 0). Each run keeps one colour in every figure except ``return_vs_lag.png``, coloured by correction.

Slowdown: for every run group (the seeds of one setting), the env steps and the wall time each run takes
to reach 50% and 80% of the reference group's final return (``--reference``, default the group with the
smallest mean lag; with ``--random-return``, 50% and 80% of the way from a random policy's return to it),
and the ratio to the reference's mean with its spread over seeds, or "not reached". A threshold crossed
between two evaluations is linearly interpolated between them (``staleness_runs.first_crossing``); wall
time runs to the publication of the evaluated version. ``report.json`` holds it all per run and per group.

The code: ``staleness_runs.py`` reads the runs and derives the statistics, ``staleness_plots.py`` draws
the figures, ``staleness_markdown.py`` writes the text; this file writes the report and is the command.

Figures (``figures/<name>``):

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
  |log pi_k/mu|, KL(mu || pi_k) at the update's start and the KL the update moved, and the drift ratio
  (KL(mu || pi_k) over the per-update KLs summed between the two versions: about the lag for a
  consistent drift, about 1 for random moves; ``learner/drift.py``) with its terms, against env steps.
- ``dropped_episode_bias.png``: mean episode length of the episodes that ended in consumed vs dropped
  rollouts, to show whether dropping favours short or long episodes.
- ``return_vs_lag.png``: final return (mean of the last 3 evaluations) against the sample-weighted mean lag,
  one marker per run, coloured by the off-policy correction; runs of one correction are joined in lag order.
- ``slowdown.png``: the slowdown's ratios to the reference, in env steps and in wall time, a bar per
  threshold and group (min–max over seeds), "not reached" where no seed got there.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import Counter
from collections.abc import Sequence
from pathlib import Path

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:   # the parts beside this file, also when it is loaded by path (tests, benchmarks)
    sys.path.insert(0, str(HERE))

import matplotlib.pyplot as plt  # noqa: E402

from staleness_markdown import MISSING, markdown  # noqa: E402  (MISSING: the report's empty cell)
from staleness_plots import FIGURES, figure_dpi, plot_slowdown, run_colours  # noqa: E402
from staleness_runs import Run, RunDirError, UnknownReference, load_run, slowdown  # noqa: E402

__all__ = ["FIGURES", "FIGURES_DIR", "MISSING", "Run", "RunDirError", "load_run", "main", "report_data",
           "write_report"]

FIGURES_DIR = "figures"   # report.md's PNGs, beside it


def report_data(runs: Sequence[Run], slowdown_result: dict) -> dict:
    """``report.json``: per run its label, directory, correction, env steps, updates, wall seconds, mean
    and largest lag, final return and the median over its updates of the drift ratio and of the value a
    consistent drift would give (null where not logged), and the slowdown (:func:`staleness_runs.slowdown`'s
    result)."""
    return {"runs": [{"label": r.label, "path": str(r.path), "correction": r.correction, "env_steps": r.env_steps,
                      "updates": r.updates, "wall_s": r.wall_s, "mean_lag": r.mean_lag, "max_lag": r.max_lag,
                      "final_return": r.final_return,
                      "drift_ratio_median": r.median("offpolicy/drift_ratio"),
                      "drift_ratio_consistent_median": r.median("offpolicy/drift_ratio_consistent")}
                     for r in runs],
            "slowdown": slowdown_result}


def write_report(runs: Sequence[Run], out_dir: str | Path, random_return: float | None = None,
                 reference: str | None = None) -> list[Path]:
    """Write ``report.md`` and ``report.json`` for `runs` into `out_dir` and every figure into
    ``out_dir/figures/`` (both created if needed); report.md links ``figures/<name>``, as the reports
    under docs/results/reports/ do. `reference` names the run group the slowdown is measured against
    (default: the one with the smallest mean lag); `random_return`: see ``--random-return``.

    Returns the paths written, figures first, then ``report.json`` and ``report.md`` last. Raises
    UnknownReference (a ValueError), before writing anything, when `reference` names no run group.
    """
    out_dir = Path(out_dir)
    slowdown_result = slowdown(runs, reference, random_return)
    (out_dir / FIGURES_DIR).mkdir(parents=True, exist_ok=True)
    colours = run_colours(len(runs))
    written = []
    for name, _, plot, _ in FIGURES:
        # the slowdown figure draws the report's own result (its reference and random return)
        fig = plot_slowdown(runs, colours, slowdown_result) if plot is plot_slowdown else plot(runs, colours)
        fig.tight_layout()
        fig.savefig(out_dir / FIGURES_DIR / name, dpi=figure_dpi(fig))
        plt.close(fig)
        written.append(out_dir / FIGURES_DIR / name)
    data = out_dir / "report.json"
    data.write_text(json.dumps(report_data(runs, slowdown_result), indent=1) + "\n")
    written.append(data)
    report = out_dir / "report.md"
    figures = [(f"{FIGURES_DIR}/{name}", title, caption) for name, title, _, caption in FIGURES]
    report.write_text(markdown(runs, figures, random_return, slowdown_result))
    written.append(report)
    return written


def _default_labels(paths: Sequence[Path]) -> list[str]:
    """Run directory names, with the parent's name prefixed where two runs share a name."""
    names = [p.resolve().name for p in paths]
    counts = Counter(names)
    return [f"{p.resolve().parent.name}/{n}" if counts[n] > 1 else n for p, n in zip(paths, names)]


def main(argv: Sequence[str] | None = None) -> int:
    """Command line entry point; returns the exit status (2 when a run directory is unusable or
    ``--reference`` names no run group)."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("run_dirs", nargs="+", type=Path, metavar="RUN_DIR", help="Tandem run directories")
    parser.add_argument("--out", type=Path, default=None,
                        help="output directory (default: RUN_DIR/staleness_report for one run, else "
                             "./staleness_report)")
    parser.add_argument("--labels", default=None, help="comma-separated labels, one per RUN_DIR")
    parser.add_argument("--random-return", type=float, default=None,
                        help="a random policy's return on the task: the correction x lag table then gives the "
                             "return kept as (R - this) / (R_ref - this), and the slowdown thresholds are R_random + "
                             "f (R_ref - R_random) (e.g. Pendulum-v1, whose returns are negative)")
    parser.add_argument("--reference", default=None, metavar="LABEL",
                        help="the run group the slowdown is measured against: its label (a run's label without "
                             "its _sN seed suffix) or one of its runs' labels (default: the group with the "
                             "smallest mean lag)")
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
    try:
        written = write_report(runs, out, args.random_return, args.reference)
    except UnknownReference as e:
        print(f"staleness.py: error: {e}", file=sys.stderr)
        return 2
    print(f"wrote {len(written)} files to {out}/ (see {written[-1].name})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
