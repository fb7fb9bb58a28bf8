"""launch/staleness.py on small synthetic run directories: every figure is written, the table's numbers are
the ones constructed, and missing data or a missing run directory is handled."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SPEC = importlib.util.spec_from_file_location("staleness", ROOT / "launch" / "staleness.py")
staleness = importlib.util.module_from_spec(SPEC)
sys.modules["staleness"] = staleness  # dataclasses look the module up while the class is created
SPEC.loader.exec_module(staleness)
import staleness_plots  # noqa: E402  (beside staleness.py, which put launch/ on sys.path)
import staleness_runs  # noqa: E402

pytestmark = pytest.mark.timeout(60)

FIGURES = ["lag_histogram.png", "lag_over_time.png", "return_vs_steps.png", "return_vs_time.png",
           "actor_throughput.png", "sync_delay.png", "offpolicy_health.png", "dropped_episode_bias.png",
           "return_vs_lag.png", "slowdown.png"]
T0 = 1_800_000_000.0
STEPS = 64  # env steps per rollout
DROP_REASONS = ["lag", "stale", "overwritten", "shutdown", "lag"]


def write_run(run_dir: Path, *, n_rollouts: int, correction: str, drops: list[str], syncs: bool,
              lag_hist: bool = True, truncated: bool = True) -> dict[str, float]:
    """Write a run directory with `n_rollouts` consumed rollouts from 2 actors at known lags, a drop line per
    reason in `drops`, sync lines if `syncs`, 4 evaluations, and (if `truncated`) a cut-off last line in
    versions.jsonl. Returns the mean lag and lag-dropped share the report must show."""
    run_dir.mkdir(parents=True)
    config = {"trainer": {"exp_name": "synthetic", "seed": 1, "buffer_type": "fifo", "max_policy_lag": 4,
                          "lag_policy": "drop"},
              "actors": {"num_actors": 2, "sync_every": 1, "weights_delay_s": 0.0},
              "algorithm": {"name": "ppo", "cfg": {"correction": correction}}, "env": {"id": "CartPole-v1"}}
    (run_dir / "config.json").write_text(json.dumps(config))
    versions = [{"event": "publish", "version": 0, "time": T0, "env_steps": 0, "updates": 0}]
    lag_total = samples = 0
    for i in range(n_rollouts):
        low = i % 3  # samples at lags low (40 of them) and low + 1 (24)
        t = T0 + 1 + i
        rollout = {"event": "consume", "time": t, "actor": i % 2, "seq": i // 2, "policy_version": i,
                   "learner_version": i + low + 1, "lag": low + 1, "lag_min": low, "lag_mean": low + 24 / STEPS,
                   "env_steps": STEPS, "episodes": 2, "episode_length_mean": 32.0, "received": t - 0.2,
                   "sent": t - 0.25}
        if lag_hist:
            rollout["lag_hist"] = [[low, 40], [low + 1, 24]]
            lag_total += low * 40 + (low + 1) * 24
        else:  # old runs: the report counts every sample at lag_mean rounded
            lag_total += round(low + 24 / STEPS) * STEPS
        samples += STEPS
        versions.append(rollout)
        versions.append({"event": "publish", "version": i + 1, "time": t + 0.5, "env_steps": (i + 1) * STEPS,
                         "updates": i + 1})
        if syncs:
            for actor in (0, 1):
                delay = 0.01 * (actor + 1)
                versions.append({"event": "sync", "actor": actor, "version": i + 1, "time": t + 0.5 + delay,
                                 "published": t + 0.5, "received": t + 0.505, "delay_s": delay})
    for k, reason in enumerate(drops):
        versions.append({"event": "drop", "reason": reason, "time": T0 + 2 + k, "actor": k % 2, "seq": 100 + k,
                         "policy_version": 0, "learner_version": 5, "lag": 5, "lag_min": 5, "lag_mean": 5.0,
                         "env_steps": STEPS, "episodes": 4, "episode_length_mean": 10.0, "received": T0 + 1.5 + k,
                         "sent": None})
    lines = [json.dumps(v) for v in versions]
    text = "\n".join(lines) + "\n"
    if truncated:
        text += '{"event": "consume", "time": 17'  # what a killed run leaves
    (run_dir / "versions.jsonl").write_text(text)
    metrics = [{"version": i + 1, "updates": i + 1, "env_steps": (i + 1) * STEPS, "time": T0 + 1.6 + i,
                "lag/mean": 1.0, "lag/max": 3, "perf/sps": 100.0} for i in range(n_rollouts)]
    for j in range(4):
        metrics.append({"eval/return_mean": 100.0 * (j + 1), "eval/return_std": 5.0, "env_steps": 200 * (j + 1),
                        "time": T0 + 5 * (j + 1)})
    (run_dir / "metrics.jsonl").write_text("\n".join(json.dumps(m) for m in metrics) + "\n")
    received = n_rollouts + len(drops)
    return {"mean_lag": lag_total / samples,
            "lag_drop_share": sum(r in ("lag", "stale") for r in drops) / received}


def table(report: str) -> dict[str, dict[str, str]]:
    """The report's summary table: run label -> column header -> cell."""
    section = report.split("## Summary")[1].split("\n## ")[0]
    rows = [line for line in section.splitlines() if line.startswith("| ")]
    header = [c.strip() for c in rows[0].strip("|").split("|")]
    return {cells[0]: dict(zip(header, cells)) for cells in
            ([c.strip() for c in row.strip("|").split("|")] for row in rows[1:])}


