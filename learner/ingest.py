"""What the learner's receiver thread does with every message from outside: decode, check, store.

Everything that reaches the learner over a socket passes through :class:`Intake`, and
:meth:`Intake.handle` is total: a message is either stored (a rollout into the circular buffer, an
evaluation result into the learner's eval queue) or dropped and counted, with its sender in the
log. Nothing a peer sends can raise out of it, so the receiver thread cannot die of input.

The checks refuse what no policy of this run could have produced, before any of it reaches an
update: a rollout must match the learner's schema exactly (keys, shapes, dtypes), hold only finite
numbers of sane magnitude, actions inside the action space, log-probs inside the range the
policy's distribution can give (:func:`log_prob_bounds`), ``done == terminated | truncated``, and
versions no newer than the learner's. Evaluation results are taken only from the evaluator the
learner started: on its own socket, with the per-run token it was given.
"""

from __future__ import annotations

import hmac
import logging
import math
import queue
import time
from typing import Any, Callable

import torch
from tensordict import TensorDictBase

from shared import keys, wire
from shared.chunks import env_steps_of
from shared.envs import EnvSpec
from shared.metrics import clean_metrics
from shared.policies import ids_out_of_bounds
from shared.rollout import MAX_ABS_VALUE  # noqa: F401  (re-exported: the intake's bound)

from learner.counters import RunCounters

log = logging.getLogger("tandem.learner")

# A Gaussian sample more than Z_MAX standard deviations from its mean has probability < 2e-23: no
# actor of ours produces one. LOG_STD_RANGE bounds the log standard deviation a sane policy acts with.
Z_MAX = 10.0
LOG_STD_RANGE = (-20.0, 20.0)
MAX_COLLECT_S = 86_400.0   # an actor's reported seconds for one rollout beyond this are not believed
_HALF_LOG_2PI = 0.5 * math.log(2 * math.pi)
LOG_EVERY = 1000      # after the first 10, log one refusal in this many: a flood must not flood the log


