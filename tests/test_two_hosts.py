"""Two hosts on one machine: the learner in one network namespace, the actors in another, joined by
a veth pair; CURVE on. Trains across the link, and a peer without a key is refused.

Skipped, with the reason, where network namespaces cannot be made (not root, no ``ip``, no
CAP_NET_ADMIN in a container)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.children import child_pythonpath
from tests.test_integration import read_jsonl

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "configs" / "cartpole_ppo.json"
LEARNER_IP, ACTOR_IP = "10.77.0.1", "10.77.0.2"


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, timeout=20, check=check)


@pytest.fixture
def two_hosts():
    if shutil.which("ip") is None:
        pytest.skip("no 'ip' command (iproute2) to make network namespaces")
    if os.geteuid() != 0:
        pytest.skip("making network namespaces needs root (CAP_NET_ADMIN)")
    tag = f"{os.getpid() % 100000}"
    learner_ns, actor_ns = f"tdm-l{tag}", f"tdm-a{tag}"
    veth_l, veth_a = f"vl{tag}", f"va{tag}"
    probe = _ip("netns", "add", learner_ns, check=False)
    if probe.returncode != 0:
        pytest.skip(f"cannot make a network namespace here: {probe.stderr.strip()}")
    try:
        _ip("netns", "add", actor_ns)
        _ip("link", "add", veth_l, "type", "veth", "peer", "name", veth_a)
        _ip("link", "set", veth_l, "netns", learner_ns)
        _ip("link", "set", veth_a, "netns", actor_ns)
        for ns, dev, addr in ((learner_ns, veth_l, LEARNER_IP), (actor_ns, veth_a, ACTOR_IP)):
            _ip("-n", ns, "addr", "add", f"{addr}/24", "dev", dev)
            _ip("-n", ns, "link", "set", dev, "up")
            _ip("-n", ns, "link", "set", "lo", "up")
        ping = subprocess.run(["ip", "netns", "exec", actor_ns, sys.executable, "-c",
                               f"import socket; s=socket.socket(); s.settimeout(2); "
                               f"print(s.connect_ex(('{LEARNER_IP}', 9)))"], capture_output=True, text=True, timeout=20)
        if ping.returncode != 0:
            pytest.skip(f"cannot run processes in the namespaces: {ping.stderr.strip()[-300:]}")
        yield learner_ns, actor_ns
    finally:
        _ip("netns", "del", actor_ns, check=False)    # deleting a namespace removes its end of the veth pair
        _ip("netns", "del", learner_ns, check=False)


def _start(ns: str, args: list[str], log: Path) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": child_pythonpath(), "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    return subprocess.Popen(["ip", "netns", "exec", ns, *args], cwd=ROOT, env=env, stdout=open(log, "w"),
                            stderr=subprocess.STDOUT, start_new_session=True)


def _stop(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGTERM)
    deadline = time.monotonic() + 15
    for p in procs:
        try:
            p.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait(timeout=5)


PROBE = r"""
import sys, time, zmq, json
from shared.security import generate_keypair, load_secret, load_public
eps = json.load(open(sys.argv[1])); keys = sys.argv[2]; tmp = sys.argv[3]
_, sec = generate_keypair(tmp, "stranger")
pub, secret = load_secret(sec, "probe"); server = load_public(keys + "/learner.key", "probe")
ctx = zmq.Context(); got = []; listening = {}
for with_key in (False, True):
    s = ctx.socket(zmq.SUB); s.setsockopt(zmq.LINGER, 0); s.setsockopt(zmq.SUBSCRIBE, b"")
    p = ctx.socket(zmq.PUSH); p.setsockopt(zmq.LINGER, 0)
    if with_key:
        for x in (s, p):
            x.curve_publickey, x.curve_secretkey, x.curve_serverkey = pub, secret, server
    s.connect(eps["weights"]); p.connect(eps["rollouts"])
    try:
        p.send(b"x" * 100, flags=zmq.NOBLOCK); sent = True
    except zmq.Again:
        sent = False
    got.append({"with_key": with_key, "weights": 0, "push_accepted": sent})
    listening[s] = got[-1]
poller = zmq.Poller()
for s in listening:
    poller.register(s, zmq.POLLIN)
deadline = time.monotonic() + 3          # both subscribers listen for 3 s, side by side
while listening and (left := deadline - time.monotonic()) > 0:
    for s, event in poller.poll(left * 1000):
        listening.pop(s)["weights"] = event
        poller.unregister(s)
print(json.dumps(got)); ctx.destroy(linger=0)
"""


def test_train_across_namespaces_with_curve_and_refuse_keyless_peers(two_hosts, tmp_path):
    learner_ns, actor_ns = two_hosts
    keys = tmp_path / "keys"
    subprocess.run([sys.executable, str(ROOT / "launch" / "make_keys.py"), str(keys)], check=True,
                   capture_output=True, timeout=60)
    curve = ["--set", f"learner.curve_secret_key={keys}/learner.key_secret",
             "--set", f"learner.curve_authorized_keys={keys}/authorized",
             "--set", f"actors.curve_secret_key={keys}/actors.key_secret",
             "--set", f"actors.curve_server_key={keys}/learner.key"]
    run = tmp_path / "run"
    learner = _start(learner_ns, [sys.executable, "-m", "learner", "--config", str(CONFIG), "--run-dir", str(run),
                                  "--set", f"learner.host={LEARNER_IP}", "--set", "trainer.total_steps=12000",
                                  "--set", "trainer.eval_freq=4000", *curve], tmp_path / "learner.log")
    procs = [learner]
    try:
        deadline = time.monotonic() + 120
        while not (run / "endpoints.json").exists():
            assert learner.poll() is None and time.monotonic() < deadline, (tmp_path / "learner.log").read_text()
            time.sleep(0.1)
        endpoints = json.loads((run / "endpoints.json").read_text())
        assert endpoints["rollouts"].startswith(f"tcp://{LEARNER_IP}:")
        probe = subprocess.run(["ip", "netns", "exec", actor_ns, sys.executable, "-c", PROBE, str(run / "endpoints.json"),
                                str(keys), str(tmp_path)], cwd=ROOT, env={**os.environ, "PYTHONPATH": child_pythonpath()},
                               capture_output=True, text=True, timeout=60)
        assert probe.returncode == 0, probe.stderr
        refused = json.loads(probe.stdout.strip().splitlines()[-1])
        assert all(r["weights"] == 0 for r in refused), refused        # no weights without an admitted key
        for i in range(2):
            procs.append(_start(actor_ns, [sys.executable, "-m", "actors", "--config", str(CONFIG), "--actor-id",
                                           str(i), "--endpoints", str(run / "endpoints.json"), *curve],
                                tmp_path / f"actor{i}.log"))
        learner.wait(timeout=240)
        assert learner.returncode == 0, (tmp_path / "learner.log").read_text()[-3000:]
        for p in procs[1:]:
            p.wait(timeout=30)
    finally:
        _stop(procs)
    summary = json.loads((run / "summary.json").read_text())
    assert summary["env_steps"] >= 12000 and summary["malformed"] == 0 and summary["rejected"] == 0, summary
    consumed = [e for e in read_jsonl(run / "versions.jsonl") if e["event"] == "consume"]
    assert {e["actor"] for e in consumed} == {0, 1}
    assert summary["last_eval/return_mean"] > 30, summary
    metrics = [m for m in read_jsonl(run / "metrics.jsonl") if "wire/auth_refused" in m]
    assert metrics[-1]["wire/auth_refused"] >= 1                        # the stranger's key was refused
