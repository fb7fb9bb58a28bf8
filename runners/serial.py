"""The serial runner: Tandem's actors and learner in one process, one after the other, no sockets.

The readable reference for Tandem's data flow, and the in-process API other tools build on::

    learner = Learner(cfg, run_dir, LatestWeights())            # no sockets: weights go to an in-process sink
    learner.publish()                                           # version 0
    rollout, stats, _ = collector.collect(version)              # the actors' Collector, any env
    learner.ingest(rollout, RolloutMeta.of(actor, seq, stats).to_meta())   # the wire's checks, then the buffer
    batch = learner.take_batch(timeout_s=0)                     # (data, infos) or None
    learner.update_once(*batch)                                 # one PPO/GRPO update; publishes v + 1

:class:`SerialRunner` wires exactly that: one ``Collector`` per configured actor (``actors.num_actors``
envs of ``actors.num_envs`` each, seeded as the actor processes seed theirs), each acting with its
own policy copy that loads the published weights as an actor does, and the learner the learner
process runs. Every rollout is acted by the current version (lag 0), so it is on-policy in both
modes. Evaluations run in-process every ``trainer.eval_freq`` env steps, on the episodes the
evaluator process would play. ``step()`` is one turn; its halves ``collect()`` (the actors) and
``train()`` (the learner's updates) are there for benchmarks that time them and tests that look at
what passes between them. A loop that does something else on purpose (lagged or forged rollouts)
builds on :class:`SerialActor` and the :class:`Learner` directly.

    python -m runners.serial --config configs/cartpole_ppo.json [--steps N] [--out DIR] [--set K=V ...]
"""

from __future__ import annotations

import argparse
import logging
import sys
import time
from pathlib import Path
from typing import Any

import torch
from tensordict import TensorDictBase

from actors.rollout import Collector
from shared.chunks import actions_per_call, env_steps_of
from learner.corrections import correction_rule
from learner.disk import DISK, RunDirWriteError, catch_background_write_errors
from learner.evaluator import eval_seed, evaluate
from learner.learner import Learner
from learner.logs import RunLogger
from shared.config import Config, ConfigError, load_config, save_config
from shared.console import say
from shared.envs import check_env_config, make_env
from shared.instructions import instruction_tokenizer
from shared.policies import has_critic, load_weights_, make_policy
from shared.rollout import RolloutMeta, actor_seed, group_seeds, sends_bootstrap_obs


class LatestWeights:
    """The learner's publisher in one process: keeps the newest weights message only."""

    def __init__(self):
        self.weights: TensorDictBase | None = None
        self.meta: dict[str, Any] = {}

    def publish(self, td: TensorDictBase, **meta: Any) -> None:
        self.weights, self.meta = td.clone(), meta

    def send_control(self, **meta: Any) -> None:   # credits and stop messages: no actor to tell
        pass


class SerialActor:
    """One actor's env, policy copy and collector, as ``actors/actor.py`` builds them, without sockets."""

    def __init__(self, cfg: Config, actor_id: int, device: str | None = None):
        self.cfg, self.actor_id, self.seq = cfg, actor_id, 0
        self.seed = actor_seed(cfg, actor_id)                          # the actor process's seed
        torch.manual_seed(self.seed)
        self.device = torch.device(device or cfg.actors.devices[actor_id % len(cfg.actors.devices)])
        self.env = make_env(cfg.env.id, cfg.actors.num_envs, cfg.env.cfg, cfg.env.device or self.device,
                            tokenizer=instruction_tokenizer(cfg))
        self.policy = make_policy(cfg, self.env.spec).to(self.device).eval()
        self.collector = Collector(self.env, self.policy, cfg.trainer.buffer_size, seed=self.seed,
                                   bootstrap_obs=sends_bootstrap_obs(cfg, has_critic(self.policy)),
                                   actions_per_call=actions_per_call(cfg, self.policy), gamma=cfg.algorithm.cfg.gamma)
        self.version = -1

    def load(self, weights: TensorDictBase, version: int) -> None:
        if version != self.version:
            load_weights_(self.policy, weights.to(self.device))
            self.version = version

    def collect(self) -> tuple[TensorDictBase, dict]:
        rollout, stats, _ = self.collector.collect(self.version, reset_seeds=group_seeds(self.cfg, self.actor_id, self.seq))
        meta = RolloutMeta.of(self.actor_id, self.seq, stats, policy_version=self.version, env_steps=env_steps_of(rollout))
        self.seq += 1
        return rollout, meta.to_meta()

    def close(self) -> None:
        self.env.close()


