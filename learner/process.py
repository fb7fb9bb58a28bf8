"""The learner process: sockets, receiver thread, evaluator process, main loop, clean shutdown."""

from __future__ import annotations

import json
import logging
import os
import signal
import threading
import time
from pathlib import Path

import torch
import torch.multiprocessing as mp
import zmq

from learner.evaluator import run_evaluator
from learner.learner import Learner, RejectedMessage
from learner.logs import RunLogger
from shared import wire
from shared.config import Config, save_config
from learner.distributed import ranks_from_env
from shared.security import server_from_config
from shared.transport import WeightsPublisher, bind, write_endpoints

log = logging.getLogger("tandem.learner")


def _sender(frames: list) -> str:
    """Who sent a message, as far as ZeroMQ knows: its address, and its CURVE key when it has one."""
    try:
        address = frames[0].get("Peer-Address")
    except (zmq.ZMQError, AttributeError, IndexError):
        return "an unknown peer on the rollout socket"
    try:
        user = frames[0].get("User-Id")
    except (zmq.ZMQError, AttributeError):
        user = ""
    address = f"tcp://{address}" if address and "://" not in address else address or "an unknown peer"
    return address + (f" (key {user})" if user else "")


def _receive_loop(learner: Learner, sock: zmq.Socket, stop: threading.Event) -> None:
    """Receiver thread: decode and ingest until `stop`. Bad input is counted, never raised."""
    while not stop.is_set():
        if not sock.poll(50):
            continue
        try:
            frames = sock.recv_multipart(copy=False)
        except zmq.ZMQError:
            break
        try:
            td, meta = wire.decode(frames)
        except wire.WireError as e:
            learner.note_malformed(_sender(frames), str(e))
            continue
        try:
            learner.ingest(td, meta)
        except RejectedMessage as e:
            learner.note_rejected(str(e))
        except Exception as e:  # a bug on a bad message must not take the run down
            learner.note_rejected(f"{type(e).__name__} while ingesting from actor {meta.get('actor')!r}: {e}")


