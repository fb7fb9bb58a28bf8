"""shared/run_dir.py, the one reader of run directories: every file it reads, a killed run's partial
last line skipped, anything else malformed an error naming the file (and line), and arbitrary bytes
never a crash of another kind."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from learner.logs import JsonlWriter, RunLogger
from shared.run_dir import RunDir, RunDirError, read_json_object, read_jsonl, setting

pytestmark = pytest.mark.timeout(60)


def test_a_written_run_reads_back(tmp_path):
    """What the learner's writers leave, read back: rows in order, NaN kept, events filtered, ranks apart."""
    logger = RunLogger(tmp_path, use_tensorboard=False)
    logger.versions.write(event="publish", version=0, time=1.0)
    logger.versions.write(event="consume", actor=0, lag=1, time=2.0)
    logger.versions.write(event="drop", actor=1, reason="lag", time=3.0)
    logger.scalars(64, {"loss/policy": 0.5, "eval/return_mean": math.nan}, version=1)
    logger.close()
    rank1 = RunLogger(tmp_path, use_tensorboard=False, suffix=".rank1")
    rank1.versions.write(event="consume", actor=2, lag=0, time=2.5)
    rank1.close()
    run = RunDir(tmp_path)
    assert [v["event"] for v in run.versions()] == ["publish", "consume", "drop"]
    assert [v["actor"] for v in run.versions("consume")] == [0]
    assert [v["event"] for v in run.versions(("consume", "drop"))] == ["consume", "drop"]
    assert [v["actor"] for v in run.versions("consume", rank=1)] == [2]
    [row] = run.metrics()
    assert row["loss/policy"] == 0.5 and math.isnan(row["eval/return_mean"]) and row["env_steps"] == 64
    assert run.skipped == {"versions.jsonl": [], "versions.rank1.jsonl": [], "metrics.jsonl": []}


def test_summary_config_and_settings(tmp_path):
    run = RunDir(tmp_path)
    assert run.summary() is None                       # a run that has not finished
    with pytest.raises(RunDirError, match=r"config.json: not found"):
        run.config()
    (tmp_path / "summary.json").write_text(json.dumps({"env_steps": 10, "wall_s": 1.5}))
    (tmp_path / "config.json").write_text(json.dumps({"actors": {"sync_every": 4, "weights_at": None}}))
    assert run.summary() == {"env_steps": 10, "wall_s": 1.5}
    assert run.config() == {"actors": {"sync_every": 4, "weights_at": None}}
    assert run.setting("actors", "sync_every") == 4
    assert run.setting("actors", "weights_at", default="rollout") == "rollout"   # null reads as missing
    assert run.setting("trainer", "seed", default=1) == 1
    assert setting({"a": 3}, "a", "b", default="x") == "x"                      # a leaf is not a block
    for text, why in (("[1, 2]", "not a JSON object"), ('{"a": ', "not JSON"), (b"\xff\xfe", "not JSON")):
        path = tmp_path / "summary.json"
        path.write_bytes(text if isinstance(text, bytes) else text.encode())
        with pytest.raises(RunDirError, match=rf"summary.json: {why}"):
            run.summary()


def test_missing_directory_and_files_name_the_path(tmp_path):
    with pytest.raises(RunDirError, match=r"nowhere: no such run directory"):
        RunDir(tmp_path / "nowhere")
    run = RunDir(tmp_path)
    with pytest.raises(RunDirError, match=r"metrics.jsonl: not found"):
        run.metrics()
    assert run.metrics(missing_ok=True) == [] and run.versions("consume", missing_ok=True) == []
    with pytest.raises(RunDirError, match=r"record/index.jsonl: no record \(was the run started with --record\?\)"):
        run.record_index()
    assert run.record_threads() == {} and run.checkpoints() == []


def test_a_killed_runs_partial_last_line_is_skipped_and_other_bad_lines_raise(tmp_path):
    path = tmp_path / "metrics.jsonl"
    good = '{"a": 1}\n\n{"a": 2}\n'
    path.write_text(good + '{"a": 3, "b"')                   # cut off mid-line: no newline
    skipped: list[int] = []
    assert read_jsonl(path, skipped=skipped) == [{"a": 1}, {"a": 2}] and skipped == [4]
    run = RunDir(tmp_path)
    assert len(run.metrics()) == 2 and run.skipped["metrics.jsonl"] == [4]
    path.write_text(good + '{"a": 3, "b"\n')                  # a whole line, bad: not a partial write
    with pytest.raises(RunDirError, match=r"metrics.jsonl:4: not JSON"):
        run.metrics()
    path.write_text('{"a": 1}\n[1, 2]\n{"a": 2}\n')
    with pytest.raises(RunDirError, match=r"metrics.jsonl:2: not a JSON object \(a list\)"):
        run.metrics()
    path.write_bytes(b'{"a": 1}\n{"a": "\xff"}\n')
    with pytest.raises(RunDirError, match=r"metrics.jsonl:2: not UTF-8"):
        run.metrics()
    path.write_text('{"a": 1}\nnot json\n{"a": 2}\n{"a"')    # a report over many runs reads leniently
    assert run.metrics(lenient=True) == [{"a": 1}, {"a": 2}] and run.skipped["metrics.jsonl"] == [2, 4]


