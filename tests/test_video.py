"""Evaluation videos: the MP4 writer, frames captured by the evaluator (torch-native Reach and a
gymnasium MuJoCo env), which evaluations are recorded, failures that are not fatal, and a real
launcher run that writes decodable videos."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

av = pytest.importorskip("av", reason="needs PyAV: pip install -e '.[video]'")

from learner.evaluator import evaluate  # noqa: E402
from learner.video import Frames, VideoRecorder  # noqa: E402
from shared.config import config_from_dict  # noqa: E402
from shared.envs import make_env  # noqa: E402
from shared import keys  # noqa: E402
from shared.video import frame_strip, read_mp4, write_mp4  # noqa: E402
from tests.children import child_pythonpath  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent


def _reach_cfg(**video):
    return config_from_dict({
        "trainer": {"num_eval_episodes": 4, "video": {"every": 2, "episodes": 2, **video}},
        "env": {"id": "tandem/Reach-v0", "cfg": {"max_episode_steps": 12}},
    }, source="test")


class _Drift(torch.nn.Module):
    """A deterministic policy for Reach: always the same step (the agent visibly moves)."""

    def forward(self, td, deterministic=True):
        td.set(keys.ACTION, torch.full((td.batch_size[0], 2), 0.5))
        return td


def make_policy(cfg, spec):
    return _Drift()


def test_mp4_round_trip_keeps_frame_count_and_size(tmp_path):
    g = np.random.default_rng(0)
    frames = [g.integers(0, 255, size=(37, 50, 3), dtype=np.uint8) for _ in range(9)]   # odd height: padded
    path = write_mp4(tmp_path / "v" / "a.mp4", frames, fps=12)
    assert path.exists() and not (tmp_path / "v" / "a.mp4.part").exists()
    decoded = read_mp4(path)
    assert decoded.shape == (9, 38, 50, 3)
    # lossy, but a flat colour survives
    flat = [np.full((16, 16, 3), (200, 40, 90), dtype=np.uint8)] * 3
    assert np.abs(read_mp4(write_mp4(tmp_path / "flat.mp4", flat)).astype(int) - (200, 40, 90)).max() < 12
    with pytest.raises(ValueError, match="size"):
        write_mp4(tmp_path / "bad.mp4", [frames[0], frames[0][:20]])
    strip = frame_strip(frames, count=4, height=20)
    assert strip.dtype == np.uint8 and strip.shape[0] == 20 and strip.shape[2] == 3


@pytest.mark.parametrize("frame_every,max_frames", [(1, 300), (3, 300), (1, 5)])
def test_evaluate_captures_each_recorded_episode_until_it_ends(frame_every, max_frames):
    cfg = _reach_cfg()
    env = make_env(cfg.env.id, 4, cfg.env.cfg)
    policy = make_policy(cfg, env.spec).eval()
    recorded = evaluate(policy, env, 4, seed=5, frames=Frames((0, 2), max_frames=max_frames, every=frame_every))
    returns, lengths, frames = recorded.returns, recorded.lengths, recorded.frames
    plain = evaluate(policy, env, 4, seed=5)
    assert (returns, lengths) == (plain.returns, plain.lengths)        # recording changes nothing evaluated
    assert sorted(frames) == [0, 2] and plain.frames == {}
    for i in (0, 2):
        expected = min(-(-lengths[i] // frame_every), max_frames)   # steps 0, k, 2k, ... of the episode
        assert len(frames[i]) == expected
        assert frames[i][0].shape == (128, 128, 3) and frames[i][0].dtype == np.uint8
    assert not np.array_equal(frames[0][0], frames[0][-1]) or lengths[0] == 1   # the agent moved


def test_recorder_choice_of_evaluations_and_files(tmp_path):
    cfg = _reach_cfg()
    env = make_env(cfg.env.id, 4, cfg.env.cfg)
    rec = VideoRecorder(cfg, str(tmp_path), env)
    assert [rec.wants(c, final=False) for c in range(5)] == [True, False, True, False, True]
    assert rec.wants(3, final=True)
    policy = make_policy(cfg, env.spec).eval()
    assert rec.frames().envs == (0, 1)
    recorded = evaluate(policy, env, 4, seed=1, frames=rec.frames())
    frames, lengths = recorded.frames, recorded.lengths
    written = rec.write(frames, version=7, env_steps=1000)
    rec.close()
    assert [p.name for p in written] == ["eval_v7_ep0.mp4", "eval_v7_ep1.mp4"]
    assert read_mp4(written[0]).shape == (lengths[0], 128, 128, 3)
    assert list(tmp_path.glob("events.out.tfevents.*.evaluator")), "the frame strip goes to TensorBoard"
    # off when every = 0, and when the env cannot render
    assert not VideoRecorder(_reach_cfg(every=0), str(tmp_path), env).enabled
    assert not VideoRecorder(cfg, str(tmp_path), make_env("tandem/Pendulum-v0", 2)).enabled


class _Proprio(torch.nn.Module):
    """A deterministic policy for Reach whose action depends on the state (a fixed random map of
    the proprioceptive vector), so a replay that drifts shows."""

    def __init__(self):
        super().__init__()
        self.w = torch.randn(4, 2, generator=torch.Generator().manual_seed(3))

    def forward(self, td, deterministic=True):
        td.set(keys.ACTION, torch.tanh(td[keys.OBS]["proprio"] @ self.w + 0.3))
        return td


def _state_reach():
    cfg = _reach_cfg()
    return cfg, make_env(cfg.env.id, 4, cfg.env.cfg), _Proprio()


def test_a_replay_of_the_actions_renders_the_frames_live_rendering_gives():
    cfg, env, policy = _state_reach()
    spec = Frames((0, 1), max_frames=8, every=2)
    first = evaluate(policy, env, 4, seed=9, frames=spec)
    returns, lengths, live = first.returns, first.lengths, first.frames
    kept = evaluate(policy, env, 4, seed=9, keep_actions=True)
    actions, per_env = kept.actions, kept.per_env
    assert (kept.returns, kept.lengths) == (returns, lengths) and first.actions == []
    assert len(actions) == max(lengths) and per_env == dict(enumerate(returns))
    replay = evaluate(None, env, 4, seed=9, frames=spec, replay=actions)
    replayed, again = replay.frames, replay.per_env
    for i in (0, 1):
        assert len(replayed[i]) == len(live[i]) > 1
        assert all(np.array_equal(a, b) for a, b in zip(live[i], replayed[i]))
        assert again[i] == returns[i]


@pytest.mark.parametrize("cpus,processes,expected", [(16, 4, "live"), (4, 4, "live"), (2, 4, "end"), (3, 5, "end")])
def test_auto_renders_live_only_where_every_process_has_a_cpu(cpus, processes, expected):
    from learner.video import run_processes, video_when
    cfg = config_from_dict({"actors": {"num_actors": processes - 2}}, source="test")
    assert run_processes(cfg) == processes
    assert video_when(cfg, cpus) == expected
    for when in ("live", "end"):
        forced = config_from_dict({"actors": {"num_actors": processes - 2}, "trainer": {"video": {"when": when}}},
                                  source="test")
        assert video_when(forced, cpus) == when


def test_deferred_evaluations_are_rendered_after_training_and_a_diverged_replay_is_flagged(tmp_path, caplog):
    cfg, env, policy = _state_reach()
    rec = VideoRecorder(cfg, str(tmp_path), env, cpus=1)
    assert rec.when == "end" and rec.defers(0, final=False) and not rec.defers(1, final=False)
    assert not rec.defers(0, final=True)                     # the final evaluation renders at once
    live = evaluate(policy, env, 4, seed=4, frames=rec.frames()).frames
    for version, shift in ((3, 0.0), (5, 0.7)):
        kept = evaluate(policy, env, 4, seed=4, keep_actions=True)
        actions, per_env = kept.actions, kept.per_env
        rec.defer(4, version, 100 * version, [a + shift for a in actions] if shift else actions, per_env)
    assert rec.pending_frames() == 2 * 2 * cfg.trainer.video.max_frames
    written = rec.render_deferred(env)
    rec.close()
    assert [p.name for p in written] == ["eval_v3_ep0.mp4", "eval_v3_ep1.mp4", "eval_v5_ep0.mp4", "eval_v5_ep1.mp4"]
    assert read_mp4(written[0]).shape == read_mp4(write_mp4(tmp_path / "live.mp4", live[0])).shape
    assert rec.deferred == [] and rec.pending_frames() == 0
    assert rec.replay_mismatches == 1 and "version 5" in caplog.text   # the shifted actions do not replay


def test_a_failure_to_encode_is_logged_not_fatal(tmp_path, monkeypatch, caplog):
    import shared.video
    cfg = _reach_cfg()
    env = make_env(cfg.env.id, 4, cfg.env.cfg)
    rec = VideoRecorder(cfg, str(tmp_path), env)

    def broken(*a, **k):
        raise OSError("disk full")

    monkeypatch.setattr(shared.video, "write_mp4", broken)
    frames = {0: [np.zeros((8, 8, 3), np.uint8)] * 3, 1: []}
    assert rec.write(frames, version=1, env_steps=0) == []
    assert rec.failures == 1 and "disk full" in caplog.text


def test_a_gymnasium_mujoco_env_renders_frames(tmp_path):
    """HalfCheetah through gymnasium's rgb_array renderer, off-screen (MUJOCO_GL=egl), in a fresh
    process as the evaluator has it; the frames make a decodable video."""
    code = f"""