class RejectedMessage(ValueError):
    """A message the learner will not take; the text names the sender and what is wrong."""


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_num(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def log_prob_bounds(spec: EnvSpec, dtype: torch.dtype = torch.float32) -> tuple[float, float]:
    """The range of log-probs an acting policy can stamp on a sampled action of `spec`.

    Discrete: an action sampled from probabilities in `dtype` has probability at least the
    smallest positive `dtype` number, and at most 1. Box (a diagonal Gaussian over ``dim``
    dimensions): per dimension ``-z^2/2 - log_std - log(2 pi)/2`` with ``|z| <= Z_MAX`` and
    ``log_std`` in ``LOG_STD_RANGE``.
    """
    act = spec.action
    if act.kind == "discrete":
        tiny = torch.finfo(dtype).smallest_normal * torch.finfo(dtype).eps   # the smallest subnormal
        return math.log(tiny), 0.0
    lo_std, hi_std = LOG_STD_RANGE
    low = -(0.5 * Z_MAX ** 2 + hi_std + _HALF_LOG_2PI) * act.dim
    high = (-lo_std - _HALF_LOG_2PI) * act.dim
    return low, high


def check_eval(meta: dict) -> dict:
    """An evaluator's result with the fields the learner logs, type-checked."""
    returns, lengths = meta.get("returns"), meta.get("lengths")
    ok = (isinstance(returns, list) and isinstance(lengths, list) and len(returns) == len(lengths) <= 100_000
          and all(_is_num(r) and math.isfinite(r) for r in returns)
          and all(_is_int(n) and 0 <= n < 1 << 40 for n in lengths)
          and _is_int(meta.get("version")) and _is_int(meta.get("env_steps")))
    if not ok:
        raise RejectedMessage(f"malformed eval result from {meta.get('sender')!r}: needs returns (numbers), "
                              f"lengths (ints) of the same length, version and env_steps (ints)")
    successes = meta.get("successes") or []
    if not (isinstance(successes, list) and all(isinstance(x, bool) for x in successes)):
        raise RejectedMessage(f"malformed eval result from {meta.get('sender')!r}: successes must be booleans")
    metrics = meta.get("metrics")
    if metrics is not None and not isinstance(metrics, dict):
        raise RejectedMessage(f"malformed eval result from {meta.get('sender')!r}: metrics must be a map of numbers")
    pending = meta.get("video_frames_pending", 0)
    if not (_is_int(pending) and 0 <= pending <= 10_000_000):
        raise RejectedMessage(f"malformed eval result from {meta.get('sender')!r}: video_frames_pending must be an "
                              f"int in [0, 1e7], got {pending!r}")
    best = {}
    if "best_score" in meta:   # trainer.keep_best: the evaluator's best so far
        score, version, kept = meta.get("best_score"), meta.get("best_version"), meta.get("best")
        if not (_is_num(score) and math.isfinite(score) and _is_int(version) and isinstance(kept, bool)):
            raise RejectedMessage(f"malformed eval result from {meta.get('sender')!r}: best_score (a finite number), "
                                  f"best_version (an int) and best (a bool) go together")
        best = {"best_score": float(score), "best_version": version, "best": kept}
    return {"returns": [float(r) for r in returns], "lengths": lengths, "successes": successes,
            "version": meta["version"], "env_steps": meta["env_steps"], "final": bool(meta.get("final")),
            "metrics": clean_metrics(metrics), "video_frames_pending": pending, **best}


def message_limits(template: TensorDictBase) -> tuple[int, int]:
    """``(largest frame, whole message)`` in bytes for one rollout of `template`'s schema, with room
    for the header: what the rollout socket's ``MAXMSGSIZE`` and :func:`wire.decode` allow."""
    sizes = [t.numel() * t.element_size() for t in template.values(include_nested=True, leaves_only=True)]
    header = wire.MAX_HEADER_BYTES
    return max([header, *sizes]), sum(sizes) + header


class Intake:
    """The receiver thread's side of the learner: every message passes through here, is checked, is
    counted, and (a rollout) is handed to `store`. It knows the learner only through what it is given.

    Args:
        cfg: the run's config (actors' ids, and the lag the learner accepts).
        spec: the env's spec (action bounds for the value checks).
        template: one rollout of the run's schema: what every rollout must match.
        counters: where what arrives is counted.
        store: ``store(td, info, other_learner)`` takes a rollout that passed every check (lag filter,
            buffer); ``info`` is its bookkeeping for ``versions.jsonl``.
        version: the learner's current weights version (a rollout may not claim a newer one).
        accepting: False once the run's env steps are all in: rollouts are then ignored.
        publish_times: version -> when it was published (weight-sync delays), kept up to date by the learner.
        evals: where checked evaluation results queue for the main thread.
        logger: writes ``versions.jsonl`` sync lines (None: no run directory).
        base_digest, incarnation: the frozen base's digest and this learner life's id, which rollouts
            must match.
        eval_token: the secret the learner gave its evaluator; results must carry it.
        obs_bounds: the policy's token-id observation leaves and their valid range
            (``shared.policies.observation_bounds``).
    """

    def __init__(self, cfg, spec: EnvSpec, template: TensorDictBase, counters: RunCounters,
                 store: Callable[[TensorDictBase, dict, bool], None], version: Callable[[], int],
                 accepting: Callable[[], bool], publish_times: dict[int, float], evals: queue.Queue,
                 logger=None, base_digest: str = "", incarnation: str = "", eval_token: str | None = None,
                 obs_bounds: dict[str, tuple[int, int]] | None = None):
        self.cfg, self.spec, self.counters, self.store = cfg, spec, counters, store
        self.obs_bounds = obs_bounds or {}
        self.version, self.accepting = version, accepting
        self.publish_times, self.evals, self.logger = publish_times, evals, logger
        self.base_digest, self.incarnation = base_digest, incarnation
        self.eval_token = eval_token
        self.expected = {k: (v.shape, v.dtype) for k, v in template.items(include_nested=True, leaves_only=True)}
        self.logp_low, self.logp_high = log_prob_bounds(spec, template[keys.LOG_PROB].dtype)
        # action chunks (shared/chunks.py): a row's log-prob sums up to H actions' terms
        self.chunk = template[keys.ACTION].shape[2] if keys.EXECUTED in template.keys() else 1
        self.logp_low, self.logp_high = self.logp_low * self.chunk, self.logp_high * self.chunk
        self.max_frame_bytes, self.max_message_bytes = message_limits(template)
        self.ring = None     # a shared.rollout_ring.RolloutRing (actors.rollout_transport "ring"), set by the process

    # ------------------------------------------------------------------ the total entry point
    def handle(self, frames: list, sender: str, socket: str = "rollouts") -> bool:
        """Decode and take one message from `socket` ("rollouts" or "eval"). Never raises.
        Returns True when the message was taken (stored or, for a rollout, counted as dropped)."""
        try:
            td, meta = wire.decode(frames, max_message_bytes=self.max_message_bytes)
        except wire.WireError as e:
            self.note_malformed(sender, str(e))
            return False
        except Exception as e:   # decode promises WireError only; a bug there must not kill the thread
            self.note_malformed(sender, f"{type(e).__name__} while decoding: {e}")
            return False
        who = f"{sender} (actor {meta.get('actor')!r})" if "actor" in meta else sender
        if socket != "eval" and "ring" in meta:
            try:   # a header only: the tensors wait in the actor's ring slot (shared/rollout_ring.py)
                td = self.from_ring(td, meta)
            except wire.WireError as e:
                self.note_malformed(who, str(e))
                return False
            except Exception as e:   # a bug on a bad header must not kill the thread
                self.note_malformed(who, f"{type(e).__name__} while reading the rollout ring: {e}")
                return False
        try:
            if socket == "eval":
                self.eval_result(meta)
            else:
                self.rollout(td, meta)
            return True
        except RejectedMessage as e:
            self.note_rejected(who, str(e))
        except Exception as e:   # a bug on a bad message must not take the run down
            self.note_rejected(who, f"{type(e).__name__} while ingesting: {e}")
            if self.counters.counts["rejected"] <= 3:
                log.exception("unexpected error while ingesting a message from %s", who)
        return False

    def from_ring(self, td: TensorDictBase, meta: dict) -> TensorDictBase:
        """The rollout a ring header names, copied out of its slot (which is released): the checks
        of :meth:`rollout` then run on the learner's own copy. Raises WireError."""
        if self.ring is None:
            raise wire.WireError("a rollout ring header, but this learner has no ring (actors.rollout_transport "
                                 "differs between the actor's config and the learner's)")
        if not td.is_empty():
            raise wire.WireError("a rollout ring header must carry no tensors")
        return self.ring.take(meta.get("actor"), meta["ring"])

    def idle(self) -> None:
        """Called by the receiver thread at every turn: free the ring slots that dead actors left."""
        if self.ring is not None:
            freed = self.ring.reclaim()
            if freed:
                log.info("freed %d rollout ring slot(s) left ready by an actor that restarted", freed)

    # ------------------------------------------------------------------ evaluation results
    def eval_result(self, meta: dict) -> None:
        """An evaluation result from the evaluator socket: checked, then queued for the main thread."""
        token = meta.get("token")
        if self.eval_token is not None and not (isinstance(token, str)
                                                and hmac.compare_digest(token.encode(), self.eval_token.encode())):
            raise RejectedMessage("evaluation result without this run's evaluator token")
        try:
            self.evals.put_nowait(check_eval(meta))   # never block the receiver thread
        except queue.Full:
            raise RejectedMessage("evaluation result dropped: 64 results wait to be logged already") from None

    # ------------------------------------------------------------------ rollouts
    def rollout(self, td: TensorDictBase, meta: dict) -> None:
        """Take one decoded rollout message: checks, bookkeeping, lag filter, buffer.

        Raises:
            RejectedMessage: naming the actor and the problem; nothing was stored.
        """
        kind = meta.get("kind")
        if kind == "eval":
            raise RejectedMessage("evaluation results are taken only from the evaluator's own socket")
        if not self.accepting():
            return  # the run is over; this rollout is neither counted nor stored
        if kind != "rollout":
            raise RejectedMessage(f"message of kind {kind!r}: the rollout socket accepts 'rollout'")
        actor = meta.get("actor")
        if not _is_int(actor) or not 0 <= actor < self.cfg.actors.num_actors:
            raise RejectedMessage(f"rollout without a valid 'actor' id (got {actor!r}; actors.num_actors is "
                                  f"{self.cfg.actors.num_actors})")
        try:
            self._accept(td, meta, actor)
        except RejectedMessage:
            self.counters.finish(actor)   # a refused rollout is finished too: a pacing actor must not wait for it
            raise

    def check_schema(self, td: TensorDictBase) -> list[str]:
        """Every way `td` differs from the rollout the learner expects (keys, shapes, dtypes)."""
        got = {k: (v.shape, v.dtype) for k, v in td.items(include_nested=True, leaves_only=True)}
        problems = [f"missing {k!r}" for k in self.expected.keys() - got.keys()]
        problems += [f"unexpected {k!r}" for k in got.keys() - self.expected.keys()]
        for k in self.expected.keys() & got.keys():
            (es, ed), (gs, gd) = self.expected[k], got[k]
            if es != gs or ed != gd:
                problems.append(f"{k!r} is {gd} {list(gs)}, expected {ed} {list(es)}")
        return problems

    def check_values(self, td: TensorDictBase) -> str | None:
        """Values no policy of this run could have produced, or that would break the update."""
        for k, v in td.items(include_nested=True, leaves_only=True):
            if v.dtype.is_floating_point and v.numel():
                if not bool(torch.isfinite(v).all()):
                    return f"rollout {k!r} holds NaN or inf"
                if float(v.abs().max()) > MAX_ABS_VALUE:
                    return f"rollout {k!r} holds values beyond +-{MAX_ABS_VALUE:g}"
        for top in (keys.OBS, keys.BOOTSTRAP_OBS):   # token ids the update would look up
            obs = td.get(top, None) if self.obs_bounds else None
            bad = ids_out_of_bounds(obs, self.obs_bounds) if isinstance(obs, TensorDictBase) else None
            if bad:
                return f"rollout {top!r}: {bad}"
        act = self.spec.action
        if act.kind == "discrete":
            a = td[keys.ACTION]
            if bool(((a < 0) | (a >= act.n)).any()):
                return f"rollout 'action' outside 0..{act.n - 1}"
        logp = td[keys.LOG_PROB]
        if logp.numel():
            lo, hi = float(logp.min()), float(logp.max())
            if hi > self.logp_high + 1e-4:
                return ("rollout 'sample_log_prob' > 0 for a discrete action" if act.kind == "discrete" else
                        f"rollout 'sample_log_prob' > {self.logp_high:.4g}, the most a {act.dim}-dim Gaussian "
                        f"with log-std >= {LOG_STD_RANGE[0]:g} gives") + f" (max {hi:.4g})"
            if lo < self.logp_low:
                return (f"rollout 'sample_log_prob' < {self.logp_low:.4g}, the least a sampled {act.kind} "
                        f"action can have (min {lo:.4g})")
        if bool((td[keys.DONE] != (td[keys.TERMINATED] | td[keys.TRUNCATED])).any()):
            return "rollout 'done' differs from 'terminated' | 'truncated'"
        if bool((td[keys.POLICY_VERSION] < 0).any()):
            return "rollout 'policy_version' holds negative versions"
        if self.chunk > 1 and bool(((td[keys.EXECUTED] < 1) | (td[keys.EXECUTED] > self.chunk)).any()):
            return f"rollout 'executed_actions' outside 1..{self.chunk} (the policy's chunk size)"
        return None

    def _accept(self, td: TensorDictBase, meta: dict, actor: int) -> None:
        problems = self.check_schema(td)
        if problems:
            raise RejectedMessage(f"actor {actor}: rollout does not match the learner's schema: "
                                  + "; ".join(problems[:3])
                                  + (f" (+{len(problems) - 3} more)" if len(problems) > 3 else ""))
        bad = self.check_values(td)
        if bad:
            raise RejectedMessage(f"actor {actor}: {bad}")
        versions = td[keys.POLICY_VERSION]
        vmin, vmax = int(versions.min()), int(versions.max())
        version = self.version()
        if vmax > version:
            raise RejectedMessage(f"actor {actor}: rollout claims version {vmax}, newer than the learner's "
                                  f"{version}")
        now = time.time()
        seq, sent = meta.get("seq"), meta.get("time")
        # Only well-typed values reach versions.jsonl: a peer's meta must never break the log writer.
        uniq, counts = torch.unique(versions, return_counts=True)
        returns, lengths = meta.get("episode_returns"), meta.get("episode_lengths")
        returns = returns if isinstance(returns, list) else []
        lengths = lengths if isinstance(lengths, list) else []
        lengths_ok = [n for n in lengths if _is_int(n)]
        info = {"actor": actor, "seq": seq if _is_int(seq) else None, "policy_version": vmin,
                "policy_version_max": vmax, "env_steps": env_steps_of(td),
                "version_counts": list(zip(uniq.tolist(), counts.tolist())), "episodes": len(lengths_ok),
                "episode_length_mean": sum(lengths_ok) / len(lengths_ok) if lengths_ok else None,
                "sent": float(sent) if _is_num(sent) and math.isfinite(sent) else None,
                "received": now}
        base = meta.get("base_digest")
        if base is not None and base != self.base_digest:
            raise RejectedMessage(f"actor {actor}: acts with another base model (frozen weights digest "
                                  f"{str(base)[:16]}, the learner's is {self.base_digest[:16]}): both must load "
                                  f"the same policy.vla_config.model_path")
        incarnation = meta.get("incarnation")
        other_learner = incarnation is not None and incarnation != self.incarnation
        self.note_syncs(actor, meta.get("synced"))
        spent = {"collect_wall_s": meta.get("collect_s"), "collect_cpu_s": meta.get("collect_cpu_s")}
        # the actor's own account: only plausible numbers are added; episodes bounded and cleaned, so
        # that a peer cannot flood the logs
        times = {k: float(v) for k, v in spent.items() if _is_num(v) and math.isfinite(v) and 0 <= v <= MAX_COLLECT_S}
        successes = meta.get("episode_successes")
        successes = [x for x in successes[:10_000] if isinstance(x, bool)] if isinstance(successes, list) else []
        metrics = meta.get("episode_metrics")
        metrics = [m for m in map(clean_metrics, metrics[:1_000]) if m] if isinstance(metrics, list) else []
        episodes = [(float(r), n) for r, n in list(zip(returns, lengths))[:10_000]
                    if _is_num(r) and _is_int(n) and math.isfinite(r)]
        # stored before counted: once the run's env steps are all in (the count), the learner's final
        # drain must find every counted rollout in the buffer, or it drops the last full batch
        self.store(td, info, other_learner)
        self.counters.add_rollout(actor, info["env_steps"], now, times, episodes, successes, metrics)

    def note_syncs(self, actor: int, synced: Any) -> None:
        """Weight-sync delays an actor reports: ``[[version, received, first_acted], ...]`` for each
        version it started acting with since its last rollout. Ill-typed entries are ignored."""
        if not isinstance(synced, list):
            return
        for item in synced[:16]:
            if not (isinstance(item, list) and len(item) == 3 and _is_int(item[0])
                    and all(_is_num(x) for x in item[1:])):
                continue
            version, received, acted = item[0], float(item[1]), float(item[2])
            published = self.publish_times.get(version)
            if published is None or not (math.isfinite(received) and math.isfinite(acted)):
                continue
            delay = acted - published
            self.counters.add_sync_delay(delay)
            if self.logger is not None:
                self.logger.versions.write(event="sync", actor=actor, version=version, time=acted,
                                           published=published, received=received, delay_s=delay)

    # ------------------------------------------------------------------ counting what is dropped
    def note_malformed(self, sender: str, error: str) -> None:
        n = self._count("malformed")
        if n <= 10 or n % LOG_EVERY == 0:
            log.warning("dropped malformed message #%d from %s: %s", n, sender, error[:500])

    def note_rejected(self, sender: str, error: str) -> None:
        n = self._count("rejected")
        if n <= 10 or n % LOG_EVERY == 0:
            log.warning("rejected message #%d from %s: %s", n, sender, error[:500])

    def _count(self, key: str) -> int:
        return self.counters.count(key)
