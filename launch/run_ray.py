"""Start one Tandem run on a Ray cluster: W learner ranks and N actors, placed by one placement group.

    python launch/run_ray.py --config FILE [--address auto|HOST:PORT] [--actors N] [--steps S] [--out DIR]
                             [--resume] [--no-eval] [--set KEY=VALUE ...]

Without --address it starts a local Ray instance (one node). Each learner rank, each actor and, with
``actors.inference: server``, each inference server is a bundle of the placement group (``launch.ray``
in the config: resources per role, strategy) and a thin Ray actor (runners/ray_hosts.py) that owns one
``python -m learner`` / ``python -m actors`` / ``python -m actors.inference`` process. A server must
share a node with every actor it serves (it listens on loopback and they find it by a file in the
run directory on that node): a placement that splits them is refused.
The launcher sets the learner ranks' torch.distributed environment itself (no torchrun); actors get
the learner's endpoints from the run's named Ray actor, and rank 0 still writes OUT/endpoints.json.
A failed actor is restarted by Ray (at most TANDEM_MAX_RESTARTS times, default 3, with back-off); if
a learner rank dies, or an actor fails once more than that, the run stops and exits non-zero.
SIGINT or SIGTERM: every process is sent SIGTERM and given time to stop (the learner writes its final
checkpoint), then what is left is killed; the exit code is 130 or 143. The local Ray instance (no
--address) runs in a session of its own, so a signal to the launcher's whole process group (timeout,
systemd, a container stop, scancel) does not take Ray down under the shutdown; the launcher stops it
last. Should that instance die anyway, the launcher stops waiting on Ray and ends what is left itself.
A cluster given with --address is left running. Ray's object store carries
control messages only (config text, endpoints, exit codes, logs): rollouts and weights go over
ZeroMQ, with CURVE where configured. See docs/guides/multi_node.md.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
# Ray folds lines that look alike from different processes into one ("[repeated 2x across cluster]");
# an operator must see every actor's lines. Read when ray is imported.
os.environ.setdefault("RAY_DEDUP_LOGS", "0")

from shared.config import Config, ConfigError, load_config  # noqa: E402

NAMESPACE = "tandem"
LOOPBACK = ("127.0.0.1", "localhost", "::1")
ANY_ADDRESS = ("0.0.0.0", "::", "*")
LEARNER_STOP_S = 30.0     # a learner's final checkpoint and summary, after SIGTERM
ACTOR_STOP_S = 10.0
POLL_S = 0.5
HEAD_START_S = 120.0      # the local Ray instance's `ray start`
HEAD_STOP_S = 15.0        # ... and its stop, before what is left of it is killed


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="launch/run_ray.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--config", default=str(ROOT / "configs" / "cartpole_ppo.json"), help="JSON config file")
    p.add_argument("--address", help="Ray cluster to join ('auto': the one this node belongs to); "
                   "default: start a local Ray instance")
    p.add_argument("--actors", type=int, help="actors.num_actors")
    p.add_argument("--steps", type=int, help="trainer.total_steps")
    p.add_argument("--out", type=Path, help="run directory (default <output_dir>/<exp_name>/<date-time>)")
    p.add_argument("--resume", action="store_true", help="continue the run in --out from its newest checkpoint")
    p.add_argument("--no-eval", action="store_true", help="no evaluator process")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a config key")
    args = p.parse_args(argv)
    for name in ("actors", "steps"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            p.error(f"--{name} must be a positive integer")
    if args.resume and args.out is None:
        p.error("--resume needs --out (the run to continue)")
    return args


class Stop:
    """SIGINT/SIGTERM set a flag the supervision loop checks (never raise inside a Ray call)."""

    def __init__(self) -> None:
        self.signal: str | None = None
        self.install()

    def install(self) -> None:
        """(Again after ray.init, which installs a SIGTERM handler of its own.)"""
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, self._on_signal)

    def _on_signal(self, signum, frame) -> None:
        self.signal = self.signal or signal.Signals(signum).name

    @property
    def exit_code(self) -> int:
        return 130 if self.signal == "SIGINT" else 143


def _ray_options(resources: dict, pg, index: int) -> dict:
    """A host's resource request: exactly its bundle, so Ray sets CUDA_VISIBLE_DEVICES for its GPUs."""
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy
    rest = {k: float(v) for k, v in resources.items() if k not in ("CPU", "GPU", "memory")}
    opts = {"num_cpus": resources.get("CPU", 0), "num_gpus": resources.get("GPU", 0), "resources": rest,
            "scheduling_strategy": PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=index)}
    if "memory" in resources:
        opts["memory"] = resources["memory"]
    return opts


