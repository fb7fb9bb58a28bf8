"""``actors.inference: server``: one copy of the policy per device, acting for every actor on it.

With ``local`` (the default) each actor holds its own copy and runs its own forward pass. For a
large model that is the expensive way round: N copies in device memory, N contexts time-slicing one
GPU, and N calls a round where one batched call costs about the same. With ``server``:

- one server process per device of ``actors.devices`` (:mod:`actors.inference_topology`) holds the
  only acting copy (:class:`~actors.inference_server.InferenceServer`); the actors on that device
  become env processes whose :class:`~actors.remote_policy.RemotePolicy` sends observations and
  receives actions, log-probs, values and the version that acted;
- the server gathers requests from all its actors into one forward pass: it waits at most
  ``actors.server_max_wait_ms`` after the first request (and at most half its recent time per
  batch: for a cheap policy, waiting costs more than batching gains), and stops gathering at
  ``actors.server_max_batch`` envs (0: all its actors' envs), so a slow or dead actor never holds a
  batch back for longer than that wait;
- it takes new weights between batches, never during one, through the same
  :class:`~actors.weights_loader.WeightsLoader` an actor uses (whole versions only, a restarted
  learner's versions, the frozen base checked); every reply carries the version that acted, which
  the collector stamps on that step, so per-sample versions, lag accounting, corrections and the
  staleness report see exactly what acted. An actor asks for a minimum version at the start of a
  rollout (``min_version``, with the learner life it counts in): in standard mode the one the
  learner trains next (one newer than its last rollout's, or that rollout's newest when it mixed
  versions and is dropped as stale); under ``lag_policy: pace`` the newest the learner has
  announced, as a local actor loads it before a rollout, unless a study knob holds weights back (otherwise the server's
  load delay added a version of lag, past pace's bound). The server holds that request until it has
  such a version, or any version of another life (a resumed learner's); a paced request names the
  life its credit came from (``same_life``) and is held for that life's weights, for at most
  :data:`~actors.inference_server.SAME_LIFE_WAIT_S` (after a learner restart, a rollout acted with
  the old life's is dropped);
- requests and replies are :mod:`shared.wire` messages (no pickle; :mod:`actors.inference_requests`);
  a malformed request is dropped and counted with its sender in the log (one of the server's own
  actors is told why), and the queue of requests waiting for a batch is bounded
  (``actors.server_queue``: a request past it is answered "busy" and its actor sends it again);
  CURVE applies to its socket where the run uses it;
- it serves the actors of its own host: its ZeroMQ socket is bound to loopback (127.0.0.1), beside
  its Unix socket (:mod:`actors.unix_channel`); actors on another host run a server of their own
  there (or local copies);
- the server writes ``inference/server_<id>.json`` (endpoint and incarnation) in the run directory;
  a restarted server binds the same port when it can and writes a new incarnation, and an actor
  waiting on it re-sends its request to the new one.

With ``actors.server_splits`` k > 1 each actor steps its envs in k parts, each with its own request
in flight (``RemotePolicy.submit``/``result``): the server answers one part while the actor steps
another (double-buffered sampling, ``actors/rollout.py``).

GRPO: a group is envs of one actor (of one part), so they are always in the same request and act
with the same version. ``lag_policy: pace`` and its credits stay with the actors (the learner counts rollouts).

This module is the server's process (``python -m actors.inference``): the policy on its device, the
learner's weights, the sockets, and the loop until the learner ends the run.
"""

from __future__ import annotations

import logging
import os
import threading
from pathlib import Path

import torch
import zmq

from actors.emulated_device import EmulatedInference
from actors.inference_requests import RequestChecker
from actors.inference_server import InferenceServer, progress_path
from actors.inference_topology import endpoint_path, layout_json, read_endpoint, server_devices, write_endpoint
from actors.unix_channel import ServerChannels, socket_path
from actors.weights_loader import WeightsLoader
from shared.config import Config
from shared.envs import env_spec
from shared.instructions import instruction_tokenizer  # noqa: F401  (the VLA envs' import order)
from shared.policies import frozen_digest, has_critic, make_policy
from shared.security import client_from_config, server_from_config
from shared.teardown import stop_on_signals
from shared.transport import DrainingSubscriber, WeightsSubscriber, bind, read_endpoints

log = logging.getLogger("tandem.inference")


