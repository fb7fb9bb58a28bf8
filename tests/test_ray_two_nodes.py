"""launch/run_ray.py on a two-node Ray cluster on one machine: the head on the host, a worker node in a
network namespace joined by a veth pair (10.200.T.0/24), Ray's token authentication on. Two gloo
learner ranks sit on different nodes and each actor sends across the link, with CURVE on every
socket; a keyless peer is refused and counted; a SIGKILLed actor is restarted by Ray and training
goes on; SIGTERM to the driver writes a final checkpoint that loads, and leaves nothing running. A
second run places an inference server and the actors it serves on the worker node, the learner on
the head.

Skipped, with the reason, without Ray (``pip install -e '.[ray]'``) or where network namespaces
cannot be made (not root, no ``ip``, no CAP_NET_ADMIN)."""

from __future__ import annotations

import json
import os
import re
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.children import child_pythonpath
from tests.test_integration import read_jsonl
from tests.test_two_hosts import PROBE

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
from _common import stop_process_groups  # noqa: E402
CONFIG = ROOT / "configs" / "cartpole_ppo.json"
RAY = Path(sys.executable).with_name("ray")


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, timeout=20, check=check)


def _wait_for(predicate, timeout_s: float, what: str, log: Path | None = None):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        out = predicate()
        if out:
            return out
        time.sleep(0.2)
    tail = log.read_text()[-4000:] if log and log.exists() else ""
    raise AssertionError(f"timed out after {timeout_s:.0f} s waiting for {what}\n{tail}")


def _descendants(pid: int) -> set[int]:
    import psutil
    try:
        return {p.pid for p in psutil.Process(pid).children(recursive=True)}
    except psutil.NoSuchProcess:
        return set()


@pytest.fixture(scope="module")
def ray_two_nodes(tmp_path_factory):
    """One cluster for the module's runs (each run has its own directory and placement group)."""
    pytest.importorskip("ray", reason="Ray is not installed (pip install -e '.[ray]')")
    if shutil.which("ip") is None:
        pytest.skip("no 'ip' command (iproute2) to make network namespaces")
    if os.geteuid() != 0:
        pytest.skip("making network namespaces needs root (CAP_NET_ADMIN)")
    t = 20 + os.getpid() % 200
    ns, veth_host, veth_ns = f"tdr{t}", f"vrh{t}", f"vrn{t}"
    head_ip, worker_ip = f"10.200.{t}.1", f"10.200.{t}.2"
    probe = _ip("netns", "add", ns, check=False)
    if probe.returncode != 0:
        pytest.skip(f"cannot make a network namespace here: {probe.stderr.strip()}")
    temp = Path(f"/tmp/tdr{t}")          # Ray's sockets live here: a short path (AF_UNIX's 107 bytes)
    env = {**os.environ, "PYTHONPATH": child_pythonpath(), "OMP_NUM_THREADS": "1", "RAY_AUTH_MODE": "token",
           "RAY_AUTH_TOKEN": secrets.token_hex(32), "RAY_USAGE_STATS_ENABLED": "0", "TANDEM_MAX_RESTARTS": "2"}
    env.pop("RAY_ADDRESS", None)
    nodes: list[subprocess.Popen] = []
    seen: set[int] = set()
    try:
        _ip("link", "add", veth_host, "type", "veth", "peer", "name", veth_ns)
        _ip("link", "set", veth_ns, "netns", ns)
        _ip("addr", "add", f"{head_ip}/24", "dev", veth_host)
        _ip("link", "set", veth_host, "up")
        _ip("-n", ns, "addr", "add", f"{worker_ip}/24", "dev", veth_ns)
        _ip("-n", ns, "link", "set", veth_ns, "up")
        _ip("-n", ns, "link", "set", "lo", "up")
        with socket.socket() as probe_port:      # a free port for the head's GCS
            probe_port.bind((head_ip, 0))
            port = probe_port.getsockname()[1]
        common = ["--num-cpus", "2", "--object-store-memory", str(80 << 20), "--disable-usage-stats", "--block"]
        logs = tmp_path_factory.mktemp("ray_nodes")
        head_log, worker_log = logs / "ray_head.log", logs / "ray_worker.log"
        nodes.append(subprocess.Popen(
            [str(RAY), "start", "--head", "--node-ip-address", head_ip, "--port", str(port), "--temp-dir", str(temp),
             "--include-dashboard=false", "--resources", '{"node_a": 1}', *common],
            env=env, stdout=open(head_log, "w"), stderr=subprocess.STDOUT, start_new_session=True))
        _wait_for(lambda: "block forever" in head_log.read_text(), 60, "the Ray head", head_log)
        nodes.append(subprocess.Popen(
            ["ip", "netns", "exec", ns, str(RAY), "start", "--address", f"{head_ip}:{port}", "--node-ip-address",
             worker_ip, "--resources", '{"node_b": 1}', *common],
            env=env, stdout=open(worker_log, "w"), stderr=subprocess.STDOUT, start_new_session=True))
        _wait_for(lambda: "block forever" in worker_log.read_text(), 60, "the Ray worker node", worker_log)
        yield {"env": env, "address": f"{head_ip}:{port}", "ns": ns, "seen": seen, "nodes": nodes}
    finally:
        for n in nodes:
            seen |= _descendants(n.pid)
        stop_process_groups(nodes, grace_s=5)
        for pid in seen:       # Ray's workers lead groups of their own: any that outlived their raylet
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        _ip("netns", "del", ns, check=False)      # removes the veth pair with it
        _ip("link", "del", veth_host, check=False)
        shutil.rmtree(temp, ignore_errors=True)


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return False


