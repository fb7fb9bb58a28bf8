"""The Ray side of ``launch/run_ray.py``: one thin Ray actor per Tandem process, and the run's registry.

A :class:`ProcessHost` owns exactly one ``python -m learner`` or ``python -m actors`` process, started
as its child with the interpreter Ray runs on that node. Ray places the hosts (one placement-group
bundle each), restarts a host whose actor process failed, and carries small control messages:
the config text, the learner's endpoints, exit codes, and log files at the end where the nodes share
no filesystem. Rollouts and weights never pass through Ray: the children talk over ZeroMQ (wire
codec, CURVE, the learner's ingest checks) exactly as under ``launch/run_local.sh``.

The child gets ``SIGTERM`` when its host dies (``PR_SET_PDEATHSIG``), so a host killed by Ray (or a
driver that vanished) still lets the learner write its final checkpoint, and no child outlives its
host.
"""

from __future__ import annotations

import ctypes
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import ray

ROOT = Path(__file__).resolve().parents[1]
PR_SET_PDEATHSIG = 1
COLLECT_MAX_BYTES = 64 << 20                 # logs sent back to the driver, at most, per host
COLLECT_PATTERNS = ("logs/*.log", "*.jsonl", "summary*.json", "ranks/*.jsonl")


def backoff_s(start: int) -> float:
    """Seconds to wait before the `start`-th start of a process (1 s, 2 s, 4 s ... 30 s; none for the first)."""
    return 0.0 if start <= 1 else float(min(30, 1 << min(start - 2, 5)))


def remove_learner_leftovers(run_dir: Path) -> None:
    """What a killed learner could not remove: its endpoints.json and the shared-memory files it names."""
    path = run_dir / "endpoints.json"
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return
    for key, pattern in (("shm", "tandem-*.weights"), ("rollout_ring", "tandem-*.rollouts")):
        p = Path(str(data.get(key, "")))
        if p.parent == Path("/dev/shm") and p.match(pattern):
            p.unlink(missing_ok=True)
    path.unlink(missing_ok=True)


def _die_with_parent() -> None:  # runs in the child between fork and exec
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


@ray.remote(num_cpus=0)
class RunRegistry:
    """The run's named actor (``tandem:<run>``): the learner's endpoints for the actors, how often each
    supervised process was started, and which gave up. Small control data only."""

    def __init__(self) -> None:
        self._endpoints: dict | None = None
        self._starts: dict[str, int] = {}
        self._gave_up: dict[str, int] = {}

    def set_endpoints(self, endpoints: dict) -> None:
        self._endpoints = endpoints

    def endpoints(self) -> dict | None:
        return self._endpoints

    def started(self, name: str) -> int:
        self._starts[name] = self._starts.get(name, 0) + 1
        return self._starts[name]

    def gave_up(self, name: str, code: int) -> None:
        self._gave_up[name] = code

    def failures(self) -> dict[str, int]:
        return dict(self._gave_up)

    def starts(self) -> dict[str, int]:
        return dict(self._starts)


