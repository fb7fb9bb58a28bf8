"""Learner process: receives rollouts, keeps the circular buffer, runs PPO, publishes weights.

The whole data flow of the learner is wired here::

    receiver thread:  PULL --decode--> ingest (schema, lag filter) --> CircularBuffer
    main thread:      CircularBuffer --take--> GAE --> PPO --> version + 1 --> XPUB (weights)
                                                           \\-> logs, checkpoints
    evaluator process: SUB (weights) --> deterministic episodes --> PUSH (eval results)

Only the main thread touches the policy and the optimiser. The receiver thread touches the buffer
(thread-safe) and counters under a lock. ``Learner`` also runs in-process without sockets
(``ingest`` + ``update_once``) for tests and the serial mode.
"""

from __future__ import annotations

import json
import logging
import math
import queue
import threading
import time
import uuid
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

import torch
from tensordict import TensorDict, TensorDictBase

from learner.advantages import compute_gae
from learner.buffer import CircularBuffer
from learner.counters import RunCounters
from learner.cpu_threads import CpuThreads, learner_threads, uses_critic_thread  # noqa: F401 (re-exported)
from learner.checkpoint import list_checkpoints, load_checkpoint, load_policy_tensors_, save_checkpoint
from learner.ingest import Intake, RejectedMessage  # noqa: F401 (RejectedMessage: re-exported)
from learner.grpo import MASK, grpo_advantages, grpo_update
from learner.logs import RunLogger
from learner.minibatch import log_ratio
from learner.ppo import ppo_update
from learner.weights_out import Publisher, WeightsOut  # noqa: F401 (Publisher: re-exported)
from learner.update_log import UpdateLog
from learner.vtrace import EWMAProximal, bootstrap_mask, current_values, ewma_decay_for, vtrace
from shared import keys

if TYPE_CHECKING:
    from learner.distributed import Ranks
from shared.config import Config
from shared.console import say
from shared.envs import EnvSpec, env_spec
from shared.rollout import rollout_template, sends_bootstrap_obs
from shared.policies import (frozen_digest, has_critic, make_policy, published_state,
                             weights_digest, weights_td)
from shared.policies.normalization import RewardScaler

log = logging.getLogger("tandem.learner")


class ListPublisher:
    """In-process publisher for tests: keeps every (weights, meta) it was given (weights cloned), and
    control messages (stop, credit) apart, as the socket does (they never replace the weights)."""

    def __init__(self):
        self.published: list[tuple[TensorDictBase, dict]] = []
        self.controls: list[dict] = []

    def publish(self, td: TensorDictBase, **meta: Any) -> None:
        self.published.append((td.clone(), meta))

    def send_control(self, **meta: Any) -> None:
        self.controls.append(meta)


MAX_FAILED_UPDATES = 10   # updates in a row with no finite optimiser step before the run stops


def make_optimizer(policy: torch.nn.Module, lr: float, eps: float) -> torch.optim.Adam:
    # The fused kernel is ~35% faster per minibatch for small MLPs on CPU and is what CUDA wants too.
    params = [p for p in policy.parameters() if p.requires_grad]   # frozen parts are not optimised
    try:
        return torch.optim.Adam(params, lr=lr, eps=eps, fused=True)
    except (RuntimeError, TypeError):
        return torch.optim.Adam(params, lr=lr, eps=eps)


def env_spec_of(cfg: Config) -> EnvSpec:
    return env_spec(cfg.env.id, cfg.env.cfg)


