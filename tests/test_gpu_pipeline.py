"""benchmarks/gpu_pipeline.py runs end to end on the CPU in small settings (its figures only mean
something on a GPU): every part writes its rows, with ratios against its own baseline."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

import gpu_pipeline  # noqa: E402

SMALL = ["--device", "cpu", "--minibatches", "128,512", "--envs", "32", "--steps", "16", "--epochs", "2",
         "--hidden", "32", "--repeats", "1"]


def test_update_part_times_every_mode_against_the_floor(tmp_path):
    out = tmp_path / "gp.json"
    assert gpu_pipeline.main(SMALL + ["--modes", "off,graph", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["device"] == "cpu" and "pipeline" not in result
    assert [r["minibatch"] for r in result["update"]] == [128, 512]
    for row in result["update"]:
        assert row["samples"] == 512 and row["steps_per_update"] == 2 * (512 // row["minibatch"])
        assert "floor_graph_ms" not in row                      # no CUDA graph on the CPU
        for mode in ("off", "graph"):
            assert row[f"{mode}_ms"] > 0
            assert row[f"{mode}_over_floor"] == pytest.approx(row[f"{mode}_ms"] / row["floor_eager_ms"])


@pytest.mark.slow
def test_pipeline_part_compares_the_launcher_with_the_serial_runner(tmp_path):
    out = tmp_path / "gp.json"
    # one actor of 32 envs (the default is two of 16): 512 samples an update all the same, and each of
    # the three launcher runs starts one process less
    args = SMALL + ["--minibatches", "256", "--modes", "off", "--pipeline", "--total-steps", "4096", "--actors", "1",
                    "--timeout", "120", "--out", str(out)]
    assert gpu_pipeline.main(args) == 0
    (row,) = json.loads(out.read_text())["pipeline"]
    assert row["mode"] == "off" and row["serial"]["env_steps"] >= 4096
    serial = row["serial"]                  # collection and update timed apart: the uncontended bound
    assert serial["bound_sps"] == pytest.approx(512 / max(serial["collect_s_per_update"], serial["update_s_per_update"]))
    assert 0 < serial["collect_s_per_update"] and 0 < serial["update_s_per_update"]
    for buffer_type in ("standard", "vla", "vla_ring"):
        assert row[buffer_type]["env_steps"] >= 4096 and row[buffer_type]["stop_notes"] == []
        assert row[f"{buffer_type}_over_serial"] == pytest.approx(row[buffer_type]["sps"] / row["serial"]["sps"])
        r = row[buffer_type]    # the steady window leaves the first update out (a run may train one rollout more)
        assert r["updates_timed"] in (4096 // 512 - 1, 4096 // 512)
        assert r["bound_sps"] == pytest.approx(512 / max(r["collect_s_per_update"], r["update_s_per_update"]))
        assert r["overlap"] == pytest.approx(r["sps"] / r["bound_sps"])
        assert r["overlap_uncontended"] == pytest.approx(r["sps"] / serial["bound_sps"])