def bind_router(ctx: zmq.Context, host: str, path: Path, curve=None, max_bytes: int | None = None
                ) -> tuple[zmq.Socket, str]:
    """A ROUTER socket for the server, on the port of the previous incarnation when it is free.
    `max_bytes`: the largest frame a request can hold (:attr:`RequestChecker.max_bytes`); ZeroMQ
    disconnects a peer that sends more before any of it is buffered whole."""
    sock = ctx.socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 0)
    if max_bytes is not None:   # set before the bind: every connection, however early, has the limit
        sock.setsockopt(zmq.MAXMSGSIZE, max_bytes)
    sock.setsockopt(zmq.ROUTER_MANDATORY, 1)    # an unroutable reply raises instead of vanishing
    sock.setsockopt(zmq.SNDHWM, 64)
    sock.setsockopt(zmq.RCVHWM, 256)
    if curve is not None:
        curve.apply(sock)
    old = read_endpoint(path)
    if old is not None:
        try:
            port = int(old["endpoint"].rsplit(":", 1)[1])
            return sock, bind(sock, host, port)
        except (ValueError, zmq.ZMQError):
            pass
    return sock, bind(sock, host, 0)


def run_server_process(cfg: Config, server_id: int, run_dir: Path, learner_timeout_s: float = 120.0,
                       endpoints_path: Path | None = None, device: str | None = None) -> int:
    """Entry point of one inference server process: the policy on its device (`device`, else its
    entry of :func:`server_devices`), the learner's weights (from `endpoints_path`, else the run
    directory's endpoints.json), the actors' requests, until the learner ends the run (or SIGTERM)."""
    stop = _process_setup(cfg)
    device = torch.device(device or server_devices(cfg)[server_id])
    torch.manual_seed(cfg.trainer.seed * 7919 + 104729 + server_id)
    endpoints = read_endpoints(endpoints_path or Path(run_dir) / "endpoints.json", timeout_s=learner_timeout_s)
    spec = env_spec(cfg.env.id, cfg.env.cfg)
    policy = make_policy(cfg, spec).to(device).eval()
    loader = WeightsLoader(policy, device, cfg.actors, frozen_digest(policy), f"inference server {server_id}")
    curve_server, curve_client = server_from_config(cfg), client_from_config(cfg)
    ctx = zmq.Context()
    if curve_server is not None:
        curve_server.start(ctx)
    sub = WeightsSubscriber(ctx, endpoints["weights"], curve=curve_client)
    path = endpoint_path(run_dir, server_id)
    max_bytes = RequestChecker(spec, cfg.actors.num_envs, []).max_bytes   # the bound the server's checker applies
    sock, endpoint = bind_router(ctx, "127.0.0.1", path, curve_server, max_bytes)
    writer = _summary_writer(run_dir, server_id)
    # from here on, read while a forward pass runs: no weights message is dropped (the seconds before
    # hold no forward pass, and the first weights come again to a subscriber that joins)
    weights = DrainingSubscriber(sub)
    server = InferenceServer(cfg, server_id, _acting(policy, cfg), loader, weights, sock, spec, stop, writer,
                             expire_s=learner_timeout_s, progress=progress_path(run_dir, server_id))
    ended = False   # by its loop; else by an exception, whose last error replies must still go out
    try:   # from the Unix socket on: whatever fails, the finally below closes what was opened
        unix = _listen_unix(server, run_dir, endpoint) if cfg.actors.server_transport == "unix" else None
        incarnation = write_endpoint(path, endpoint, has_critic(policy), loader.base_digest, unix, layout_json(policy))
        log.info("inference server %d on %s for actors %s at %s (incarnation %s): batches of up to %d envs, "
                 "%.1f ms wait", server_id, device, server.actors, endpoint, incarnation, server.max_batch,
                 1000 * server.max_wait_s)
        rc = server.run()
        ended = True
        return rc
    finally:
        _close(server, sub, ctx, curve_server, device, ended)


def _process_setup(cfg: Config) -> threading.Event:
    """Threads and priority as the actors it serves have them; an event SIGINT and SIGTERM set."""
    torch.set_num_threads(cfg.actors.torch_threads)
    if cfg.actors.nice:   # an acting process like the actors it serves: the learner's update goes first
        os.nice(cfg.actors.nice)
    stop = threading.Event()
    stop_on_signals(stop)
    return stop


def _acting(policy, cfg: Config):
    """The policy as the server acts with it: behind the emulated latency where a study asks for one."""
    a = cfg.actors
    if a.inference_latency_s or a.inference_latency_per_env_s:
        return EmulatedInference(policy, a.inference_latency_s, per_env_s=a.inference_latency_per_env_s)
    return policy