def assert_figures(out: Path) -> None:
    """Every figure is a PNG in ``out/figures/`` (the layout of docs/results/reports/*/)."""
    for name in FIGURES:
        data = (out / "figures" / name).read_bytes()
        assert data.startswith(b"\x89PNG\r\n\x1a\n"), name
        assert len(data) > 5_000, name


def test_two_runs(tmp_path: Path) -> None:
    expected_a = write_run(tmp_path / "a", n_rollouts=30, correction="none", drops=DROP_REASONS, syncs=True)
    expected_b = write_run(tmp_path / "b", n_rollouts=20, correction="vtrace", drops=[], syncs=False,
                           lag_hist=False, truncated=False)
    runs = [staleness.load_run(tmp_path / "a", "run A"), staleness.load_run(tmp_path / "b", "run B")]
    assert len(runs[0].consumed) == 30  # the truncated line is skipped
    out = tmp_path / "report"
    written = staleness.write_report(runs, out)
    assert sorted(p.name for p in written) == sorted([*FIGURES, "report.json", "report.md"])
    assert written[-1] == out / "report.md" and written[-2] == out / "report.json"
    assert all(p.parent == out / "figures" for p in written[:-2])
    assert_figures(out)

    report = (out / "report.md").read_text()
    rows = table(report)
    assert set(rows) == {"run A", "run B"}
    assert rows["run A"]["mean lag"] == f"{expected_a['mean_lag']:.2f}"
    assert rows["run B"]["mean lag"] == f"{expected_b['mean_lag']:.2f}"
    assert rows["run A"]["dropped (lag)"] == f"{100 * expected_a['lag_drop_share']:.1f}%"
    assert rows["run A"]["overwritten"] == f"{100 / 35:.1f}%"
    assert rows["run B"]["dropped (lag)"] == "0.0%"
    assert rows["run A"]["max lag"] == "3"
    assert rows["run A"]["final return"] == "300.0"  # mean of the last 3 evals: 200, 300, 400
    assert rows["run A"]["sync delay (ms)"] == "15.0"
    assert rows["run A"]["episode length consumed / dropped"] == "32.0 / 10.0"
    assert rows["run B"]["correction"] == "vtrace"
    # every synthetic rollout of run A was acted by two versions (lag_hist has two entries); B has no hist
    assert rows["run A"]["rollouts with >1 version"] == "100.0%"
    assert rows["run B"]["rollouts with >1 version"] == staleness.MISSING
    assert rows["run A"]["weights at"] == "rollout"
    assert "skipped 1 line(s) of versions.jsonl" in report
    assert "no sync events recorded" in report and "nothing dropped" in report
    for name in FIGURES:
        assert f"](figures/{name})" in report


