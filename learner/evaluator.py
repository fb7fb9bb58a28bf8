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
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

import torch
import zmq
from tensordict import TensorDict

from learner.checkpoint import load_checkpoint, save_atomic
from learner.video import FrameCapture, Frames, VideoRecorder, render_offscreen, start_video
from shared import keys, wire
from shared.chunks import chunk_size
from shared.config import Config, TrainerConfig, config_from_dict
from shared.envs import make_env
from shared.instructions import instruction_tokenizer
from shared.metrics import mean_metrics
from shared.policies import frozen_digest, make_policy, published_state
from shared.security import CurveClient
from shared.shm_weights import ShmWeightsReader, load_published_
from shared.transport import RolloutPusher, WeightsSubscriber

log = logging.getLogger("tandem.evaluator")


@dataclass
class EvalResult:
    """What :func:`evaluate` found. `returns`, `lengths`, `successes` (for tasks that define it) and
    `metrics` (the env metrics, ``StepResult.episode_metrics``, where the env reports any) are those
    of the first `num_episodes` episodes; `per_env` is ``{env index: return}`` of every episode that
    ended (to check that a replay followed the evaluation); `frames` ``{env index: [frame, ...]}``
    the rendered frames (see :class:`~learner.video.Frames`); `actions` every step's action batch
    where `keep_actions` asked for them."""
    returns: list[float]
    lengths: list[int]
    successes: list[bool]
    metrics: list[dict[str, float]] = field(default_factory=list)
    per_env: dict[int, float] = field(default_factory=dict)
    frames: dict[int, list] = field(default_factory=dict)
    actions: list[torch.Tensor] = field(default_factory=list)


def _replayed(action: torch.Tensor, n: int) -> torch.Tensor:
    """A replayed action batch for `n` envs: where only the recorded envs' actions were kept, the
    others repeat env 0's (they do not matter: the envs are independent)."""
    if action.shape[0] < n:
        action = torch.cat([action, action[:1].expand(n - action.shape[0], *action.shape[1:])])
    return action


class ChunkedActing:
    """The deterministic policy's action for every env, one env step at a time: one call per step, or
    for an action-chunk policy one call per ``actions_per_call`` steps (or sooner, after an episode
    ended)."""

    def __init__(self, policy):
        self.policy = policy
        self.chunk = chunk_size(policy) if policy is not None else 1
        self.per_call = min(int(getattr(policy, "actions_per_call", 0) or self.chunk), self.chunk)
        self.plan, self.pos = None, 0

    def act(self, obs, n: int) -> torch.Tensor:
        if self.chunk == 1 or self.plan is None or self.pos >= self.per_call:
            out = self.policy(TensorDict({keys.OBS: obs}, batch_size=[n]), deterministic=True)[keys.ACTION]
            if self.chunk == 1:
                return out
            self.plan, self.pos = out, 0
        self.pos += 1
        return self.plan[:, self.pos - 1]

    def replan_if(self, ended: bool) -> None:
        if ended:
            self.plan = None


def _rng_devices() -> list[int]:
    """The CUDA devices whose random state an evaluation must save and restore (none before CUDA is used)."""
    return list(range(torch.cuda.device_count())) if torch.cuda.is_initialized() else []


@torch.inference_mode()
def evaluate(policy: torch.nn.Module | None, env, num_episodes: int, seed: int, *, frames: Frames | None = None,
             keep_actions: bool = False, replay: Sequence[torch.Tensor] | None = None) -> EvalResult:
    """Run the first episode of each of ``env.num_envs`` envs with the deterministic policy.

    `seed` resets the envs and also seeds torch's random generators for the evaluation's length, so
    a deterministic policy that still draws random numbers (π0's ODE starts from Gaussian noise) plays
    the same episodes the same way each time; the caller's random state is saved and restored.

    `frames` (evaluation videos): which envs' first episodes to render, how often and how much.

    Rendering later (``trainer.video.when: "end"``): `keep_actions` keeps every step's action
    batch; ``evaluate(None, env, ..., frames=..., replay=those actions)`` then steps the same envs
    from the same seed with them (no policy) and renders. Each replayed batch may hold only the
    first k envs' actions (the envs are independent: the others repeat env 0's). The replay stops
    when the actions run out or every recorded episode has ended.

    An action-chunk policy (shared/chunks.py) is called for all envs at once, and its first
    ``actions_per_call`` actions are executed before the next call; an episode ending calls it again
    at once for every env (the envs step in lockstep), as the actors do with envs that cannot step a
    subset."""
    with torch.random.fork_rng(devices=_rng_devices()):
        torch.manual_seed(seed)
        return _episodes(policy, env, num_episodes, seed, frames, keep_actions, replay)


