"""Evaluator process: deterministic episodes on separate envs, off the training path.

It subscribes to the learner's weights like an actor, evaluates the newest weights each time the
env-step count passes a multiple of ``eval_freq`` (and the final weights), and pushes the results
back to the learner as a small ``kind="eval"`` message. Training never waits for it.
"""

from __future__ import annotations

import logging
import math
import os
import signal
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import zmq
from tensordict import TensorDict

from learner.checkpoint import load_checkpoint, save_atomic
from shared import keys, wire
from shared.config import Config, TrainerConfig, config_from_dict
from shared.envs import make_env
from shared.instructions import instruction_tokenizer
from shared.metrics import mean_metrics
from shared.policies import frozen_digest, make_policy, published_state
from shared.security import CurveClient
from shared.shm_weights import ShmWeightsReader, load_published_
from shared.transport import RolloutPusher, WeightsSubscriber

log = logging.getLogger("tandem.evaluator")


@torch.inference_mode()
def evaluate(policy: torch.nn.Module | None, env, num_episodes: int, seed: int,
             frames: dict[int, list] | None = None, max_frames: int = 300, frame_every: int = 1,
             metrics: list[dict[str, float]] | None = None, actions: list | None = None,
             replay: list | None = None, per_env: dict[int, float] | None = None,
             ) -> tuple[list[float], list[int], list[bool]]:
    """Run the first episode of each of ``env.num_envs`` envs with the deterministic policy.
    Returns episode returns, lengths and (for tasks that define it) successes.

    `frames` (evaluation videos): ``{env index: []}``; each list is filled with that env's rendered
    frames (``env.render_frames``) of its first episode, every `frame_every` steps, at most
    `max_frames`. Rendering starts at the reset state and stops when the episode ends (the
    auto-reset state after it belongs to the next one).

    `metrics`: a list that receives the env metrics (``StepResult.episode_metrics``) of the first
    `num_episodes` episodes, where the env reports any.

    Rendering later (``trainer.video.when: "end"``): `actions`, a list, receives every step's action
    batch; ``evaluate(None, env, ..., frames=..., replay=those actions)`` then steps the same envs
    from the same seed with them (no policy) and renders. Each replayed batch may hold only the
    first k envs' actions (the envs are independent: the others repeat env 0's). The replay stops
    when the actions run out or every recorded episode has ended. `per_env` receives ``{env index: return}`` of every episode
    that ended, to check that a replay followed the evaluation."""
    obs = env.reset(seed=seed)
    n = env.num_envs
    returns: list[float | None] = [None] * n
    lengths: list[int | None] = [None] * n
    successes: list[bool | None] = [None] * n
    env_metrics: list[dict | None] = [None] * n
    ep_ret = torch.zeros(n, dtype=torch.float64)
    ep_len = torch.zeros(n, dtype=torch.int64)
    limit = env.spec.max_episode_steps or 100_000
    recording = sorted(frames) if frames else []

    def capture(step: int) -> None:
        live = [i for i in recording if returns[i] is None and len(frames[i]) < max_frames]
        if live and step % frame_every == 0:
            for i, frame in zip(live, env.render_frames(live)):
                frames[i].append(frame)

    capture(0)
    for t in range(limit + 1):
        if replay is not None:
            if t >= len(replay):
                break
            action = replay[t]
            if action.shape[0] < n:   # only the recorded envs' actions were kept: the others do not matter
                action = torch.cat([action, action[:1].expand(n - action.shape[0], *action.shape[1:])])
        else:
            action = policy(TensorDict({keys.OBS: obs}, batch_size=[n]), deterministic=True)[keys.ACTION]
            if actions is not None:
                actions.append(action.detach().to("cpu", copy=True))
        step = env.step(action)
        ep_ret += step.reward.double().cpu()
        ep_len += 1
        done = (step.terminated | step.truncated).cpu()
        for j, i in enumerate(torch.nonzero(done).flatten().tolist()):
            if returns[i] is None:
                returns[i], lengths[i] = float(ep_ret[i]), int(ep_len[i])
                if j < len(step.episode_successes):
                    successes[i] = bool(step.episode_successes[j])
                if j < len(step.episode_metrics):
                    env_metrics[i] = step.episode_metrics[j]
        ep_ret[done] = 0.0
        ep_len[done] = 0
        obs = step.obs
        if all(r is not None for r in returns):
            break
        if replay is not None and all(returns[i] is not None for i in recording):
            break   # a replay renders; the other envs' episodes were evaluated already
        if recording:
            capture(t + 1)
    if per_env is not None:
        per_env.update({i: r for i, r in enumerate(returns) if r is not None})
    if metrics is not None:
        done_ids = [i for i in range(n) if returns[i] is not None][:num_episodes]
        metrics.extend(env_metrics[i] for i in done_ids if env_metrics[i])
    return ([r for r in returns if r is not None][:num_episodes], [n for n in lengths if n is not None][:num_episodes],
            [x for x in successes if x is not None][:num_episodes])


