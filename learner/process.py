"""The learner process: sockets, receiver thread, evaluator process, main loop, clean shutdown.

:func:`run_learner_process` reads as three steps: :meth:`LearnerRun.start` (sockets, the
:class:`Learner`, the receiver thread, the evaluator), :meth:`LearnerRun.loop` (updates until
``total_steps`` or a stop signal) and :meth:`LearnerRun.shutdown` (final checkpoint, final
evaluation, ``summary.json``, sockets closed). The receiver thread hands every message to
``learner.intake`` (``learner/ingest.py``), which never raises; if the thread dies anyway, the
main loop notices within one turn and the process exits non-zero with the reason.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import secrets
import threading
import time
from pathlib import Path
from typing import Any

import torch
import torch.multiprocessing as mp
import zmq

from learner.disk import DISK, catch_background_write_errors
from learner.distributed import ranks_from_env
from learner.evaluator import run_evaluator
from learner.learner import Learner, learner_threads
from learner.logs import RunLogger
from shared.config import Config, save_config
from shared.console import say
from shared.files import write_json_atomic
from shared.teardown import stop_on_signals
from shared.security import server_from_config
from shared.transport import WeightsPublisher, bind, write_endpoints

log = logging.getLogger("tandem.learner")

RECV_MEMORY_BYTES = 2 << 30    # rollouts queued in the receive socket, at most (bounds RCVHWM)
EVAL_MAX_BYTES = 1 << 20       # an evaluation result is a few numbers per episode


def _sender(frames: list) -> str:
    """Who sent a message, as far as ZeroMQ knows: its address, and its CURVE key when it has one."""
    try:
        address = frames[0].get("Peer-Address")
    except (zmq.ZMQError, AttributeError, IndexError):
        return "an unknown peer"
    try:
        user = frames[0].get("User-Id")
    except (zmq.ZMQError, AttributeError):
        user = ""
    address = f"tcp://{address}" if address and "://" not in address else address or "an unknown peer"
    return address + (f" (key {user})" if user else "")


def _receive_loop(learner: Learner, socks: dict[str, zmq.Socket], stop: threading.Event, died: list) -> None:
    """Receiver thread: hand every message to ``learner.intake`` until `stop`. The intake never
    raises; anything else that goes wrong is recorded in `died` for the main loop to report."""
    poller = zmq.Poller()
    names = {}
    for name, sock in socks.items():
        poller.register(sock, zmq.POLLIN)
        names[sock] = name
    try:
        while not stop.is_set():
            for sock, _ in poller.poll(50):
                frames = sock.recv_multipart(copy=False)
                learner.intake.handle(frames, _sender(frames), names[sock])
            learner.intake.idle()
    except zmq.ContextTerminated:
        pass
    except BaseException as e:    # noqa: BLE001 - reported by the main loop, which exits non-zero
        died.append(f"{type(e).__name__}: {e}")
        log.exception("receiver thread died")


class LearnerRun:
    """One learner process's resources, from :meth:`start` to :meth:`shutdown`."""

    def __init__(self, cfg: Config, run_dir: Path, evaluator: bool, discard: bool):
        self.cfg, self.run_dir, self.evaluator, self.discard = cfg, Path(run_dir), evaluator, discard
        self.stop = threading.Event()            # a signal: SIGINT or SIGTERM
        self.reason: list[str] = []
        self.recv_stop = threading.Event()
        self.receiver_died: list[str] = []
        self.eval_proc = None
        self.video_frames_pending = 0             # deferred video frames the evaluator renders after the final eval
        self.held = None                          # several ranks: this rank's batch, waiting for the others
        self.ring = None                          # actors.rollout_transport "ring": the rollout slots

    # ================================================================ setup
    @classmethod
    def start(cls, cfg: Config, run_dir: Path, resume: bool | Path, evaluator: bool, discard: bool) -> LearnerRun:
        self = cls(cfg, run_dir, evaluator, discard)
        self.threads = learner_threads(cfg)
        torch.set_num_threads(self.threads)
        self.ranks = ranks_from_env(cfg.learner.devices)     # started by torchrun with several ranks
        if self.ranks is not None and discard:
            raise ValueError("--discard (the transport benchmark) runs one learner rank, not several")
        self.main = self.ranks is None or self.ranks.is_main
        if self.ranks is not None:
            cfg.learner.device = str(self.ranks.device)
        (self.run_dir / "checkpoints").mkdir(parents=True, exist_ok=True)
        if self.main:
            if resume:
                warn_if_correction_changed(cfg, self.run_dir / "config.json")
            save_config(cfg, self.run_dir / "config.json")
        stop_on_signals(self.stop, self.reason)
        self.curve = server_from_config(cfg)   # bad key files fail here, before any socket exists
        self.ctx = zmq.Context()
        if self.curve is not None:
            self.curve.start(self.ctx)
        elif cfg.learner.host not in ("127.0.0.1", "localhost", "::1"):
            log.warning("learner.host is %s and CURVE is off: anyone who can reach these ports can send "
                        "rollouts and read the weights (see docs/guides/two_hosts.md)", cfg.learner.host)
        self.publisher = (WeightsPublisher(self.ctx, cfg.learner.host, cfg.learner.weights_port, curve=self.curve,
                                           advertise=cfg.learner.advertise_host) if self.main else NullPublisher())
        self.logger = (RunLogger(self.run_dir, use_wandb=cfg.trainer.use_wandb, config=cfg.to_dict()) if self.main
                       else RunLogger(self.run_dir, use_tensorboard=False, suffix=f".rank{self.ranks.rank}"))
        self.learner = Learner(cfg, self.run_dir, self.publisher, resume=resume, logger=self.logger,
                               discard=discard, ranks=self.ranks)
        self.learner.curve = self.curve
        self.learner.stop_requested = self.stop.is_set   # a signal cuts a long update short
        self.learner.budget_closes_intake = self.ranks is None   # no rollout past trainer.total_steps
        self._bind_receivers()
        self.ring = open_rollout_ring(self.cfg, self.learner, self.run_dir)
        self._write_endpoints()
        ranks = self.ranks
        say(f"[learner{f' rank {ranks.rank}/{ranks.world}' if ranks else ''}] run dir {self.run_dir} | rollouts "
            f"{self.endpoints['rollouts']} | weights {self.publisher.endpoint} | mode {cfg.trainer.buffer_type} | "
            f"{cfg.env.id} | {self.threads} torch thread{'s' if self.threads > 1 else ''} | "
            f"incarnation {self.learner.incarnation}"
            + (f" | resumed at v{self.learner.version}" if resume else ""))
        self._start_evaluator()
        self.receiver = threading.Thread(target=_receive_loop, name="receiver", daemon=True,
                                         args=(self.learner, self.socks, self.recv_stop, self.receiver_died))
        self.receiver.start()
        # After --resume the checkpoint's version was published before: log a "resume" line, not a second publish.
        self.learner.publish(event="resume" if self.learner.resumed_from is not None else "publish")
        return self

    def _bind_receivers(self) -> None:
        """The rollout socket, sized from the rollout schema, and the evaluator's own socket."""
        cfg, intake = self.cfg, self.learner.intake
        pull = self.ctx.socket(zmq.PULL)
        if self.curve is not None:
            self.curve.apply(pull)
        pull.setsockopt(zmq.LINGER, 0)
        # A peer that sends a frame larger than any rollout frame is disconnected by ZeroMQ itself.
        pull.setsockopt(zmq.MAXMSGSIZE, intake.max_frame_bytes)
        hwm = min(cfg.learner.recv_hwm, max(2, RECV_MEMORY_BYTES // intake.max_message_bytes))
        pull.setsockopt(zmq.RCVHWM, hwm)
        port = cfg.learner.rollout_port + (self.ranks.rank if self.ranks and cfg.learner.rollout_port else 0)
        self.endpoints = {"rollouts": bind(pull, cfg.learner.host, port, cfg.learner.advertise_host),
                          "weights": self.publisher.endpoint}
        self.socks = {"rollouts": pull}
        self.eval_token = None
        if self.evaluator and not self.discard and self.main:
            # The evaluator is our child on this host: a loopback socket, not in endpoints.json, and a
            # per-run token it is given at start; results from anywhere else are refused.
            ev = self.ctx.socket(zmq.PULL)
            ev.setsockopt(zmq.LINGER, 0)
            ev.setsockopt(zmq.MAXMSGSIZE, EVAL_MAX_BYTES)
            self.eval_endpoint = bind(ev, "127.0.0.1", 0)
            self.socks["eval"] = ev
            self.eval_token = secrets.token_hex(16)
            intake.eval_token = self.eval_token

    def _write_endpoints(self) -> None:
        extra: dict[str, Any] = {}
        if self.ranks is not None:   # every rank's rollouts address, in rank order, for the actors
            # each rank's own: ranks on several nodes (launch/run_ray.py) advertise several hosts
            extra["rollouts_by_rank"] = self.ranks.all_gather_text(self.endpoints["rollouts"])
        if self.learner.shm_writer is not None:   # so that the launcher can remove it if this process is killed
            extra["shm"] = str(self.learner.shm_writer.path)
        if self.ring is not None:      # where actors find their ring (and the launcher what to remove)
            extra["rollout_ring"] = str(self.ring.path)
        if self.main:
            write_endpoints(self.run_dir, **self.endpoints, **extra)

    def _start_evaluator(self) -> None:
        if self.eval_token is None:
            return
        endpoints = {**self.endpoints, "eval": self.eval_endpoint}
        self.eval_proc = mp.get_context("spawn").Process(
            target=run_evaluator, name="tandem-evaluator", daemon=True,
            args=(self.cfg.to_dict(), self.cfg.source, endpoints, os.getpid(),
                  self.curve.client_for_child().to_strings() if self.curve is not None else None, self.eval_token,
                  str(self.run_dir), self.learner.resumed_from is not None))
        self.eval_proc.start()

    # ================================================================ main loop
    def loop(self) -> int:
        """Update until the run is over or stopped. Returns the exit code so far (0 or 1)."""
        last_progress = time.time()
        learner = self.learner
        try:
            while self.ranks is not None or (not self.stop.is_set() and not learner.finished):
                if DISK.failed and not self.stop.is_set():   # the run directory cannot be written: stop
                    self.stop.set()
                    if self.ranks is None:
                        break
                if not self.receiver.is_alive():
                    raise RuntimeError(f"the receiver thread died: {self.receiver_died or 'no reason recorded'}")
                self.publisher.serve_subscriptions()
                while not learner.evals.empty():
                    learner.log_eval(learner.evals.get())
                if self.main and time.time() - last_progress >= self.cfg.trainer.log_interval_s:
                    say(learner.progress_line())
                    last_progress = time.time()
                if self.discard:
                    time.sleep(0.05)
                elif self.ranks is not None:
                    if not self._turn_with_ranks():
                        break
                else:
                    self._turn()
            if self.ranks is None and not self.discard and not self.stop.is_set():
                self._drain()
        except Exception as e:
            log.exception("learner failed")
            say(f"[learner] failed: {type(e).__name__}: {e}")
            return 1
        if DISK.failed:
            say(DISK.line(self.learner.checkpoints.last_intact()))
            return 1
        return 0

    def _drain(self) -> None:
        """The run's env steps are all in: take no more rollouts (they are beyond the budget: neither
        counted nor stored), and train on every full batch already received. Without this, vla mode
        dropped the last round of rollouts at shutdown when it arrived during the previous update.
        A partial batch left over is dropped at shutdown, as before (counted)."""
        self.learner.accepting = False
        while (batch := self.learner.take_batch(timeout_s=0)) is not None:
            self.learner.update_once(*batch)
            self.learner.maybe_save()

    def _turn(self) -> None:
        batch = self.learner.take_batch(timeout_s=0.05)
        if batch is None:
            self.learner.maybe_send_credit()
            return
        self.learner.update_once(*batch)
        self.learner.maybe_save()

    def _turn_with_ranks(self) -> bool:
        """Ranks decide together: update only when every rank has its share, stop when any rank is
        told to or the ranks' env steps together reach the total. False: stop."""
        self.held = self.held or self.learner.take_batch(timeout_s=0.05)
        all_have, stop_now = _agree(self.learner, self.ranks, self.held is not None, self.stop.is_set())
        if stop_now:
            return False
        if all_have:
            self.learner.update_once(*self.held)
            self.held = None
            self.learner.maybe_save()
        else:
            self.learner.maybe_send_credit()
        return True

    # ================================================================ shutdown
    def shutdown(self, exit_code: int) -> int:
        """Stop the actors, save, evaluate the final weights, write the summary, close everything.
        Each step runs even if an earlier one failed; returns the final exit code."""
        learner = self.learner
        if self.reason and not DISK.failed:
            say(f"[learner] {self.reason[0]}: stopping")
        # Training is over: rollouts that still arrive are not counted, and actors are told to
        # stop now (the evaluator ignores this stop and evaluates the final weights sent after it).
        learner.accepting = False
        for step in (self._stop_actors, self._save_final, self._final_eval):
            exit_code = self._guarded(step, exit_code)
        exit_code = self._guarded(self._stop_receiver, exit_code)
        self._guarded(self._stop_evaluator, exit_code)
        exit_code = self._guarded(lambda code: self._write_summary(code), exit_code)
        self._close()
        return exit_code

    def _guarded(self, step, exit_code: int) -> int:
        try:
            out = step(exit_code)
            return exit_code if out is None else out
        except Exception:
            log.exception("shutdown step %s failed", getattr(step, "__name__", step))
            return 1

    def _stop_actors(self, exit_code: int) -> None:
        self.publisher.send_control(kind="stop", who="actors", incarnation=self.learner.incarnation)

    def _save_final(self, exit_code: int) -> int | None:
        if exit_code == 0:  # after a failure the last periodic checkpoint is the one to resume from
            if self.learner.save() is None and DISK.failed:   # the final checkpoint could not be written
                say(DISK.line(self.learner.checkpoints.last_intact()))
                return 1
        return None

    def _final_eval(self, exit_code: int) -> None:
        """A last evaluation of the final weights, bounded in time (not after a signal or failure)."""
        learner, proc = self.learner, self.eval_proc
        if exit_code != 0 or self.stop.is_set() or proc is None:
            return
        learner.publish(final=True)
        video = self.cfg.trainer.video
        # rendering the final evaluation's video gets its own time (0.5 s a frame: software GL is slow)
        grace = 120 + (0.5 * video.max_frames * video.episodes if video.every else 0)
        deadline, republish = time.time() + grace, time.time() + 5
        while time.time() < deadline and proc.is_alive() and not self.stop.is_set() and self.receiver.is_alive():
            self.publisher.serve_subscriptions()
            if time.time() > republish:   # a busy evaluator's full queue may have dropped it
                learner.publish(final=True)
                republish = time.time() + 5
            try:
                meta = learner.evals.get(timeout=0.1)
            except Exception:
                continue
            learner.log_eval(meta)
            if meta.get("final"):
                self.video_frames_pending = meta["video_frames_pending"]   # an int in [0, 1e7]: check_eval
                return

    def _stop_receiver(self, exit_code: int) -> None:
        for _ in range(3):
            self.publisher.send_control(kind="stop", incarnation=self.learner.incarnation)
        say(self.learner.progress_line())
        self.recv_stop.set()
        self.receiver.join(timeout=5)
        for info in (self.held[1] if self.held else []):
            self.learner._drop(info, "shutdown")
        self.learner.drop_unconsumed("shutdown")    # after the receiver stopped: nothing can slip in behind it

    def _stop_evaluator(self, exit_code: int) -> None:
        proc = self.eval_proc
        if proc is None:
            return
        wait = 2.0
        if self.video_frames_pending and exit_code == 0 and not self.stop.is_set():
            # videos deferred to the end of the run (trainer.video.when): 0.5 s a frame, for software GL
            wait += 0.5 * self.video_frames_pending
            say(f"[learner] the evaluator renders its deferred videos ({self.video_frames_pending} frames at most; "
                f"waiting up to {wait:.0f} s)")
        proc.join(timeout=wait)
        if proc.is_alive():
            proc.terminate()          # the evaluator keeps nothing: SIGTERM ends it at once
            proc.join(timeout=2)
        if proc.is_alive():
            proc.kill()
            proc.join(timeout=1)

    def _write_summary(self, exit_code: int) -> int:
        if self.receiver_died and exit_code == 0:
            exit_code = 1
        summary = run_summary(self.learner, self.threads, exit_code, self.reason[0] if self.reason else None,
                              self.ranks)
        name = "summary.json" if self.main else f"summary.rank{self.ranks.rank}.json"
        return exit_code if write_summary(self.run_dir / name, summary) else 1

    def _close(self) -> None:
        for close in (self.logger.close, lambda: time.sleep(0.2),   # let the stop messages leave
                      self.publisher.close, *[lambda s=s: s.close(linger=0) for s in self.socks.values()],
                      lambda: self.learner.shm_writer and self.learner.shm_writer.close(),
                      # a receiver thread that did not stop in time may still read the ring: then only unlink
                      lambda: self.ring and self.ring.close(unmap=not self.receiver.is_alive()),
                      lambda: self.curve and self.curve.stop(), self.ctx.term,
                      lambda: self.main and (self.run_dir / "endpoints.json").unlink(missing_ok=True),
                      lambda: self.ranks and torch.distributed.destroy_process_group()):
            try:
                close()
            except Exception:
                log.exception("closing the learner's resources")


def warn_if_correction_changed(cfg: Config, saved: Path) -> None:
    """On --resume: say so when this config trains with another correction than the run's saved one
    (an older run whose config left it unset trained with none; unset now means trust in async mode)."""
    try:
        before = json.loads(saved.read_text())["algorithm"]["cfg"].get("correction")
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return
    now = getattr(cfg.algorithm.cfg, "correction", None)
    if before is not None and now is not None and before != now:
        log.warning("--resume: this run trained with correction %r (%s) and goes on with %r; set "
                    "algorithm.cfg.correction=%s to keep it", before, saved, now, before)


def write_summary(path: Path, summary: dict[str, Any]) -> bool:
    """``summary.json`` through a temp file; False when it could not be written (a full disk: no temp
    file is left, and ``learner.disk.DISK`` stops the run)."""
    try:
        write_json_atomic(path, summary, indent=2)
        return True
    except OSError as e:
        path.with_name(path.name + ".tmp").unlink(missing_ok=True)
        DISK.record(path, e)
        return False


def run_summary(learner: Learner, threads: int, exit_code: int, stopped_by: str | None, ranks) -> dict[str, Any]:
    """``summary.json``: the run's final counters, times, last and best evaluation, and how it ended."""
    summary = {"env_steps": learner.env_steps + learner.peer_env_steps, "env_steps_trained": learner.env_steps_trained,
               "version": learner.version,
               "updates": learner.updates, "start_time": learner.start_time,
               "wall_s": time.time() - learner.start_time, **learner.counts,
               "learner_threads": threads, **{f"time/{k}": round(v, 3) for k, v in learner.time_totals.items()},
               "first_rollout_time": learner.first_rollout_time, "last_rollout_time": learner.last_rollout_time,
               **({f"last_eval/{k.removeprefix('eval/')}": v for k, v in learner.last_eval.items()}
                  if learner.last_eval else {}),
               **({f"best/{k}": v for k, v in learner.best_eval.items()} if learner.best_eval else {}),
               "incarnation": learner.incarnation,
               "resumed_from": str(learner.resumed_from) if learner.resumed_from else None,
               **({"resume_skipped": learner.resume_skipped} if learner.resume_skipped else {}),
               "exit_code": exit_code, "stopped_by": stopped_by}
    if ranks is not None:
        summary.update(rank=ranks.rank, world=ranks.world, env_steps_this_rank=learner.env_steps)
    return summary


def open_rollout_ring(cfg: Config, learner: Learner, run_dir: Path):
    """actors.rollout_transport "ring": the actors' rollout slots (shared/rollout_ring.py), owned by
    the learner process, handed to its intake; None with "zmq"."""
    if cfg.actors.rollout_transport != "ring":
        return None
    from shared.rollout_ring import RolloutRing, default_path
    tag = hashlib.sha1(str(run_dir.resolve()).encode()).hexdigest()[:12]
    device = learner.device if learner.device.type == "cuda" else "cpu"
    ring = RolloutRing(learner.template, cfg.actors.num_actors, cfg.actors.rollout_ring_slots, default_path(tag), device)
    learner.intake.ring = ring
    return ring


def run_learner_process(cfg: Config, run_dir: Path, resume: bool | Path = False, evaluator: bool = True,
                        discard: bool = False) -> int:
    """Run the learner until ``total_steps`` or a stop signal. Returns the process exit code.

    With `discard`, rollouts are received, decoded, checked and counted but never trained on
    (the transport-cost benchmark); version 0 stays the only version.
    """
    catch_background_write_errors()
    run = LearnerRun.start(cfg, run_dir, resume, evaluator, discard)
    exit_code = 1
    try:
        exit_code = run.loop()
    finally:
        exit_code = run.shutdown(exit_code)
    return exit_code


class NullPublisher:
    """Learner ranks other than 0 publish nothing (rank 0 publishes the weights every rank holds)."""
    endpoint = None

    def publish(self, td, **meta) -> None:
        pass

    def send_control(self, **meta) -> None:
        pass

    def serve_subscriptions(self) -> int:
        return 0

    def close(self) -> None:
        pass


def _agree(learner: Learner, ranks, have_batch: bool, stop: bool) -> tuple[bool, bool]:
    """One small all-gather per loop turn: does every rank hold its share of the next batch, must
    the run stop (a signal on any rank, or the ranks' env steps together reach total_steps), and the
    other ranks' counters (env steps, per-actor consumed counts: rank 0 publishes the totals)."""
    local_steps = learner.env_steps
    with learner.stats.lock:
        finished = list(learner.finished_per_actor)
    rows = ranks.all_gather_ints([int(have_batch), int(stop), local_steps, *finished])
    total = sum(r[2] for r in rows)
    learner.peer_env_steps = total - local_steps
    learner.peer_finished = [sum(r[3 + i] for j, r in enumerate(rows) if j != ranks.rank)
                             for i in range(len(finished))]
    stop_now = any(r[1] for r in rows) or total >= learner.cfg.trainer.total_steps
    return all(r[0] for r in rows), stop_now
