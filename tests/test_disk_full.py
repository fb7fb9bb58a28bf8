"""A full disk (or any I/O error on the run directory) ends a run cleanly: every writer hands its error
to learner.disk.DISK instead of raising it into the thread that wrote; the run stops with exit 1 and
one line naming the file and the last intact checkpoint; no rollout is counted as rejected; no temp
file is left; --resume goes on once space is freed.

The unit tests inject an OSError into each writer in turn. The integration tests put the run directory
on a tiny tmpfs (root only; skipped, saying why, where it cannot be mounted)."""

from __future__ import annotations

import errno
import json
import os
import shutil
import subprocess
import time
from pathlib import Path

import pytest

from learner.disk import DISK

ROOT = Path(__file__).resolve().parents[1]
ENOSPC = OSError(errno.ENOSPC, "No space left on device")


@pytest.fixture(autouse=True)
def _fresh_latch():
    DISK.reset()
    yield
    DISK.reset()


def _serial(tmp_path, steps=2048):
    from runners.serial import SerialRunner
    from tests.test_learner_component import small_config
    cfg = small_config(total_steps=steps, save_freq=256)
    cfg.actors.num_actors = 2
    return SerialRunner(cfg, tmp_path, evaluate_every=0)


def _inject(monkeypatch, writer: str, run_dir: Path) -> None:
    """Make `writer` fail with ENOSPC from its first write on."""
    import learner.checkpoint as checkpoint
    import learner.logs as logs
    if writer in ("versions.jsonl", "metrics.jsonl"):
        real = logs.JsonlWriter.write

        def write(self, **record):
            if self.path.name == writer:
                self._f.write = lambda *_: (_ for _ in ()).throw(ENOSPC)   # the file's own write fails
            return real(self, **record)
        monkeypatch.setattr(logs.JsonlWriter, "write", write)
    elif writer == "tensorboard":
        from torch.utils.tensorboard import SummaryWriter
        monkeypatch.setattr(SummaryWriter, "add_scalar", lambda *a, **k: (_ for _ in ()).throw(ENOSPC))
    elif writer == "checkpoint":
        real_save = checkpoint.torch.save

        def save(obj, f, *a, **k):
            f.write(b"partial")
            raise ENOSPC
        monkeypatch.setattr(checkpoint.torch, "save", save)
        assert real_save is not None
    elif writer == "summary":
        import learner.process as process

        def write_json_atomic(path, data, indent=None):
            Path(str(path) + ".tmp").write_text("{")
            raise OSError(errno.ENOSPC, "No space left on device", str(path))
        monkeypatch.setattr(process, "write_json_atomic", write_json_atomic)
    else:
        raise AssertionError(writer)


@pytest.mark.parametrize("writer", ["versions.jsonl", "metrics.jsonl", "tensorboard", "checkpoint"])
def test_a_failing_writer_stops_the_serial_run_with_one_line_and_no_rejection(tmp_path, monkeypatch, writer):
    from learner.disk import RunDirWriteError
    runner = _serial(tmp_path)
    _inject(monkeypatch, writer, tmp_path)
    with pytest.raises(RunDirWriteError, match=r"cannot write .*No space left on device") as caught:
        runner.run(log_interval_s=1e9)
    assert DISK.failed and ("checkpoint" in str(caught.value))
    expected = {"versions.jsonl": "versions.jsonl", "metrics.jsonl": "metrics.jsonl",
                "tensorboard": "events.out.tfevents", "checkpoint": "ckpt_"}[writer]
    assert expected in str(DISK.path)
    assert runner.learner.counts["rejected"] == 0 and runner.learner.counts["malformed"] == 0
    assert not list(tmp_path.rglob("*.tmp"))
    assert runner.learner.env_steps < 2048               # it stopped at the failure, not at the budget


def test_a_failing_summary_write_leaves_no_temp_file_and_exits_1(tmp_path, monkeypatch):
    """The learner process's last write: summary.json through a temp file."""
    import learner.process as process
    _inject(monkeypatch, "summary", tmp_path)

    class Run:      # the parts of LearnerRun._write_summary uses
        receiver_died, threads, reason, ranks, main, run_dir = None, 1, [], None, True, tmp_path
    learner = _serial(tmp_path).learner
    Run.learner = learner
    assert process.LearnerRun._write_summary(Run(), 0) == 1
    assert not list(tmp_path.glob("summary.json*")) and DISK.failed and DISK.path.name == "summary.json"


# ---------------------------------------------------------------------------------------- tmpfs runs

def _mount_tiny(path: Path, size: str) -> None:
    path.mkdir(parents=True, exist_ok=True)
    if os.geteuid() != 0 or shutil.which("mount") is None:
        pytest.skip("needs root to mount a small tmpfs for the run directory")
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)], capture_output=True, text=True)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {r.stderr.strip()}")