MAX_DEFERRED = 8   # evaluations waiting to be rendered at the end: a bound on the run's last minutes


def eval_seed(seed: int, count: int, mode: str = "new") -> int:
    """The seed the `count`-th evaluation (0-based) of a run with ``trainer.seed`` `seed` resets its envs
    with (``trainer.eval_seeds``): new episodes each time, or the same ones."""
    if mode not in ("new", "same"):
        raise ValueError(f"trainer.eval_seeds: {mode!r} must be 'new' or 'same'")
    return seed + 1_000_003 + (count if mode == "new" else 0)


def eval_score(returns: list[float], successes: list[bool]) -> tuple[str, float]:
    """What ``trainer.keep_best`` ranks evaluations by: the success rate where the env reports
    success, else the mean return."""
    if successes:
        return "success_rate", sum(successes) / len(successes)
    return "return_mean", (sum(returns) / len(returns)) if returns else float("nan")


class BestKeeper:
    """``trainer.keep_best``: ``RUN_DIR/checkpoints/best.pt``, rewritten (atomically) whenever an
    evaluation beats every earlier one. It holds what a weights message carries (the trained
    tensors and normaliser statistics; a frozen base is named by its digest) plus the version, env
    steps and score it was chosen for. On a resumed run the kept file's score stays the bar; on a
    new run it is replaced by the first evaluation. A file that cannot be written is logged and
    counted, never fatal."""

    NAME = "best.pt"

    def __init__(self, run_dir: str | Path | None, enabled: bool, resume: bool = False):
        self.path = Path(run_dir) / "checkpoints" / self.NAME if enabled and run_dir is not None else None
        self.score: float | None = None
        self.metric: str | None = None
        self.version: int | None = None
        self.failures = 0
        self._digest: str | None = None    # the frozen base's, hashed once: it never changes in a run
        if self.path is None or not self.path.is_file():
            return
        if not resume:
            log.info("evaluator: %s is from an earlier run in this directory: the first evaluation replaces it",
                     self.path)
            return
        try:
            state = load_checkpoint(self.path)
            self.score, self.metric = float(state["eval"]["score"]), str(state["eval"]["metric"])
            self.version = int(state["version"])
            log.info("evaluator: resumed with %s (version %d, %s %.4g) as the best so far", self.path,
                     self.version, self.metric, self.score)
        except Exception as e:   # unreadable: the next evaluation writes a good one
            log.warning("evaluator: cannot read %s (%s: %s): the next evaluation replaces it", self.path,
                        type(e).__name__, e)

    def offer(self, policy: torch.nn.Module, returns: list[float], successes: list[bool], *, version: int,
              env_steps: int, seed: int) -> bool:
        """Keep `policy` if this evaluation's score beats the best so far. Returns whether it did."""
        if self.path is None:
            return False
        metric, score = eval_score(returns, successes)
        if not math.isfinite(score):
            return False
        if self.score is not None and metric == self.metric and score <= self.score:
            return False
        if self._digest is None:
            self._digest = frozen_digest(policy)
        state = {"policy": {k: v.detach().to("cpu", copy=True) for k, v in published_state(policy).items()},
                 "base_digest": self._digest, "version": int(version), "env_steps": int(env_steps),
                 "eval": {"metric": metric, "score": float(score), "episodes": len(returns), "seed": int(seed),
                          "time": time.time()}}
        try:
            save_atomic(self.path, state)
        except Exception as e:   # a full disk must not end the evaluator
            self.failures += 1
            log.warning("evaluator: could not write %s: %s: %s", self.path, type(e).__name__, e)
            return False
        self.score, self.metric, self.version = float(score), metric, int(version)
        log.info("evaluator: version %d is the best so far (%s %.4g on %d episodes): %s", version, metric, score,
                 len(returns), self.path)
        return True


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

    def buffers(self) -> dict[int, list]:
        return {i: [] for i in range(self.episodes)}

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
        written = []
        while self.deferred:
            d = self.deferred.pop(0)
            frames, per_env = self.buffers(), {}
            try:
                evaluate(None, env, len(frames), d.seed, frames=frames, max_frames=self.video.max_frames,
                         frame_every=self.video.frame_every, replay=d.actions, per_env=per_env)
            except Exception as e:
                self.failures += 1
                log.warning("evaluator: could not render the video of version %s: %s: %s", d.version,
                            type(e).__name__, e)
                continue
            off = {i: (r, per_env[i]) for i, r in d.returns.items()
                   if i in per_env and abs(per_env[i] - r) > 1e-6 * max(1.0, abs(r))}
            if off:
                self.replay_mismatches += 1
                log.warning("evaluator: the replay of version %s's evaluation diverged (return evaluated, "
                            "replayed: %s); its video shows the replay", d.version, off)
            written += self.write(frames, d.version, d.env_steps)
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