def test_main_single_run_without_syncs_or_drops(tmp_path: Path) -> None:
    run = tmp_path / "quiet"
    write_run(run, n_rollouts=12, correction="is", drops=[], syncs=False)
    assert staleness.main([str(run)]) == 0
    out = run / "staleness_report"
    assert_figures(out)
    report = (out / "report.md").read_text()
    assert "| quiet |" in report
    assert "no sync events recorded" in report and "nothing dropped" in report


def test_metrics_only_run_still_gets_every_figure(tmp_path: Path) -> None:
    run = tmp_path / "old"
    run.mkdir()
    (run / "metrics.jsonl").write_text(json.dumps({"eval/return_mean": 1.0, "env_steps": 10, "time": T0}) + "\n")
    out = tmp_path / "out"
    assert staleness.main([str(run), "--out", str(out), "--labels", "legacy"]) == 0
    assert_figures(out)
    report = (out / "report.md").read_text()
    assert "| legacy |" in report
    assert "versions.jsonl missing" in report and "config.json missing" in report


def test_unusable_run_dir_exits_non_zero(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    missing = tmp_path / "does_not_exist"
    assert staleness.main([str(missing)]) != 0
    assert str(missing) in capsys.readouterr().err
    empty = tmp_path / "empty"
    empty.mkdir()
    assert staleness.main([str(empty)]) != 0
    assert str(empty) in capsys.readouterr().err
    assert not (empty / "staleness_report").exists()
    with pytest.raises(SystemExit):
        staleness.main([str(empty), "--labels", "x,y"])


def test_correction_by_lag_table_and_share_kept(tmp_path: Path) -> None:
    """Several corrections at several sync_every values: a pivot of mean ± std over seeds, and the
    share of none's smallest-lag return each keeps, measured from a random policy's return."""
    runs = []
    returns = {("none", 1, 0): [-150.0, -130.0], ("none", 4, 0): [-400.0, -420.0], ("is", 1, 0): [-140.0, -140.0],
               ("is", 4, 0): [-200.0, -220.0], ("is", 1, 7): [-300.0, -320.0]}
    for (correction, sync, held), values in returns.items():
        for seed, ret in enumerate(values, 1):
            d = tmp_path / f"sync{sync}_delay0_held{held}_{correction}_s{seed}"
            write_run(d, n_rollouts=6, correction=correction, drops=[], syncs=False)
            cfg = json.loads((d / "config.json").read_text())
            cfg["actors"]["sync_every"], cfg["trainer"]["seed"] = sync, seed
            if held:         # a constant lag: versions held back (older runs' configs lack the key)
                cfg["actors"]["weights_lag_versions"] = held
            (d / "config.json").write_text(json.dumps(cfg))
            (d / "summary.json").write_text(json.dumps({"last_eval/return_mean": ret}))
            metrics = [json.loads(line) for line in (d / "metrics.jsonl").read_text().splitlines()]
            metrics = [m for m in metrics if "eval/return_mean" not in m] + [
                {"eval/return_mean": ret, "eval/return_std": 1.0, "env_steps": 800 + k, "time": T0 + 30 + k}
                for k in range(3)]
            (d / "metrics.jsonl").write_text("\n".join(json.dumps(m) for m in metrics) + "\n")
            runs.append(d)
    out = tmp_path / "report"
    assert staleness.main([str(r) for r in runs] + ["--out", str(out), "--random-return", "-1240"]) == 0
    text = (out / "report.md").read_text()
    section = text.split("## Correction × lag")[1].split("## Figures")[0]
    rows = {line.split("|")[1].strip(): [c.strip() for c in line.strip("|").split("|")[1:]]
            for line in section.split("Share of the return kept")[0].splitlines()
            if line.startswith("| ") and "correction" not in line}
    assert "| correction | sync 1 | sync 4 | sync 1, 7 behind |" in section
    assert rows["none"][0].startswith("-140.0 ± 10.0 (2;")
    assert rows["is"][1].startswith("-210.0 ± 10.0 (2;")
    assert rows["is"][2].startswith("-310.0 ± 10.0 (2;") and rows["none"][2] == "—"
    kept = section.split("Share of the return kept")[1]
    # is at sync 4: (-210 + 1240) / (-140 + 1240) = 93.6%; none at sync 4: (-410 + 1240) / 1100 = 75%;
    # is 7 behind: (-310 + 1240) / 1100 = 84.5%
    assert "| is | 100% | 94% | 85% |" in kept and "| none | 100% | 75% | — |" in kept


def test_a_large_sweep_keeps_every_figure_within_the_pixel_cap(tmp_path: Path) -> None:
    """A panel per run (actor throughput) grows with the sweep: 40 runs must still give figures of at
    most MAX_PIXELS, the small figures keep the full DPI."""
    import struct

    runs = []
    for i in range(40):
        d = tmp_path / f"sync1_delay0_none_s{i + 1}"
        write_run(d, n_rollouts=4, correction="none", drops=[], syncs=False, truncated=False)
        runs.append(d)
    out = tmp_path / "report"
    assert staleness.main([str(r) for r in runs] + ["--out", str(out)]) == 0
    sizes = {}
    for name in FIGURES:
        head = (out / "figures" / name).read_bytes()[:24]
        sizes[name] = struct.unpack(">II", head[16:24])   # the PNG IHDR: width, height
        assert sizes[name][0] * sizes[name][1] <= staleness_plots.MAX_PIXELS * 1.01, (name, sizes[name])
    assert sizes["lag_histogram.png"] == (8 * staleness_plots.DPI, 5 * staleness_plots.DPI)   # untouched by the cap
    tw, th = sizes["actor_throughput.png"]
    assert tw * th > 0.9 * staleness_plots.MAX_PIXELS                 # capped, not shrunk further
    assert 1.1 < th / tw < 1.5                                   # 4 columns x 10 rows of 5.5 x 2.8 in panels


def test_return_figures_draw_a_line_per_setting_over_seeds(tmp_path: Path) -> None:
    """Settings run over several seeds: one labelled line per setting at the seeds' mean (x and return),
    a band of ±1 std over seeds, each seed a faint unlabelled line; evaluations past the shortest seed's
    are left out of the mean. Single runs keep a line each."""
    import numpy as np
    runs = []
    for correction, base in (("none", 0.0), ("is", 1000.0)):
        for seed, (offset, evals) in enumerate(((0.0, 4), (20.0, 3)), 1):
            d = tmp_path / f"sync1_delay0_{correction}_s{seed}"
            write_run(d, n_rollouts=4, correction=correction, drops=[], syncs=False, truncated=False)
            metrics = [{"eval/return_mean": base + offset + 10.0 * j, "eval/return_std": 1.0,
                        "env_steps": 100 * (j + 1) + seed, "time": T0 + j} for j in range(evals)]
            (d / "metrics.jsonl").write_text("\n".join(json.dumps(m) for m in metrics) + "\n")
            runs.append(staleness.load_run(d))
    fig = staleness_plots.plot_return_vs_steps(runs, staleness_plots.run_colours(len(runs)))
    ax = fig.axes[0]
    labelled = {line.get_label(): line for line in ax.get_lines() if not line.get_label().startswith("_")}
    assert set(labelled) == {"sync1_delay0_none (n=2)", "sync1_delay0_is (n=2)"}
    assert len(ax.get_lines()) == 6                                   # 2 means + 4 faint seeds
    none = labelled["sync1_delay0_none (n=2)"]
    np.testing.assert_allclose(none.get_ydata(), [10.0, 20.0, 30.0])  # mean of offsets 0 and 20, 3 evals each
    np.testing.assert_allclose(none.get_xdata(), [101.5, 201.5, 301.5])
    assert "over seeds" in ax.get_title()
    single = staleness_plots.plot_return_vs_steps(runs[:1] + runs[2:3], staleness_plots.run_colours(2)).axes[0]
    assert {line.get_label() for line in single.get_lines()} == {"sync1_delay0_none_s1", "sync1_delay0_is_s1"}
    assert "over episodes" in single.get_title()


def write_curve(run_dir: Path, returns: list[float], *, lag: int, seconds_per_version: float = 10.0) -> None:
    """A run with one evaluation per 100 env steps (version j evaluated at 100 j steps, published at
    `seconds_per_version` j seconds; each evaluation line is written 3 s after its version's publication)
    and every sample at policy lag `lag`."""
    run_dir.mkdir(parents=True)
    config = {"trainer": {"seed": 1, "buffer_type": "vla"}, "actors": {"sync_every": 1},
              "algorithm": {"name": "ppo", "cfg": {"correction": "none"}}}
    (run_dir / "config.json").write_text(json.dumps(config))
    versions = [{"event": "publish", "version": j, "time": T0 + seconds_per_version * j, "env_steps": 100 * j}
                for j in range(len(returns) + 1)]
    versions.append({"event": "consume", "time": T0 + 1, "actor": 0, "seq": 0, "policy_version": 0,
                     "learner_version": lag, "lag": lag, "lag_hist": [[lag, 64]], "env_steps": 64})
    (run_dir / "versions.jsonl").write_text("\n".join(json.dumps(v) for v in versions) + "\n")
    evals = [{"eval/return_mean": r, "eval/return_std": 1.0, "env_steps": 100 * j, "version": j,
              "time": T0 + seconds_per_version * j + 3.0} for j, r in enumerate(returns, 1)]
    (run_dir / "metrics.jsonl").write_text("\n".join(json.dumps(e) for e in evals) + "\n")


# Final returns (mean of the last 3 evaluations): lag1 seeds 1000 and 1000, so the thresholds are 500 and 800.
CURVES = {"lag1_s1": ([200, 600, 1000, 1000, 1000], 1, 10.0),   # 500 at 175 steps (3/4 of 200 -> 600), 800 at 250
          "lag1_s2": ([400, 800, 1000, 1000, 1000], 1, 10.0),   # 500 at 125, 800 at 200 (reached exactly there)
          "lag8_s1": ([100, 300, 700, 900, 900], 8, 20.0),      # 500 at 250 steps, 50 s; 800 at 350 steps, 70 s
          "lag8_s2": ([100, 200, 400, 600, 700], 8, 10.0),      # 500 at 350 steps, 35 s; 800 never
          "lag32_s1": ([50, 100, 200, 300, 400], 32, 10.0)}     # never reaches either


def test_first_crossing_interpolates_between_evaluations() -> None:
    from staleness_runs import EvalPoint, first_crossing
    points = [EvalPoint(100, 10.0, 200.0), EvalPoint(200, 30.0, 600.0), EvalPoint(300, None, 1000.0)]
    assert first_crossing(points, 500.0) == staleness_runs.Crossing(175.0, 25.0)   # 3/4 of the way
    assert first_crossing(points, 600.0) == staleness_runs.Crossing(200.0, 30.0)   # exactly at an evaluation
    assert first_crossing(points, 100.0) == staleness_runs.Crossing(100.0, 10.0)   # the first one already does
    assert first_crossing(points, 800.0) == staleness_runs.Crossing(250.0, None)   # no wall time on one side
    assert first_crossing(points, 1000.5) is None


def test_slowdown_against_a_by_hand_example(tmp_path: Path) -> None:
    """Steps and wall time to 50% and 80% of the lag-1 group's final return, per seed and per group,
    interpolated between evaluations; a run that never gets there is "not reached"."""
    for label, (returns, lag, seconds) in CURVES.items():
        write_curve(tmp_path / label, returns, lag=lag, seconds_per_version=seconds)
    runs = [staleness.load_run(tmp_path / label) for label in CURVES]
    result = staleness_runs.slowdown(runs)
    assert result["reference"] == "lag1" and result["reference_final_return"] == pytest.approx(1000.0)
    assert result["thresholds"] == {"0.5": pytest.approx(500.0), "0.8": pytest.approx(800.0)}
    groups = {g["label"]: g for g in result["groups"]}
    assert [r["reached"]["0.5"]["env_steps"] for r in groups["lag1"]["runs"]] == pytest.approx([175.0, 125.0])
    assert groups["lag1"]["wall_s"]["0.8"]["mean"] == pytest.approx(22.5)       # publication times, not the eval lines'
    lag8 = groups["lag8"]
    assert lag8["runs"][1]["reached"]["0.8"] is None
    steps50, steps80 = lag8["env_steps"]["0.5"], lag8["env_steps"]["0.8"]
    assert (steps50["mean"], steps50["min"], steps50["max"]) == pytest.approx((300.0, 250.0, 350.0))
    assert steps50["ratio"]["mean"] == pytest.approx(2.0)                          # 250/150 and 350/150
    assert (steps50["ratio"]["min"], steps50["ratio"]["max"]) == pytest.approx((250 / 150, 350 / 150))
    assert (steps80["reached"], steps80["runs"]) == (1, 2) and steps80["ratio"]["mean"] == pytest.approx(350 / 225)
    assert lag8["wall_s"]["0.5"]["ratio"]["mean"] == pytest.approx((50 / 15 + 35 / 15) / 2)
    assert groups["lag32"]["env_steps"]["0.5"] == {"runs": 1, "reached": 0}

    out = tmp_path / "report"
    assert staleness.main([str(tmp_path / label) for label in CURVES] + ["--out", str(out)]) == 0
    section = (out / "report.md").read_text().split("## Slowdown")[1].split("\n## ")[0]
    assert "linear interpolation" in section
    assert ("| lag8 | none | 2 | 8.00 | 300 (250–350) | 2.00× (1.67–2.33) | 350, 1/2 reached | 1.56×, 1/2 |"
            in section)
    assert "| lag32 | none | 1 | 32.0 | not reached | not reached | not reached | not reached |" in section
    # wall time: the reference's seeds reach 50% at 17.5 and 12.5 s, 80% at 25 and 20 s
    assert ("| lag1 | none | 2 | 1.00 | 15.0 (12.5–17.5) | 1.00× (0.83–1.17) | "
            "22.5 (20.0–25.0) | 1.00× (0.89–1.11) |" in section)
    data = json.loads((out / "report.json").read_text())
    assert [r["label"] for r in data["runs"]] == list(CURVES) and data["runs"][2]["mean_lag"] == 8.0
    assert data["runs"][0]["final_return"] == pytest.approx(1000.0) and data["runs"][0]["drift_ratio_median"] is None
    saved = data["slowdown"]
    assert saved["groups"][1]["env_steps"]["0.5"]["ratio"]["mean"] == pytest.approx(2.0)
    assert saved["groups"][1]["runs"][1]["reached"]["0.8"] is None


def test_slowdown_reference_and_random_return(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    for label in ("lag1_s1", "lag8_s1"):
        returns, lag, seconds = CURVES[label]
        write_curve(tmp_path / label, returns, lag=lag, seconds_per_version=seconds)
    runs = [staleness.load_run(tmp_path / label) for label in ("lag1_s1", "lag8_s1")]
    # returns measured from a random policy's -1000: thresholds -1000 + f (1000 + 1000)
    result = staleness_runs.slowdown(runs, reference="lag8_s1", random_return=-1000.0)
    assert result["reference"] == "lag8"
    assert result["thresholds"]["0.5"] == pytest.approx(-1000 + 0.5 * (2500 / 3 + 1000))   # lag8_s1's final: 2500/3
    assert staleness.main([str(tmp_path / "lag1_s1"), "--reference", "nope", "--out", str(tmp_path / "o")]) == 2
    assert "nope" in capsys.readouterr().err and not (tmp_path / "o").exists()


def test_env_step_ticks_read_as_thousands_and_millions() -> None:
    fmt = staleness_plots._steps_label
    assert [fmt(x) for x in (0, 500, 25_000, 200_000, 1_500_000)] == ["0", "500", "25k", "200k", "1.5M"]