@ray.remote(num_cpus=0)
class ProcessHost:
    """Owns one Tandem process. `spec`: ``name`` (log name), ``argv`` (after the interpreter;
    ``{config}`` and ``{endpoints}`` are replaced by node-local files), ``config_text`` and
    ``config_name`` (the config, written on this node: no shared filesystem needed), ``run_dir``,
    ``env`` (extra variables), ``registry`` (the registry's name), and for actors ``supervised``
    (a failed child ends this host, so that Ray restarts it) with ``max_restarts``."""

    def __init__(self, spec: dict, start: bool = False):
        self.spec, self.proc, self.code = spec, None, None
        self.stopping = False
        self.exited = threading.Event()
        self.tmp = Path(tempfile.mkdtemp(prefix=f"tandem-{spec['name']}-"))
        self.config = self.tmp / spec["config_name"]
        self.config.write_text(spec["config_text"])
        self.registry = ray.get_actor(spec["registry"], namespace=spec["namespace"])
        if start:
            self.start()

    # ------------------------------------------------------------------ placement facts
    def node(self) -> dict:
        """This node's address, Ray id and the network interface holding the address (for gloo)."""
        import psutil
        ip = ray.util.get_node_ip_address()
        iface = next((name for name, addrs in psutil.net_if_addrs().items() if any(a.address == ip for a in addrs)),
                     None)
        return {"ip": ip, "node_id": ray.get_runtime_context().get_node_id(), "interface": iface,
                "hostname": socket.gethostname()}

    def free_port(self) -> int:
        """A free TCP port on this node's address (torch.distributed's MASTER_PORT on rank 0's node)."""
        with socket.socket() as s:
            s.bind((ray.util.get_node_ip_address(), 0))
            return s.getsockname()[1]

    # ------------------------------------------------------------------ the child
    def start(self, env: dict | None = None, extra_argv: list[str] = ()) -> int:
        """Start the child (waiting out the restart back-off, and for actors the learner's endpoints);
        `env` and `extra_argv` are what only this node knows (rank environment, its address)."""
        spec = self.spec
        endpoints = self.tmp / "endpoints.json"
        if "{endpoints}" in spec["argv"]:
            self._write_endpoints(endpoints, spec.get("endpoints_timeout_s", 300.0))
        n = ray.get(self.registry.started.remote(spec["name"]))
        if n > 1:
            print(f"[launch] {spec['name']}: restart {n - 1}/{spec.get('max_restarts', 0)} in "
                  f"{backoff_s(n):.0f}s", flush=True)
            time.sleep(backoff_s(n))
        self.starts = n
        argv = [a.replace("{config}", str(self.config)).replace("{endpoints}", str(endpoints))
                for a in [*spec["argv"], *extra_argv]]
        run_dir = Path(spec["run_dir"])
        (run_dir / "logs").mkdir(parents=True, exist_ok=True)
        if spec.get("writes_endpoints"):   # rank 0: a stale file from a crashed run would point actors at nothing
            (run_dir / "endpoints.json").unlink(missing_ok=True)
        log_path = run_dir / "logs" / f"{spec['name']}.log"
        log = open(log_path, "ab")
        echoed_from = log.tell()            # a restarted actor appends to its log: echo only the new lines
        child_env = {**os.environ, **spec.get("env", {}), **(env or {}), "PYTHONUNBUFFERED": "1",
                     "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
        child_env.setdefault("OMP_NUM_THREADS", "1")
        self.proc = subprocess.Popen([sys.executable, *argv], cwd=spec.get("cwd") or None, env=child_env,
                                     stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                     preexec_fn=_die_with_parent)
        log.close()
        print(f"[launch] {spec['name']}: pid {self.proc.pid} on {ray.util.get_node_ip_address()}", flush=True)
        threading.Thread(target=self._watch, daemon=True, name="watch").start()
        threading.Thread(target=self._tail, args=(log_path, echoed_from), daemon=True).start()
        return self.proc.pid

    def _write_endpoints(self, path: Path, timeout_s: float) -> None:
        from shared.transport import write_endpoints
        deadline = time.monotonic() + timeout_s
        while (eps := ray.get(self.registry.endpoints.remote())) is None:
            if time.monotonic() > deadline:
                raise TimeoutError(f"{self.spec['name']}: no learner endpoints after {timeout_s:.0f} s")
            time.sleep(0.2)
        write_endpoints(path.parent, **eps)

    def _watch(self) -> None:
        self.code = self.proc.wait()
        self.exited.set()
        spec = self.spec
        if spec.get("supervised") and self.code != 0 and not self.stopping:
            # End this host so that Ray restarts it (its constructor starts a new child), unless the
            # restarts are spent: then the driver stops the run, as run_local.sh does.
            if self.starts > spec.get("max_restarts", 0):
                print(f"[launch] {spec['name']} failed {self.starts} times (last exit code {self.code}): "
                      f"stopping the run", flush=True)
                ray.get(self.registry.gave_up.remote(spec["name"], self.code))
            else:
                print(f"[launch] {spec['name']} exited with code {self.code}: Ray restarts it", flush=True)
            sys.stdout.flush()
            self.cleanup()
            os._exit(1)

    def _tail(self, path: Path, offset: int) -> None:
        """Copy the child's log to this host's stdout, which Ray forwards to the driver's terminal."""
        with open(path, "rb") as f:
            f.seek(offset)
            while True:
                line = f.readline()
                if line:
                    sys.stdout.write(line.decode(errors="replace"))
                    continue
                if self.exited.is_set():
                    sys.stdout.flush()
                    return
                sys.stdout.flush()
                time.sleep(0.2)

    def pid(self) -> int | None:
        return self.proc.pid if self.proc else None

    def poll(self) -> int | None:
        return self.code if self.exited.is_set() else None

    def endpoints(self, timeout_s: float) -> dict | None:
        """Rank 0: the learner's endpoints.json once written (None after `timeout_s`, or if the learner exited)."""
        from shared.transport import read_endpoints
        path = Path(self.spec["run_dir"]) / "endpoints.json"
        try:
            return read_endpoints(path, timeout_s=timeout_s) if not self.exited.is_set() else None
        except TimeoutError:
            return None

    def stop(self, timeout_s: float) -> int | None:
        """SIGTERM the child, wait up to `timeout_s` (the learner writes its final checkpoint), then SIGKILL."""
        self.stopping = True
        if self.proc is None:
            return None
        if not self.exited.is_set():
            self.proc.send_signal(signal.SIGTERM)
            if not self.exited.wait(timeout_s):
                print(f"[launch] killing {self.spec['name']} (did not stop in {timeout_s:.0f} s)", flush=True)
                self.proc.kill()
                self.exited.wait(5)
        if self.spec.get("writes_endpoints"):
            remove_learner_leftovers(Path(self.spec["run_dir"]))
        return self.code

    def collect(self, marker: str) -> list[tuple[str, bytes]]:
        """The run directory's logs on this node, for a driver that cannot see them (no shared
        filesystem: the driver's `marker` file is not here). Checkpoints stay on rank 0's node."""
        run_dir = Path(self.spec["run_dir"])
        if (run_dir / marker).exists():
            return []
        out, total = [], 0
        for pattern in COLLECT_PATTERNS:
            for p in sorted(run_dir.glob(pattern)):
                size = p.stat().st_size
                if total + size <= COLLECT_MAX_BYTES:
                    out.append((str(p.relative_to(run_dir)), p.read_bytes()))
                    total += size
        return out

    def cleanup(self) -> None:
        """Remove this host's node-local config and endpoints copies."""
        for p in self.tmp.glob("*"):
            p.unlink(missing_ok=True)
        self.tmp.rmdir()