class SerialRunner:
    """Collect with every actor, ingest, update; evaluate every ``eval_freq`` env steps.

    Args:
        cfg: the run's config.
        run_dir: where metrics, TensorBoard files and checkpoints go; None writes nothing.
        evaluate_every: env steps between evaluations (default ``trainer.eval_freq``; 0: none).
    """

    def __init__(self, cfg: Config, run_dir: Path | None = None, evaluate_every: int | None = None):
        correction_rule(cfg)     # a config built in code: its config.json names the correction it trains with
        self.cfg = cfg
        self.run_dir = Path(run_dir) if run_dir is not None else None
        self.logger = None
        if self.run_dir is not None:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            save_config(cfg, self.run_dir / "config.json")
            self.logger = RunLogger(self.run_dir, config=cfg.to_dict())
        self.weights = LatestWeights()
        self.learner = Learner(cfg, self.run_dir, self.weights, logger=self.logger)
        self.actors = [SerialActor(cfg, i) for i in range(cfg.actors.num_actors)]
        self.eval_every = cfg.trainer.eval_freq if evaluate_every is None else evaluate_every
        self.evaluations = 0
        self._eval_env = None
        self.learner.publish()

    # ------------------------------------------------------------------ one turn
    def step(self) -> bool:
        """Every actor collects one rollout with the current weights; the learner trains on them.
        Returns False once the run's env steps are all in."""
        learner = self.learner
        if learner.finished:
            return False
        for rollout, meta in self.collect():
            learner.ingest(rollout, meta)
        self.train()
        if DISK.failed:   # the run directory cannot be written (a full disk): stop, and say where to resume
            raise RunDirWriteError(DISK.line(learner.checkpoints.last_intact()))
        if self.eval_every and learner.env_steps >= (self.evaluations + 1) * self.eval_every:
            self.evaluate()
        return not learner.finished

    def collect(self) -> list[tuple[TensorDictBase, dict]]:
        """Every actor loads the newest weights and collects one rollout: ``(rollout, meta)`` per
        actor, not yet ingested. A rollout is its collector's storage: clone it to keep it past
        that actor's next collection."""
        out = []
        for actor in self.actors:
            actor.load(self.weights.weights, self.learner.version)
            out.append(actor.collect())
        return out

    def train(self) -> list[dict]:
        """One update per full batch the learner holds (each publishes the next version); returns
        the updates' stats (``Learner.update_once``), none if no batch is complete."""
        stats = []
        while (batch := self.learner.take_batch(timeout_s=0)) is not None:
            stats.append(self.learner.update_once(*batch))
            self.learner.maybe_save()
        return stats

    def evaluate(self) -> dict:
        """The deterministic policy on ``num_eval_episodes`` episodes (the evaluator's seeds); logged."""
        t = self.cfg.trainer
        if self._eval_env is None:
            self._eval_env = make_env(self.cfg.env.id, t.num_eval_episodes, self.cfg.env.cfg, t.eval_device,
                                      tokenizer=instruction_tokenizer(self.cfg))
        policy = self.actors[0].policy
        self.actors[0].load(self.weights.weights, self.learner.version)
        result = evaluate(policy, self._eval_env, t.num_eval_episodes,
                          seed=eval_seed(t.seed, self.evaluations, t.eval_seeds))
        self.evaluations += 1
        meta = {"returns": result.returns, "lengths": result.lengths, "successes": result.successes,
                "version": self.learner.version, "env_steps": self.learner.env_steps}
        self.learner.log_eval(meta)
        return meta

    def run(self, log_interval_s: float | None = None) -> dict:
        """Train until ``total_steps``; returns the last evaluation (``eval/…``), after a final one."""
        interval = self.cfg.trainer.log_interval_s if log_interval_s is None else log_interval_s
        last = time.time()
        try:
            while self.step():
                if time.time() - last >= interval:
                    say(self.learner.progress_line().replace("[learner]", "[serial]"))
                    last = time.time()
            if self.learner.last_eval is None or self.learner.last_eval["version"] != self.learner.version:
                self.evaluate()
            say(self.learner.progress_line().replace("[learner]", "[serial]"))
            self.learner.save()
            if DISK.failed:
                raise RunDirWriteError(DISK.line(self.learner.checkpoints.last_intact()))
            return dict(self.learner.last_eval or {})
        finally:
            self.close()

    def close(self) -> None:
        for actor in self.actors:
            actor.close()
        if self._eval_env is not None:
            self._eval_env.close()
        if self.logger is not None:
            self.logger.close()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m runners.serial", description=__doc__.split("\n\n")[0])
    p.add_argument("--config", default="configs/cartpole_ppo.json", help="JSON config (default: CartPole PPO)")
    p.add_argument("--steps", type=int, help="env steps (trainer.total_steps)")
    p.add_argument("--out", type=Path, help="run directory for metrics, TensorBoard and checkpoints (default: none)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a config key")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="[serial] %(message)s")
    try:
        cfg = load_config(args.config, args.set + ([f"trainer.total_steps={args.steps}"] if args.steps else []))
        check_env_config(cfg)   # env.cfg's keys and values, the instruction tokenizer: one message, no traceback
    except ConfigError as e:
        print(e, file=sys.stderr)
        return 2
    torch.set_num_threads(1)
    catch_background_write_errors()
    try:
        runner = SerialRunner(cfg, args.out)
    except ConfigError as e:   # e.g. a tokenizer that is not the model's
        print(e, file=sys.stderr)
        return 2
    except OSError as e:       # the run directory cannot be written at start-up
        print(f"[serial] cannot write the run directory {e.filename or ''}: [Errno {e.errno}] {e.strerror}",
              file=sys.stderr)
        return 1
    try:
        result = runner.run()
    except RunDirWriteError as e:
        say(str(e).replace("[learner]", "[serial]"))
        return 1
    say(f"[serial] done: eval return {result.get('eval/return_mean', float('nan')):.1f} at version "
        f"{result.get('version')}" + (f"; run directory {args.out}" if args.out else ""))
    return 0


if __name__ == "__main__":
    from shared.teardown import exit_now
    exit_now(main())