def _is_int(x) -> bool:
    """An int that is not a bool (what a message's version and env-step count must be)."""
    return isinstance(x, int) and not isinstance(x, bool)


def _render_offscreen() -> None:
    """Environment for rendering videos, set before the renderers are imported."""
    if not os.environ.get("DISPLAY"):
        os.environ.setdefault("MUJOCO_GL", "egl")   # MuJoCo renders off-screen (before mujoco is imported)
    os.environ.setdefault("LP_NUM_THREADS", "1")    # Mesa's software rasteriser: one thread, not one per core


def _load_weights(policy: torch.nn.Module, td, meta: dict, shm: ShmWeightsReader, device) -> bool:
    """Load a weights message into `policy`. False where it is skipped: a torn shared-memory read
    (the next version is evaluated instead) or weights that do not fit this policy (logged)."""
    try:
        return bool(load_published_(policy, td, meta, shm, device))
    except Exception as e:   # weights that do not fit this policy: skip them, never die
        log.warning("evaluator: could not load weights version %r: %s", meta.get("version"), e)
        return False


def _evaluate_recorded(policy: torch.nn.Module, env, t: TrainerConfig, video: VideoRecorder, count: int,
                       final: bool, seed: int, version, steps: int
                       ) -> tuple[list[float], list[int], list[bool], list[dict]]:
    """Evaluation number `count` of the loaded weights, from `seed`, with its video where `video`
    wants one: written at once, or its actions kept to render at the end. A renderer that fails
    turns videos off for the run and the evaluation is redone without it. Returns the episode
    returns, lengths and successes, and the env metrics."""
    deferring = video.defers(count, final)
    frames = video.buffers() if video.wants(count, final) and not deferring else None
    actions: list | None = [] if deferring else None
    per_env: dict[int, float] = {}
    env_metrics: list[dict] = []
    try:
        returns, lengths, successes = evaluate(policy, env, t.num_eval_episodes, seed=seed,
                                               frames=frames, max_frames=t.video.max_frames,
                                               frame_every=t.video.frame_every, metrics=env_metrics,
                                               actions=actions, per_env=per_env)
    except Exception as e:
        if frames is None:
            raise
        # the renderer failed: say so, stop recording, and evaluate without it
        log.warning("evaluator: rendering failed (%s: %s); videos are off for this run", type(e).__name__, e)
        video.enabled, frames, env_metrics = False, None, []
        returns, lengths, successes = evaluate(policy, env, t.num_eval_episodes, seed=seed,
                                               metrics=env_metrics)
    if _is_int(version):   # it names the files
        if frames:
            video.write(frames, version, steps)
        elif actions:
            video.defer(seed, version, steps, actions, per_env)
    return returns, lengths, successes, env_metrics


def _evaluation_result(policy: torch.nn.Module, env, t: TrainerConfig, video: VideoRecorder, best: BestKeeper,
                       meta: dict, *, count: int, final: bool, steps: int, token: str | None) -> dict:
    """Evaluation number `count`, of the weights of message `meta` (loaded into `policy`), offered
    to `best`. Returns the fields of the result message to the learner."""
    t0 = time.perf_counter()
    seed = eval_seed(t.seed, count, t.eval_seeds)
    version = meta.get("version")
    returns, lengths, successes, env_metrics = _evaluate_recorded(policy, env, t, video, count, final, seed,
                                                                  version, steps)
    kept = _is_int(version) and best.offer(policy, returns, successes, version=version, env_steps=steps, seed=seed)
    return dict(kind="eval", sender="evaluator", token=token, version=version, env_steps=steps,
                returns=returns, lengths=lengths, successes=successes, final=final,
                metrics=mean_metrics(env_metrics),
                eval_s=time.perf_counter() - t0,
                **({"best": kept, "best_version": best.version, "best_score": best.score}
                   if best.score is not None else {}),
                **({"video_frames_pending": video.pending_frames()} if final else {}))


