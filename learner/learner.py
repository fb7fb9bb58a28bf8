"""Learner process: receives rollouts, keeps the circular buffer, runs PPO, publishes weights.

The whole data flow of the learner is wired here::

    receiver thread:  PULL --decode--> Intake (schema) --> lag filter --> Batcher (CircularBuffer)
    main thread:      Batcher --take--> algorithm.prepare (GAE, corrections) --> algorithm.update
                          --> version + 1 --> WeightsOut (XPUB or shared memory) --> logs, checkpoints
    evaluator process: SUB (weights) --> deterministic episodes --> PUSH (eval results)

One object per role: :class:`~learner.ingest.Intake` (validation), :class:`~learner.batching.Batcher`
(buffer and batches), the algorithm (:class:`~learner.ppo.PPO` or :class:`~learner.grpo.GRPO`),
run on each batch by :class:`~learner.training.Training`,
:class:`~learner.weights_out.WeightsOut`, :class:`~learner.counters.RunCounters`,
:class:`~learner.update_log.UpdateLog` and :class:`~learner.checkpoint.Checkpoints`. ``Learner`` holds
the policy, the optimiser and the version, and wires the rest; ``learner/process.py`` adds the sockets.

Only the main thread touches the policy and the optimiser. The receiver thread touches the buffer
(thread-safe) and counters under a lock. ``Learner`` also runs in-process without sockets
(``ingest`` + ``take_batch`` + ``update_once``; ``runners/serial.py`` shows how).
"""

from __future__ import annotations

import json
import logging
import math
import queue
import time
import uuid
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

import torch
from tensordict import TensorDictBase

from learner.batching import Batcher
from learner.checkpoint import Checkpoints, load_policy_tensors_
from learner.corrections import correction_rule
from learner.disk import DISK
from learner.counters import MAX_FAILED_UPDATES, RunCounters, SkippedSteps  # noqa: F401 (re-exported)
from learner.cpu_threads import CpuThreads, learner_threads, uses_critic_thread  # noqa: F401 (re-exported)
from learner.fast_epochs import MinibatchStep, capturable_policy, resolve_mode
from learner.grpo import GRPO
from learner.ingest import Intake, RejectedMessage  # noqa: F401 (RejectedMessage: re-exported)
from learner.logs import RunLogger
from learner.ppo import PPO
from learner.record import BatchRecorder
from learner.training import Training
from learner.update_log import UpdateLog
from learner.weights_out import ListPublisher, Publisher, WeightsOut  # noqa: F401 (re-exported)
from shared import keys
from shared.chunks import env_steps_of
from shared.config import Config, ConfigError
from shared.envs import EnvSpec, env_spec
from shared.policies import frozen_digest, has_critic, make_policy, observation_bounds, published_state, weights_digest
from shared.rollout import policy_layout, rollout_template, sends_bootstrap_obs

if TYPE_CHECKING:
    from learner.distributed import Ranks

log = logging.getLogger("tandem.learner")

def make_optimizer(policy: torch.nn.Module, lr: float, eps: float) -> torch.optim.Adam:
    # The fused kernel is faster per minibatch for small MLPs on CPU and is what CUDA wants too.
    params = [p for p in policy.parameters() if p.requires_grad]   # frozen parts are not optimised
    try:
        return torch.optim.Adam(params, lr=lr, eps=eps, fused=True)
    except (RuntimeError, TypeError):
        return torch.optim.Adam(params, lr=lr, eps=eps)


def env_spec_of(cfg: Config) -> EnvSpec:
    return env_spec(cfg.env.id, cfg.env.cfg)


def make_algorithm(cfg: Config, spec: EnvSpec, policy: torch.nn.Module, optimizer: torch.optim.Optimizer,
                   generator: torch.Generator, device: torch.device, k: int, count, cpu: CpuThreads, ranks=None):
    """The run's :class:`PPO` or :class:`GRPO`, for a learner rank that trains on `k` rollouts per update."""
    a = cfg.algorithm.cfg
    capturable = capturable_policy(policy) and bool(optimizer.defaults.get("fused"))
    mode, why = resolve_mode(cfg.learner.compile, device, capturable, ranks)
    if why:
        log.warning(why)
    step = MinibatchStep(mode, policy, optimizer, a.max_grad_norm) if mode != "off" else None
    if cfg.algorithm.name == "grpo":
        return GRPO(a, policy, optimizer, generator, lambda: make_policy(cfg, spec).to(device), step)
    if not has_critic(policy):
        raise ValueError(f"{cfg.source}: PPO needs a value estimate, and this {cfg.policy.name!r} policy has "
                         f"none (give the VLA model a value(obs) head, or use algorithm.name \"grpo\")")
    samples = k * cfg.actors.num_envs * cfg.trainer.buffer_size
    steps = a.n_epochs * math.ceil(samples / a.batch_size)
    return PPO(a, policy, optimizer, generator, device, steps, count, None if step else cpu.critic_thread, step)


