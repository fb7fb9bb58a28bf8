"""What the learner logs after each update and each evaluation, and its progress line.

:class:`UpdateLog` turns an update's figures, the counters (``learner/counters.py``) and the
learner's state into the scalars every run writes to TensorBoard and ``metrics.jsonl`` under the same
names (``docs/metrics.md`` lists them all), keeps the last evaluation and the best one, and prints
the line a run shows every ``trainer.log_interval_s``.
"""

from __future__ import annotations

import math
import time
from typing import Any

import torch

from learner.counters import RunCounters
from learner.logs import RunLogger, fmt_num
from shared.config import Config
from shared.metrics import clean_metrics, mean_metrics


class UpdateLog:
    """Scalars of every update and evaluation, through `logger` (None: kept, not written).

    Args:
        cfg: the run's config (the total env steps, for the progress line).
        counters: what arrived, was dropped and was trained on.
        logger: the run's TensorBoard and JSON-lines writer.
    """

    def __init__(self, cfg: Config, counters: RunCounters, logger: RunLogger | None):
        self.cfg, self.counters, self.logger = cfg, counters, logger
        self.start_time = time.time()
        self.last_values: dict[str, Any] = {}
        self.last_eval: dict | None = None
        self.best_eval: dict | None = None      # trainer.keep_best: the evaluator's best.pt, as it reports it
        self._steps_at_log = ([0] * cfg.actors.num_actors, time.time())

    def update(self, stats: dict[str, float], lags: torch.Tensor, update_s: float, update_cpu_s: float, *,
               version: int, updates: int, learning_rate: float, buffer_fill: int, wait_s: float,
               auth_refused: int | None = None, weights_asks: dict[str, int] | None = None) -> dict[str, Any]:
        """The scalars of one update (``loss/``, ``train/``, ``lag/``, ``perf/``, ...), logged; returns them.

        `stats` are the update's own figures (``learner/ppo.py``, ``grpo.py``), `lags` its samples' lags
        ``[n]``; the rest is the learner's state after it."""
        snap = self.counters.snapshot()
        episodes, counts, totals, env_steps = snap["episodes"], snap["counts"], snap["time_totals"], snap["env_steps"]
        elapsed = time.time() - self.start_time
        # loss/policy, loss/value and loss/entropy are the unweighted terms; the coefficients are in the config
        names = {"loss_policy": "policy", "value_loss": "value", "entropy": "entropy", "approx_kl": "approx_kl",
                 "clip_frac": "clip_frac", "grad_norm": "grad_norm", "explained_variance": "explained_variance",
                 "epochs": "epochs", "kl_ref": "kl_ref", "samples": "samples", "skipped_steps": "skipped_steps"}
        values = {f"loss/{names[k]}": v for k, v in stats.items() if k in names}
        values.update({f"offpolicy/{k}": stats[k] for k in ("rho_mean", "rho_max", "rho_clipped_frac", "value_shift",
                                                             "bootstrap_shift", "masked_frac", "prox_weight_mean",
                                                             "ess", "log_ratio_abs", "kl_behaviour", "trust_clip",
                                                             "trust_kl", "drift_ratio", "drift_ratio_consistent",
                                                             "drift_kl_behaviour", "drift_kl_path", "drift_kl_update")
                       if k in stats})
        values["train/learning_rate"] = learning_rate
        if "groups_kept" in stats:   # GRPO's dynamic sampling: groups trained on and left out of this update
            values.update({"grpo/groups_kept": stats["groups_kept"], "grpo/groups_dropped": stats["groups_dropped"]})
        if "side_share" in stats:   # learner.critic_thread: the share of value losses run on its thread
            values["train/critic_thread_share"] = stats["side_share"]
        if "idle_threads_share" in stats:   # learner.torch_threads "idle": the share run on every core
            values["train/idle_threads_share"] = stats["idle_threads_share"]
        values["train/episode_return_mean"] = sum(r for r, _ in episodes) / len(episodes) if episodes else None
        values["train/episode_length_mean"] = sum(n for _, n in episodes) / len(episodes) if episodes else None
        values["train/updates"] = updates
        successes = snap["successes"]
        if successes:
            values["train/success_rate"] = sum(successes) / len(successes)
        values.update({f"train/metrics/{k}": v for k, v in mean_metrics(snap["metrics"]).items()})
        lagf = lags.float()
        values.update({"lag/mean": float(lagf.mean()), "lag/max": float(lagf.max()), "lag/min": float(lagf.min())})
        values.update({"perf/sps": env_steps / max(elapsed, 1e-9), "perf/update_s": update_s,
                       "perf/update_cpu_s": update_cpu_s,
                       **{f"perf/total/{k}": v for k, v in totals.items()},
                       "perf/learner_wait_s": wait_s,
                       "perf/samples_per_update": float(lags.numel())})
        rollouts = max(counts["rollouts"], 1)
        values.update({"buffer/dropped_lag_share": counts["dropped_lag"] / rollouts,
                       "buffer/overwritten_share": counts["overwritten"] / rollouts})
        per_actor, delays = snap["steps_per_actor"], self.counters.take_sync_delays()
        (before, t_before), now = self._steps_at_log, time.time()
        if now > t_before:
            values.update({f"actors/{i}/sps": (s - b) / (now - t_before)
                           for i, (s, b) in enumerate(zip(per_actor, before))})
        self._steps_at_log = (per_actor, now)
        if delays:
            values.update({"sync/delay_s": sum(delays) / len(delays), "sync/delay_max_s": max(delays)})
        values.update({"buffer/fill": buffer_fill, "buffer/dropped_lag": counts["dropped_lag"],
                       "buffer/overwritten": counts["overwritten"], "wire/malformed": counts["malformed"],
                       "wire/rejected": counts["rejected"], "train/skipped_steps_total": counts["skipped_steps"],
                       "train/failed_updates": counts["failed_updates"],
                       "grpo/rollouts_uninformative": counts["dropped_uninformative"]})
        if "masked_samples" in counts:
            values["offpolicy/masked_samples_total"] = counts["masked_samples"]
        if auth_refused is not None:
            values["wire/auth_refused"] = auth_refused
        if weights_asks is not None:   # subscribers that asked again for what they waited for (shared.transport)
            values.update({"sync/asks": weights_asks["asks"], "sync/asks_malformed": weights_asks["malformed"],
                           "sync/weights_resent": weights_asks["weights_resent"]})
        self.last_values = values
        if self.logger is not None:
            self.logger.scalars(env_steps, values, version=version, updates=updates)
            self.logger.histogram("lag/hist", lags, env_steps)
            if delays:
                self.logger.histogram("sync/delay_s", torch.tensor(delays), env_steps)
        return values

    def rollout_event(self, event: str, info: dict, version: int, **extra: Any) -> None:
        """One ``versions.jsonl`` line for a rollout consumed or dropped at learner `version`: the
        lag of every sample at this moment (exact histogram, min, mean, max), and the rollout's
        episode statistics (for the drop bias)."""
        if self.logger is None:
            return
        hist = [[version - v, c] for v, c in info["version_counts"]]
        total = sum(c for _, c in hist)
        self.logger.versions.write(event=event, time=time.time(), actor=info["actor"], seq=info["seq"],
                                   policy_version=info["policy_version"], learner_version=version,
                                   lag=version - info["policy_version"], lag_min=version - info["policy_version_max"],
                                   lag_mean=sum(lag * c for lag, c in hist) / max(total, 1), lag_hist=hist,
                                   env_steps=info["env_steps"], episodes=info["episodes"],
                                   episode_length_mean=info["episode_length_mean"], received=info["received"],
                                   sent=info["sent"], **extra)

    def published(self, event: str, version: int, env_steps: int, updates: int, incarnation: str) -> None:
        """One ``versions.jsonl`` line for a version published."""
        if self.logger is not None:
            self.logger.versions.write(event=event, version=version, time=time.time(), env_steps=env_steps,
                                       updates=updates, incarnation=incarnation)

    def evaluation(self, meta: dict) -> None:
        """One evaluation result (checked by ``learner/ingest.py``): ``eval/`` scalars, logged once per version."""
        if self.last_eval is not None and meta.get("version") == self.last_eval["version"]:
            return  # the final weights were already evaluated: no duplicate line
        returns = [float(r) for r in meta.get("returns", [])]
        lengths = [int(n) for n in meta.get("lengths", [])]
        if not returns:
            return
        mean = sum(returns) / len(returns)
        std = math.sqrt(sum((r - mean) ** 2 for r in returns) / len(returns))
        successes = meta.get("successes") or []
        metrics = clean_metrics(meta.get("metrics"))
        self.last_eval = {"eval/return_mean": mean, "eval/return_std": std,
                          "eval/length_mean": sum(lengths) / max(len(lengths), 1),
                          **({"eval/success_rate": sum(successes) / len(successes)} if successes else {}),
                          **{f"eval/metrics/{k}": v for k, v in metrics.items()},
                          "env_steps": int(meta.get("env_steps", self.counters.env_steps)),
                          "version": int(meta.get("version", -1)), "time": time.time()}
        if "best_score" in meta:
            self.best_eval = {"version": meta["best_version"], "score": meta["best_score"],
                              "path": "checkpoints/best.pt"}
            self.last_eval["eval/best_score"] = meta["best_score"]
        if self.logger is not None:
            self.logger.scalars(self.last_eval["env_steps"], {k: v for k, v in self.last_eval.items()
                                                                if k.startswith("eval/")},
                                version=self.last_eval["version"], wall_s=self.last_eval["time"] - self.start_time)

    def progress_line(self, version: int) -> str:
        """The line printed every ``trainer.log_interval_s``."""
        snap = self.counters.snapshot()
        episodes, counts, env_steps = snap["episodes"], snap["counts"], snap["env_steps"]
        elapsed = time.time() - self.start_time
        ret = f"{sum(r for r, _ in episodes) / len(episodes):.1f}" if episodes else "-"
        ev = "-"
        if self.last_eval:
            rate = self.last_eval.get("eval/success_rate")
            ev = (f"{self.last_eval['eval/return_mean']:.1f}" + (f" ({100 * rate:.0f}% success)" if rate is not None
                                                                 else "") + f" @ {fmt_num(self.last_eval['env_steps'])}")
            if self.best_eval is not None:
                ev += f" (best v{self.best_eval['version']}: {self.best_eval['score']:.3g})"
        lag = self.last_values.get("lag/mean")
        return (f"[learner] {elapsed:6.1f}s | steps {fmt_num(env_steps)}/{fmt_num(self.cfg.trainer.total_steps)} | "
                f"{env_steps / max(elapsed, 1e-9):6.0f} sps | v{version} | return {ret} | eval {ev} | "
                f"lag {'-' if lag is None else f'{lag:.2f}'} | dropped {counts['dropped_lag']}+{counts['overwritten']}"
                f" | bad {counts['malformed'] + counts['rejected']}")
