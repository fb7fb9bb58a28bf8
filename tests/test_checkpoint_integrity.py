"""Checkpoints that can be verified: a digest beside each, checked before loading; --resume skips a
damaged newest checkpoint (naming it) and --resume-from has no fallback; evaluate.py refuses one."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from learner.checkpoint import (CheckpointError, digest_path, list_checkpoints, load_checkpoint, load_newest_intact,
                                save_atomic, save_checkpoint, verify_checkpoint)

ROOT = Path(__file__).resolve().parents[1]


def _state(seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {"policy": {"actor.0.weight": torch.randn(64, 32, generator=g), "actor.0.bias": torch.randn(64, generator=g)},
            "version": seed, "env_steps": 100 * seed}


def _flip_inside_tensor_data(path: Path, tensor: torch.Tensor) -> None:
    """Flip 8 bytes in the middle of `tensor`'s data inside checkpoint `path` (the zip stores it raw)."""
    data = bytearray(path.read_bytes())
    raw = tensor.numpy().tobytes()
    at = data.find(raw)
    assert at >= 0, "the tensor's bytes are stored as they are"
    mid = at + len(raw) // 2
    data[mid:mid + 8] = bytes(b ^ 0xFF for b in data[mid:mid + 8])
    path.write_bytes(bytes(data))


def test_a_checkpoint_carries_its_digest_and_verifies(tmp_path):
    path = save_checkpoint(tmp_path, _state(1), version=1)
    assert digest_path(path).is_file() and verify_checkpoint(path) is True
    assert load_checkpoint(path)["version"] == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt_00000001.pt", "ckpt_00000001.pt.sha256"]


def test_flipped_bytes_inside_a_tensor_are_caught_by_name_where_torch_load_alone_would_not(tmp_path):
    state = _state(2)
    path = save_checkpoint(tmp_path, state, version=2)
    _flip_inside_tensor_data(path, state["policy"]["actor.0.weight"])
    silently = torch.load(path, weights_only=True)        # what a bare load does: no complaint, other weights
    assert not torch.equal(silently["policy"]["actor.0.weight"], state["policy"]["actor.0.weight"])
    with pytest.raises(CheckpointError, match=r"ckpt_00000002\.pt: damaged"):
        load_checkpoint(path)


def test_resume_skips_a_truncated_newest_checkpoint_and_names_it(tmp_path):
    for v in (1, 2, 3):
        save_checkpoint(tmp_path, _state(v), version=v)
    newest = list_checkpoints(tmp_path)[-1]
    newest.write_bytes(newest.read_bytes()[:5000])
    path, state, skipped = load_newest_intact(tmp_path)
    assert path.name == "ckpt_00000002.pt" and state["version"] == 2
    assert len(skipped) == 1 and "ckpt_00000003.pt" in skipped[0] and "damaged" in skipped[0]


def test_a_checkpoint_without_its_digest_still_loads_unverified(tmp_path, caplog):
    path = save_checkpoint(tmp_path, _state(4), version=4)
    digest_path(path).unlink()                            # written before digests, or copied without it
    assert verify_checkpoint(path) is False
    with caplog.at_level("WARNING"):
        assert load_checkpoint(path)["version"] == 4
    assert "loaded without verification" in caplog.text
    path.write_bytes(path.read_bytes()[:3000])            # and one that does not load is still an error
    with pytest.raises(CheckpointError, match="cannot load checkpoint"):
        load_checkpoint(path)


def test_no_intact_checkpoint_is_an_error_listing_each(tmp_path):
    for v in (1, 2):
        p = save_checkpoint(tmp_path, _state(v), version=v)
        p.write_bytes(b"\0" * 100)
    with pytest.raises(CheckpointError, match=r"no intact checkpoint(.|\n)*ckpt_00000002(.|\n)*ckpt_00000001"):
        load_newest_intact(tmp_path)


def test_a_failed_write_leaves_no_temp_file_and_the_previous_checkpoint(tmp_path, monkeypatch):
    save_checkpoint(tmp_path, _state(1), version=1)

    def full_disk(obj, f, *a, **kw):
        f.write(b"partial")
        raise OSError(28, "No space left on device")
    monkeypatch.setattr(torch, "save", full_disk)
    with pytest.raises(OSError, match="No space left"):
        save_atomic(tmp_path / "ckpt_00000002.pt", _state(2))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt_00000001.pt", "ckpt_00000001.pt.sha256"]


def _learner_with_checkpoints(tmp_path, versions):
    """A CartPole learner's run directory with checkpoints at `versions` (real learner states)."""
    from learner.learner import Learner, ListPublisher
    from tests.test_learner_component import small_config
    cfg = small_config()
    learner = Learner(cfg, tmp_path, ListPublisher())
    for v in versions:
        learner.version = v
        learner.save()
    return cfg


def test_resume_from_a_damaged_file_is_an_error_with_no_fallback(tmp_path):
    from learner.learner import Learner, ListPublisher
    cfg = _learner_with_checkpoints(tmp_path, [1, 2])
    older, newest = list_checkpoints(tmp_path / "checkpoints")
    newest.write_bytes(newest.read_bytes()[:5000])
    with pytest.raises(CheckpointError, match=r"ckpt_00000002\.pt: damaged"):
        Learner(cfg, tmp_path, ListPublisher(), resume=newest)
    resumed = Learner(cfg, tmp_path, ListPublisher(), resume=True)           # --resume goes on from the older one
    assert resumed.resumed_from == older and resumed.version == 1
    assert len(resumed.resume_skipped) == 1 and "ckpt_00000002.pt" in resumed.resume_skipped[0]