import numpy as np, torch
from learner.evaluator import evaluate
from learner.video import Frames
from shared.config import config_from_dict
from shared.envs import make_env
from shared.policies import make_policy
from shared.video import read_mp4, write_mp4
cfg = config_from_dict({{"env": {{"id": "HalfCheetah-v5", "cfg": {{"max_episode_steps": 6, "width": 64, "height": 48}}}}}},
                       source="t")
env = make_env(cfg.env.id, 2, cfg.env.cfg, render=True)
policy = make_policy(cfg, env.spec).eval()
recorded = evaluate(policy, env, 2, seed=0, frames=Frames((1,)))
frames, lengths = recorded.frames, recorded.lengths
v = read_mp4(write_mp4({str(tmp_path / 'hc.mp4')!r}, frames[1]))
actions = evaluate(policy, env, 2, seed=0, keep_actions=True).actions
replayed = evaluate(None, env, 2, seed=0, frames=Frames((1,)), replay=actions).frames   # trainer.video.when "end"
assert len(replayed[1]) == len(frames[1]) and all(np.array_equal(a, b) for a, b in zip(frames[1], replayed[1]))
print(lengths[1], v.shape, float(v.std()))
"""
    env = {**os.environ, "MUJOCO_GL": "egl", "PYTHONPATH": child_pythonpath()}
    p = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    if p.returncode != 0 and "egl" in p.stderr.lower() and "error" in p.stderr.lower():
        pytest.skip(f"no off-screen OpenGL (EGL) here: {p.stderr.strip().splitlines()[-1]}")
    assert p.returncode == 0, p.stderr[-2000:]
    length, shape, std = p.stdout.split(" ", 1)[0], p.stdout.split(" ", 1)[1].rsplit(" ", 1)[0], p.stdout.split()[-1]
    assert length == "6" and shape == "(6, 48, 64, 3)" and float(std) > 1.0   # six frames of a real scene


@pytest.mark.slow
@pytest.mark.parametrize("when", ["live", "end"])
def test_launcher_run_writes_videos_that_decode(tmp_path, when):
    """launch/run_local.sh on HalfCheetah with trainer.video on: an MP4 per recorded evaluation
    (every 2nd, and the final one), each decodable, with the configured frame count and size, whether
    rendered during the run or replayed after it. One actor at twice the pace of each of the config's
    two (the same env steps a second, one process less)."""
    run = tmp_path / "run"
    cmd = ["bash", str(ROOT / "launch" / "run_local.sh"), "--config", str(ROOT / "configs" / "halfcheetah_ppo.json"),
           "--steps", "4096", "--actors", "1", "--out", str(run), "--set", "trainer.eval_freq=1024",
           "--set", "actors.slowdown_s=0.005",
           "--set", "trainer.buffer_size=64",
           "--set", "trainer.num_eval_episodes=2", "--set", "trainer.video.every=2",
           "--set", "trainer.video.max_frames=12", "--set", "trainer.video.episodes=1",
           "--set", 'env.cfg={"width": 80, "height": 64}', "--set", "actors.num_envs=4",
           "--set", "algorithm.cfg.n_epochs=1", "--set", f"trainer.video.when={when}"]
    p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=240, start_new_session=True)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    videos = sorted((run / "videos").glob("eval_v*_ep0.mp4"))
    assert len(videos) >= 2, (list((run / "videos").glob("*")), p.stderr[-2000:])
    for v in videos:
        assert read_mp4(v).shape == (12, 64, 80, 3)
    # every 2nd evaluation (counting from the first) has its video, rendered live or replayed at the end
    evals = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if "eval/return_mean" in line]
    wanted = {e["version"] for e in evals[::2]}
    assert wanted <= {int(v.name.split("_")[1][1:]) for v in videos}, (wanted, videos)
    if when == "end":
        assert "renders its deferred videos" in p.stdout + p.stderr
    assert list(run.glob("events.out.tfevents.*.evaluator"))


def test_a_long_run_keeps_a_bounded_spread_of_deferred_evaluations():
    from learner.video import MAX_DEFERRED
    cfg, env, policy = _state_reach()
    rec = VideoRecorder(cfg, None, env, cpus=1)
    kept = evaluate(policy, env, 4, seed=4, keep_actions=True)
    actions, per_env = kept.actions, kept.per_env
    for version in range(40):
        rec.defer(4, version, 1000 * version, actions, per_env)
        assert len(rec.deferred) <= MAX_DEFERRED
    versions = [d.version for d in rec.deferred]
    assert versions == sorted(versions) and versions[-1] == 39 and versions[0] == 0   # the first and the newest
    assert rec.thinned == 40 - len(versions)
