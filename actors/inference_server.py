"""The inference server: the acting copy for the actors of one device, batched across them.

:class:`InferenceServer` is its loop (requests in, one forward pass per batch, replies out, new
weights between batches); :class:`ServerStats` what it counts and logs. The process around it, and
what the server is for, are in :mod:`actors.inference`; the requests it takes in
:mod:`actors.inference_requests`.
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path

import torch
import zmq
from tensordict import TensorDict

from actors.inference_requests import Request, RequestChecker, busy_reply, error_reply
from actors.inference_topology import served_actors
from shared import keys, wire
from shared.config import Config
from shared.envs.base import EnvSpec
from shared.files import write_json_atomic
from shared.policies import observation_bounds
from shared.transport import RESEND_AFTER_S

# A request that names its learner life (lag_policy pace after a learner restart) waits this long at
# most for that life's weights; the server asks the learner for them after RESEND_AFTER_S.
SAME_LIFE_WAIT_S = 2 * RESEND_AFTER_S

log = logging.getLogger("tandem.inference")

LOG_EVERY = 1000          # after the first 10, one refusal in this many is logged
WEIGHTS_LOOK_S = 0.005    # how often a server holding requests for a version looks for it


class InferenceServer:
    """The acting copy for the actors on one device, batched across them.

    Args:
        cfg: the run's config.
        server_id: which device of :func:`~actors.inference_topology.server_devices`.
        policy: the acting copy (on its device, eval mode), possibly wrapped by the emulated latency.
        loader: its :class:`~actors.weights_loader.WeightsLoader`.
        weights: the learner's weights socket (``newest(timeout_ms)``).
        sock: a bound ROUTER socket.
        spec: the env's spec (the request schema).
        stop: set to end :meth:`run`.
        writer, progress: for its :class:`ServerStats` (TensorBoard).
        expire_s: a request not served after this long is dropped (``expired``): its actor has stopped
            waiting for the reply (the actors' learner timeout).
    """

    def __init__(self, cfg: Config, server_id: int, policy, loader, weights, sock: zmq.Socket, spec: EnvSpec,
                 stop, writer=None, expire_s: float = 120.0, progress: Path | None = None):
        a = cfg.actors
        self.cfg, self.server_id, self.policy, self.loader = cfg, server_id, policy, loader
        self.weights, self.sock, self.stop = weights, sock, stop
        self.actors = served_actors(cfg, server_id)
        extras = getattr(policy, "rollout_extras", None)    # an action-chunk policy's own rollout tensors
        self.extras = tuple(extras()) if callable(extras) else ()
        self.max_batch = a.server_max_batch or a.num_envs * max(1, len(self.actors))
        self.max_wait_s = a.server_max_wait_ms / 1000.0
        # Waiting for more requests pays only while it is short next to a forward pass: the wait is
        # also bounded by half the recent time per batch (a cheap policy then serves what is there).
        self.forward_ema_s = self.max_wait_s * 2
        self.max_queue = a.server_queue
        self.checker = RequestChecker(spec, a.num_envs, self.actors, observation_bounds(policy))
        self.waiting: list[Request] = []        # checked, not served yet (bounded by max_queue)
        self.stats = ServerStats(server_id, cfg.trainer.log_interval_s, writer, progress)
        self.counts = self.stats.counts
        self._next_ask = 0.0    # asks the learner again for weights a request waits for (_maybe_ask)
        self.expire_s = expire_s
        self._next_expiry = time.monotonic() + 1.0
        self.stopped_by_learner = False
        self.failed = False

    # -------------------------------------------------------------- the loop
    def run(self) -> int:
        while not self.stop.is_set():
            if not self._take_weights():
                break
            self._receive(timeout_s=0.1 if not self._ready() else 0.0)
            self._maybe_ask()
            batch = self._batch()
            if batch:
                self._serve(batch)
            self.stats.maybe_log(self.loader.version, self.max_batch, self.max_wait_s, self._wait_s())
        return 1 if self.failed else 0

    def _take_weights(self) -> bool:
        """Between batches: queue what the learner published, load what is due. False on stop."""
        while True:
            msg = self.weights.newest(0)
            if msg is None:
                break
            if msg[1].get("kind") == "stop":
                if msg[1].get("who") == "actors":   # the learner's end of run: actors stop, so do we
                    log.info("inference server %d: the learner stopped the run", self.server_id)
                self.stopped_by_learner = True
                self.stop.set()
                return False
            self.loader.offer(msg)
        if self.loader.load_due() == "refused_base":
            self.failed = True
            self.stop.set()
            return False
        return True

    def _maybe_ask(self) -> None:
        """A request has waited :data:`~shared.transport.RESEND_AFTER_S` for a version we lack: ask the
        learner again for its newest weights (ZeroMQ may have dropped the message at a high-water
        mark), then again every as long while one waits so."""
        now = time.perf_counter()
        if now < self._next_ask or not hasattr(self.weights, "ask"):
            return
        if any(now - r.arrived >= RESEND_AFTER_S and not self._servable(r) for r in self.waiting):
            self.weights.ask(*self.loader.newest_received())
            self.counts["asked"] += 1
            self._next_ask = now + RESEND_AFTER_S

    def _ready(self) -> bool:
        return any(self._servable(r) for r in self.waiting)

    def _servable(self, r: Request) -> bool:
        """Weights are loaded, whole, and new enough for the request: a version of the learner life
        its ``min_version`` came from at least that, or any version of another life (a restarted
        learner resumes at its checkpoint's, lower, version: standard mode acts with it at once)."""
        if self.loader.torn or self.loader.version < 0:
            return False
        other_life = r.incarnation is not None and r.incarnation != self.loader.incarnation
        if other_life and r.same_life:
            # a paced actor names the life its credit came from: after a learner restart, the new one,
            # whose weights are on their way (acted with the old life's, its rollout would be dropped).
            # A life the learner has moved on from (its credit reached the actor before the new one's)
            # is served at once; a newer one is waited for, but not for ever.
            lives = getattr(self.weights, "lives", None) or []
            if r.incarnation in lives and r.incarnation != lives[-1]:
                return True
            return time.perf_counter() - r.arrived >= SAME_LIFE_WAIT_S
        return other_life or self.loader.version >= r.min_version

    def _receive(self, timeout_s: float) -> None:
        """Take requests off the socket: wait up to `timeout_s` for the first; after a servable one
        is waiting, go on for at most ``server_max_wait_ms`` from its arrival, until the batch is full
        (``server_max_batch`` envs, or a request from every served actor). While requests are held for
        weights, return within :data:`WEIGHTS_LOOK_S` (the weights come on another thread)."""
        deadline = time.perf_counter() + timeout_s
        while True:
            now = time.perf_counter()
            servable = [r for r in self.waiting if self._servable(r)]
            envs = sum(r.n for r in servable)
            # full: the most envs a batch takes, or a request from every actor (with server_splits an
            # actor's other parts come only after it has stepped the envs this batch acts for)
            if envs >= self.max_batch or len({r.actor for r in servable}) >= len(self.actors):
                return
            if servable:
                deadline = min(r.arrived for r in servable) + self._wait_s()
            elif self.waiting:   # held for weights, which come on the subscriber's thread: look again soon
                deadline = min(deadline, now + WEIGHTS_LOOK_S)
            remaining = deadline - now
            # ZeroMQ waits in whole milliseconds: under half of one left, take what has arrived and
            # serve (polling with 0 until the deadline spun a core, taken from the learner on a small host)
            wait_ms = round(remaining * 1000) if remaining >= 0.0005 else 0
            if not self.sock.poll(wait_ms):
                if wait_ms == 0 or time.perf_counter() >= deadline:
                    return
                continue
            for _ in range(self.max_queue):   # bounded: a flood of requests cannot keep batches from going out
                if not self.sock.poll(0):
                    break
                self._take(self.sock.recv_multipart(copy=False))
            if time.perf_counter() >= deadline:
                return

    def _take(self, frames: list) -> None:
        route, body = frames[0].bytes, frames[1:]
        self.counts["requests"] += 1
        try:
            req = self.checker.check(route, body)
        except wire.WireError as e:
            self.stats.refuse("malformed", route, str(e))
            rid = getattr(e, "rid", None)
            if rid is not None:   # one of our actors' requests, bad by its observations: tell it, not wait
                self._tell(route, error_reply(rid, f"the request was refused: {e}"))
            return
        except Exception as e:   # decode promises WireError only: a bug on bad input must not end the server
            self.stats.refuse("malformed", route, f"{type(e).__name__}: {e}")
            return
        if len(self.waiting) >= self.max_queue:
            self.stats.refuse("busy", route, f"{len(self.waiting)} requests wait already (actors.server_queue)")
            self._tell(route, busy_reply(req.rid))
            return
        self.waiting.append(req)

    def _expire(self) -> None:
        """Drop the requests that waited longer than their actors wait for a reply (a version that never
        comes); looked at once a second."""
        now = time.monotonic()
        if now < self._next_expiry:
            return
        self._next_expiry = now + 1.0
        oldest = time.perf_counter() - self.expire_s
        for r in [r for r in self.waiting if r.arrived < oldest]:
            self.stats.refuse("expired", r.route, f"actor {r.actor}'s request {r.rid} waited {self.expire_s:.0f} s "
                         f"(min_version {r.min_version}, the server has v{self.loader.version})")
        self.waiting = [r for r in self.waiting if r.arrived >= oldest]

    def _batch(self) -> list[Request]:
        """The requests to serve now, oldest first, at most `max_batch` envs (one request at least)."""
        self._expire()
        out, envs = [], 0
        for r in self.waiting:
            if self._servable(r) and (not out or envs + r.n <= self.max_batch):
                out.append(r)
                envs += r.n
        taken = {id(r) for r in out}
        self.waiting = [r for r in self.waiting if id(r) not in taken]
        return out

    @torch.inference_mode()
    def _serve(self, batch: list[Request]) -> None:
        """One forward pass for the act requests and one value pass for the value requests; every
        reply carries the version that acted (the loader's: nothing loads during this)."""
        version, incarnation, received = self.loader.version, self.loader.incarnation, self.loader.received_at
        t0 = time.perf_counter()
        envs = sum(r.n for r in batch)
        self.counts["batches"] += 1          # before any reply: whoever has a reply sees its batch counted
        self.counts["envs"] += envs
        meta = {"version": version, "incarnation": incarnation, "received": received}
        for kind in ("act", "value"):
            reqs = [r for r in batch if r.kind == kind]
            if not reqs:
                continue
            try:
                outs = self._forward(kind, reqs)
            except Exception as e:   # what one actor's observations did to the policy must not end the server
                self._isolate(kind, reqs, e, meta)
                continue
            self._reply(reqs, outs, meta)
        took = time.perf_counter() - t0
        self.stats.served(envs, len(batch), took)
        self.forward_ema_s += 0.1 * (took - self.forward_ema_s)

    def _wait_s(self) -> float:
        """How long a servable request waits for others to join its batch: ``server_max_wait_ms``, or
        half the recent time per batch if less."""
        return min(self.max_wait_s, 0.5 * self.forward_ema_s)

    def _forward(self, kind: str, reqs: list[Request]) -> dict[str, torch.Tensor]:
        """The policy's outputs for `reqs`, in passes of at most ``max_batch`` envs: a device sized to
        that never gets more, whatever one request holds (up to num_envs: an actor's last values)."""
        obs = torch.cat([r.obs for r in reqs]).to(self.loader.device)
        if obs.shape[0] <= self.max_batch:
            return self._pass(kind, obs)
        parts = [self._pass(kind, obs[i:i + self.max_batch]) for i in range(0, obs.shape[0], self.max_batch)]
        return {k: torch.cat([p[k] for p in parts]) for k in parts[0]}

    def _pass(self, kind: str, obs) -> dict[str, torch.Tensor]:
        td = TensorDict({keys.OBS: obs}, batch_size=[obs.shape[0]])
        if kind == "act":
            out = self.policy(td)
            outs = {k: out[k] for k in (keys.ACTION, keys.LOG_PROB, keys.VALUE, *self.extras) if k in out.keys()}
        else:
            outs = {keys.VALUE: self.policy.get_value(td)}
        return {k: v.cpu() for k, v in outs.items()}

    def _reply(self, reqs: list[Request], outs: dict[str, torch.Tensor], meta: dict) -> None:
        start = 0
        for r in reqs:
            part = [((k,), v[start:start + r.n]) for k, v in outs.items()]
            start += r.n
            self._send(r, wire.encode_leaves([r.n], part, kind="reply", id=r.rid, **meta))

    def _send(self, r: Request, frames: list) -> None:
        try:
            self.sock.send_multipart([r.route, *frames], flags=zmq.NOBLOCK)
            self.counts["replies"] += 1
        except zmq.ZMQError as e:   # its queue is full or it is gone: never block the others
            self.stats.refuse("undeliverable", r.route, f"its reply could not be sent ({e})")

    def _isolate(self, kind: str, reqs: list[Request], error: Exception, meta: dict) -> None:
        """The policy raised on a batch (observations it cannot act on: out of its vocabulary, huge
        values that give NaN probabilities, ...): serve each request alone, and refuse the ones that
        fail alone, with an error reply (their actor ends, as it would acting locally, and the
        launcher restarts it). A device left unusable (a CUDA assert is sticky) ends the server, so
        the launcher starts a fresh one."""
        self._device_usable(error, reqs)
        for i, r in enumerate(reqs):
            try:
                outs = self._forward(kind, [r]) if len(reqs) > 1 else None
            except Exception as e:
                self._device_usable(e, reqs[i:])
                error, outs = e, None
            if outs is not None:
                self._reply([r], outs, meta)
                continue
            why = f"the policy failed on its observations: {type(error).__name__}: {error}"[:500]
            self.stats.refuse("failed", r.route, f"actor {r.actor}, request {r.rid}: {why}")
            self._tell(r.route, error_reply(r.rid, why))

    def _tell(self, route: bytes, frames: list) -> None:
        """Send a busy or an error reply (:func:`~actors.inference_requests.busy_reply`, ``error_reply``)."""
        try:
            self.sock.send_multipart([route, *frames], flags=zmq.NOBLOCK)
        except zmq.ZMQError:   # the actor is gone or its queue is full: its request is counted already
            pass

    def _device_usable(self, error: Exception, reqs: list[Request]) -> None:
        """Raise `error` (the server ends, and the launcher starts a new one) when the device it came
        from cannot run anything more: a CUDA assert is sticky. The requests `reqs` of the batch that
        failed get an error reply first: which of them did it cannot be told on a dead device, and an
        actor left waiting would send its request again to the next server, and end that one too."""
        if self.loader.device.type != "cuda":
            return
        try:
            torch.cuda.synchronize(self.loader.device)
        except Exception:
            log.error("inference server %d: the device failed and stays unusable (%s: %s); refusing the %d "
                      "requests of the batch and exiting for a restart", self.server_id, type(error).__name__,
                      error, len(reqs))
            why = (f"the inference server's device failed on a batch with this request "
                   f"({type(error).__name__}: {error})")[:500]
            for r in reqs:
                self.stats.refuse("failed", r.route, f"actor {r.actor}, request {r.rid}: {why}")
                self._tell(r.route, error_reply(r.rid, why))
            raise error


class ServerStats:
    """What an inference server counts and logs.

    ``counts``, over this incarnation's life: requests taken, replies sent, batches and their envs;
    refused requests by why (malformed; busy: the queue was full, its actor sends it again;
    undeliverable: the reply could not be sent; failed: the policy raised on it; expired: it waited
    longer than its actor waits for a reply); and the times the learner was asked again for weights
    (asked). Every `log_interval_s` a progress line, and TensorBoard scalars, over the batches since.

    Args:
        server_id: the server's id (in the log lines and the TensorBoard tags).
        log_interval_s: ``trainer.log_interval_s``.
        writer: a TensorBoard SummaryWriter, or None.
        progress: where the server keeps its TensorBoard step (batches served by every incarnation
            of this server in the run, :func:`read_progress`), so a restarted server's curves go on
            from where the last one logged instead of starting again at 0; or None.
    """

    def __init__(self, server_id: int, log_interval_s: float, writer=None, progress: Path | None = None):
        self.server_id, self.log_interval_s, self.writer, self.progress = server_id, log_interval_s, writer, progress
        self.counts = {"requests": 0, "replies": 0, "batches": 0, "envs": 0, "malformed": 0, "busy": 0,
                       "undeliverable": 0, "failed": 0, "expired": 0, "asked": 0}
        self.forward_total_s = 0.0   # serving batches, over this incarnation's life
        self.step_base = read_progress(progress) if progress is not None else 0
        self._window = self._new_window()
        self._last_log = time.monotonic()

    @staticmethod
    def _new_window() -> dict:
        return {"batches": 0, "envs": 0, "requests": 0, "forward_s": 0.0, "max_envs": 0}

    def refuse(self, what: str, route: bytes, why: str) -> None:
        """Count a request refused for `what` (a key of ``counts``); the first ten, then one in
        :data:`LOG_EVERY`, are logged with their sender and `why`."""
        self.counts[what] += 1
        n = self.counts[what]
        if n <= 10 or n % LOG_EVERY == 0:
            log.warning("inference server %d: dropped %s request #%d from %s: %s", self.server_id, what, n,
                        route.hex()[:16], why[:300])

    def served(self, envs: int, requests: int, took_s: float) -> None:
        """A batch of `envs` envs from `requests` requests, served in `took_s` (into the window)."""
        w = self._window
        w["batches"] += 1
        w["envs"] += envs
        w["requests"] += requests
        w["max_envs"] = max(w["max_envs"], envs)
        w["forward_s"] += took_s
        self.forward_total_s += took_s

    def maybe_log(self, version: int, max_batch: int, max_wait_s: float, wait_s: float) -> None:
        """Once `log_interval_s` has passed since the last: the window's line (the server holds
        `version`, batches of at most `max_batch` envs, waits `wait_s` of `max_wait_s` at most)."""
        now = time.monotonic()
        if now - self._last_log < self.log_interval_s:
            return
        w, c = self._window, self.counts
        b = max(1, w["batches"])
        line = {"batches": w["batches"], "batch_envs_mean": w["envs"] / b, "batch_envs_max": w["max_envs"],
                "batch_requests_mean": w["requests"] / b, "forward_ms_mean": 1000 * w["forward_s"] / b,
                "busy_frac": w["forward_s"] / max(1e-9, now - self._last_log), "version": version,
                "malformed": c["malformed"], "busy": c["busy"], "undeliverable": c["undeliverable"],
                "failed": c["failed"], "expired": c["expired"], "asked_learner": c["asked"],
                "wait_ms": 1000 * wait_s}
        log.info("inference server %d: v%d | %d batches, %.1f envs (max %d of %d) from %.1f requests each, "
                 "%.1f ms per batch, busy %.0f%%, waits up to %.1f ms | dropped %d malformed, %d busy, "
                 "%d undeliverable, %d failed, %d expired", self.server_id, line["version"], line["batches"],
                 line["batch_envs_mean"], line["batch_envs_max"], max_batch, line["batch_requests_mean"],
                 line["forward_ms_mean"], 100 * line["busy_frac"], line["wait_ms"], line["malformed"], line["busy"],
                 line["undeliverable"], line["failed"], line["expired"])
        if self.writer is not None:
            step = self.step_base + c["batches"]
            self._write_progress(step)
            for k, v in line.items():
                self.writer.add_scalar(f"inference{self.server_id}/{k}", v, step)
            self.writer.add_scalar(f"inference{self.server_id}/max_batch", max_batch, step)
            self.writer.add_scalar(f"inference{self.server_id}/max_wait_ms", 1000 * max_wait_s, step)
        self._window = self._new_window()
        self._last_log = now

    def _write_progress(self, step: int) -> None:
        if self.progress is None:
            return
        try:
            write_json_atomic(self.progress, {"batches": step})
        except OSError as e:   # only the next incarnation's TensorBoard step depends on it
            log.warning("inference server %d: cannot write %s (%s); a restart's TensorBoard steps "
                        "will start again at 0", self.server_id, self.progress, e)
            self.progress = None

    def log_summary(self) -> None:
        """The server's last line: what it served and refused over its life."""
        c = self.counts
        b = max(1, c["batches"])
        log.info("inference server %d: stopping after %d batches (%.1f envs from %.2f requests each, %.1f ms "
                 "per batch); requests refused: %d malformed, %d busy (sent again), %d undeliverable, %d failed, "
                 "%d expired; asked the learner again for weights %d times", self.server_id, c["batches"],
                 c["envs"] / b, c["replies"] / b, 1000 * self.forward_total_s / b, c["malformed"], c["busy"],
                 c["undeliverable"], c["failed"], c["expired"], c["asked"])


def progress_path(run_dir: str | Path, server_id: int) -> Path:
    """Server `server_id`'s TensorBoard step across its incarnations (:class:`InferenceServer` ``progress``)."""
    return Path(run_dir) / "inference" / f"server_{server_id}.progress.json"


def read_progress(path: Path) -> int:
    """The batches an earlier incarnation logged (0 when there is none, or the file is not what we write)."""
    try:
        batches = json.loads(path.read_text()).get("batches")
    except (OSError, ValueError, AttributeError):
        return 0
    return batches if isinstance(batches, int) and not isinstance(batches, bool) and batches >= 0 else 0