def test_evaluate_refuses_a_damaged_checkpoint_with_a_clear_error(tmp_path):
    _learner_with_checkpoints(tmp_path, [1])
    (ckpt,) = list_checkpoints(tmp_path / "checkpoints")
    data = bytearray(ckpt.read_bytes())
    data[len(data) // 2] ^= 0xFF
    ckpt.write_bytes(bytes(data))
    from shared.config import save_config
    from tests.test_learner_component import small_config
    save_config(small_config(), tmp_path / "config.json")
    r = subprocess.run([sys.executable, "launch/evaluate.py", str(tmp_path), "--checkpoint", str(ckpt), "--episodes", "1"],
                       cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 2, r.stderr
    assert "ckpt_00000001.pt: damaged" in r.stderr and "Traceback" not in r.stderr


@pytest.mark.slow
def test_the_launcher_resumes_past_a_damaged_checkpoint_and_reports_only_its_own_summary(tmp_path):
    """A run leaves checkpoints; the newest is truncated. --resume goes on from the one before and
    its summary names both; --resume-from the damaged file fails with no fallback, and the launcher
    then says it has no summary instead of printing the earlier launch's. The resume is also the
    launcher's resume test: versions, env steps, updates and the actors' weights go on from the
    checkpoint it resumed from (tests.test_integration.assert_resume_continues)."""
    import json
    from tests.test_integration import (RUN_TIMEOUT_S, assert_resume_continues, finish, launch, load_ckpt,
                                        read_jsonl)
    run_dir = tmp_path / "run"
    common = ("--no-eval", "--actors", "1", "--set", "trainer.eval_freq=0", "--set", "trainer.save_freq=512")
    finish(launch(tmp_path, run_dir, *common, "--steps", "2048", name="first"), run_dir)
    older, newest = list_checkpoints(run_dir / "checkpoints")[-2:]
    newest.write_bytes(newest.read_bytes()[:5000])
    ckpt = load_ckpt(older)
    assert ckpt["version"] >= 1
    n_before = len(read_jsonl(run_dir / "versions.jsonl"))
    m_before = len(read_jsonl(run_dir / "metrics.jsonl"))

    out = finish(launch(tmp_path, run_dir, *common, "--resume", "--steps", "3072", name="second"), run_dir)
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["resumed_from"] == str(older), out
    assert len(summary["resume_skipped"]) == 1 and newest.name in summary["resume_skipped"][0], out
    assert f'"resumed_from":"{older}"' in out.replace(" ", "")             # the printed summary is this launch's
    assert_resume_continues(run_dir, ckpt, n_before, m_before, steps=3072)

    damaged = list_checkpoints(run_dir / "checkpoints")[-1]
    damaged.write_bytes(damaged.read_bytes()[:5000])
    run = launch(tmp_path, run_dir, *common, "--resume-from", str(damaged), "--steps", "4096", name="third")
    try:
        rc = run.wait(RUN_TIMEOUT_S)
        out = run.output()
        run.assert_all_gone(run_dir)
    finally:
        run.stop()
    assert rc != 0, out
    assert f"{damaged.name}: damaged" in out and "Traceback" not in out, out
    assert "[launch] no summary from this launch" in out and "[launch] summary:" not in out, out


def test_resume_from_an_older_checkpoint_sets_the_newer_ones_aside(tmp_path):
    """--resume-from v1 with v2 and v3 beside it: they move to checkpoints/set_aside/ (with their
    digests), so rotation keeps the new branch's checkpoints and the next --resume takes one of them."""
    from learner.learner import Learner, ListPublisher
    cfg = _learner_with_checkpoints(tmp_path, [1, 2, 3])
    first = list_checkpoints(tmp_path / "checkpoints")[0]
    learner = Learner(cfg, tmp_path, ListPublisher(), resume=first)
    assert learner.version == 1 and [p.name for p in list_checkpoints(tmp_path / "checkpoints")] == [first.name]
    aside = sorted(p.name for p in (tmp_path / "checkpoints" / "set_aside").iterdir())
    assert aside == ["ckpt_00000002.pt", "ckpt_00000002.pt.sha256", "ckpt_00000003.pt", "ckpt_00000003.pt.sha256"]
    learner.version = 2
    assert learner.save().is_file()                                  # the new branch's v2, kept


def test_rotation_never_deletes_the_checkpoint_it_just_wrote(tmp_path):
    for v in (10, 11, 12):
        save_checkpoint(tmp_path, _state(v), version=v)
    path = save_checkpoint(tmp_path, _state(5), version=5)          # lower than every one kept
    assert path.is_file() and len(list_checkpoints(tmp_path)) == 3


def test_a_verified_checkpoint_that_will_not_load_stops_the_resume_instead_of_falling_back(tmp_path, monkeypatch):
    import learner.checkpoint as checkpoint
    for v in (1, 2):
        save_checkpoint(tmp_path, _state(v), version=v)
    monkeypatch.setattr(checkpoint.torch, "load", lambda *a, **k: (_ for _ in ()).throw(RuntimeError("out of memory")))
    with pytest.raises(CheckpointError, match=r"ckpt_00000002\.pt: cannot load checkpoint: out of memory"):
        load_newest_intact(tmp_path)