def run_learner_process(cfg: Config, run_dir: Path, resume: bool = False, evaluator: bool = True,
                        discard: bool = False) -> int:
    """Run the learner until ``total_steps`` or a stop signal. Returns the process exit code.

    With `discard`, rollouts are received, decoded, checked and counted but never trained on
    (the transport-cost benchmark); version 0 stays the only version.
    """
    torch.set_num_threads(cfg.learner.torch_threads)
    ranks = ranks_from_env(cfg.learner.devices)     # started by torchrun with several ranks
    if ranks is not None and discard:
        raise ValueError("--discard (the transport benchmark) runs one learner rank, not several")
    main = ranks is None or ranks.is_main
    if ranks is not None:
        cfg.learner.device = str(ranks.device)
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "checkpoints").mkdir(exist_ok=True)
    if main:
        save_config(cfg, run_dir / "config.json")
    stop = threading.Event()
    reason = []

    def _on_signal(signum, frame):  # only set a flag: never raise inside a ZeroMQ call
        reason.append(signal.Signals(signum).name)
        stop.set()

    signal.signal(signal.SIGINT, _on_signal)
    signal.signal(signal.SIGTERM, _on_signal)

    curve = server_from_config(cfg)   # bad key files fail here, before any socket exists
    ctx = zmq.Context()
    if curve is not None:
        curve.start(ctx)
    elif cfg.learner.host not in ("127.0.0.1", "localhost", "::1"):
        log.warning("learner.host is %s and CURVE is off: anyone who can reach these ports can send "
                    "rollouts and read the weights (see README: running across hosts)", cfg.learner.host)
    pull = ctx.socket(zmq.PULL)
    if curve is not None:
        curve.apply(pull)
    pull.setsockopt(zmq.LINGER, 0)
    pull.setsockopt(zmq.RCVHWM, cfg.learner.recv_hwm)
    pull.setsockopt(zmq.MAXMSGSIZE, 1 << 34)
    port = cfg.learner.rollout_port + (ranks.rank if ranks and cfg.learner.rollout_port else 0)
    rollouts_ep = bind(pull, cfg.learner.host, port)
    publisher = WeightsPublisher(ctx, cfg.learner.host, cfg.learner.weights_port, curve=curve) if main \
        else NullPublisher()
    endpoints = {"rollouts": rollouts_ep, "weights": publisher.endpoint}
    logger = RunLogger(run_dir, use_wandb=cfg.trainer.use_wandb, config=cfg.to_dict()) if main else \
        RunLogger(run_dir, use_tensorboard=False, suffix=f".rank{ranks.rank}")
    learner = Learner(cfg, run_dir, publisher, resume=resume, logger=logger, discard=discard, ranks=ranks)
    learner.curve = curve
    extra = {}
    if ranks is not None:   # every rank's rollouts address, in rank order, for the actors
        ports = [p[0] for p in ranks.all_gather_ints([int(rollouts_ep.rsplit(":", 1)[1])])]
        extra["rollouts_by_rank"] = [f"tcp://{cfg.learner.host}:{p}" for p in ports]
    if learner.shm_writer is not None:   # so that the launcher can remove it if this process is killed
        extra["shm"] = str(learner.shm_writer.path)
    if main:
        write_endpoints(run_dir, **endpoints, **extra)
    print(f"[learner{f' rank {ranks.rank}/{ranks.world}' if ranks else ''}] run dir {run_dir} | rollouts "
          f"{rollouts_ep} | weights {publisher.endpoint} | mode {cfg.trainer.buffer_type} | {cfg.env.id}"
          + (f" | resumed at v{learner.version}" if resume else ""), flush=True)

    eval_proc = None
    if evaluator and not discard and main:
        eval_proc = mp.get_context("spawn").Process(
            target=run_evaluator, args=(cfg.to_dict(), cfg.source, endpoints, os.getpid(),
                                        curve.client_for_child().to_strings() if curve is not None else None),
            daemon=True,
            name="tandem-evaluator")
        eval_proc.start()

    recv_stop = threading.Event()
    receiver = threading.Thread(target=_receive_loop, args=(learner, pull, recv_stop), name="receiver", daemon=True)
    receiver.start()
    # After --resume the checkpoint's version was published before: log a "resume" line, not a second publish.
    learner.publish(event="resume" if learner.resumed_from is not None else "publish")
    last_progress = time.time()
    exit_code = 0
    held = None            # several ranks: this rank's batch, waiting for every rank to have one
    try:
        while ranks is not None or (not stop.is_set() and not learner.finished):
            publisher.serve_subscriptions()
            while not learner.evals.empty():
                learner.log_eval(learner.evals.get())
            if main and time.time() - last_progress >= cfg.trainer.log_interval_s:
                print(learner.progress_line(), flush=True)
                last_progress = time.time()
            if discard:
                time.sleep(0.05)
                continue
            if ranks is not None:
                # Ranks decide together: update only when every rank has its share, stop when any
                # rank is told to or the ranks' env steps together reach the total.
                held = held or learner.take_batch(timeout_s=0.05)
                all_have, stop_now = _agree(learner, ranks, held is not None, stop.is_set())
                if stop_now:
                    break
                if all_have:
                    learner.update_once(*held)
                    held = None
                    learner.maybe_save()
                else:
                    learner.maybe_send_credit()
                continue
            batch = learner.take_batch(timeout_s=0.05)
            if batch is None:
                learner.maybe_send_credit()
                continue
            learner.update_once(*batch)
            learner.maybe_save()
    except Exception:
        log.exception("learner failed")
        exit_code = 1
    finally:
        if reason:
            print(f"[learner] {reason[0]}: stopping", flush=True)
        # Training is over: rollouts that still arrive are not counted, and actors are told to
        # stop now (the evaluator ignores this stop and evaluates the final weights sent after it).
        learner.accepting = False
        publisher.send_control(kind="stop", who="actors")
        if exit_code == 0:  # after a failure the last periodic checkpoint is the one to resume from
            try:
                learner.save()
            except Exception:
                log.exception("final checkpoint failed")
                exit_code = 1
        if exit_code == 0 and not stop.is_set() and eval_proc is not None:
            # A last evaluation of the final weights, bounded in time.
            learner.publish(final=True)
            deadline = time.time() + 120
            republish = time.time() + 5
            while time.time() < deadline and eval_proc.is_alive() and not stop.is_set():
                publisher.serve_subscriptions()
                if time.time() > republish:   # a busy evaluator's full queue may have dropped it
                    learner.publish(final=True)
                    republish = time.time() + 5
                try:
                    meta = learner.evals.get(timeout=0.1)
                except Exception:
                    continue
                learner.log_eval(meta)
                if meta.get("final"):
                    break
        for _ in range(3):
            publisher.send_control(kind="stop")
        print(learner.progress_line(), flush=True)
        recv_stop.set()
        receiver.join(timeout=5)
        for info in (held[1] if held else []):
            learner._drop(info, "shutdown")
        learner.drop_unconsumed("shutdown")    # after the receiver stopped: nothing can slip in behind it
        if eval_proc is not None:
            eval_proc.join(timeout=2)
            if eval_proc.is_alive():
                eval_proc.terminate()          # the evaluator keeps nothing: SIGTERM ends it at once
                eval_proc.join(timeout=2)
            if eval_proc.is_alive():
                eval_proc.kill()
                eval_proc.join(timeout=1)
        summary = {"env_steps": learner.env_steps + learner.peer_env_steps, "version": learner.version,
                   "updates": learner.updates,
                   "wall_s": time.time() - learner.start_time, **learner.counts,
                   "first_rollout_time": learner.first_rollout_time, "last_rollout_time": learner.last_rollout_time,
                   **({f"last_eval/{k.split('/')[-1]}": v for k, v in learner.last_eval.items()}
                      if learner.last_eval else {}),
                   "exit_code": exit_code, "stopped_by": reason[0] if reason else None}
        if ranks is not None:
            summary.update(rank=ranks.rank, world=ranks.world, env_steps_this_rank=learner.env_steps)
        name = "summary.json" if main else f"summary.rank{ranks.rank}.json"
        (run_dir / name).write_text(json.dumps(summary, indent=2) + "\n")
        if logger is not None:
            logger.close()
        time.sleep(0.2)  # let the stop messages leave
        publisher.close()
        pull.close(linger=0)
        if learner.shm_writer is not None:
            learner.shm_writer.close()
        if curve is not None:
            curve.stop()
        ctx.term()
        if main:
            (run_dir / "endpoints.json").unlink(missing_ok=True)
        if ranks is not None:
            torch.distributed.destroy_process_group()
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
    with learner._lock:
        finished = list(learner.finished_per_actor)
    rows = ranks.all_gather_ints([int(have_batch), int(stop), local_steps, *finished])
    total = sum(r[2] for r in rows)
    learner.peer_env_steps = total - local_steps
    learner.peer_finished = [sum(r[3 + i] for j, r in enumerate(rows) if j != ranks.rank)
                             for i in range(len(finished))]
    stop_now = any(r[1] for r in rows) or total >= learner.cfg.trainer.total_steps
    return all(r[0] for r in rows), stop_now