def rank_overrides(cfg: Config, ip: str, across_nodes: bool, resources: dict) -> list[str]:
    """What a learner rank changes in the config on its node: bind and advertise its node's address
    when actors or ranks sit on other nodes, and the one GPU Ray shows it (cuda:0)."""
    le, sets = cfg.learner, []
    if across_nodes and le.host in LOOPBACK:
        sets.append(f"learner.host={ip}")
    elif across_nodes and le.host in ANY_ADDRESS and not le.advertise_host:
        sets.append(f"learner.advertise_host={ip}")
    if resources.get("GPU", 0) > 0:   # Ray's CUDA_VISIBLE_DEVICES leaves each rank its own GPU as cuda:0
        world = max(1, len(le.devices))
        sets.append("learner.device=cuda:0")
        if le.devices:
            sets.append("learner.devices=" + json.dumps(["cuda:0"] * world))
    return sets


def check_placement(cfg: Config, rank_nodes: list[str], actor_nodes: list[str],
                    server_nodes: list[str] = ()) -> list[str]:
    """Same-host transports refused where the placement put an actor on another node than rank 0, and
    an inference server on another node than an actor it serves."""
    remote = [i for i, n in enumerate(actor_nodes) if n != rank_nodes[0]]
    errors = []
    if server_nodes:
        from actors.inference_topology import server_of
        apart = [(i, server_of(cfg, i)) for i, n in enumerate(actor_nodes) if n != server_nodes[server_of(cfg, i)]]
        if apart:
            errors.append(f"actors.inference \"server\": actors {[i for i, _ in apart]} were placed on other nodes "
                          f"than their inference servers ({sorted({s for _, s in apart})}); a server serves only "
                          f"its own node (use launch.ray.strategy \"STRICT_PACK\", or pin each server and its "
                          f"actors to one node with a custom resource in launch.ray.server_resources and "
                          f"actor_resources)")
    if remote and cfg.learner.weights_transport in ("shm", "cuda_ipc"):
        errors.append(f"learner.weights_transport \"{cfg.learner.weights_transport}\": the weights ring is in the "
                      f"memory of rank 0's node, "
                      f"but actors {remote} were placed on other nodes; use \"zmq\" (or pin the actors to rank "
                      f"0's node with a node resource in launch.ray.actor_resources)")
    if remote and cfg.actors.rollout_transport == "ring":
        errors.append(f"actors.rollout_transport \"ring\": actors {remote} were placed on other nodes than the "
                      f"learner's; use \"zmq\"")
    return errors


def _term_with_parent() -> None:  # runs in the child between fork and exec
    import ctypes
    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)   # PR_SET_PDEATHSIG


class HeadGone(RuntimeError):
    """The local Ray instance this launcher started is gone: no Ray call would be answered."""