@pytest.fixture
def tiny_fs(tmp_path):
    mounts = []

    def mount(size: str) -> Path:
        where = tmp_path / f"fs{len(mounts)}"
        _mount_tiny(where, size)
        mounts.append(where)
        return where
    yield mount
    for where in mounts:
        subprocess.run(["umount", "-l", str(where)], capture_output=True)


def _check_ended_cleanly(run, out: str, run_dir: Path) -> None:
    assert "No space left on device" in out, out
    assert "stopping: cannot write" in out or "cannot write the run directory" in out, out
    assert "rejected message" not in out and "OSError while ingesting" not in out, out
    run.assert_all_gone(run_dir)
    assert not list(run_dir.rglob("*.tmp")), sorted(map(str, run_dir.rglob("*")))


@pytest.mark.slow
@pytest.mark.parametrize("attempt", [1])
def test_a_run_on_a_disk_full_from_the_start_ends_by_itself(tmp_path, tiny_fs, attempt):
    from tests.test_integration import launch
    fs = tiny_fs("200k")
    run_dir = fs / "run"
    run = launch(tmp_path, run_dir, "--no-eval", "--actors", "1", "--steps", "200000", "--set", "trainer.save_freq=2000",
                 name=f"full{attempt}")
    try:
        rc = run.wait(90)
        out = run.output()
        assert rc not in (None, 0), out
        _check_ended_cleanly(run, out, run_dir)
    finally:
        run.stop()


@pytest.mark.slow
@pytest.mark.parametrize("attempt", [1])
def test_a_disk_filled_mid_run_ends_it_within_60_s_and_resume_goes_on_once_space_is_freed(tmp_path, tiny_fs, attempt):
    from tests.test_integration import finish, launch
    fs = tiny_fs("8m")
    run_dir = fs / "run"
    args = ("--no-eval", "--actors", "1", "--set", "trainer.save_freq=2000", "--set", "trainer.eval_freq=0")
    run = launch(tmp_path, run_dir, *args, "--steps", "400000", name=f"mid{attempt}")
    filler = fs / "filler"
    try:
        assert run.wait(120, until=lambda: len(list((run_dir / "checkpoints").glob("ckpt_*.pt.sha256"))) >= 2) is None, \
            run.output()
        with open(filler, "wb") as f:                    # fill the disk: ENOSPC ends the write
            try:
                while True:
                    f.write(b"\0" * (1 << 16))
            except OSError:
                pass
        filled = time.time()
        rc = run.wait(60)
        out = run.output()
        assert rc not in (None, 0), f"still running {time.time() - filled:.0f} s after the disk filled:\n{out}"
        _check_ended_cleanly(run, out, run_dir)
    finally:
        run.stop()
    filler.unlink()
    from learner.checkpoint import load_newest_intact
    _, last, _ = load_newest_intact(run_dir / "checkpoints")
    resumed = launch(tmp_path, run_dir, *args, "--resume", "--steps", str(last["env_steps"] + 2048),
                     name=f"resume{attempt}")
    out = finish(resumed, run_dir)
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["resumed_from"] and summary["exit_code"] == 0, out


def test_a_final_checkpoint_that_cannot_be_written_makes_the_run_fail(tmp_path, monkeypatch, capsys):
    """The disk fills at the very end: the final checkpoint fails while the summary would still fit.
    The run must not end 0 as if that checkpoint existed."""
    import learner.process as process
    learner = _serial(tmp_path).learner

    class Run:      # the parts LearnerRun._save_final uses
        pass
    run = Run()
    run.learner = learner
    _inject(monkeypatch, "checkpoint", tmp_path)
    assert process.LearnerRun._save_final(run, 0) == 1
    assert "stopping: cannot write" in capsys.readouterr().out and not list(tmp_path.rglob("*.tmp"))
    assert process.LearnerRun._save_final(run, 1) is None      # after a failure no final checkpoint is tried


def test_a_record_that_would_not_fit_is_a_disk_failure_not_a_bus_error(tmp_path, monkeypatch):
    """--record memory-maps each batch; writing a mapping past a full disk is SIGBUS, so the room is
    checked first and a lack of it reported like any other full disk."""
    import shutil as shutil_module
    import torch
    from tensordict import TensorDict
    from learner.record import BatchRecorder
    rec = BatchRecorder(tmp_path / "record")
    usage = shutil_module.disk_usage(tmp_path)
    monkeypatch.setattr(shutil_module, "disk_usage", lambda p: usage._replace(free=1000))
    rec.write(TensorDict({"obs": torch.zeros(4, 8, 100)}, [4, 8]), [], None, 1, 0)
    assert DISK.failed and "No space left on device" in str(DISK.error) and rec.failed
    assert not (tmp_path / "record" / "index.jsonl").exists()
