"""The cost of in-flight weight updates (``actors.weights_at: step``) on a fast env: CartPole,
16 envs in one actor, env steps per second of the real collector with ``rollout`` against ``step``.

    .venv/bin/python benchmarks/inflight_poll.py [--rollouts 20] [--repeats 5] [--publish-every-ms 0,50]

A real :class:`actors.actor.Actor` receives weights from a real ``WeightsPublisher`` over TCP
loopback (this process publishes, as the learner would); its rollouts go nowhere. Both settings poll
the weights socket between steps (that is how a stop request is seen); ``step`` also loads whatever
newer version is due and writes each step's version. With ``--publish-every-ms 0`` nothing new
arrives after the first version, so the difference is the poll path alone; with 50 a thread
publishes a new version every 50 ms, and ``step`` pays for loading them mid-rollout. The two
settings are timed in alternation, ``--repeats`` times each; the median is reported with the ratio
step / rollout (1.00: free).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import threading
import time
from pathlib import Path

from _common import ROOT, machine_info  # noqa: F401  (puts the repo on sys.path)

import torch  # noqa: E402
import zmq  # noqa: E402


class _NullSink:
    def send(self, frames, timeout_ms):
        return None


def run(rollouts: int, repeats: int, publish_every_ms: float, num_envs: int = 16) -> dict:
    from actors.actor import Actor
    from shared.config import load_config
    from shared.policies import make_policy, weights_td
    from shared.envs import make_env
    from shared.transport import WeightsPublisher, WeightsSubscriber

    cfg = load_config(ROOT / "configs" / "cartpole_ppo.json",
                      ["trainer.buffer_type=async", "trainer.lag_policy=drop", f"actors.num_envs={num_envs}"])
    torch.set_num_threads(1)
    ctx = zmq.Context()
    pub = WeightsPublisher(ctx, "127.0.0.1")
    env = make_env(cfg.env.id, 1, cfg.env.cfg)
    policy = make_policy(cfg, env.spec)
    env.close()
    version = [0]
    lock = threading.Lock()

    def publish():
        with lock:
            with torch.no_grad():
                for p in policy.parameters():
                    p.mul_(1.0001)
            pub.publish(weights_td(policy).clone(), kind="weights", version=version[0], incarnation="bench",
                        env_steps=0, time=time.time())
            version[0] += 1

    sub = WeightsSubscriber(ctx, pub.endpoint)
    actor = Actor(cfg, 0, sub, _NullSink())
    deadline = time.time() + 10
    while actor.version < 0 and time.time() < deadline:   # the first version (slow joiner: re-publish)
        pub.serve_subscriptions()
        publish()
        actor._poll(100)
        actor._load_due()
    stop = threading.Event()

    def publisher():
        while not stop.wait(publish_every_ms / 1000):
            pub.serve_subscriptions()
            publish()

    thread = threading.Thread(target=publisher, daemon=True) if publish_every_ms > 0 else None
    if thread:
        thread.start()
    times = {"rollout": [], "step": []}
    loads = {"rollout": 0, "step": 0}
    try:
        col = actor.collector
        for _ in range(repeats):
            for mode in ("rollout", "step"):
                refresh = actor._refresh if mode == "step" else None
                t0 = time.perf_counter()
                before = actor.version
                for _ in range(rollouts):
                    actor._poll(0)
                    actor._load_due()               # the rollout boundary: both settings take weights here
                    out = col.collect(actor.version, should_stop=actor._between_steps, refresh=refresh)
                    assert out is not None
                times[mode].append(rollouts * num_envs * cfg.trainer.buffer_size / (time.perf_counter() - t0))
                loads[mode] += actor.version - before
    finally:
        stop.set()
        if thread:
            thread.join()
        actor.close()
        sub.close()
        pub.close()
        ctx.term()
    med = {m: statistics.median(v) for m, v in times.items()}
    return {"publish_every_ms": publish_every_ms, "sps_rollout": med["rollout"], "sps_step": med["step"],
            "ratio": med["step"] / med["rollout"], "versions_taken": loads, "all": times}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rollouts", type=int, default=20, help="rollouts per timed block (16 envs x 128 steps each)")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--publish-every-ms", default="0,50")
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args(argv)
    print(json.dumps(machine_info()))
    rows = [run(args.rollouts, args.repeats, float(x)) for x in args.publish_every_ms.split(",")]
    print("| new weights every | rollout: env steps/s | step: env steps/s | step / rollout | versions taken (rollout / step) |")
    print("|---:|---:|---:|---:|---|")
    for r in rows:
        every = "never" if r["publish_every_ms"] == 0 else f"{r['publish_every_ms']:.0f} ms"
        print(f"| {every} | {r['sps_rollout']:,.0f} | {r['sps_step']:,.0f} | {r['ratio']:.3f} | "
              f"{r['versions_taken']['rollout']} / {r['versions_taken']['step']} |")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
