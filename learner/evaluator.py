"""Evaluator process: deterministic episodes on separate envs, off the training path.

It subscribes to the learner's weights like an actor, evaluates the newest weights each time the
env-step count passes a multiple of ``eval_freq`` (and the final weights), and pushes the results
back to the learner as a small ``kind="eval"`` message. Training never waits for it.
"""

from __future__ import annotations

import logging
import os
import signal
import time

import torch
import zmq
from tensordict import TensorDict

from shared import keys, wire
from shared.config import Config, config_from_dict
from shared.envs import make_env
from shared.policies import make_policy
from shared.security import CurveClient
from shared.shm_weights import ShmWeightsReader, load_published_
from shared.transport import RolloutPusher, WeightsSubscriber

log = logging.getLogger("tandem.evaluator")


@torch.inference_mode()
def evaluate(policy: torch.nn.Module, env, num_episodes: int, seed: int
             ) -> tuple[list[float], list[int], list[bool]]:
    """Run the first episode of each of ``env.num_envs`` envs with the deterministic policy.
    Returns episode returns, lengths and (for tasks that define it) successes."""
    obs = env.reset(seed=seed)
    n = env.num_envs
    returns: list[float | None] = [None] * n
    lengths: list[int | None] = [None] * n
    successes: list[bool | None] = [None] * n
    ep_ret = torch.zeros(n, dtype=torch.float64)
    ep_len = torch.zeros(n, dtype=torch.int64)
    limit = env.spec.max_episode_steps or 100_000
    for _ in range(limit + 1):
        td = policy(TensorDict({keys.OBS: obs}, batch_size=[n]), deterministic=True)
        step = env.step(td[keys.ACTION])
        ep_ret += step.reward.double().cpu()
        ep_len += 1
        done = (step.terminated | step.truncated).cpu()
        for j, i in enumerate(torch.nonzero(done).flatten().tolist()):
            if returns[i] is None:
                returns[i], lengths[i] = float(ep_ret[i]), int(ep_len[i])
                if j < len(step.episode_successes):
                    successes[i] = bool(step.episode_successes[j])
        ep_ret[done] = 0.0
        ep_len[done] = 0
        obs = step.obs
        if all(r is not None for r in returns):
            break
    return ([r for r in returns if r is not None][:num_episodes], [n for n in lengths if n is not None][:num_episodes],
            [x for x in successes if x is not None][:num_episodes])


def run_evaluator(cfg_dict: dict, source: str, endpoints: dict[str, str], parent_pid: int,
                  curve: dict[str, str] | None = None, token: str | None = None) -> None:
    """Entry point of the evaluator process (spawned by the learner). Results go to the learner's
    evaluator socket (``endpoints["eval"]``, loopback) with the per-run `token` the learner gave."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the launcher's Ctrl-C reaches the learner; it stops us
    signal.signal(signal.SIGTERM, signal.SIG_DFL)  # nothing to save: end at once, even mid-evaluation
    torch.set_num_threads(1)
    cfg: Config = config_from_dict(cfg_dict, source=source)
    t = cfg.trainer
    env = make_env(cfg.env.id, t.num_eval_episodes, cfg.env.cfg, "cpu")
    policy = make_policy(cfg, env.spec).eval()
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
            if not (isinstance(steps, int) and not isinstance(steps, bool) and steps >= 0):
                log.warning("evaluator: weights message with env_steps %r ignored", steps)
                continue
            final = bool(meta.get("final"))
            if not (final or (t.eval_freq and steps >= next_eval)):
                continue
            if final and last is not None and last["version"] == meta.get("version"):
                last["final"] = True
                push.send(wire.encode(TensorDict({}, []), **last), timeout_ms=5000)
                continue
            try:
                if not load_published_(policy, td, meta, shm, "cpu"):
                    continue   # a torn shared-memory read: evaluate the next version instead
            except Exception as e:   # weights that do not fit this policy: skip them, never die
                log.warning("evaluator: could not load weights version %r: %s", meta.get("version"), e)
                continue
            t0 = time.perf_counter()
            returns, lengths, successes = evaluate(policy, env, t.num_eval_episodes, seed=t.seed + 1_000_003 + count)
            count += 1
            if t.eval_freq:
                next_eval = (steps // t.eval_freq + 1) * t.eval_freq
            last = dict(kind="eval", sender="evaluator", token=token, version=meta.get("version"), env_steps=steps,
                        returns=returns, lengths=lengths, successes=successes, final=final,
                        eval_s=time.perf_counter() - t0)
            push.send(wire.encode(TensorDict({}, []), **last), timeout_ms=5000)
    finally:
        env.close()
        sub.close()
        push.close()
        ctx.term()