def _all_gone(pids: set[int], timeout_s: float) -> bool:
    """Whether every process of `pids` has ended (zombies count as ended) within `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while [p for p in pids if _alive(p)]:
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def test_run_ray_two_nodes_gloo_ranks_curve_restart_and_sigterm(ray_two_nodes, tmp_path):
    cluster = ray_two_nodes
    keys, run, log = tmp_path / "keys", tmp_path / "run", tmp_path / "driver.log"
    subprocess.run([sys.executable, str(ROOT / "launch" / "make_keys.py"), str(keys)], check=True,
                   capture_output=True, timeout=60)
    sets = {"learner.devices": '["cpu","cpu"]',
            # rank 0 on the head, rank 1 on the worker; actor i sends to rank i % 2 on the other node
            "launch.ray.learner_resources": '[{"CPU":1,"node_a":0.01},{"CPU":1,"node_b":0.01}]',
            "launch.ray.actor_resources": '[{"CPU":0.5,"node_b":0.01},{"CPU":0.5,"node_a":0.01}]',
            "learner.curve_secret_key": f"{keys}/learner.key_secret",
            "learner.curve_authorized_keys": f"{keys}/authorized",
            "actors.curve_secret_key": f"{keys}/actors.key_secret", "actors.curve_server_key": f"{keys}/learner.key",
            "trainer.save_freq": 10**9}
    argv = [sys.executable, str(ROOT / "launch" / "run_ray.py"), "--config", str(CONFIG), "--address",
            cluster["address"], "--steps", "1000000", "--out", str(run), "--no-eval",
            *[a for k, v in sets.items() for a in ("--set", f"{k}={v}")]]
    driver = subprocess.Popen(argv, cwd=ROOT, env=cluster["env"], stdout=open(log, "w"), stderr=subprocess.STDOUT,
                              start_new_session=True)
    try:
        def consumed(after: float = 0.0) -> set[int]:   # actor i sends to rank i % 2, which logs it
            rows = [e for name in ("versions.jsonl", "versions.rank1.jsonl") if (run / name).exists()
                    for e in read_jsonl(run / name)]
            return {e["actor"] for e in rows if e["event"] == "consume" and e["time"] > after}

        _wait_for(lambda: consumed() == {0, 1}, 120, "both actors' rollouts consumed", log)
        endpoints = json.loads((run / "endpoints.json").read_text())
        worker_ip = cluster["address"].split(":")[0].rsplit(".", 1)[0] + ".2"
        assert endpoints["rollouts_by_rank"][1].startswith(f"tcp://{worker_ip}:"), endpoints   # rank 1's own host

        # a peer on the worker node without an admitted key gets no weights
        probe = subprocess.run(["ip", "netns", "exec", cluster["ns"], sys.executable, "-c", PROBE,
                                str(run / "endpoints.json"), str(keys), str(tmp_path)], cwd=ROOT,
                               env={**os.environ, "PYTHONPATH": child_pythonpath()}, capture_output=True, text=True,
                               timeout=60)
        assert probe.returncode == 0, probe.stderr
        assert all(r["weights"] == 0 for r in json.loads(probe.stdout.strip().splitlines()[-1]))

        # SIGKILL actor 0 (on the worker node): Ray restarts its host, which starts a new actor 0
        pids = lambda: sorted(set(re.findall(r"actor_0: pid (\d+)", log.read_text())))   # noqa: E731
        (first,) = map(int, _wait_for(pids, 30, "actor 0's pid in the driver's log", log))
        os.kill(first, signal.SIGKILL)
        killed_at = time.time()
        _wait_for(lambda: len(pids()) >= 2, 60, "Ray to restart actor 0", log)
        _wait_for(lambda: 0 in consumed(after=killed_at + 1.0), 60, "rollouts of the restarted actor 0", log)

        driver.send_signal(signal.SIGTERM)
        assert driver.wait(timeout=90) == 143, log.read_text()[-4000:]
    finally:
        stop_process_groups([driver], grace_s=60)
    output = log.read_text()
    started = {int(p) for p in re.findall(r"(?:actor_\d|learner\d): pid (\d+)", output)}
    assert len(started) >= 5, output[-4000:]                 # 2 ranks, 2 actors, 1 restart
    assert _all_gone(started, 1.0), output[-4000:]            # every Tandem process is gone (within 1 s)

    summary = json.loads((run / "summary.json").read_text())
    assert summary["stopped_by"] == "SIGTERM" and summary["world"] == 2, summary
    assert summary["malformed"] == 0 and summary["rejected"] == 0 and summary["env_steps"] > 0, summary
    assert (run / "summary.rank1.json").exists()
    import torch
    checkpoint = max((run / "checkpoints").glob("*.pt"))
    state = torch.load(checkpoint, weights_only=True)
    assert state["version"] == summary["version"], (checkpoint, state.keys())
    refused = [m["wire/auth_refused"] for m in read_jsonl(run / "metrics.jsonl") if "wire/auth_refused" in m]
    assert refused and refused[-1] >= 1                     # the keyless peer was refused and counted
    assert "Ray restarts it" in output and not (run / "endpoints.json").exists()


def test_run_ray_places_one_inference_server_per_node_with_its_actors(ray_two_nodes, tmp_path):
    """actors.inference "server" with actors.servers_per_device 2 through run_ray.py: the learner on
    the head node; server 0 and actor 0 on the head node, server 1 and actor 1 on the worker node
    (their bundles pinned by a resource per node), each server acting for its own actor only. The
    servers take the learner's weights (across the link for server 1), the actors find their server by
    its file in the run directory, the run ends normally and leaves nothing running."""
    cluster = ray_two_nodes
    run, log = tmp_path / "run", tmp_path / "driver.log"
    per_node = '[{"CPU":0.5,"node_a":0.01},{"CPU":0.5,"node_b":0.01}]'
    sets = {"actors.inference": "server", "actors.server_splits": 2, "actors.servers_per_device": 2,
            "trainer.buffer_type": "vla", "launch.ray.learner_resources": '[{"CPU":1,"node_a":0.01}]',
            # 20 ms an env step: alone, actor 0 would take over 10 s for the run's 4,096 steps, so the
            # run lasts until actor 1, started on the other node a few seconds later, has acted too
            "actors.slowdown_s": 0.02,
            "launch.ray.actor_resources": per_node, "launch.ray.server_resources": per_node}
    argv = [sys.executable, str(ROOT / "launch" / "run_ray.py"), "--config", str(CONFIG), "--address",
            cluster["address"], "--steps", "4096", "--out", str(run), "--no-eval",
            *[a for k, v in sets.items() for a in ("--set", f"{k}={v}")]]
    driver = subprocess.Popen(argv, cwd=ROOT, env=cluster["env"], stdout=open(log, "w"), stderr=subprocess.STDOUT,
                              start_new_session=True)
    try:
        rc = driver.wait(timeout=180)
    finally:
        stop_process_groups([driver], grace_s=30)
    output = log.read_text()
    assert rc == 0, output[-4000:]
    head_ip = cluster["address"].split(":")[0]
    worker_ip = head_ip.rsplit(".", 1)[0] + ".2"
    for name, ip in (("inference_0", head_ip), ("actor_0", head_ip), ("inference_1", worker_ip), ("actor_1", worker_ip)):
        assert re.search(rf"{name}: pid \d+ on {re.escape(ip)}", output), (name, output[-4000:])
    started = {int(p) for p in re.findall(r"(?:actor_\d|learner|inference_\d): pid (\d+)", output)}
    assert len(started) == 5, output[-4000:]
    assert _all_gone(started, 1.0), output[-4000:]
    summary = json.loads((run / "summary.json").read_text())
    assert summary["exit_code"] == 0 and summary["env_steps"] >= 4096 and summary["malformed"] == 0, summary
    consumed = {e["actor"] for e in read_jsonl(run / "versions.jsonl") if e["event"] == "consume"}
    assert consumed == {0, 1}
    for server in (0, 1):
        server_log = (run / "logs" / f"inference_{server}.log").read_text()
        assert f"inference server {server} on cpu for actors [{server}]" in server_log, server_log
        assert "the learner stopped the run" in server_log, server_log
