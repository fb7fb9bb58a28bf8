"""launch/run_ray.py's pure parts, without a Ray cluster: the ``launch.ray`` block, what each learner
rank changes on its node (bind and advertise addresses, its GPU), same-host transports refused across
nodes, each rank's own address gathered without pickle, and the restart back-off."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil
import pytest
import torch
import zmq

from shared.config import ConfigError, config_from_dict
from shared.transport import bind

ROOT = Path(__file__).resolve().parents[1]
CARTPOLE = json.loads((ROOT / "configs" / "cartpole_ppo.json").read_text())


def _run_ray():
    spec = importlib.util.spec_from_file_location("run_ray", ROOT / "launch" / "run_ray.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _cfg(*overrides: str):
    return config_from_dict(CARTPOLE, "cartpole_ppo.json", list(overrides))


def test_launch_ray_defaults_and_per_rank_resources():
    cfg = _cfg('learner.devices=["cpu","cpu"]',
               'launch.ray.learner_resources=[{"CPU":1,"node_a":0.01},{"CPU":1,"GPU":0.5,"node_b":0.01}]')
    assert cfg.launch.ray.learner_resources[1]["GPU"] == 0.5
    assert _cfg().launch.ray.actor_resources == [{"CPU": 1}] and _cfg().launch.ray.strategy == "PACK"


@pytest.mark.parametrize("override, match", [
    ('launch.ray.actor_resources=[{"CPU":-1}]', r"launch\.ray\.actor_resources\[0\].*CPU.*non-negative"),
    ('launch.ray.actor_resources=[{"GPU":"one"}]', r"launch\.ray\.actor_resources\[0\].*GPU"),
    ("launch.ray.learner_resources=[]", r"launch\.ray\.learner_resources: give at least one"),
    ('launch.ray.learner_resources=[{"CPU":1},{"CPU":1}]', r"2 entries for 1 learner rank"),
    ("launch.ray.strategy=EVERYWHERE", r"launch\.ray\.strategy"),
    ("launch.ray.nodes=2", r"launch\.ray\.nodes: unknown key"),
])
def test_bad_launch_ray_block_names_file_and_key(override, match):
    with pytest.raises(ConfigError, match=r"cartpole_ppo\.json.*" + match):
        _cfg(override)


def test_ring_refused_with_an_advertised_address():
    with pytest.raises(ConfigError, match=r"rollout_transport.*advertise_host is '10\.0\.0\.1'"):
        _cfg("actors.rollout_transport=ring", "learner.advertise_host=10.0.0.1")


def test_bind_advertises_another_address_than_it_binds():
    ctx = zmq.Context()
    try:
        sock = ctx.socket(zmq.PULL)
        address = bind(sock, "127.0.0.1", 0, advertise="10.9.8.7")
        assert address.startswith("tcp://10.9.8.7:")
        assert sock.getsockopt_string(zmq.LAST_ENDPOINT).rsplit(":", 1)[1] == address.rsplit(":", 1)[1]
        assert bind(ctx.socket(zmq.PULL), "127.0.0.1", 0).startswith("tcp://127.0.0.1:")
    finally:
        ctx.destroy(linger=0)


def test_rank_overrides_bind_or_advertise_the_node_address():
    rr = _run_ray()
    assert rr.rank_overrides(_cfg(), "10.0.0.2", across_nodes=False, resources={"CPU": 1}) == []
    assert rr.rank_overrides(_cfg(), "10.0.0.2", True, {"CPU": 1}) == ["learner.host=10.0.0.2"]
    assert rr.rank_overrides(_cfg("learner.host=0.0.0.0"), "10.0.0.2", True, {}) == ["learner.advertise_host=10.0.0.2"]
    named = _cfg("learner.host=0.0.0.0", "learner.advertise_host=a.example")
    assert rr.rank_overrides(named, "10.0.0.2", True, {}) == []
    gpu = rr.rank_overrides(_cfg('learner.devices=["cuda:0","cuda:1"]'), "10.0.0.2", True, {"GPU": 1})
    assert gpu == ["learner.host=10.0.0.2", "learner.device=cuda:0", 'learner.devices=["cuda:0", "cuda:0"]']


def test_same_host_transports_are_refused_for_actors_on_other_nodes():
    rr = _run_ray()
    shm = _cfg("learner.weights_transport=shm")
    errors = rr.check_placement(shm, ["node-a"], ["node-a", "node-b"])
    assert len(errors) == 1 and "weights_transport \"shm\"" in errors[0] and "actors [1]" in errors[0]
    assert rr.check_placement(shm, ["node-a"], ["node-a", "node-a"]) == []
    assert rr.check_placement(_cfg(), ["node-a"], ["node-b", "node-b"]) == []


def test_an_inference_server_placed_apart_from_its_actors_is_refused():
    rr = _run_ray()
    served = _cfg("actors.inference=server", 'actors.devices=["cuda:0","cuda:1"]', "actors.num_actors=3",
                  "trainer.buffer_type=vla")
    errors = rr.check_placement(served, ["node-a"], ["node-b", "node-c", "node-b"], ["node-b", "node-c"])
    assert errors == []                                   # actors 0 and 2 with server 0, actor 1 with server 1
    errors = rr.check_placement(served, ["node-a"], ["node-b", "node-b", "node-c"], ["node-b", "node-c"])
    assert len(errors) == 1 and "actors [1, 2]" in errors[0] and "servers ([0, 1])" in errors[0], errors
    assert "STRICT_PACK" in errors[0] and "server_resources" in errors[0]
    # one server per node for a device name every node has: actors.servers_per_device 2, actors dealt
    # out in turn (actor i to server i % 2), as resource lists of two entries place them (i % 2)
    per_node = _cfg("actors.inference=server", 'actors.devices=["cuda:0"]', "actors.num_actors=4",
                    "actors.servers_per_device=2", "trainer.buffer_type=vla")
    assert rr.check_placement(per_node, ["node-a"], ["node-a", "node-b"] * 2, ["node-a", "node-b"]) == []
    errors = rr.check_placement(per_node, ["node-a"], ["node-a", "node-b"] * 2, ["node-b", "node-a"])
    assert len(errors) == 1 and "actors [0, 1, 2, 3]" in errors[0], errors


def test_all_gather_text_through_gloo_without_pickle(tmp_path):
    import torch.distributed as dist
    from learner.distributed import Ranks
    import torch
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        ranks = Ranks(0, 1, torch.device("cpu"))
        assert ranks.all_gather_text("tcp://10.200.1.2:5555") == ["tcp://10.200.1.2:5555"]
        assert ranks.all_gather_text("hôte") == ["hôte"]
        with pytest.raises(ValueError, match="more than 8"):
            ranks.all_gather_text("x" * 9, max_bytes=8)
    finally:
        dist.destroy_process_group()


def test_restart_back_off_and_leftovers(tmp_path):
    pytest.importorskip("ray", reason="Ray is not installed (pip install -e '.[ray]')")
    from runners.ray_hosts import backoff_s, remove_learner_leftovers
    assert [backoff_s(n) for n in (1, 2, 3, 4, 7, 8, 20)] == [0, 1, 2, 4, 30, 30, 30]
    outside = tmp_path / "tandem-x.weights"        # only /dev/shm/tandem-*.weights is removed
    outside.write_text("keep")
    (tmp_path / "endpoints.json").write_text(json.dumps({"rollouts": "tcp://a:1", "weights": "tcp://a:2",
                                                         "shm": str(outside)}))
    remove_learner_leftovers(tmp_path)
    assert outside.exists() and not (tmp_path / "endpoints.json").exists()


def _running(p) -> bool:
    import psutil
    try:
        return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


@pytest.mark.slow
def test_sigterm_to_the_process_group_stops_the_local_ray_instance_too(tmp_path):
    """What `timeout`, systemd, a container stop and scancel do: SIGTERM to the launcher's whole process
    group. The local Ray instance it started runs in a session of its own, so it outlives the signal:
    the launcher stops the run through it (the learner writes its final checkpoint), then stops it,
    and exits 143 within seconds (it used to wait 60 s for a GCS that the signal had killed, then fail
    with 1), leaving no Ray or Tandem process running."""
    pytest.importorskip("ray", reason="Ray is not installed (pip install -e '.[ray]')")
    from tests.children import child_pythonpath
    run, log = tmp_path / "run", tmp_path / "driver.log"
    ray_tmp = Path(tempfile.mkdtemp(prefix="rrg", dir="/tmp"))    # short: Ray's Unix sockets live under it
    env = {**os.environ, "PYTHONPATH": child_pythonpath(), "OMP_NUM_THREADS": "1", "RAY_TMPDIR": str(ray_tmp),
           "RAY_USAGE_STATS_ENABLED": "0"}
    env.pop("RAY_ADDRESS", None)
    argv = [sys.executable, str(ROOT / "launch" / "run_ray.py"), "--config", str(ROOT / "configs" / "cartpole_ppo.json"),
            "--actors", "1", "--steps", "100000000", "--no-eval", "--out", str(run),
            "--set", "trainer.save_freq=1000000000"]          # the only checkpoint: the one SIGTERM writes
    driver = subprocess.Popen(argv, cwd=ROOT, env=env, stdout=open(log, "w"), stderr=subprocess.STDOUT,
                              start_new_session=True)
    seen: dict[int, psutil.Process] = {}

    def note_processes() -> None:       # the launcher's tree: the Ray instance, its workers, learner and actor
        try:
            for p in psutil.Process(driver.pid).children(recursive=True):
                seen.setdefault(p.pid, p)
        except psutil.NoSuchProcess:
            pass

    def of_this_run() -> list:          # any process still running that names this run's Ray directory
        found = []
        for p in psutil.process_iter(["cmdline"]):
            if str(ray_tmp) in " ".join(p.info["cmdline"] or []) and _running(p):
                found.append(p)
        return found

    try:
        deadline = time.monotonic() + 180
        versions = run / "versions.jsonl"
        while not (versions.exists() and versions.read_text().count('"publish"') >= 2):
            assert driver.poll() is None, log.read_text()[-4000:]
            assert time.monotonic() < deadline, "no training after 180 s\n" + log.read_text()[-4000:]
            note_processes()
            time.sleep(0.5)
        assert not list((run / "checkpoints").glob("*.pt"))      # none yet: the final one is SIGTERM's
        note_processes()
        assert any("raylet" in p.name() for p in seen.values()), "no raylet under the launcher"
        os.killpg(driver.pid, signal.SIGTERM)
        signalled = time.monotonic()
        rc = driver.wait(timeout=60)
        took = time.monotonic() - signalled
    finally:
        if driver.poll() is None:
            os.killpg(driver.pid, signal.SIGKILL)
            driver.wait(10)
        deadline = time.monotonic() + 1.0     # what is left 1 s after the driver ended
        while (left := [p for p in seen.values() if _running(p)] + of_this_run()) and time.monotonic() < deadline:
            time.sleep(0.05)
        for p in left:
            try:
                p.kill()
            except psutil.Error:
                pass
        shutil.rmtree(ray_tmp, ignore_errors=True)
    output = log.read_text()
    assert rc == 143 and took < 30, (rc, took, output[-4000:])
    assert "Failed to connect to GCS" not in output, output[-4000:]
    assert not left, ([(p.pid, p.name()) for p in left], output[-4000:])
    started = {int(p) for p in re.findall(r"(?:actor_\d|learner): pid (\d+)", output)}
    assert len(started) == 2, output[-4000:]
    assert not [p for p in started if psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]
    summary = json.loads((run / "summary.json").read_text())
    assert summary["stopped_by"] == "SIGTERM", summary
    checkpoint = max((run / "checkpoints").glob("*.pt"))
    assert torch.load(checkpoint, weights_only=True)["version"] == summary["version"]