def _send_final_again(push: RolloutPusher, last: dict, video: VideoRecorder, env) -> None:
    """The final weights were evaluated already: send that result again, marked final, and render
    the deferred videos."""
    last["final"] = True
    last["video_frames_pending"] = video.pending_frames()
    push.send(wire.encode(TensorDict({}, []), **last), timeout_ms=5000)
    if video.deferred:
        video.render_deferred(env)


def _start_video(video: VideoRecorder, cfg: Config) -> None:
    """With videos on: say when they are rendered, and lower this process's priority."""
    if not video.enabled:
        return
    if video.when == "end":
        log.info("evaluator: videos are rendered when training ends (trainer.video.when %r: %d CPUs for "
                 "%d processes)", cfg.trainer.video.when, len(os.sched_getaffinity(0)), run_processes(cfg))
    os.nice(19)   # rendering is slow: it must take CPU from training only when training leaves some


def run_evaluator(cfg_dict: dict, source: str, endpoints: dict[str, str], parent_pid: int,
                  curve: dict[str, str] | None = None, token: str | None = None, run_dir: str | None = None,
                  resume: bool = False) -> None:
    """Entry point of the evaluator process (spawned by the learner). Results go to the learner's
    evaluator socket (``endpoints["eval"]``, loopback) with the per-run `token` the learner gave."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the launcher's Ctrl-C reaches the learner; it stops us
    signal.signal(signal.SIGTERM, signal.SIG_DFL)  # nothing to save: end at once, even mid-evaluation
    torch.set_num_threads(1)
    cfg: Config = config_from_dict(cfg_dict, source=source)
    t = cfg.trainer
    if t.video.every > 0:
        _render_offscreen()
    env = make_env(cfg.env.id, t.num_eval_episodes, cfg.env.cfg, t.eval_device, render=t.video.every > 0,
                   tokenizer=instruction_tokenizer(cfg))
    policy = make_policy(cfg, env.spec).to(t.eval_device).eval()
    video = VideoRecorder(cfg, run_dir, env)
    best = BestKeeper(run_dir, t.keep_best, resume)
    _start_video(video, cfg)
    ctx = zmq.Context()
    client = CurveClient.from_strings(curve) if curve is not None else None
    sub = WeightsSubscriber(ctx, endpoints["weights"], curve=client)
    push = RolloutPusher(ctx, endpoints["eval"], hwm=16)   # loopback to our parent: no CURVE needed
    shm = ShmWeightsReader()
    next_eval = t.eval_freq
    count = 0
    last: dict | None = None   # the last result, reused when the final weights were already evaluated
    try:
        while os.getppid() == parent_pid:
            msg = sub.newest(timeout_ms=200)
            if msg is None:
                continue
            td, meta = msg
            if meta.get("kind") == "stop":
                if meta.get("who") == "actors":
                    continue  # the run is over for actors; the final weights follow
                break
            steps = meta.get("env_steps", 0)
            if not (_is_int(steps) and steps >= 0):
                log.warning("evaluator: weights message with env_steps %r ignored", steps)
                continue
            final = bool(meta.get("final"))
            if not (final or (t.eval_freq and steps >= next_eval)):
                continue
            if final and last is not None and last["version"] == meta.get("version"):
                _send_final_again(push, last, video, env)
                continue
            if not _load_weights(policy, td, meta, shm, t.eval_device):
                continue
            last = _evaluation_result(policy, env, t, video, best, meta, count=count, final=final, steps=steps,
                                      token=token)
            count += 1
            if t.eval_freq:
                next_eval = (steps // t.eval_freq + 1) * t.eval_freq
            push.send(wire.encode(TensorDict({}, []), **last), timeout_ms=5000)
            if final and video.deferred:   # training is over: render what was kept for now
                log.info("evaluator: rendering %d deferred evaluation videos", len(video.deferred))
                video.render_deferred(env)
    finally:
        video.close()
        env.close()
        sub.close()
        push.close()
        ctx.term()