def _episodes(policy, env, num_episodes: int, seed: int, frames: Frames | None, keep_actions: bool,
              replay: Sequence[torch.Tensor] | None) -> EvalResult:
    """:func:`evaluate`'s episodes, under the random state it set."""
    chunks = ChunkedActing(policy)
    obs = env.reset(seed=seed)
    n = env.num_envs
    returns: list[float | None] = [None] * n
    lengths: list[int | None] = [None] * n
    successes: list[bool | None] = [None] * n
    env_metrics: list[dict | None] = [None] * n
    ep_ret = torch.zeros(n, dtype=torch.float64)
    ep_len = torch.zeros(n, dtype=torch.int64)
    limit = env.spec.max_episode_steps or 100_000
    capture = FrameCapture(env, frames)
    actions: list[torch.Tensor] = []

    capture.take(0, returns)
    for t in range(limit + 1):
        if replay is not None:
            if t >= len(replay):
                break
            action = _replayed(replay[t], n)
        else:
            action = chunks.act(obs, n)
            if keep_actions:
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
        chunks.replan_if(bool(done.any()))
        obs = step.obs
        if all(r is not None for r in returns):
            break
        if replay is not None and capture.ended(returns):
            break   # a replay renders; the other envs' episodes were evaluated already
        if capture.recording:
            capture.take(t + 1, returns)
    done_ids = [i for i in range(n) if returns[i] is not None][:num_episodes]
    return EvalResult([r for r in returns if r is not None][:num_episodes],
                      [n for n in lengths if n is not None][:num_episodes],
                      [x for x in successes if x is not None][:num_episodes],
                      metrics=[env_metrics[i] for i in done_ids if env_metrics[i]],
                      per_env={i: r for i, r in enumerate(returns) if r is not None},
                      frames=capture.frames, actions=actions)


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


def _is_int(x) -> bool:
    """An int that is not a bool (what a message's version and env-step count must be)."""
    return isinstance(x, int) and not isinstance(x, bool)


def _load_weights(policy: torch.nn.Module, td, meta: dict, shm: ShmWeightsReader, device) -> bool:
    """Load a weights message into `policy`. False where it is skipped: a torn shared-memory read
    (the next version is evaluated instead) or weights that do not fit this policy (logged)."""
    try:
        return bool(load_published_(policy, td, meta, shm, device))
    except Exception as e:   # weights that do not fit this policy: skip them, never die
        log.warning("evaluator: could not load weights version %r: %s", meta.get("version"), e)
        return False


def _evaluate_recorded(policy: torch.nn.Module, env, t: TrainerConfig, video: VideoRecorder, count: int,
                       final: bool, seed: int, version, steps: int) -> EvalResult:
    """Evaluation number `count` of the loaded weights, from `seed`, with its video where `video`
    wants one: written at once, or its actions kept to render at the end. A renderer that fails
    turns videos off for the run and the evaluation is redone without it."""
    deferring = video.defers(count, final)
    frames = video.frames() if video.wants(count, final) and not deferring else None
    try:
        result = evaluate(policy, env, t.num_eval_episodes, seed=seed, frames=frames, keep_actions=deferring)
    except Exception as e:
        if frames is None:
            raise
        # the renderer failed: say so, stop recording, and evaluate without it
        log.warning("evaluator: rendering failed (%s: %s); videos are off for this run", type(e).__name__, e)
        video.enabled = False
        result = evaluate(policy, env, t.num_eval_episodes, seed=seed)
    if _is_int(version):   # it names the files
        if result.frames:
            video.write(result.frames, version, steps)
        elif result.actions:
            video.defer(seed, version, steps, result.actions, result.per_env)
    return result


def _evaluation_result(policy: torch.nn.Module, env, t: TrainerConfig, video: VideoRecorder, best: BestKeeper,
                       meta: dict, *, count: int, final: bool, steps: int, token: str | None) -> dict:
    """Evaluation number `count`, of the weights of message `meta` (loaded into `policy`), offered
    to `best`. Returns the fields of the result message to the learner."""
    t0 = time.perf_counter()
    seed = eval_seed(t.seed, count, t.eval_seeds)
    version = meta.get("version")
    r = _evaluate_recorded(policy, env, t, video, count, final, seed, version, steps)
    kept = _is_int(version) and best.offer(policy, r.returns, r.successes, version=version, env_steps=steps, seed=seed)
    return dict(kind="eval", sender="evaluator", token=token, version=version, env_steps=steps,
                returns=r.returns, lengths=r.lengths, successes=r.successes, final=final,
                metrics=mean_metrics(r.metrics),
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
        render_offscreen()
    env = make_env(cfg.env.id, t.num_eval_episodes, cfg.env.cfg, t.eval_device, render=t.video.every > 0,
                   tokenizer=instruction_tokenizer(cfg))
    policy = make_policy(cfg, env.spec).to(t.eval_device).eval()
    video = VideoRecorder(cfg, run_dir, env)
    best = BestKeeper(run_dir, t.keep_best, resume)
    start_video(video, cfg)
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