class LocalHead:
    """The one-node Ray instance run_ray.py starts without --address: ``ray start --head --block`` in a
    session of its own. Ray's processes started by ray.init would share the launcher's process group, so
    a SIGTERM to the group (timeout, systemd, a container stop, scancel) killed the GCS under the
    shutdown and the driver waited 60 s for it, then failed. Its own temporary directory keeps it apart
    from any other Ray instance on the host (neither joined by ray.init nor named by `--address auto`);
    it gets SIGTERM if the launcher dies (PR_SET_PDEATHSIG). The launcher stops it last, then kills
    whatever is left of it and of the processes it hosted."""

    def __init__(self, log: Path, num_cpus: int):
        self.log, self.num_cpus = log, num_cpus
        self.proc: subprocess.Popen | None = None
        self.seen: dict = {}           # pid: psutil.Process, every process of the instance seen so far
        self.core: list = []           # its GCS and raylet
        # short: Ray's Unix sockets live under it (AF_UNIX paths have at most 107 bytes)
        base = os.environ.get("RAY_TMPDIR") or tempfile.gettempdir()
        os.makedirs(base, exist_ok=True)
        self.temp_dir = Path(tempfile.mkdtemp(prefix="tandem-ray-", dir=base))

    def start(self, stop: Stop) -> str | None:
        """Start the instance and wait until it is up; returns its GCS address (None if stopped first)."""
        with socket.socket() as a, socket.socket() as b:    # free ports: another instance may have the defaults
            a.bind(("", 0))
            b.bind(("", 0))
            port, client_port = a.getsockname()[1], b.getsockname()[1]
        argv = [sys.executable, "-m", "ray.scripts.scripts", "start", "--head", "--block", "--port", str(port),
                "--ray-client-server-port", str(client_port), "--num-cpus", str(self.num_cpus),
                "--include-dashboard=false", "--disable-usage-stats", "--temp-dir", str(self.temp_dir)]
        _local_token_auth()
        env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
        # A host that dies (its raylet got SIGTERM too, or every process did, as systemd signals a
        # unit's control group) must not take its child down with SIGKILL, as Ray does to a worker's
        # children and process group: the child gets SIGTERM from PR_SET_PDEATHSIG, the learner writes
        # its final checkpoint, and stop() waits for it and kills what is left.
        env.setdefault("RAY_kill_child_processes_on_worker_exit", "0")
        env.setdefault("RAY_process_group_cleanup_enabled", "0")
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen(argv, env=env, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                         start_new_session=True, preexec_fn=_term_with_parent)
        address_file = self.temp_dir / "ray_current_cluster"    # `ray start` writes it once the node is up
        deadline = time.monotonic() + HEAD_START_S
        while True:
            address = address_file.read_text().strip() if address_file.exists() else ""
            if address.rpartition(":")[2].isdigit():
                self.remember()
                return address
            if stop.signal:
                return None
            if self.proc.poll() is not None:
                raise RuntimeError(f"the local Ray instance did not start (exit code {self.proc.returncode}; "
                                   f"see {self.log})")
            if time.monotonic() > deadline:
                raise RuntimeError(f"the local Ray instance was not up after {HEAD_START_S:.0f} s (see {self.log})")
            time.sleep(0.2)

    def remember(self) -> None:
        """Note the instance's processes as they are now (its GCS, raylet, workers and their children:
        the run's learner and actors), to kill any of them still running at the end."""
        import psutil
        if self.proc is None:
            return
        try:
            for p in psutil.Process(self.proc.pid).children(recursive=True):
                if p.pid not in self.seen:
                    self.seen[p.pid] = p
                    if _name(p) in ("gcs_server", "raylet"):
                        self.core.append(p)
        except psutil.NoSuchProcess:
            pass

    def alive(self) -> bool:
        """The instance is up: `ray start` and its GCS and raylet run."""
        if self.proc is None or self.proc.poll() is not None:
            return False
        return all(_running(p) for p in self.core)

    def stop(self, grace_s: float) -> None:
        """SIGTERM the instance and wait for it (at most HEAD_STOP_S; none if its GCS or raylet is
        already gone), kill its process group, then wait up to `grace_s` for everything it ran (a
        learner orphaned by its host writes its final checkpoint), then SIGKILL what is left."""
        import psutil
        if self.proc is None:
            return
        self.remember()
        if self.alive():
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(HEAD_STOP_S)
            except subprocess.TimeoutExpired:
                pass
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(5)
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)   # its session's group: GCS, raylet, agents
        except (ProcessLookupError, PermissionError):
            pass
        left = _wait_gone(list(self.seen.values()), grace_s)
        for p in left:       # Ray's workers lead process groups of their own; a child may outlive its host
            try:
                p.kill()
            except psutil.NoSuchProcess:
                pass
        _wait_gone(left, 5.0)


def _local_token_auth() -> None:
    """What ray.init does for a local instance it starts: token authentication unless RAY_AUTH_MODE
    says otherwise (for the instance and this driver), and a token made if there is none."""
    try:
        from ray._private.authentication.authentication_token_setup import (
            enable_token_auth_by_default, ensure_token_if_auth_enabled)
    except ImportError:       # a Ray without token authentication
        return
    enable_token_auth_by_default()
    ensure_token_if_auth_enabled(None, create_token_if_missing=True)


def _name(p) -> str:
    try:
        return p.name()
    except Exception:  # noqa: BLE001 - gone
        return ""