def test_a_partial_line_left_by_the_writer_is_the_only_one_skipped(tmp_path):
    """What JsonlWriter leaves when the process dies inside a write: every line before it intact."""
    writer = JsonlWriter(tmp_path / "versions.jsonl")
    for i in range(5):
        writer.write(event="publish", version=i)
    writer.close()
    data = (tmp_path / "versions.jsonl").read_bytes()
    (tmp_path / "versions.jsonl").write_bytes(data[:-1])     # only the newline lost: the line is whole
    assert len(RunDir(tmp_path).versions()) == 5
    for cut in range(len(data) - 2, len(data) - 20, -1):
        (tmp_path / "versions.jsonl").write_bytes(data[:cut])
        rows = RunDir(tmp_path).versions("publish")
        assert [r["version"] for r in rows] == [0, 1, 2, 3]


def test_record_index_and_threads_are_checked(tmp_path):
    record = tmp_path / "record"
    record.mkdir()
    entry = {"update": 1, "version": 0, "dir": "update_0000001", "reward_std": None,
             "rollouts": [{"actor": 0, "seq": 0, "policy_version": 0, "policy_version_max": 0, "env_steps": 8}]}
    (record / "index.jsonl").write_text(json.dumps(entry) + "\n" + json.dumps({**entry, "update": 2})[:30])
    assert RunDir(tmp_path).record_index() == [entry]
    (record / "index.jsonl").write_text(json.dumps({**entry, "version": "0"}) + "\n")
    with pytest.raises(RunDirError, match=r"index.jsonl:1: not \{update: int, version: int"):
        RunDir(tmp_path).record_index()
    (record / "threads.jsonl").write_text('{"update": 1, "threads": [[2, 3], [1, 2]]}\n\n'
                                          '{"update": 2, "threads": [[1, 0]]}\n')
    with pytest.raises(RunDirError, match=r"threads.jsonl:3: not \{update: int, threads"):
        RunDir(tmp_path).record_threads()


def test_checkpoints_oldest_first(tmp_path):
    ckpt = tmp_path / "checkpoints"
    ckpt.mkdir()
    for name in ("ckpt_100.pt", "ckpt_20.pt", "best.pt", "ckpt_3.pt.tmp", "ckpt_1000.pt"):
        (ckpt / name).write_bytes(b"")
    assert [p.name for p in RunDir(tmp_path).checkpoints()] == ["ckpt_20.pt", "ckpt_100.pt", "ckpt_1000.pt"]


def test_a_directory_in_place_of_a_file_is_a_clear_error(tmp_path):
    (tmp_path / "summary.json").mkdir()
    with pytest.raises(RunDirError, match=r"summary.json: cannot read"):
        read_json_object(tmp_path / "summary.json")


LINES = st.one_of(st.binary(max_size=40),
                  st.sampled_from([b'{"a": 1}', b"[1]", b"3", b"null", b'{"a": NaN}', b"{", b'"s"', b"\xff",
                                   b"[" * 3000, b"1" * 5000, b'{"a": "\xc3\xa9"}', b"\r", b"   "]))


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(lines=st.lists(LINES, max_size=8), newline_at_end=st.booleans())
def test_arbitrary_bytes_give_rows_a_skipped_last_line_or_a_clear_error(tmp_path, lines, newline_at_end):
    """Whatever the bytes: a list of JSON objects, or RunDirError naming file:line, and skipped lines
    only ever the partial last one (strict) or the bad ones (lenient)."""
    data = b"\n".join(lines) + (b"\n" if newline_at_end and lines else b"")
    path = tmp_path / "metrics.jsonl"
    path.write_bytes(data)
    pieces = data.split(b"\n")
    for lenient in (False, True):
        skipped: list[int] = []
        try:
            rows = read_jsonl(path, lenient=lenient, skipped=skipped)
        except RunDirError as e:
            assert not lenient
            line = int(str(e).split("metrics.jsonl:")[1].split(":")[0])
            assert str(path) in str(e) and 1 <= line < len(pieces)
            continue
        assert all(isinstance(r, dict) for r in rows)
        assert len(rows) + len(skipped) == sum(1 for p in pieces if p.strip())
        if not lenient:
            assert skipped in ([], [len(pieces)])


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.binary(max_size=60))
def test_arbitrary_bytes_in_a_json_file_give_an_object_or_a_clear_error(tmp_path, data):
    (tmp_path / "config.json").write_bytes(data)
    try:
        assert isinstance(RunDir(tmp_path).config(), dict)
    except RunDirError as e:
        assert str(tmp_path / "config.json") in str(e)


def test_only_files_under_the_run_directory_are_read(tmp_path: Path):
    """RunDir reads nothing at construction: a live run's files are read when asked, each time anew."""
    run = RunDir(tmp_path)
    (tmp_path / "metrics.jsonl").write_text('{"a": 1}\n')
    assert run.metrics() == [{"a": 1}]
    with open(tmp_path / "metrics.jsonl", "a") as f:
        f.write('{"a": 2}\n')
    assert run.metrics() == [{"a": 1}, {"a": 2}]