def _summary_writer(run_dir: Path, server_id: int):
    try:
        from torch.utils.tensorboard import SummaryWriter
        return SummaryWriter(str(run_dir), filename_suffix=f".inference{server_id}")
    except Exception as e:   # TensorBoard is optional for the server: its progress lines still say it all
        log.warning("inference server %d: no TensorBoard events (%s)", server_id, e)
        return None


def _listen_unix(server: InferenceServer, run_dir: Path, endpoint: str) -> Path | None:
    """``actors.server_transport: unix``: the server also listens on a Unix socket for the actors on
    this host (actors/unix_channel.py); returns its path, or None when it cannot (every actor then
    uses the ZeroMQ socket at `endpoint`)."""
    path = socket_path(run_dir, server.server_id)
    try:
        server.sock = ServerChannels(server.sock, path, server.checker.max_bytes,
                                     on_broken=lambda route, why: server.stats.refuse("malformed", route, why))
    except OSError as e:   # a directory not ours, a path too long, ...: every actor on ZeroMQ
        log.warning("inference server %d: no Unix socket at %s (%s); the actors use %s", server.server_id,
                    path, e, endpoint)
        return None
    return server.sock.path


def _close(server: InferenceServer, sub, ctx: zmq.Context, curve_server, device: torch.device, ended: bool) -> None:
    """Log what the server did, and close what the process opened. `ended`: by its loop (else by an
    exception, whose last error replies must still go out)."""
    server_id, sock = server.server_id, server.sock
    server.stats.log_summary()
    if isinstance(sock, ServerChannels):
        log.info("inference server %d: %d actor connections over its Unix socket", server_id, sock.accepted)
    if device.type == "cuda":   # where the server's device memory goes: the caching allocator's peaks
        log.info("inference server %d: peak device memory %.0f MiB allocated, %.0f MiB reserved", server_id,
                 torch.cuda.max_memory_allocated(device) / 2**20, torch.cuda.max_memory_reserved(device) / 2**20)
    if server.stats.writer is not None:
        server.stats.writer.close()
    server.loader.close()
    drained = server.weights.close()
    if drained:
        sub.close()
    # a device left unusable refused its batch's requests just before the exception: ZeroMQ sends
    # them from its I/O thread, so give it half a second (the Unix socket's are in the kernel already)
    sock.close(linger=0 if ended else 500)
    if curve_server is not None:
        curve_server.stop()
    if drained:
        ctx.term()
    else:   # its reader is stuck in the socket: the process ends without waiting on it
        log.warning("inference server %d: the weights socket's reader did not stop", server_id)


def main(argv: list[str] | None = None) -> int:
    """``python -m actors.inference --config C --server-id S --run-dir D [--set K=V ...]``."""
    import argparse
    import sys

    from shared.config import ConfigError, load_config
    from shared.console import dump_stacks_on_signal
    p = argparse.ArgumentParser(prog="python -m actors.inference", description=main.__doc__)
    p.add_argument("--config", required=True)
    p.add_argument("--server-id", type=int, required=True, help="which server: index into server_devices (the distinct "
                   "actors.devices, each actors.servers_per_device times)")
    p.add_argument("--run-dir", type=Path, required=True, help="the run directory (the server's endpoint file "
                   "goes there, where its actors look for it)")
    p.add_argument("--endpoints", type=Path, help="the learner's endpoints.json (default: RUN_DIR/endpoints.json)")
    p.add_argument("--device", help="the device instead of the config's (a Ray bundle's GPU is cuda:0)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument("--learner-timeout", type=float, default=120.0)
    args = p.parse_args(argv)
    dump_stacks_on_signal()
    logging.basicConfig(level=logging.INFO, format=f"[inference {args.server_id}] %(message)s")
    try:
        cfg = load_config(args.config, args.set)
    except ConfigError as e:
        print(e, file=sys.stderr)
        return 2
    n = len(server_devices(cfg))
    if not 0 <= args.server_id < n:
        print(f"--server-id {args.server_id}: must be in 0..{n - 1} (the distinct actors.devices of {args.config}, "
              f"each actors.servers_per_device times)",
              file=sys.stderr)
        return 2
    try:
        return run_server_process(cfg, args.server_id, args.run_dir, args.learner_timeout, args.endpoints,
                                  args.device)
    except TimeoutError as e:
        print(e, file=sys.stderr)
        return 1


if __name__ == "__main__":
    from shared.teardown import exit_now
    exit_now(main())