def _running(p) -> bool:
    """Running and not a zombie (one whose parent died is reaped by another process, not by us)."""
    import psutil
    try:
        return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def _wait_gone(procs: list, timeout_s: float) -> list:
    """Wait up to `timeout_s` for `procs` (psutil.Process) to end; returns those still running."""
    deadline = time.monotonic() + timeout_s
    while (left := [p for p in procs if _running(p)]) and time.monotonic() < deadline:
        time.sleep(0.1)
    return left


class RayRun:
    """The driver's side: placement group, hosts, supervision, shutdown."""

    def __init__(self, args: argparse.Namespace, cfg: Config, overrides: list[str], out: Path, stop: Stop,
                 head: LocalHead | None = None):
        import ray
        from runners.ray_hosts import ProcessHost, RunRegistry
        self.ray, self.ProcessHost = ray, ProcessHost
        self.args, self.cfg, self.overrides, self.out, self.stop = args, cfg, overrides, out, stop
        self.head = head          # the local Ray instance this launcher started (None: a cluster's)
        self.head_lost = False
        self.world = max(1, len(cfg.learner.devices))
        self.tag = f"{time.strftime('%Y%m%d-%H%M%S')}-{secrets.token_hex(3)}"
        self.registry_name = f"tandem:{self.tag}"
        self.marker = f".run_ray-{self.tag}"
        self.ranks: list = []
        self.actors: list = []
        self.servers: list = []
        self.n_servers = 0
        if cfg.actors.inference == "server":
            from actors.inference_topology import server_devices
            self.n_servers = len(server_devices(cfg))
        self.pg = None
        self.registry = RunRegistry.options(name=self.registry_name, namespace=NAMESPACE).remote()
        self.max_restarts = int(os.environ.get("TANDEM_MAX_RESTARTS", "3"))

    def say(self, msg: str) -> None:
        print(f"[launch] {msg}", flush=True)

    def head_alive(self) -> bool:
        return self.head is None or self.head.alive()

    def get(self, refs, timeout: float):
        """ray.get in slices of a second, raising HeadGone as soon as the local Ray instance is gone
        (Ray's own calls would wait a minute for its GCS, then end the process)."""
        deadline = time.monotonic() + timeout
        while True:
            if not self.head_alive():
                raise HeadGone("the local Ray instance is gone")
            try:
                return self.ray.get(refs, timeout=max(0.0, min(1.0, deadline - time.monotonic())))
            except self.ray.exceptions.GetTimeoutError:
                if time.monotonic() >= deadline:
                    raise

    # ------------------------------------------------------------------ placement
    def place(self) -> list[str] | None:
        """Reserve every bundle; returns the node id of each (ranks, then actors, then inference
        servers), or None if stopped first."""
        from ray.util.placement_group import placement_group, placement_group_table
        r = self.cfg.launch.ray
        bundles = [r.learner_resources[i % len(r.learner_resources)] for i in range(self.world)]
        bundles += [r.actor_resources[i % len(r.actor_resources)] for i in range(self.cfg.actors.num_actors)]
        bundles += [r.server_resources[s % len(r.server_resources)] for s in range(self.n_servers)]
        self.bundles = [{k: float(v) for k, v in b.items()} for b in bundles]
        self.pg = placement_group(self.bundles, strategy=r.strategy, name=f"tandem-{self.tag}")
        start = time.monotonic()
        deadline, told = start + r.ready_timeout_s, False
        while not self.ray.wait([self.pg.ready()], timeout=1.0)[0]:
            if self.stop.signal:
                return None
            if not told and time.monotonic() > start + 10:
                self.say(f"waiting for the cluster to have room for {self.bundles} ({r.strategy}; "
                         f"`ray status` shows what the nodes offer)")
                told = True
            if time.monotonic() > deadline:
                raise RuntimeError(f"the Ray cluster had no room for the placement group after "
                                   f"{r.ready_timeout_s:.0f} s (bundles {self.bundles}, strategy {r.strategy}; "
                                   f"`ray status` shows what the nodes offer)")
        table = placement_group_table(self.pg)["bundles_to_node_id"]
        return [table[i] for i in range(len(self.bundles))]

    def _spec(self, name: str, argv: list[str], **extra) -> dict:
        return {"name": name, "argv": argv, "config_text": Path(self.args.config).read_text(),
                "config_name": Path(self.args.config).name, "run_dir": str(self.out), "registry": self.registry_name,
                "namespace": NAMESPACE, **extra}

    # ------------------------------------------------------------------ start
    def start_learner(self, nodes: list[str]) -> dict | None:
        """Start every rank with its rank environment (no torchrun); returns rank 0's endpoints (None
        if stopped first)."""
        ray, cfg = self.ray, self.cfg
        across = len(set(nodes)) > 1
        flags = (["--resume"] if self.args.resume else []) + (["--no-eval"] if self.args.no_eval else [])
        for r in range(self.world):
            spec = self._spec(f"learner{r if self.world > 1 else ''}",
                              ["-m", "learner", "--config", "{config}", "--run-dir", str(self.out), *flags,
                               *_set_args(self.overrides)], writes_endpoints=r == 0)
            self.ranks.append(self.ProcessHost.options(**_ray_options(self.bundles[r], self.pg, r)).remote(spec))
        info = ray.get([h.node.remote() for h in self.ranks])
        common = {}
        if self.world > 1:
            port = ray.get(self.ranks[0].free_port.remote())
            common = {"WORLD_SIZE": str(self.world), "MASTER_ADDR": info[0]["ip"], "MASTER_PORT": str(port)}
        started = []
        for r, host in enumerate(self.ranks):
            env = dict(common)
            if self.world > 1:
                local = [q for q in range(self.world) if nodes[q] == nodes[r]]
                env.update(RANK=str(r), LOCAL_RANK=str(local.index(r)), LOCAL_WORLD_SIZE=str(len(local)))
                if info[r]["interface"] and "GLOO_SOCKET_IFNAME" not in os.environ:
                    env["GLOO_SOCKET_IFNAME"] = info[r]["interface"]   # else gloo takes the hostname's address
            extra = _set_args(rank_overrides(cfg, info[r]["ip"], across, self.bundles[r]))
            started.append(host.start.remote(env, extra))
        ray.get(started)
        self.say(f"run dir {self.out} | config {self.args.config} | {cfg.actors.num_actors} actors on "
                 f"{len(set(nodes[self.world:]))} node(s) | {self.world} learner rank(s) on "
                 f"{', '.join(i['ip'] for i in info)} | Ray {ray.__version__}")
        while not self.stop.signal:
            eps = ray.get(self.ranks[0].endpoints.remote(1.0))
            if eps is not None:
                return eps
            codes = ray.get([h.poll.remote() for h in self.ranks])
            if any(c is not None for c in codes):
                raise RuntimeError(f"a learner rank exited (codes {codes}) before writing its endpoints "
                                   f"(see {self.out}/logs/)")
        return None

    def start_actors(self, endpoints: dict) -> None:
        """The inference servers (if any), then the actors; each restarted by Ray when it fails."""
        cfg = self.cfg
        self.ray.get(self.registry.set_endpoints.remote(endpoints))
        for s in range(self.n_servers):
            self.servers.append(self._supervised(f"inference_{s}", self.world + cfg.actors.num_actors + s,
                                                 ["-m", "actors.inference", "--server-id", str(s),
                                                  "--run-dir", str(self.out)]))
        # with servers, an actor finds its server's file in the run directory on its node
        run_dir = ["--run-dir", str(self.out)] if self.n_servers else []
        for i in range(cfg.actors.num_actors):
            self.actors.append(self._supervised(f"actor_{i}", self.world + i,
                                                ["-m", "actors", "--actor-id", str(i), *run_dir]))

    def _supervised(self, name: str, bundle: int, argv: list[str]):
        """The host of one process that Ray restarts when it fails, in bundle `bundle`, given the config,
        the learner's endpoints, the run's overrides and ``--device cuda:0`` where its bundle has a GPU."""
        device = ["--device", "cuda:0"] if self.bundles[bundle].get("GPU", 0) > 0 else []
        spec = self._spec(name, [*argv, "--config", "{config}", "--endpoints", "{endpoints}", *device,
                                 *_set_args(self.overrides)],
                          supervised=True, max_restarts=self.max_restarts)
        opts = _ray_options(self.bundles[bundle], self.pg, bundle)
        return self.ProcessHost.options(max_restarts=self.max_restarts, **opts).remote(spec, True)

    # ------------------------------------------------------------------ supervise and stop
    def supervise(self) -> int:
        ray, stop = self.ray, self.stop
        polls = 0
        while True:
            if stop.signal:
                self.say(f"{stop.signal}: stopping the learner and {len(self.actors)} actors")
                return stop.exit_code
            if self.head is not None and polls % 10 == 0:
                self.head.remember()        # a restarted actor's new processes too
            polls += 1
            try:
                codes = self.get([h.poll.remote() for h in self.ranks], timeout=60)
            except HeadGone:
                self.say("the local Ray instance is gone: stopping the run")
                return stop.exit_code if stop.signal else 1
            except (ray.exceptions.RayError, ray.exceptions.GetTimeoutError) as e:
                if stop.signal:     # the signal reached the cluster's processes too
                    continue
                self.say(f"lost a learner rank ({type(e).__name__}): stopping the run")
                return 1
            if stop.signal:
                continue
            if any(c is not None for c in codes):
                failed = [c for c in codes if c not in (None, 0)]
                if failed:
                    self.say(f"a learner rank exited with code {failed[0]}: stopping the run")
                    return failed[0] if failed[0] > 0 else 128 - failed[0]   # killed by signal N: 128 + N
                if all(c == 0 for c in codes):
                    return 0
            gave_up = ray.get(self.registry.failures.remote())
            if gave_up:
                return 1
            time.sleep(POLL_S)

    def shutdown(self) -> None:
        """TERM every child through its host and give it time, then kill the hosts and free the bundles.
        If the local Ray instance is gone (it got the signal too), stop calling Ray: LocalHead.stop
        waits for the orphaned children (SIGTERMed as their hosts died) and kills what is left."""
        if self.head is not None:
            self.head.remember()
        try:
            self._shutdown()
        except HeadGone:
            self.head_lost = True
            self.say("the local Ray instance is gone: ending the run's processes without it")

    def _shutdown(self) -> None:
        ray = self.ray
        calls = [h.stop.remote(LEARNER_STOP_S) for h in self.ranks] + \
            [h.stop.remote(ACTOR_STOP_S) for h in [*self.actors, *self.servers]]
        for c in calls:
            try:
                self.get(c, timeout=LEARNER_STOP_S + 10)
            except HeadGone:
                raise
            except Exception:  # noqa: BLE001 - a host that died or is restarting: killed below
                pass
        self.collect_logs()
        for h in [*self.ranks, *self.actors, *self.servers]:
            try:
                h.cleanup.remote()
            except Exception:  # noqa: BLE001
                pass
        time.sleep(0.2)
        for h in [*self.ranks, *self.actors, *self.servers, self.registry]:
            if not self.head_alive():
                raise HeadGone("the local Ray instance is gone")
            ray.kill(h, no_restart=True)
        if self.pg is not None and self.head_alive():
            from ray.util.placement_group import remove_placement_group
            remove_placement_group(self.pg)

    def collect_logs(self) -> None:
        """Where a node does not share the run directory, bring its logs here (checkpoints stay on rank 0's node)."""
        (self.out / self.marker).touch()
        try:
            for h in [*self.ranks, *self.actors, *self.servers]:
                try:
                    files = self.get(h.collect.remote(self.marker), timeout=30)
                except HeadGone:
                    raise
                except Exception:  # noqa: BLE001
                    continue
                for rel, data in files:
                    dst = self.out / rel
                    if not dst.exists():
                        dst.parent.mkdir(parents=True, exist_ok=True)
                        dst.write_bytes(data)
        finally:
            (self.out / self.marker).unlink(missing_ok=True)


