"""The evaluator's videos (``trainer.video``): which evaluations are recorded, the frames an
evaluation captures, the MP4 files under ``RUN_DIR/videos`` and the frame strips in TensorBoard.

An evaluation is rendered ``live`` (while :func:`learner.evaluator.evaluate` runs it) or at the
``end`` of the run: then it keeps only its actions (:class:`Deferred`), and
:meth:`VideoRecorder.render_deferred` replays them with rendering once training is over. The MP4
encoding itself is ``shared/video.py``'s.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from pathlib import Path

import torch

from shared.config import Config

log = logging.getLogger("tandem.evaluator")

MAX_DEFERRED = 8   # evaluations waiting to be rendered at the end: a bound on the run's last minutes


@dataclass(frozen=True)
class Frames:
    """What :func:`~learner.evaluator.evaluate` renders: the first episode of each env in `envs`
    (``env.render_frames``), every `every` steps, at most `max_frames`. Rendering starts at the
    reset state and stops when the episode ends (the auto-reset state after it belongs to the next
    one)."""
    envs: tuple[int, ...]
    max_frames: int = 300
    every: int = 1


@dataclass
class FrameCapture:
    """The frames of one evaluation, as it runs: ``{env index: [frame, ...]}`` for the envs of
    `spec` (none without one)."""
    env: object
    spec: Frames | None
    frames: dict[int, list] = field(default_factory=dict)

    def __post_init__(self):
        if self.spec is not None:
            self.frames = {i: [] for i in sorted(self.spec.envs)}

    @property
    def recording(self) -> bool:
        return bool(self.frames)

    def take(self, step: int, returns: list) -> None:
        """Render step `step` of the recorded episodes still running (``returns[i] is None``)."""
        live = [i for i in self.frames if returns[i] is None and len(self.frames[i]) < self.spec.max_frames]
        if live and step % self.spec.every == 0:
            for i, frame in zip(live, self.env.render_frames(live)):
                self.frames[i].append(frame)

    def ended(self, returns: list) -> bool:
        """Every recorded episode has ended (true when nothing is recorded)."""
        return all(returns[i] is not None for i in self.frames)


@dataclass
class Deferred:
    """An evaluation whose video is rendered at the end of the run: what replays it."""
    seed: int
    version: int
    env_steps: int
    actions: torch.Tensor               # [steps, recorded envs, *action shape]
    returns: dict[int, float]           # the recorded envs' evaluated returns, to check the replay


def run_processes(cfg: Config) -> int:
    """Processes a local run puts on this host: learner ranks, actors and this evaluator."""
    return max(1, len(cfg.learner.devices)) + cfg.actors.num_actors + 1


def video_when(cfg: Config, cpus: int | None = None) -> str:
    """``trainer.video.when`` resolved: "auto" renders live where every process of the run has a
    CPU of its own, and at the end of the run otherwise."""
    when = cfg.trainer.video.when
    if when != "auto":
        return when
    cpus = len(os.sched_getaffinity(0)) if cpus is None else cpus
    return "live" if cpus >= run_processes(cfg) else "end"


class VideoRecorder:
    """The evaluator's side of ``trainer.video``: which evaluations to record, the MP4 files under
    ``RUN_DIR/videos`` and the frame strips in TensorBoard (an events file of the evaluator's own in
    the run directory). Any failure to render, encode or write is logged and counted, never fatal.

    Rendered ``live`` (during the evaluation) or at the ``end`` of the run (``trainer.video.when``):
    then a chosen evaluation keeps only its actions (:class:`Deferred`), and :meth:`render_deferred`
    replays them with rendering once training is over."""

    def __init__(self, cfg: Config, run_dir: str | None, env, cpus: int | None = None):
        self.video = cfg.trainer.video
        self.episodes = min(self.video.episodes, cfg.trainer.num_eval_episodes)
        self.run_dir = None if run_dir is None else Path(run_dir)
        self.enabled = self.video.every > 0 and self.run_dir is not None
        self.failures = 0
        self.replay_mismatches = 0
        self.thinned = 0
        self.deferred: list[Deferred] = []
        self.when = video_when(cfg, cpus)
        self._writer = None
        if self.enabled and not hasattr(env, "render_frames"):
            log.warning("evaluator: trainer.video is on, but %s offers no frames (no render_frames): no videos",
                        cfg.env.id)
            self.enabled = False

    def wants(self, count: int, final: bool) -> bool:
        """Record evaluation number `count` (0-based)?"""
        return self.enabled and (final or count % self.video.every == 0)

    def defers(self, count: int, final: bool) -> bool:
        """Keep evaluation `count`'s actions and render it at the end? (The final evaluation runs
        after training: it renders at once.)"""
        return self.wants(count, final) and self.when == "end" and not final

    def frames(self) -> Frames:
        """What a recorded evaluation renders: its first `episodes` envs, as ``trainer.video`` says."""
        return Frames(tuple(range(self.episodes)), max_frames=self.video.max_frames, every=self.video.frame_every)

    def defer(self, seed: int, version: int, env_steps: int, actions: list[torch.Tensor],
              per_env: dict[int, float]) -> None:
        """Keep what replays an evaluation: the recorded envs' actions, to the end of their episodes
        (the replay checks their returns), ~24 KB for a 1000-step HalfCheetah episode."""
        self.deferred.append(Deferred(seed, version, env_steps, torch.stack(actions)[:, :self.episodes].clone(),
                                      {i: r for i, r in per_env.items() if i < self.episodes}))
        if len(self.deferred) > MAX_DEFERRED:
            # a long run: let every other older one go, so the videos kept stay spread over the run
            keep = self.deferred[:-1][::2] + self.deferred[-1:]
            self.thinned += len(self.deferred) - len(keep)
            log.info("evaluator: %d deferred videos at most (MAX_DEFERRED): %d let go so far, every other older one",
                     MAX_DEFERRED, self.thinned)
            self.deferred = keep

    def pending_frames(self) -> int:
        """An upper bound on the frames :meth:`render_deferred` still has to render."""
        return len(self.deferred) * self.episodes * self.video.max_frames

    def render_deferred(self, env) -> list[Path]:
        """Replay and render every deferred evaluation, oldest first. A replay whose returns differ
        from the evaluation's (an env that is not deterministic) is logged and counted; its video
        shows the replay."""
        from learner.evaluator import evaluate   # the evaluator imports this module
        written = []
        while self.deferred:
            d = self.deferred.pop(0)
            try:
                replayed = evaluate(None, env, self.episodes, d.seed, frames=self.frames(), replay=d.actions)
            except Exception as e:
                self.failures += 1
                log.warning("evaluator: could not render the video of version %s: %s: %s", d.version,
                            type(e).__name__, e)
                continue
            per_env = replayed.per_env
            off = {i: (r, per_env[i]) for i, r in d.returns.items()
                   if i in per_env and abs(per_env[i] - r) > 1e-6 * max(1.0, abs(r))}
            if off:
                self.replay_mismatches += 1
                log.warning("evaluator: the replay of version %s's evaluation diverged (return evaluated, "
                            "replayed: %s); its video shows the replay", d.version, off)
            written += self.write(replayed.frames, d.version, d.env_steps)
        return written

    def write(self, frames: dict[int, list], version: int, env_steps: int) -> list[Path]:
        from shared.video import frame_strip, write_mp4
        written = []
        for i, clip in sorted(frames.items()):
            if not clip:
                continue
            path = self.run_dir / "videos" / f"eval_v{version}_ep{i}.mp4"
            try:
                written.append(write_mp4(path, clip, fps=self.video.fps))
                self._tensorboard(f"eval/video/ep{i}", frame_strip(clip), env_steps)
            except Exception as e:   # a broken encoder or a full disk must not end the evaluator
                self.failures += 1
                log.warning("evaluator: could not write %s: %s: %s", path, type(e).__name__, e)
        return written

    def _tensorboard(self, tag: str, image, step: int) -> None:
        if self._writer is None:
            from torch.utils.tensorboard import SummaryWriter
            self._writer = SummaryWriter(str(self.run_dir), filename_suffix=".evaluator")
        self._writer.add_image(tag, image, step, dataformats="HWC")
        self._writer.flush()

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()


def render_offscreen() -> None:
    """Environment for rendering videos, set before the renderers are imported."""
    if not os.environ.get("DISPLAY"):
        os.environ.setdefault("MUJOCO_GL", "egl")   # MuJoCo renders off-screen (before mujoco is imported)
    os.environ.setdefault("LP_NUM_THREADS", "1")    # Mesa's software rasteriser: one thread, not one per core


def start_video(video: VideoRecorder, cfg: Config) -> None:
    """With videos on: say when they are rendered, and lower this process's priority."""
    if not video.enabled:
        return
    if video.when == "end":
        log.info("evaluator: videos are rendered when training ends (trainer.video.when %r: %d CPUs for "
                 "%d processes)", cfg.trainer.video.when, len(os.sched_getaffinity(0)), run_processes(cfg))
    os.nice(19)   # rendering is slow: it must take CPU from training only when training leaves some