class Learner:
    """Policy, optimiser, algorithm and version for one run, wired to the buffer, the weights out,
    the counters, the logs and the checkpoints.

    Args:
        cfg: the run's config.
        run_dir: where logs and checkpoints go (None: nowhere).
        publisher: where new weights go (``WeightsPublisher``, ``ListPublisher``, ``LatestWeights``).
        resume: True: continue from the newest intact checkpoint in ``run_dir/checkpoints`` (damaged
            ones are skipped, and named in :attr:`resume_skipped`); a path: from that checkpoint
            (``--resume-from``: no fallback).
        logger: a :class:`RunLogger`; None writes nothing (tests).
        discard: benchmark mode: receive, decode, check and count, never store.
        ranks: several learner ranks (``learner/distributed.py``); None: one process.
    """

    def __init__(self, cfg: Config, run_dir: Path | None, publisher: Publisher, resume: bool | Path = False,
                 logger: RunLogger | None = None, discard: bool = False, ranks: Ranks | None = None):
        if problems := correction_rule(cfg):    # a config built in code: the mode's default correction too
            raise ConfigError("; ".join(problems))
        self.cfg, self.ranks, self.discard, self.logger = cfg, ranks, discard, logger
        self.run_dir = Path(run_dir) if run_dir is not None else None
        self.device = torch.device(cfg.learner.device)
        t = cfg.trainer
        self.standard = t.buffer_type == "standard"
        self.k = cfg.rollouts_per_update // (ranks.world if ranks else 1)   # this rank's share
        torch.manual_seed(t.seed)
        self.spec = env_spec_of(cfg)
        self.policy = make_policy(cfg, self.spec, describe=True).to(self.device)
        self.base_digest = frozen_digest(self.policy)   # what never travels: actors must hold the same
        self.optimizer = make_optimizer(self.policy, cfg.algorithm.cfg.learning_rate, cfg.algorithm.cfg.adam_eps)
        self.generator = torch.Generator().manual_seed(t.seed)
        self.cpu = CpuThreads(cfg, self.policy, ranks, batch_waiting=lambda: self.standard or len(self.batcher) >= self.k)
        self.stats = RunCounters(cfg.actors.num_actors)   # shared with the receiver thread, one lock
        self.training = Training(cfg, self.policy, self.optimizer, make_algorithm(
            cfg, self.spec, self.policy, self.optimizer, self.generator, self.device, self.k, self.stats.count,
            self.cpu, ranks), self.cpu, self.stats, ranks)
        self.template = rollout_template(self.spec, cfg.actors.num_envs, t.buffer_size,
                                         with_value=has_critic(self.policy),
                                         with_bootstrap_obs=sends_bootstrap_obs(cfg, has_critic(self.policy)),
                                         **policy_layout(self.policy))
        self.batcher = Batcher(cfg, self.template, self.k, lambda: self.version, self._drop)
        self.version = self.env_steps_trained = self.updates = 0
        # This life of the learner: a new one after every restart (--resume too). Weights messages
        # carry it, so that actors take a restarted learner's versions even when they are lower.
        self.incarnation = uuid.uuid4().hex[:16]
        if ranks is not None:   # one learner of several ranks: rank 0's identity for all (actors send to each)
            self.incarnation = f"{ranks.all_gather_ints([int(self.incarnation, 16) >> 2])[0][0]:016x}"
        self.skips = SkippedSteps(self.stats)   # stops a run whose updates keep failing
        self.curve = None                            # a shared.security.CurveServer, set by the learner process
        self.peer_env_steps = 0                      # env steps the other learner ranks received
        self.peer_finished: list[int] | None = None  # their per-actor consumed/dropped counts
        self._digests = (self.run_dir / "ranks" / f"rank{ranks.rank if ranks else 0}.jsonl"
                         if cfg.learner.rank_digests and self.run_dir is not None else None)
        self.recorder = BatchRecorder(self.run_dir / "record") if t.record and self.run_dir is not None else None
        self.evals: "queue.Queue[dict]" = queue.Queue(maxsize=64)   # results from the evaluator
        self.update_log = UpdateLog(cfg, self.stats, logger)   # metrics of each update and evaluation
        self.accepting = True          # False once the run's env steps are all in (LearnerRun._drain)
        self.budget_closes_intake = False   # LearnerRun sets it for a lone learner process (_accepting)
        # Asked between minibatches: True (a stop signal; LearnerRun sets it) cuts the update short, so
        # that a long update does not hold up shutdown. One rank only: DDP ranks take the same steps.
        self.stop_requested: Callable[[], bool] | None = None
        self.checkpoints = Checkpoints(self.run_dir, t.save_freq)
        self.resume_skipped: list[str] = []
        self.resumed_from: Path | None = (self._resume(None if resume is True else Path(resume))
                                          if resume else None)
        shm = cfg.learner.weights_transport in ("shm", "cuda_ipc") and (ranks is None or ranks.is_main)
        self.weights_out = WeightsOut(publisher, self.policy, self.device, self.incarnation, self.base_digest,
                                      shm_slots=cfg.learner.shm_slots if shm else None, run_dir=self.run_dir,
                                      shm_device=self.device if cfg.learner.weights_transport == "cuda_ipc" else None)
        self.publish_times, self.shm_writer = self.weights_out.publish_times, self.weights_out.shm_writer
        self.intake = Intake(cfg, self.spec, self.template, self.stats, store=self._store,
                             version=lambda: self.version, accepting=self._accepting,
                             publish_times=self.publish_times, evals=self.evals, logger=self.logger,
                             base_digest=self.base_digest, incarnation=self.incarnation,
                             obs_bounds=observation_bounds(self.policy))

    algorithm = property(lambda self: self.training.algorithm,
                         lambda self, value: setattr(self.training, "algorithm", value),
                         doc="The run's PPO or GRPO (``Training``'s).")
    publisher = property(lambda self: self.weights_out.publisher,
                         lambda self, value: setattr(self.weights_out, "publisher", value),
                         doc="Where weights messages go (``WeightsOut``'s publisher).")
    buffer = property(lambda self: self.batcher.buffer, doc="The circular buffer of received rollouts.")
    counts = property(lambda self: self.stats.counts, doc="What happened to every message and rollout.")
    time_totals = property(lambda self: self.stats.time_totals, doc="Update and collection seconds so far.")
    finished_per_actor = property(lambda self: self.stats.finished_per_actor)
    first_rollout_time = property(lambda self: self.stats.first_rollout_time)
    last_rollout_time = property(lambda self: self.stats.last_rollout_time)

    @property
    def env_steps(self) -> int:
        """Env steps received (trained on or dropped), by this learner rank."""
        return self.stats.env_steps

    @env_steps.setter
    def env_steps(self, value: int) -> None:
        with self.stats.lock:
            self.stats.env_steps = value

    # ================================================================ receiving (any thread)
    def ingest(self, td: TensorDictBase, meta: dict) -> None:
        """Take one decoded rollout (in-process use; the receiver thread calls ``self.intake``).

        Raises:
            RejectedMessage: naming the sender and the problem; nothing was stored.
        """
        self.intake.rollout(td, meta)

    def _store(self, td: TensorDictBase, info: dict, other_learner: bool) -> None:
        """A rollout the intake accepted, into the batcher (any thread)."""
        if self.discard:
            return
        if other_learner:
            # Acted by weights an earlier life of the learner published (before a restart): its
            # version numbers are not this learner's, so its lag is unknown.
            self._drop(info, "other_learner")
            return
        self.algorithm.observe(info["actor"], td[keys.REWARD], td[keys.DONE])
        self.batcher.put(td, info)

    def _drop(self, info: dict, reason: str) -> None:
        self.stats.count_drop(reason)
        self._finished("drop", info, reason=reason)

    def _finished(self, event: str, info: dict, **extra: Any) -> None:
        """A rollout consumed or dropped: the pacing count, and its line in ``versions.jsonl``."""
        self.stats.finish(info["actor"])
        self.update_log.rollout_event(event, info, self.version, **extra)

    # ================================================================ batches (main thread)
    def take_batch(self, timeout_s: float = 0.05) -> tuple[TensorDictBase, list[dict]] | None:
        """The next `k` rollouts to train on ``[k, N, T]`` with their infos, or None if they are not
        all there within `timeout_s`. Rollouts too old for the current version are dropped."""
        return self.batcher.take(timeout_s)

    def drop_unconsumed(self, reason: str) -> None:
        """Record every rollout still held as dropped: each received rollout leaves exactly one
        consume or drop line."""
        self.batcher.drop_unconsumed(reason)

    # ================================================================ weights out (main thread)
    def publish(self, final: bool = False, event: str = "publish") -> None:
        if self.ranks is not None and not self.ranks.is_main:
            return                      # rank 0 publishes for every rank (they hold the same weights)
        env_steps = self.env_steps + self.peer_env_steps
        self.weights_out.publish(self.version, env_steps, self.finished_counts(), final)
        if not final:                   # final re-sends the current version: no new line
            self.update_log.published(event, self.version, env_steps, self.updates, self.incarnation)

    def maybe_send_credit(self, min_interval_s: float = 0.2) -> None:
        """lag_policy "pace": tell actors about rollouts finished (mostly dropped ones) since the last
        weights message, so that none waits for a credit that only the next update would bring."""
        if self.standard or self.cfg.trainer.lag_policy != "pace":
            return
        self.weights_out.send_credit(self.finished_counts(), min_interval_s)

    def finished_counts(self) -> list[int]:
        """Per actor, its rollouts consumed or dropped, over every learner rank."""
        mine = self.stats.finished()
        for actor, n in self.batcher.held().items():   # dynamic sampling: waiting for more groups
            mine[actor] += n
        if self.peer_finished is not None:
            mine = [a + b for a, b in zip(mine, self.peer_finished)]
        return mine

    # ================================================================ training (main thread)
    def update_once(self, data: TensorDictBase, infos: list[dict], reward_std: float | None = None
                    ) -> dict[str, float]:
        """One update on `k` rollouts ``[k, N, T]``; bumps the version and publishes.

        `reward_std` (replay only) replaces the reward scaler's running std with a recorded one."""
        t0, c0 = time.perf_counter(), time.process_time()
        lags = torch.cat([(self.version - data[i][keys.POLICY_VERSION]).reshape(-1) for i in range(len(infos))])
        for info in infos:
            self._finished("consume", info)
        # pace: the actors hear now, not with the next weights, that these rollouts are taken, so
        # each may collect its next rollout while this update runs (with max_inflight 1: a pipeline
        # of depth one, every sample trained by the version after the one that acted).
        self.maybe_send_credit(min_interval_s=0.0)
        if reward_std is None:   # once, before recording: a replay must scale with exactly this std
            reward_std = self.algorithm.reward_std(self.ranks.all_reduce_sum if self.ranks else None)
        if self.recorder is not None:
            self.recorder.write(data, infos, reward_std, self.updates + 1, self.version)
        flat = data.to(self.device).reshape(-1, data.shape[-1])   # [k*N, T]; GRPO groups stay within a rollout
        stats = self.training.run(flat, lags, reward_std, env_steps_trained=self.env_steps_trained,
                                  update=self.updates + 1, should_stop=self.stop_requested)
        if self.recorder is not None and self.cpu.idle_threads is not None:
            self.recorder.write_threads(self.updates + 1, self.cpu.schedule)
        self.skips.note(stats, self.updates + 1, self.version)
        # Normaliser statistics move after the update, so every epoch above saw the same
        # normalisation the actors acted with: the first epoch's ratio is exactly 1.
        self.policy.update_normalizer(flat[keys.OBS], all_reduce=self.ranks.all_reduce_sum if self.ranks else None)
        self.env_steps_trained += env_steps_of(flat) * (self.ranks.world if self.ranks else 1)
        self.updates += 1
        self.version += 1
        if self.ranks is not None:   # the other ranks consumed their shares in this same update
            mine = self.stats.finished()
            rows = self.ranks.all_gather_ints(mine)
            self.peer_finished = [sum(r[i] for j, r in enumerate(rows) if j != self.ranks.rank)
                                  for i in range(len(mine))]
        self.publish()
        if self._digests is not None:
            self._write_digest()
        update_s, update_cpu_s = time.perf_counter() - t0, time.process_time() - c0
        self.stats.add_times(update_wall_s=update_s, update_cpu_s=update_cpu_s)
        self.update_log.update(stats, lags, update_s, update_cpu_s, version=self.version, updates=self.updates,
                               learning_rate=float(self.optimizer.param_groups[0]["lr"]), buffer_fill=len(self.batcher),
                               wait_s=self.batcher.wait_s,
                               auth_refused=self.curve.refused if self.curve is not None else None,
                               weights_asks=getattr(self.weights_out.publisher, "asks", None))
        self.batcher.wait_s = 0.0
        return stats

    def _write_digest(self) -> None:
        """rank_digests: this rank's weights after the update, as a SHA-256 (ranks must agree)."""
        self._digests.parent.mkdir(parents=True, exist_ok=True)
        with open(self._digests, "a") as f:
            f.write(json.dumps({"version": self.version, "updates": self.updates,
                                "sha256": weights_digest(self.policy)}) + "\n")

    # ================================================================ logs
    def log_eval(self, meta: dict) -> None:
        self.update_log.evaluation(meta)

    def progress_line(self) -> str:
        return self.update_log.progress_line(self.version)

    last_update_values = property(lambda self: self.update_log.last_values)
    last_eval = property(lambda self: self.update_log.last_eval)
    best_eval = property(lambda self: self.update_log.best_eval)
    start_time = property(lambda self: self.update_log.start_time)

    # ================================================================ checkpoints
    def state_dict(self) -> dict[str, Any]:
        """Every component's state, merged. Only what trains is saved (a frozen base is reloaded
        from vla_config.model_path and checked by digest)."""
        return {"policy": {k: v.detach() for k, v in published_state(self.policy).items()},
                "base_digest": self.base_digest, "optimizer": self.optimizer.state_dict(),
                "version": self.version, "env_steps": self.env_steps + self.peer_env_steps,
                "env_steps_trained": self.env_steps_trained, "updates": self.updates,
                "generator": self.generator.get_state(), "torch_rng": torch.get_rng_state(),
                "counts": dict(self.counts), "reward_scaler": None, "ref_policy": None,
                **self.algorithm.state_dict(), **self.checkpoints.state_dict()}

    def save(self) -> Path | None:
        """A checkpoint of this version (rank 0 only). A failed write (a full disk) leaves none, and is
        handed to ``learner.disk.DISK``, which stops the run; returns None then."""
        if self.ranks is not None and not self.ranks.is_main:
            return None
        try:
            return self.checkpoints.save(self.state_dict(), self.version)
        except OSError as e:
            DISK.record(self.checkpoints.path_for(self.version), e)
            return None

    def maybe_save(self) -> None:
        total = self.env_steps + self.peer_env_steps
        if self.checkpoints.due(total):
            self.save()
            self.checkpoints.saved_at(total)

    def _resume(self, resume_from: Path | None) -> Path:
        path, state, self.resume_skipped = self.checkpoints.load_for_resume(self.device, resume_from)
        saved_base = state.get("base_digest")
        if saved_base is not None and saved_base != self.base_digest:
            raise RuntimeError(f"--resume: {path} was trained on another base model (frozen weights digest "
                               f"{saved_base[:16]}, this config's is {self.base_digest[:16]}): check "
                               f"policy.vla_config.model_path")
        load_policy_tensors_(self.policy, state["policy"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.version, self.env_steps, self.updates = state["version"], state["env_steps"], state["updates"]
        if self.ranks is not None and not self.ranks.is_main:
            self.env_steps = 0      # the checkpoint's count is the total over ranks: rank 0 carries it
        self.env_steps_trained = state["env_steps_trained"]
        self.generator.set_state(state["generator"])
        torch.set_rng_state(state["torch_rng"])
        self.counts.update(state["counts"])
        self.checkpoints.load_state_dict(state)
        self.algorithm.load_state_dict(state)
        log.info("resumed from %s: version %d, %d env steps%s", path, self.version, self.env_steps,
                 f" (skipped {len(self.resume_skipped)} damaged: {'; '.join(self.resume_skipped)})"
                 if self.resume_skipped else "")
        return path

    def _accepting(self) -> bool:
        """Whether the intake may still take rollouts. With ``budget_closes_intake`` (a lone learner
        process) it stops taking them the moment the env steps reach the budget: asked by the receiver
        thread, the only one that counts them, so a rollout arriving before the loop sees the run
        finished is neither counted nor stored. DDP ranks decide the end together (``_agree``) and the
        serial runner decides its own, so they stop only at ``accepting``."""
        return self.accepting and not (self.budget_closes_intake and self.finished)

    @property
    def finished(self) -> bool:
        return self.env_steps + self.peer_env_steps >= self.cfg.trainer.total_steps
