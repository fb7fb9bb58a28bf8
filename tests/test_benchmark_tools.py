"""The benchmark scripts' arithmetic: the latency calibration's fit, the async speed-up's multi-seed
table, and the in-flight benchmark's overrides, table and ratios (the runs themselves are benchmarks,
not tests)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))

import async_speedup  # noqa: E402
import calibrate_latency  # noqa: E402
import inflight_latency  # noqa: E402


def test_fit_line_recovers_a_and_b():
    a, b = calibrate_latency.fit_line([1, 4, 16], [0.05 + 0.01 * n for n in (1, 4, 16)])
    assert a == pytest.approx(0.05) and b == pytest.approx(0.01)
    assert calibrate_latency.fit_line([8], [0.3]) == (0.3, 0.0)


def test_calibration_times_a_real_policy_and_scales(tmp_path, capsys):
    out = tmp_path / "cal.json"
    assert calibrate_latency.main.__module__ == "calibrate_latency"
    argv = sys.argv
    sys.argv = ["calibrate_latency.py", "--config", str(ROOT / "configs" / "cartpole_ppo.json"),
                "--batches", "1,8", "--repeats", "2", "--scale-to", "0.2@8", "--json", str(out)]
    try:
        assert calibrate_latency.main() == 0
    finally:
        sys.argv = argv
    doc = json.loads(out.read_text())
    assert [r["batch"] for r in doc["rows"]] == [1, 8] and all(r["median_s"] > 0 for r in doc["rows"])
    assert doc["scaled_a"] + 8 * doc["scaled_b"] == pytest.approx(0.2)
    assert "--latency" in capsys.readouterr().out


def _row(group, variant, wall, speedup, ret, lag, collect=None, update=None, bound=None):
    return {"group": group, "variant": variant, "wall_s": wall, "window_s": wall - 5, "collect_s": collect,
            "update_s": update, "speedup": speedup, "bound": bound,
            "share_of_bound": None if bound is None else speedup / bound, "eval_return": ret, "lag_mean": lag}


def test_aggregate_gives_mean_and_std_per_variant():
    docs = [{"seed": s, "latency_s": 0.2, "latency_per_env_s": 0.0,
             "equal": [_row("4 devices", "standard 4x16", 100 + s, 1.0, 200 + 10 * s, 0.0, 95.0, 5.0, 1.05),
                       _row("4 devices", "vla 4x16", 96 + s, 1.04, 190 + 10 * s, 1.0 + s / 10, bound=1.05)]}
            for s in (1, 2, 3)]
    text = async_speedup.aggregate(docs)
    assert "seeds [1, 2, 3]" in text
    std_line = next(line for line in text.splitlines() if "standard 4x16" in line)
    assert "| 102.0 ± 1.0 |" in std_line and "| 220.0 ± 10.0 |" in std_line and "| 95.0 ± 0.0 |" in std_line
    vla_line = next(line for line in text.splitlines() if "| vla 4x16" in line)
    assert "| 1.04 ± 0.00 |" in vla_line and "| 0.99 ± 0.00 |" in vla_line and "| 1.20 ± 0.10 |" in vla_line
    assert async_speedup.main(["--aggregate"]) == 2


def test_inflight_overrides_and_report():
    import argparse
    a = argparse.Namespace(steps=1000, max_lag=8, buffer_size=64, actors=4, num_envs=16, latency=0.03, sets=["x.y=1"])
    sets = inflight_latency.overrides(a, "step", 2)
    pairs = dict(s.split("=", 1) for s in sets if s != "--set")
    assert pairs["actors.weights_at"] == "step" and pairs["trainer.seed"] == "2"
    assert pairs["trainer.lag_policy"] == "pace" and pairs["trainer.rollouts_per_update"] == "1"
    assert pairs["x.y"] == "1" and sets[-1] == "x.y=1"   # the user's overrides come last and win

    def r(setting, seed, lag, sps, ret):
        return {"setting": setting, "seed": seed, "mean_lag": lag, "p95_lag": round(lag + 1), "sps": sps,
                "multi_version_share": 0.9 if setting == "step" else 0.0, "final_return": ret, "dropped": 0,
                "curve": [(1.0, ret / 2), (2.0, ret)]}
    results = [r("rollout", 1, 4.0, 1000, 400), r("step", 1, 1.5, 990, 450),
               r("rollout", 2, 4.2, 1010, 420), r("step", 2, 1.7, 1000, 470)]
    q = inflight_latency.ratios(results)
    assert q["lag_rollout_over_step"] == pytest.approx(4.1 / 1.6)
    assert q["sps_step_over_rollout"] == pytest.approx(995 / 1005)
    assert q["return_step_minus_rollout"] == pytest.approx(50)
    text = inflight_latency.table(results)
    assert "| step | 1 | 1.50 | 2 | 90% | 990 | 450.0 | 0 |" in text
    assert "| rollout | 4.10 ± 0.14 |" in text


def test_sim_throughput_measures_each_size_against_the_baseline(tmp_path, capsys):
    import sim_throughput
    out = tmp_path / "sim.json"
    assert sim_throughput.main(["--env", "tandem/Pendulum-v0", "--config", "configs/pendulum_ppo.json",
                                "--num-envs", "4,8", "--baseline", "Pendulum-v1", "--baseline-envs", "2",
                                "--steps-per-rollout", "4", "--seconds", "0.05", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [(r["env"], r["num_envs"]) for r in rows] == [("Pendulum-v1", 2), ("tandem/Pendulum-v0", 4),
                                                         ("tandem/Pendulum-v0", 8)]
    assert rows[0]["sim_x_baseline"] == rows[0]["actor_x_baseline"] == 1.0
    for r in rows:
        assert r["sim_steps_per_s"] > 0 and r["actor_steps_per_s"] > 0 and r["actor_rollouts"] >= 3
        assert r["sim_x_baseline"] == pytest.approx(r["sim_steps_per_s"] / rows[0]["sim_steps_per_s"])
    assert "tandem/Pendulum-v0" in capsys.readouterr().out


class _Heading:
    """A Reach 'policy' that heads straight for target `which(env)` of each env (the env's own state)."""

    def __init__(self, env, which):
        self.env, self.which = env, which

    def __call__(self, td, deterministic=True):
        e = self.env
        goal = e.targets[torch.arange(e.num_envs), self.which(e)]
        td.set("action", ((goal - e.pos) / e.step_size).clamp(-1, 1))
        return td


def test_reach_starts_classifies_outcomes():
    import reach_starts
    from shared.config import load_config
    cfg = load_config(ROOT / "configs" / "vla_tokens_reach_grpo.json")
    seeds = [11, 11, 13, 17]
    env = reach_starts.reach_env(cfg, len(seeds))
    named = reach_starts.play(_Heading(env, lambda e: e.goal), env, seeds, deterministic=True)
    assert named.tolist() == [reach_starts.OUTCOMES.index("success")] * 4
    env.reset(seed=seeds)
    assert env.goal[0] == env.goal[1]                            # group_goals "same": one task per seed
    other = reach_starts.play(_Heading(env, lambda e: (e.goal + 1) % 3), env, seeds, deterministic=True)
    wrong, success = reach_starts.OUTCOMES.index("wrong"), reach_starts.OUTCOMES.index("success")
    assert wrong in other.tolist() and set(other.tolist()) <= {wrong, success}   # (it may pass the named one)
    still = reach_starts.play(lambda td, deterministic=True: td.set("action", torch.zeros(4, 2)), env, seeds, True)
    assert set(still.tolist()) <= {reach_starts.OUTCOMES.index("near"), reach_starts.OUTCOMES.index("elsewhere")}
    assert reach_starts.no_success_in_4(16, 16) == 1.0 and reach_starts.no_success_in_4(3, 16) == 0.0
    assert reach_starts.no_success_in_4(5, 16) == pytest.approx(5 / 1820)


def test_reach_gains_variants_and_gain():
    import reach_gains
    assert reach_gains.parse_variant("config") == ("config", [])
    assert reach_gains.parse_variant("g1 algorithm.cfg.gamma=1.0 'trainer.exp_name=\"a b\"'") == \
        ("g1", ["algorithm.cfg.gamma=1.0", 'trainer.exp_name="a b"'])
    for bad in ("", "gamma=1", "g1 gamma"):
        with pytest.raises(ValueError):
            reach_gains.parse_variant(bad)
    # README: seed 1, 61.6 / 60.4% against 40.9 / 42.8% -> +19.2
    assert reach_gains.success_gain((0.616, 0.604), (0.409, 0.428)) == pytest.approx(19.15)


class _Done:
    """A finished process, as far as run_parallel looks (poll)."""

    def __init__(self, code):
        self.code = code

    def poll(self):
        return self.code


def test_reach_gains_runs_every_variant_and_seed_and_reports_failures(tmp_path, monkeypatch, capsys):
    """The launcher and the evaluator replaced: every (variant, seed) is trained once with its overrides,
    every run and the starting model are evaluated on both sets of each seed, a run stopped by the time
    limit is measured from its last checkpoint and marked, and a failed run is reported (exit 1)
    without hiding the others."""
    import reach_gains
    trained, evaluated, stopped = [], [], []

    def fake_launcher(args, run_dir):
        sets = [args[i + 1] for i, x in enumerate(args) if x == "--set"]
        trained.append((run_dir.name, sets))
        run_dir.mkdir(parents=True, exist_ok=True)
        if run_dir.name == "bad_s2":
            (run_dir / "launcher.log").write_text("Traceback: boom\n")
            return _Done(1)
        if run_dir.name == "good_s2":                  # still running at the time limit, after a checkpoint
            (run_dir / "checkpoints").mkdir()
            (run_dir / "checkpoints" / "ckpt_00000003.pt").write_bytes(b"")
            return _Done(None)
        (run_dir / "summary.json").write_text(json.dumps({"wall_s": 12.0}))
        return _Done(0)

    def fake_evaluation(args, out):
        evaluated.append(args)
        seed = int(args[args.index("--seed") + 1])
        held = seed >= reach_gains.HELD_OUT
        if "--checkpoint" in args:                       # the starting model
            rate = 0.40 if not held else 0.42
        else:
            rate = {"good": 0.65, "bad": 0.5}[Path(args[0]).name.split("_")[0]] + (0.01 if held else 0.0)
        out.write_text(json.dumps({"success_rate": rate, "env_steps": 1000}))
        return _Done(0)

    monkeypatch.setattr(reach_gains, "start_launcher", fake_launcher)
    monkeypatch.setattr(reach_gains, "start_evaluation", fake_evaluation)
    monkeypatch.setattr(reach_gains, "stop_launcher", lambda p: stopped.append(p) or [])
    code = reach_gains.main(["--config", str(ROOT / "configs" / "vla_tokens_reach_grpo.json"),
                             "--set", "policy.vla_config.model_path=x", "--variant", "good",
                             "--variant", "bad algorithm.cfg.gamma=1.0", "--seeds", "1,2", "--steps", "1000",
                             "--device", "cuda:0", "--actor-device", "cpu", "--parallel", "3",
                             "--timeout-s", "0.3", "--episodes", "10", "--out", str(tmp_path)])
    assert code == 1
    assert sorted(n for n, _ in trained) == ["bad_s1", "bad_s2", "good_s1", "good_s2"]
    for name, sets in trained:
        assert "trainer.eval_freq=0" in sets and "trainer.total_steps=1000" in sets
        assert f"trainer.seed={name[-1]}" == sets[-1]
        assert 'learner.device="cuda:0"' in sets and 'actors.devices=["cpu"]' in sets
        assert ("algorithm.cfg.gamma=1.0" in sets) == name.startswith("bad")
    assert len(evaluated) == 2 * 2 + 3 * 2               # the start on 2 seeds + 3 runs, 2 sets each
    assert len(stopped) == 4 + 10                        # every process is made sure of, finished or not
    assert all(a[a.index("--device") + 1] == "cuda:0" for a in evaluated)
    out = json.loads((tmp_path / "gains.json").read_text())
    gains = {(r["variant"], r["seed"]): r["gain"] for r in out["rows"]}
    assert gains == pytest.approx({("good", 1): 24.5, ("good", 2): 24.5, ("bad", 1): 9.5})
    assert list(out["failures"]) == ["bad_s2"] and "boom" in out["failures"]["bad_s2"]
    assert all(r["env_steps"] == 1000 for r in out["rows"])      # from the evaluations' JSON
    assert [r.get("stopped", False) for r in out["rows"]] == [False, True, False]   # good s1, good s2, bad s1
    text = capsys.readouterr().out
    assert "FAILED" in text and "+24.5*" in text and "failed" in text and "stopped" in text


def test_reach_gains_run_parallel_bounds_and_stops_real_processes(tmp_path):
    """Real processes in their own sessions: at most `parallel` at once, exit codes kept, one past its
    time limit stopped (None), and when starting a job raises, the running ones are stopped too."""
    import subprocess
    import reach_gains
    from _common import group_members
    started = []

    def start(job):
        assert sum(p.poll() is None for p in started) < 2       # never more than `parallel` running
        if job == "boom":
            raise RuntimeError("cannot start")
        script = {"ok": "pass", "fail": "raise SystemExit(3)", "slow": "import time; time.sleep(60)"}[job]
        p = subprocess.Popen([sys.executable, "-c", script], start_new_session=True)
        started.append(p)
        return p

    done = reach_gains.run_parallel(["ok", "fail", "slow"], start, parallel=2, timeout_s=2.0)
    assert done["ok"][0] == 0 and done["fail"][0] == 3 and done["slow"][0] is None
    assert 1.5 < done["slow"][1] < 20
    with pytest.raises(RuntimeError, match="cannot start"):
        reach_gains.run_parallel(["slow", "boom"], start, parallel=2, timeout_s=60.0)
    for p in started:
        assert p.poll() is not None and not group_members(p.pid)


def test_prebuild_saves_the_fresh_vla_once_and_every_process_loads_the_same_weights(tmp_path):
    import inference_server
    from _common import BenchmarkError
    from shared.config import load_config
    from shared.envs import env_spec
    from shared.policies import frozen_digest, make_policy
    from shared.policies.vla import load_vla_model

    config = ROOT / "configs" / "vla_tokens_reach_smoke.json"
    sets = inference_server.prebuild(config, [], tmp_path / "model")
    assert sets == [f"policy.vla_config.model_path={tmp_path / 'model'}"]
    cfg = load_config(config, sets)
    spec = env_spec(cfg.env.id, cfg.env.cfg)
    torch.manual_seed(1)
    first = make_policy(cfg, spec)
    torch.manual_seed(2)                          # another process's seed: the weights are the file's
    assert frozen_digest(make_policy(cfg, spec)) == frozen_digest(first)
    fresh = load_config(config, [])
    torch.manual_seed(fresh.trainer.seed)
    built = load_vla_model("", fresh.policy.vla_config.model_class, fresh.policy.vla_config.model_config)
    loaded = load_vla_model(str(tmp_path / "model"), fresh.policy.vla_config.model_class,
                            fresh.policy.vla_config.model_config)
    for (k, a), (_, b) in zip(built.state_dict().items(), loaded.state_dict().items()):
        torch.testing.assert_close(a, b, rtol=0, atol=0, msg=k)
    with pytest.raises(BenchmarkError, match="does not build a VLA afresh"):
        inference_server.prebuild(ROOT / "configs" / "cartpole_ppo.json", [], tmp_path / "none")


def test_server_batches_reads_the_servers_own_account_from_its_log(tmp_path):
    import inference_server
    assert inference_server.server_batches(tmp_path) == {}
    (tmp_path / "logs").mkdir()
    (tmp_path / "logs" / "inference_0.log").write_text(
        "inference server 0: v0 | 32 batches, 27.0 envs (max 32) from 6.8 requests each, 110.3 ms per batch, busy 70%\n"
        "inference server 0: v2 | 16 batches, 30.0 envs (max 32) from 7.2 requests each, 90.7 ms per batch, busy 60%\n"
        "inference server 0: stopping after 48 batches (27.9 envs from 6.98 requests each), 0 malformed and 0 busy\n"
        "inference server 0: peak device memory 2380 MiB allocated, 7600 MiB reserved\n")
    got = inference_server.server_batches(tmp_path)
    assert got == {"batch_requests": 6.98, "batches": 48, "batch_envs": 27.9, "forward_ms": pytest.approx(100.5),
                   "server_allocated_mib": 2380.0, "server_reserved_mib": 7600.0}
    # without its closing line: the progress lines' mean requests per batch (older and newer lines)
    (tmp_path / "logs" / "inference_0.log").write_text(
        "inference server 0: v0 | 32 batches, 27.0 envs (max 32) from 6.0 requests each, 110.3 ms per batch, busy 70%\n"
        "inference server 0: v2 | 16 batches, 30.0 envs (max 32 of 32) from 8.0 requests each, 90.7 ms per batch, "
        "busy 60%, waits up to 5.0 ms | dropped 0 malformed, 0 busy, 0 failed\n")
    assert inference_server.server_batches(tmp_path) == {"batch_requests": 7.0, "forward_ms": pytest.approx(100.5)}
    # a run that ends before its first progress line: the closing line's time per batch, over its whole life
    (tmp_path / "logs" / "inference_0.log").write_text(
        "inference server 0: stopping after 9 batches (30.7 envs from 7.69 requests each, 21.4 ms per batch); "
        "requests dropped: 0 malformed\n")
    assert inference_server.server_batches(tmp_path) == {"batches": 9, "batch_envs": 30.7, "batch_requests": 7.69,
                                                         "forward_ms": 21.4}


def test_the_acting_processes_memory_is_read_per_process_and_by_role(tmp_path, monkeypatch):
    import os

    import inference_server
    assert inference_server.compute_apps_mib("1234, 8224\n 77, 640\nbad line\n99, [N/A]\n") == {1234: 8224.0, 77: 640.0}

    class Proc:
        def __init__(self, pid, cmdline):
            self.info = {"pid": pid, "cmdline": cmdline}
    run = str(tmp_path / "server_8")
    procs = [Proc(1, ["python", "-m", "actors.inference", "--run-dir", run, "--server-id", "0"]),
             Proc(2, ["python", "-m", "actors", "--run-dir", run, "--actor-id", "0"]),
             Proc(3, ["python", "-m", "learner", "--out", run]),
             Proc(4, ["python", "-m", "actors", "--run-dir", str(tmp_path / "other"), "--actor-id", "0"])]
    monkeypatch.setattr(inference_server.psutil, "process_iter", lambda attrs: procs)
    assert inference_server.acting_pids(tmp_path / "server_8") == {"server": [1], "actors": [2]}
    me = inference_server.memory_mib([os.getpid(), 2**22 + 7], "cpu")       # a pid that does not exist is left out
    assert list(me) == [os.getpid()] and me[os.getpid()] > 10


def test_no_updates_leaves_the_learner_idle_with_a_valid_config():
    """inference_server.py --no-updates: an update needs more rollouts than the run collects, the
    actors are not paced (they would wait for updates that never come), and the config is valid."""
    import argparse

    import inference_server
    from shared.config import load_config
    args = argparse.Namespace(sets=["trainer.lag_policy=pace"], num_envs=4, steps=4096, buffer_size=8, device="cpu",
                              env_device="", latency=0.0, latency_per_env=0.0, max_wait_ms=5.0, server_splits=1,
                              no_updates=True)
    for mode in ("local", "server"):
        cfg = load_config(ROOT / "configs" / "cartpole_ppo.json", inference_server.overrides(args, 8, mode))
        made = 4096 // (4 * 8)                                   # rollouts the run collects
        assert cfg.trainer.rollouts_per_update > made and cfg.trainer.buffer_capacity >= cfg.trainer.rollouts_per_update
        assert cfg.trainer.lag_policy == "drop"
    args.no_updates = False
    cfg = load_config(ROOT / "configs" / "cartpole_ppo.json", inference_server.overrides(args, 8, "server"))
    assert cfg.trainer.rollouts_per_update == 8 and cfg.trainer.lag_policy == "pace"


def test_checkpoint_verify_benchmark_times_both_paths_and_cleans_up(tmp_path):
    """benchmarks/checkpoint_verify.py on a tiny state: every timing present, its files removed."""
    import json
    from benchmarks import checkpoint_verify
    out = tmp_path / "ckv.json"
    assert checkpoint_verify.main(["--params", "100000", "--repeats", "2", "--dir", str(tmp_path), "--json", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert [r["repeat"] for r in doc["records"]] == [1, 2] and doc["bytes"] == 400_000
    assert all(r[k] > 0 for r in doc["records"] for k in ("write_bare_s", "write_digest_s", "load_bare_s", "load_verified_s"))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckv.json"]


def test_flow_vla_quick_measures_both_policies_and_writes_a_result_page(tmp_path, capsys):
    """benchmarks/flow_vla.py --quick: a record per policy, path, K and H; per env step = per call / H;
    pi0's ratios against the token policy at the same H, batch and path; the update on the first path's
    rows; the result file holds what results.py needs, and the page beside it is what results.py renders."""
    import flow_vla
    import results

    out = tmp_path / "flow_vla.json"
    threads = torch.get_num_threads()
    assert flow_vla.main(["--quick", "--json", str(out)]) == 0
    assert torch.get_num_threads() == threads                  # the benchmark's own setting is undone
    doc = json.loads(out.read_text())
    assert all(doc[k] for k in results.REQUIRED) and doc["settings"]["threads"] == 1
    assert "ppo_update" in doc["update"] and "8 rows" in doc["update"]
    ks, hs, batches = doc["settings"]["ks"], doc["settings"]["hs"], doc["settings"]["batches"]
    paths = ["forward", "server"]
    recs = {(r["policy"], r["path"], r["K"], r["H"]): r for r in doc["records"]}
    assert set(recs) == ({("tokens", p, None, h) for p in paths for h in hs}
                         | {("pi0", p, k, h) for p in paths for k in ks for h in hs})
    for (policy, path, k, h), r in recs.items():
        tokens = recs[("tokens", path, None, h)]
        assert (r["update_s"] is not None) == (path == "forward") and r["actions_per_call"] == h
        for b in batches:
            assert r[f"call_ms_b{b}"] > 0
            assert r[f"step_ms_b{b}"] == pytest.approx(r[f"call_ms_b{b}"] / h, rel=1e-3, abs=1e-3)
            want = r[f"call_ms_b{b}"] / tokens[f"call_ms_b{b}"] if policy == "pi0" else None
            assert r[f"x_tokens_b{b}"] == (None if want is None else pytest.approx(want, rel=1e-2))
        if path == "forward":
            assert r["update_s"] > 0 and r["update_ms_per_env_step"] == pytest.approx(
                1000 * r["update_s"] / (8 * h), rel=1e-2)
            assert (r["x_tokens_update"] is not None) == (policy == "pi0")
    pi0, tokens = recs[("pi0", "forward", ks[0], hs[0])], recs[("tokens", "forward", None, hs[0])]
    assert pi0["params"] > tokens["params"] > tokens["trainable"] > 0    # the same VLM, plus the expert
    assert (tmp_path / "flow_vla.md").read_text() == results.render(doc, str(out))
    printed = capsys.readouterr().out
    assert "torch threads 1" in printed and f"{pi0['params']:,} parameters" in printed