def _set_args(overrides: list[str]) -> list[str]:
    return [a for o in overrides for a in ("--set", o)]


def bundle_cpus(cfg) -> int:
    """The CPUs the run's bundles ask for (learner ranks, actors, inference servers), rounded up."""
    r = cfg.launch.ray
    cpus = sum(r.learner_resources[i % len(r.learner_resources)].get("CPU", 0)
               for i in range(max(1, len(cfg.learner.devices))))
    cpus += sum(r.actor_resources[i % len(r.actor_resources)].get("CPU", 0) for i in range(cfg.actors.num_actors))
    if cfg.actors.inference == "server":
        from actors.inference_topology import server_devices
        cpus += sum(r.server_resources[s % len(r.server_resources)].get("CPU", 0) for s in range(len(server_devices(cfg))))
    return int(-(-cpus // 1))


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    started = time.time()
    overrides = list(args.set)
    overrides += [f"actors.num_actors={args.actors}"] if args.actors else []
    overrides += [f"trainer.total_steps={args.steps}"] if args.steps else []
    try:
        cfg = load_config(args.config, overrides)
    except ConfigError as e:
        print(e, file=sys.stderr)
        return 2
    try:
        import ray
    except ImportError:
        print("run_ray.py needs Ray: pip install -e '.[ray]'", file=sys.stderr)
        return 2
    from learner.__main__ import default_run_dir
    out = (args.out or default_run_dir(cfg)).resolve()
    (out / "logs").mkdir(parents=True, exist_ok=True)
    stop = Stop()     # before the local instance starts: a signal meanwhile stops it too
    head = None
    if args.address is None:   # a local instance: its CPUs are scheduling tokens, as many as the bundles ask
        head = LocalHead(out / "logs" / "ray_head.log", max(os.cpu_count() or 1, bundle_cpus(cfg)))
        try:
            address = head.start(stop)
        except Exception as e:  # noqa: BLE001 - reported; what did start is stopped
            print(f"[launch] failed: {e}", file=sys.stderr, flush=True)
            head.stop(5.0)
            return 1
        if address is None:
            head.stop(5.0)
            print(f"[launch] {stop.signal} while the local Ray instance started (exit {stop.exit_code})", flush=True)
            return stop.exit_code
        try:
            ray.init(address=address, namespace=NAMESPACE, logging_level="WARNING")
        except BaseException:
            head.stop(5.0)
            raise
    else:
        ray.init(address=args.address, namespace=NAMESPACE, logging_level="WARNING")
    stop.install()    # again: ray.init installs a SIGTERM handler of its own
    try:
        run = RayRun(args, cfg, overrides, out, stop, head)
    except BaseException:
        _end_ray(ray, head)
        raise
    status = 1
    try:
        nodes = run.place()
        if nodes is None:
            status = stop.exit_code
        elif errors := check_placement(cfg, nodes[:run.world], nodes[run.world:run.world + cfg.actors.num_actors],
                                       nodes[run.world + cfg.actors.num_actors:]):
            print("run_ray.py: " + "\n  ".join(errors), file=sys.stderr)
            status = 2
        elif (endpoints := run.start_learner(nodes)) is None:
            status = stop.exit_code
        else:
            run.start_actors(endpoints)
            status = run.supervise()
    except Exception as e:  # noqa: BLE001 - reported, then everything started is stopped
        print(f"[launch] failed: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
        status = 1
    finally:
        for sig in (signal.SIGINT, signal.SIGTERM):   # a second signal must not cut the shutdown short
            signal.signal(sig, signal.SIG_IGN)
        run.shutdown()
        detached = _end_ray(ray, head, LEARNER_STOP_S if run.head_lost else 5.0)
    summary = out / "summary.json"
    if summary.exists() and summary.stat().st_mtime >= started:     # this launch's, never an earlier one's
        print(f"[launch] summary: {json.dumps(json.loads(summary.read_text()), separators=(',', ':'))}")
    else:
        print("[launch] no summary from this launch: the learner ended before writing one")
    print(f"[launch] done (exit {status}): {out}", flush=True)
    if detached:      # Ray's exit handlers would wait on a GCS that is gone
        sys.stderr.flush()
        os._exit(status)
    return status


def _end_ray(ray, head: LocalHead | None, grace_s: float = 5.0) -> bool:
    """Disconnect from Ray (at most 10 s: with the local instance gone it could wait a minute), then
    stop the local instance if this launcher started it; a cluster given with --address keeps running.
    True if the disconnect did not finish (the process must then end with os._exit)."""
    import threading
    done = threading.Event()
    if head is not None and not head.alive():
        detached = True
    else:
        def disconnect() -> None:
            try:
                ray.shutdown()
            except Exception as e:  # noqa: BLE001 - reported; the instance is stopped below all the same
                print(f"[launch] ray.shutdown: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
            done.set()

        threading.Thread(target=disconnect, daemon=True, name="ray-shutdown").start()
        detached = not done.wait(10.0)
    if head is not None:
        head.stop(grace_s)
    return detached


if __name__ == "__main__":
    sys.exit(main())