class Learner:
    """Buffer + PPO + versioning + logging for one run.

    Args:
        cfg: the run's config.
        run_dir: where logs and checkpoints go.
        publisher: where new weights go (``WeightsPublisher`` or ``ListPublisher``).
        resume: continue from the newest checkpoint in ``run_dir/checkpoints``.
        logger: a :class:`RunLogger`; None writes nothing (tests).
    """

    def __init__(self, cfg: Config, run_dir: Path | None, publisher: Publisher, resume: bool = False,
                 logger: RunLogger | None = None, discard: bool = False, ranks: Ranks | None = None):
        self.cfg = cfg
        self.ranks = ranks       # several learner ranks (learner/distributed.py); None: one process
        self.discard = discard   # benchmark mode: receive, decode, check and count, never store
        self.run_dir = Path(run_dir) if run_dir is not None else None
        self.device = torch.device(cfg.learner.device)
        self.logger = logger
        self.algo = cfg.algorithm.cfg
        t = cfg.trainer
        self.standard = t.buffer_type == "standard"
        self.k = cfg.rollouts_per_update // (ranks.world if ranks else 1)   # this rank's share
        torch.manual_seed(t.seed)
        self.spec = env_spec_of(cfg)
        self.policy = make_policy(cfg, self.spec, describe=True).to(self.device)
        # What never travels (a frozen pretrained base): actors must hold the same, or be refused.
        self.base_digest = frozen_digest(self.policy)
        self.optimizer = make_optimizer(self.policy, self.algo.learning_rate, self.algo.adam_eps)
        self.generator = torch.Generator().manual_seed(t.seed)
        self.grpo = cfg.algorithm.name == "grpo"
        self.ewma = None   # the ewma correction's proximal policy (learner/vtrace.py)
        if not self.grpo and self.algo.correction == "ewma":
            samples = self.k * cfg.actors.num_envs * t.buffer_size
            steps = self.algo.n_epochs * math.ceil(samples / self.algo.batch_size)
            decay = self.algo.ewma_decay if self.algo.ewma_decay is not None else ewma_decay_for(steps)
            self.ewma = EWMAProximal(self.policy, decay)
        # CPU-thread scheduling of the update (learner/cpu_threads.py): a critic thread, idle cores
        self.cpu = CpuThreads(cfg, self.policy, ranks, batch_waiting=lambda: self.standard or len(self.buffer) >= self.k)
        # GRPO's KL penalty pulls towards the initial (e.g. pretrained) weights, frozen here.
        self.ref_policy = None
        if self.grpo and self.algo.kl_coef > 0:
            self.ref_policy = make_policy(cfg, self.spec).to(self.device).eval().requires_grad_(False)
            self.ref_policy.load_state_dict(self.policy.state_dict())
        normalize_reward = getattr(self.algo, "normalize_reward", False)
        self.reward_scaler = RewardScaler(self.algo.gamma) if normalize_reward else None
        if not self.grpo and not has_critic(self.policy):
            raise ValueError(f"{cfg.source}: PPO needs a value estimate, and this {cfg.policy.name!r} policy has "
                             f"none (give the VLA model a value(obs) head, or use algorithm.name \"grpo\")")
        self.template = rollout_template(self.spec, cfg.actors.num_envs, t.buffer_size,
                                         with_value=has_critic(self.policy),
                                         with_bootstrap_obs=sends_bootstrap_obs(cfg, has_critic(self.policy)))
        capacity = max(t.buffer_capacity, self.k) if not self.standard else 2 * self.k
        self.buffer = CircularBuffer(capacity, self.template)
        self._pending: list[tuple[TensorDictBase, dict]] = []   # taken, waiting for the rest of a batch
        self._data_ready = threading.Condition()
        n_act = cfg.actors.num_actors
        # Counters and recent episodes, shared with the receiver thread under their own lock.
        self.stats = RunCounters(n_act)
        self._lock = self.stats.lock
        self.version = 0
        self.env_steps_trained = 0
        self.updates = 0
        # This life of the learner: a new one after every restart (--resume too). Weights messages
        # carry it, so that actors take a restarted learner's versions even when they are lower.
        self.incarnation = uuid.uuid4().hex[:16]
        if ranks is not None:   # one learner of several ranks: rank 0's identity for all (actors send to each)
            self.incarnation = f"{ranks.all_gather_ints([int(self.incarnation, 16) >> 2])[0][0]:016x}"
        self._failed_in_a_row = 0
        self.curve = None                           # a shared.security.CurveServer, set by the learner process
        self.peer_env_steps = 0                     # env steps the other learner ranks received
        self.peer_finished: list[int] | None = None  # their per-actor consumed/dropped counts
        self._ddp = None
        self._digests = (self.run_dir / "ranks" / f"rank{ranks.rank if ranks else 0}.jsonl"
                         if cfg.learner.rank_digests and self.run_dir is not None else None)
        self.record_dir = (self.run_dir / "record") if (t.record and self.run_dir is not None) else None
        self.evals: "queue.Queue[dict]" = queue.Queue(maxsize=64)   # results from the evaluator
        self.update_log = UpdateLog(cfg, self.stats, logger)   # metrics of each update and evaluation
        self.accepting = True          # False once the run's env steps are all in (LearnerRun._drain)
        # Asked between minibatches: True (a stop signal; LearnerRun sets it) cuts the update short, so
        # that a long update does not hold up shutdown. One rank only: DDP ranks take the same steps.
        self.stop_requested: Callable[[], bool] | None = None
        self._wait_s = 0.0
        self.next_save = t.save_freq
        self.resumed_from: Path | None = None
        if resume:
            self._resume()
        shm = cfg.learner.weights_transport == "shm" and (ranks is None or ranks.is_main)
        self.weights_out = WeightsOut(publisher, self.policy, self.device, self.incarnation, self.base_digest,
                                      shm_slots=cfg.learner.shm_slots if shm else None, run_dir=self.run_dir)
        self.publish_times, self.shm_writer = self.weights_out.publish_times, self.weights_out.shm_writer
        # The receiver thread's checks and bookkeeping (learner/ingest.py), given what it needs.
        self.intake = Intake(cfg, self.spec, self.template, self.stats, store=self._store,
                             version=lambda: self.version, accepting=lambda: self.accepting,
                             publish_times=self.publish_times, evals=self.evals, logger=self.logger,
                             base_digest=self.base_digest, incarnation=self.incarnation)

    @property
    def publisher(self):
        """Where weights messages go (``WeightsOut``'s publisher)."""
        return self.weights_out.publisher

    @publisher.setter
    def publisher(self, value) -> None:
        self.weights_out.publisher = value

    # ---------------------------------------------------------------- counters (RunCounters, one lock)
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
        with self._lock:
            self.stats.env_steps = value

    # ================================================================ receiving (any thread)
    def ingest(self, td: TensorDictBase, meta: dict) -> None:
        """Take one decoded rollout (in-process use; the receiver thread calls ``self.intake``).

        Raises:
            RejectedMessage: naming the sender and the problem; nothing was stored.
        """
        self.intake.rollout(td, meta)

    def _store(self, td: TensorDictBase, info: dict, other_learner: bool) -> None:
        """A rollout the intake accepted: the lag filter, then the buffer (any thread)."""
        if self.discard:
            return
        if other_learner:
            # Acted by weights an earlier life of the learner published (before a restart): its
            # version numbers are not this learner's, so its lag is unknown.
            self._drop(info, "other_learner")
            return
        if self.reward_scaler is not None:
            self.reward_scaler.observe(info["actor"], td[keys.REWARD], td[keys.DONE])
        lag = self.version - info["policy_version"]
        if lag > (0 if self.standard else self.cfg.trainer.max_policy_lag):
            self._drop(info, "lag")
            return
        overwritten = self.buffer.put(td, info)
        if overwritten is not None:
            self._drop(overwritten, "overwritten")
        with self._data_ready:
            self._data_ready.notify_all()

    def _drop(self, info: dict, reason: str) -> None:
        self.stats.count_drop(reason)
        self._version_event("drop", info, reason=reason)

    def _version_event(self, event: str, info: dict, **extra: Any) -> None:
        """One consume/drop line: the lag of every sample of the rollout at this moment (exact
        histogram, min, mean, max), and the rollout's episode statistics (for the drop bias)."""
        self.stats.finish(info["actor"])
        if self.logger is None:
            return
        hist = [[self.version - v, c] for v, c in info["version_counts"]]
        total = sum(c for _, c in hist)
        self.logger.versions.write(event=event, time=time.time(), actor=info["actor"], seq=info["seq"],
                                   policy_version=info["policy_version"], learner_version=self.version,
                                   lag=self.version - info["policy_version"],
                                   lag_min=self.version - info["policy_version_max"],
                                   lag_mean=sum(lag * c for lag, c in hist) / max(total, 1), lag_hist=hist,
                                   env_steps=info["env_steps"], episodes=info["episodes"],
                                   episode_length_mean=info["episode_length_mean"], received=info["received"],
                                   sent=info["sent"], **extra)

    # ================================================================ training (main thread)
    def publish(self, final: bool = False, event: str = "publish") -> None:
        if self.ranks is not None and not self.ranks.is_main:
            return                      # rank 0 publishes for every rank (they hold the same weights)
        self.weights_out.publish(self.version, self.env_steps + self.peer_env_steps, self.finished_counts(), final)
        if self.logger is not None and not final:  # final re-sends the current version: no new line
            self.logger.versions.write(event=event, version=self.version, time=time.time(),
                                       env_steps=self.env_steps + self.peer_env_steps, updates=self.updates,
                                       incarnation=self.incarnation)

    def maybe_send_credit(self, min_interval_s: float = 0.2) -> None:
        """lag_policy "pace": tell actors about rollouts finished (mostly dropped ones) since the last
        weights message, so that none waits for a credit that only the next update would bring."""
        if self.standard or self.cfg.trainer.lag_policy != "pace":
            return
        self.weights_out.send_credit(self.finished_counts(), min_interval_s)

    def finished_counts(self) -> list[int]:
        """Per actor, its rollouts consumed or dropped, over every learner rank."""
        mine = self.stats.finished()
        if self.peer_finished is not None:
            mine = [a + b for a, b in zip(mine, self.peer_finished)]
        return mine

    def take_batch(self, timeout_s: float = 0.05) -> tuple[TensorDictBase, list[dict]] | None:
        """The next `k` rollouts to train on ``[k, N, T]`` with their infos, or None if they are not
        all there within `timeout_s`. Rollouts too old for the current version are dropped."""
        min_version = self.version - (0 if self.standard else self.cfg.trainer.max_policy_lag)
        need = self.k - len(self._pending)
        t0 = time.perf_counter()
        with self._data_ready:
            if len(self.buffer) < need:
                self._data_ready.wait(timeout_s)
        self._wait_s += time.perf_counter() - t0
        taken = self.buffer.take(need, min_version=min_version)
        for info in taken.stale:
            self._drop(info, "stale")
        if taken.data is not None:
            self._pending += [(taken.data[i], info) for i, info in enumerate(taken.infos)]
        if len(self._pending) < self.k:
            return None
        if self.standard:
            # Arrival order between actors is a race; actor order is not. Same seed, same run.
            self._pending.sort(key=lambda p: (p[1]["actor"], p[1]["seq"] if isinstance(p[1]["seq"], int) else 0))
        data = torch.stack([d for d, _ in self._pending])
        infos = [i for _, i in self._pending]
        self._pending = []
        return data, infos

    def drop_unconsumed(self, reason: str) -> None:
        """Record every rollout still held (buffer and partial batch) as dropped: each received
        rollout leaves exactly one consume or drop line."""
        taken = self.buffer.take(self.buffer.capacity)
        for info in [i for _, i in self._pending] + taken.stale + taken.infos:
            self._drop(info, reason)
        self._pending = []

    def _record(self, data: TensorDictBase, infos: list[dict], reward_std: float | None) -> None:
        """Append the batch about to be trained on to RUN_DIR/record (``launch/replay.py`` reads it)."""
        name = f"update_{self.updates + 1:07d}"
        self.record_dir.mkdir(parents=True, exist_ok=True)
        data.cpu().memmap(self.record_dir / name)
        entry = {"update": self.updates + 1, "version": self.version, "dir": name, "reward_std": reward_std,
                 "rollouts": [{k: i[k] for k in ("actor", "seq", "policy_version", "policy_version_max",
                                                 "env_steps")} for i in infos]}
        with open(self.record_dir / "index.jsonl", "a") as f:
            f.write(json.dumps(entry) + "\n")

    def _update_policy(self):
        """The policy the update loops train: wrapped in DDP when there are several learner ranks."""
        if self.ranks is None:
            return self.policy
        if self._ddp is None:
            from learner.distributed import DDPPolicy
            self._ddp = DDPPolicy(self.policy, self.ranks, find_unused=self.grpo or self.cfg.policy.name == "vla")
        return self._ddp

    def _sync_mean(self, t: torch.Tensor) -> torch.Tensor:
        return t if self.ranks is None else self.ranks.all_reduce_sum(t) / self.ranks.world

    def _write_digest(self) -> None:
        """rank_digests: this rank's weights after the update, as a SHA-256 (ranks must agree)."""
        self._digests.parent.mkdir(parents=True, exist_ok=True)
        with open(self._digests, "a") as f:
            f.write(json.dumps({"version": self.version, "updates": self.updates,
                                "sha256": weights_digest(self.policy)}) + "\n")

    @torch.no_grad()
    def _evaluate_now(self, flat: TensorDictBase, chunk: int = 16384) -> tuple[torch.Tensor, torch.Tensor]:
        """The current policy's log-prob of the taken actions and V(s) on ``[B, T]`` data."""
        self.policy.eval()
        b = flat.reshape(-1)
        logps, values = [], []
        for start in range(0, b.shape[0], chunk):
            logp, _, value = self.policy.evaluate_actions(b[start:start + chunk])
            logps.append(logp)
            values.append(value)
        self.policy.train()
        return torch.cat(logps).view(flat.shape), torch.cat(values).view(flat.shape)

    def _values_now(self, flat: TensorDictBase, chunk: int = 16384) -> torch.Tensor:
        """The current critic's V(s) on ``[B, T]`` data, without the policy's log-prob (for a
        separate critic, one network's forward pass instead of two)."""
        self.policy.eval()
        b = flat.reshape(-1)
        values = []
        with torch.no_grad():
            for start in range(0, b.shape[0], chunk):
                part = b[start:start + chunk]
                values.append(self.policy.get_value(TensorDict({keys.OBS: part[keys.OBS]}, batch_size=part.shape)))
        self.policy.train()
        return torch.cat(values).view(flat.shape)

    def _bootstrap_values(self, flat: TensorDictBase) -> torch.Tensor | None:
        """The current critic on ``bootstrap_observation`` ``[B, T]``, evaluated only where a
        bootstrap is needed (zeros elsewhere); None when the rollouts carry no such observation."""
        if keys.BOOTSTRAP_OBS not in flat.keys():
            return None
        need = bootstrap_mask(flat[keys.TERMINATED], flat[keys.DONE])
        out = torch.zeros(flat.shape, device=self.device)
        if bool(need.any()):
            self.policy.eval()
            with torch.no_grad():
                obs = flat[keys.BOOTSTRAP_OBS][need]
                out[need] = self.policy.get_value(TensorDict({keys.OBS: obs}, batch_size=[int(need.sum())]))
            self.policy.train()
        return out

    def _recompute(self, stale: bool) -> bool:
        """Whether V(s) and the bootstraps are recomputed with the current critic this update."""
        return stale if self.algo.recompute_values is None else self.algo.recompute_values

    def _correct_and_advantages(self, flat: TensorDictBase, reward: torch.Tensor, stale: bool,
                                behaviour: torch.Tensor | None = None) -> tuple[dict[str, float], bool]:
        """Set advantages and value targets on `flat` ``[B, T]`` with the configured off-policy
        correction (``learner/vtrace.py``); `stale`: some samples were acted by an older version.
        Returns diagnostics for the log, and whether PPO should still normalise advantages per
        minibatch (plain PPO) or not (a correction normalised them once, before weighting).

        `behaviour` (``advantages_every: epoch``, every epoch after the first): the behaviour
        log-prob mu as the batch arrived. The advantages, targets and values are recomputed from the
        live critic, and for ``appo`` the weights pi/mu from the live policy (``is``, ``vtrace`` and
        ``mask`` keep the proximal policy as their target); the anchor in ``log_prob`` and the
        ``mask`` correction's choice stay as the first call set them."""
        a = self.algo
        refresh = behaviour is not None
        value, next_value = flat[keys.VALUE], flat[keys.NEXT_VALUE]
        terminated, done = flat[keys.TERMINATED], flat[keys.DONE]
        # stale samples carry a stale critic's values: recompute them (by default)
        recompute = self._recompute(stale)
        corr = a.correction
        if corr == "none" and not recompute:
            adv, target = compute_gae(reward, value, next_value, terminated, done, a.gamma, a.gae_lambda)
            flat.set(keys.ADVANTAGE, adv)
            flat.set(keys.VALUE_TARGET, target)
            return {}, True
        out: dict[str, float] = {}
        mu = behaviour if refresh else flat[keys.LOG_PROB]
        if refresh and corr in ("is", "vtrace", "mask"):
            # decoupled PPO: the target policy of the weights (and of V-trace) is the proximal one,
            # set as the anchor at the start of the update; only the critic is live, so only it runs
            logp_now = flat[keys.LOG_PROB]
            value_now = self._values_now(flat) if recompute else value
        else:
            logp_now, value_now = self._evaluate_now(flat)
        if recompute:
            boot = self._bootstrap_values(flat)
            next_now = current_values(value_now, next_value, done, boot, terminated)
            out["value_shift"] = float((value_now - value).abs().mean())
            if boot is not None:
                need = bootstrap_mask(terminated, done)
                out["bootstrap_shift"] = float((boot - next_value)[need].abs().mean()) if bool(need.any()) else 0.0
        else:
            value_now, next_now = value, next_value
        rho = log_ratio(logp_now, mu).exp()
        rho_bar = a.rho_bar_for()
        if corr in ("vtrace", "appo"):
            lam = a.gae_lambda if a.vtrace_lambda is None else a.vtrace_lambda
            target, adv, _ = vtrace(mu, logp_now, reward, value_now, next_now, terminated, done, a.gamma, rho_bar,
                                    a.c_bar, lam, weighted=False, advantage=a.vtrace_advantage_for())
        else:
            adv, target = compute_gae(reward, value_now, next_now, terminated, done, a.gamma, a.gae_lambda)
        flat.set(keys.VALUE_TARGET, target)
        flat.set(keys.VALUE, value_now)          # value clipping (clip_vloss) around the critic the targets used
        if corr == "none":
            flat.set(keys.ADVANTAGE, adv)
            return out, True
        if a.norm_adv and adv.numel() > 1:       # once per batch, before any importance weight
            adv = (adv - adv.mean()) / (adv.std() + 1e-8)
        if corr != "ewma" and (corr != "appo" or a.appo_rho_weight):
            # ewma weights per minibatch, against its moving average; appo without its extra
            # weight keeps PPO's ratio pi/mu as the only one
            adv = adv * rho.clamp(max=rho_bar)
        flat.set(keys.ADVANTAGE, adv)
        if refresh:
            return out, False
        if corr in ("is", "vtrace", "mask"):
            # Decoupled PPO: clip the ratio against the policy at the start of this update.
            flat.set(keys.LOG_PROB, logp_now)
        if corr == "mask":
            keep = (rho >= 1.0 / a.mask_threshold) & (rho <= a.mask_threshold)
            flat.set(MASK, keep)
            masked = int((~keep).sum())
            self.stats.count("masked_samples", masked)
            out["masked_frac"] = masked / keep.numel()
        out.update({"rho_mean": float(rho.mean()), "rho_max": float(rho.max()),
                    "rho_clipped_frac": float((rho > rho_bar).float().mean())})
        return out, False

    def update_once(self, data: TensorDictBase, infos: list[dict], reward_std: float | None = None
                    ) -> dict[str, float]:
        """One update on `k` rollouts ``[k, N, T]``; bumps the version and publishes.

        `reward_std` (replay only) replaces the reward scaler's running std with a recorded one."""
        t0, c0 = time.perf_counter(), time.process_time()
        a = self.algo
        lags = torch.cat([(self.version - data[i][keys.POLICY_VERSION]).reshape(-1) for i in range(len(infos))])
        for info in infos:
            self._version_event("consume", info)
        # pace: the actors hear now, not with the next weights, that these rollouts are taken, so
        # each may collect its next rollout while this update runs (with max_inflight 1: a pipeline
        # of depth one, every sample trained by the version after the one that acted).
        self.maybe_send_credit(min_interval_s=0.0)
        if self.reward_scaler is not None and reward_std is None and not self.grpo:
            # once, before recording: the replay must scale with exactly the std this update uses
            reward_std = self.reward_scaler.std(self.ranks.all_reduce_sum if self.ranks else None)
        if self.record_dir is not None:
            self._record(data, infos, reward_std)
        data = data.to(self.device)
        flat = data.reshape(-1, data.shape[-1])            # [k*N, T]; GRPO groups stay within a rollout
        if a.anneal_lr:
            frac = max(0.0, 1.0 - self.env_steps_trained / self.cfg.trainer.total_steps)
            for g in self.optimizer.param_groups:
                g["lr"] = a.learning_rate * frac
        self.policy.train()
        should_stop = self.stop_requested if self.ranks is None else None
        widen = self.cpu.before_minibatch if self.cpu.idle_threads is not None else None
        self.cpu.start_update()
        try:
            if self.grpo:
                adv, mask = grpo_advantages(flat[keys.REWARD], flat[keys.DONE], a.group_size, a.gamma, a.eps,
                                            a.truncate_at_first_done, a.scale_by_std,
                                            baseline=a.baseline, loss_mean=a.loss_mean)
                flat.set(keys.ADVANTAGE, adv)
                flat.set(MASK, mask)
                stats = grpo_update(self._update_policy(), self.ref_policy, self.optimizer, flat, a, self.generator,
                                    sync_mean=self._sync_mean, should_stop=should_stop, before_minibatch=widen)
            else:
                reward = flat[keys.REWARD]
                if self.reward_scaler is not None:
                    reward = self.reward_scaler.scale_by(reward, reward_std)
                stale = bool(lags.max() > 0)
                refresh = None
                if a.advantages_every_for(stale) == "epoch" and (a.correction != "none" or self._recompute(stale)):
                    mu = flat[keys.LOG_PROB].clone()
                    refresh = lambda: self._correct_and_advantages(flat, reward, stale, behaviour=mu)  # noqa: E731
                correction_stats, renormalize = self._correct_and_advantages(flat, reward, stale)
                stats = ppo_update(self._update_policy(), self.optimizer, flat, a, self.generator,
                                   sync_mean=self._sync_mean, renormalize=renormalize, proximal=self.ewma,
                                   refresh=refresh,
                                   critic_thread=self.cpu.critic_thread, critic_when=self.cpu.critic_when,
                                   should_stop=should_stop, before_minibatch=widen)
                stats.update(correction_stats)
        finally:
            if widen is not None and torch.get_num_threads() != 1:
                torch.set_num_threads(1)     # back to one: the actors may collect again
        if widen is not None:
            stats["idle_threads_share"] = self.cpu.wide_share()
        self._note_skips(stats)
        if stats.get("stopped"):
            self.stats.count("updates_cut_short")
            say(f"[learner] stop requested: update {self.updates + 1} cut short after {int(stats['steps'])} "
                f"optimiser steps ({int(stats['epochs'])} of {a.n_epochs} epochs begun)")
        # Normaliser statistics move after the update, so every epoch above saw the same
        # normalisation the actors acted with: the first epoch's ratio is exactly 1.
        self.policy.update_normalizer(flat[keys.OBS], all_reduce=self.ranks.all_reduce_sum if self.ranks else None)
        self.env_steps_trained += flat.numel() * (self.ranks.world if self.ranks else 1)
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
        update_s = time.perf_counter() - t0
        update_cpu_s = time.process_time() - c0
        self.stats.add_times(update_wall_s=update_s, update_cpu_s=update_cpu_s)
        self._log_update(stats, lags, update_s, infos, update_cpu_s)
        return stats

    def _note_skips(self, stats: dict[str, float]) -> None:
        """Count optimiser steps skipped for a non-finite loss or gradient. An update that took no
        step at all still publishes (standard-mode actors wait for a new version), with the same
        weights; only a run whose updates keep failing stops, with the reason."""
        skipped = int(stats.get("skipped_steps", 0))
        self.stats.count("skipped_steps", skipped)
        if skipped and not stats.get("steps"):
            self.stats.count("failed_updates")
        if skipped:
            log.warning("update %d: skipped %d of %d optimiser steps (non-finite loss or gradient); the weights "
                        "stay as they were for those", self.updates + 1, skipped, skipped + int(stats.get("steps", 0)))
        self._failed_in_a_row = self._failed_in_a_row + 1 if skipped and not stats.get("steps") else 0
        if self._failed_in_a_row >= MAX_FAILED_UPDATES:
            raise FloatingPointError(
                f"{self._failed_in_a_row} updates in a row took no optimiser step: every minibatch had a non-finite "
                f"loss or gradient (version {self.version}). The data or the config (learning_rate, clip_coef, "
                f"max_grad_norm, reward scale) is breaking the update; the last good weights are in the checkpoints.")

    def _log_update(self, stats: dict[str, float], lags: torch.Tensor, update_s: float, infos: list[dict],
                    update_cpu_s: float = 0.0) -> None:
        self.update_log.update(stats, lags, update_s, update_cpu_s, version=self.version, updates=self.updates,
                               learning_rate=self.optimizer.param_groups[0]["lr"], buffer_fill=len(self.buffer),
                               wait_s=self._wait_s, auth_refused=self.curve.refused if self.curve is not None else None)
        self._wait_s = 0.0

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
        # Only what trains (a frozen base is reloaded from vla_config.model_path and checked by digest).
        return {"policy": {k: v.detach() for k, v in published_state(self.policy).items()},
                "base_digest": self.base_digest, "optimizer": self.optimizer.state_dict(),
                "version": self.version, "env_steps": self.env_steps + self.peer_env_steps,
                "env_steps_trained": self.env_steps_trained,
                "updates": self.updates, "generator": self.generator.get_state(),
                "torch_rng": torch.get_rng_state(), "counts": dict(self.counts),
                "reward_scaler": self.reward_scaler.state_dict() if self.reward_scaler else None,
                "ref_policy": self.ref_policy.state_dict() if self.ref_policy is not None else None,
                "ewma": self.ewma.state_dict() if self.ewma is not None else None,
                "next_save": self.next_save}

    def save(self) -> Path | None:
        if self.run_dir is None or (self.ranks is not None and not self.ranks.is_main):
            return None
        return save_checkpoint(self.run_dir / "checkpoints", self.state_dict(), self.version)

    def _resume(self) -> None:
        found = list_checkpoints(self.run_dir / "checkpoints") if self.run_dir else []
        if not found:
            raise FileNotFoundError(f"--resume: no checkpoint in {self.run_dir / 'checkpoints'}")
        state = load_checkpoint(found[-1], map_location=self.device)
        saved_base = state.get("base_digest")
        if saved_base is not None and saved_base != self.base_digest:
            raise RuntimeError(f"--resume: {found[-1]} was trained on another base model (frozen weights digest "
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
        self.next_save = state["next_save"]
        if self.ref_policy is not None and state.get("ref_policy") is not None:
            self.ref_policy.load_state_dict(state["ref_policy"])
        if self.ewma is not None:
            if state.get("ewma") is not None:
                self.ewma.load_state_dict(state["ewma"])
            else:   # a checkpoint from a run without ewma: the average starts at the resumed weights
                self.ewma = EWMAProximal(self.policy, self.ewma.decay)
        if self.reward_scaler is not None and state["reward_scaler"] is not None:
            self.reward_scaler.load_state_dict(state["reward_scaler"])
        self.resumed_from = found[-1]
        log.info("resumed from %s: version %d, %d env steps", found[-1], self.version, self.env_steps)

    def maybe_save(self) -> None:
        total = self.env_steps + self.peer_env_steps
        if self.cfg.trainer.save_freq and total >= self.next_save:
            self.save()
            f = self.cfg.trainer.save_freq
            self.next_save = (total // f + 1) * f

    @property
    def finished(self) -> bool:
        return self.env_steps + self.peer_env_steps >= self.cfg.trainer.total_steps
