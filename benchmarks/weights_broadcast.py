"""Publish-to-use time of large weights to N local actors: ZeroMQ (TCP loopback) against shared memory.

    .venv/bin/python benchmarks/weights_broadcast.py [--params 10M,100M,1B] [--actors 1,2,4]
                                                     [--transports zmq,shm] [--repeats 3] [--json out.json]

A "policy" of P bf16 parameters (tensors of at most 64M elements) is published by this process,
the learner's way: ``zmq`` -- the learner's ``WeightsPublisher`` (XPUB over TCP loopback, frames sent
without copying) with the tensors in the message; ``shm`` -- ``ShmWeightsWriter`` copies them once
into the shared-memory ring and the same XPUB socket carries only the control message. N actor
processes (``shared.transport.WeightsSubscriber``) receive each version and copy it into their own,
pre-allocated parameters (what ``load_weights_`` does); each then reports the wall time its copy
finished. Publish-to-use is the time from the start of ``publish`` to the last actor's report.

The baseline, measured in the same run on the same bytes: one in-process ``copy_`` of the P
parameters (memory-copy bandwidth). The ratio printed is (bytes / publish-to-use) / memcpy bandwidth:
1.0 would be weights in every actor as fast as one plain copy. Each configuration is timed
``--repeats`` times after two warm-up versions (first-touch page faults in both ring slots); the median is reported.
ZeroMQ at 1B parameters with 4 actors needs ~18 GB and is skipped unless ``--zmq-max-bytes`` allows.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import zmq  # noqa: E402
from tensordict import TensorDict  # noqa: E402

from _common import machine_info  # noqa: E402
from shared.shm_weights import ShmWeightsReader, ShmWeightsWriter, default_path  # noqa: E402
from shared.transport import WeightsPublisher, WeightsSubscriber  # noqa: E402

CHUNK = 64 * 2**20


def parse_count(s: str) -> int:
    s = s.strip().upper()
    mult = {"K": 10**3, "M": 10**6, "B": 10**9, "G": 10**9}.get(s[-1], 1)
    return int(float(s[:-1] if s[-1] in "KMBG" else s) * mult)


def make_weights(params: int, fill: float = 0.0) -> TensorDict:
    td, i, left = TensorDict({}, batch_size=[]), 0, params
    while left > 0:
        n = min(CHUNK, left)
        td.set(f"w{i:03d}", torch.full((n,), fill, dtype=torch.bfloat16))
        i, left = i + 1, left - n
    return td


def actor_main(params: int, weights_ep: str, results_ep: str, actor_id: int, ready) -> None:
    torch.set_num_threads(1)
    ctx = zmq.Context()
    sub = WeightsSubscriber(ctx, weights_ep)
    push = ctx.socket(zmq.PUSH)
    push.connect(results_ep)
    mine = make_weights(params)
    reader = ShmWeightsReader()
    ready.set()
    try:
        while True:
            msg = sub.newest(timeout_ms=200)
            if msg is None:
                continue
            td, meta = msg
            if meta.get("kind") == "stop":
                break
            version = meta["version"]
            if "shm" in meta:
                ok = reader.stream_into(mine, meta, version)
            else:
                mine.update_(td)
                ok = True
            push.send_json({"actor": actor_id, "version": version, "done": time.time(), "ok": ok})
    finally:
        reader.close()
        sub.close()
        push.close(linger=1000)
        ctx.term()


def memcpy_seconds(params: int, repeats: int) -> float:
    src, dst = make_weights(params, 1.0), make_weights(params)
    dst.update_(src)                                  # first touch
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for k, v in src.items():
            dst.get(k).copy_(v)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def run_one(params: int, n_actors: int, transport: str, repeats: int) -> dict:
    ctx = zmq.Context()
    pub = WeightsPublisher(ctx, "127.0.0.1", 0)
    results = ctx.socket(zmq.PULL)
    results_ep = f"tcp://127.0.0.1:{results.bind_to_random_port('tcp://127.0.0.1')}"
    weights = make_weights(params, 0.5)
    writer = ShmWeightsWriter(weights, default_path(f"bench{os.getpid()}"), slots=2) if transport == "shm" else None
    spawn = mp.get_context("spawn")
    events = [spawn.Event() for _ in range(n_actors)]
    procs = [spawn.Process(target=actor_main, args=(params, pub.endpoint, results_ep, i, events[i]), daemon=True)
             for i in range(n_actors)]
    for p in procs:
        p.start()
    times = []
    try:
        for e in events:
            if not e.wait(120):
                raise RuntimeError("an actor did not start within 120 s")
        deadline = time.monotonic() + 30
        while pub.subscribers_seen < n_actors and time.monotonic() < deadline:
            pub.serve_subscriptions()
            time.sleep(0.01)
        time.sleep(0.2)
        warmup = 2                                    # one version per ring slot: first-touch page faults
        for version in range(repeats + warmup):
            t0 = time.time()
            if writer is not None:   # the learner's way: announce, then write while actors copy
                pub.publish(TensorDict({}, batch_size=[]), kind="weights", version=version,
                            **writer.begin(version))
                writer.write_body(weights, version)
            else:
                pub.publish(weights, kind="weights", version=version)
            done = []
            while len(done) < n_actors:
                if not results.poll(300_000):
                    raise RuntimeError(f"no acknowledgement for version {version} within 300 s")
                r = results.recv_json()
                if r["version"] == version:
                    if not r["ok"]:
                        raise RuntimeError(f"actor {r['actor']}: torn read of version {version}")
                    done.append(r["done"])
            if version >= warmup:
                times.append(max(done) - t0)
            time.sleep(0.2)
        pub.send_control(kind="stop")
    finally:
        for p in procs:
            p.join(timeout=20)
            if p.is_alive():
                p.kill()
                p.join(5)
        if writer is not None:
            writer.close()
        pub.close()
        results.close(linger=0)
        ctx.term()
    return {"seconds": statistics.median(times), "all": times}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--params", default="10M,100M,1B")
    p.add_argument("--actors", default="1,2,4")
    p.add_argument("--transports", default="zmq,shm")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--zmq-max-bytes", type=float, default=12e9,
                   help="skip zmq when actors x 2 x bytes exceeds this (each actor holds the message and its copy)")
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args()
    torch.set_num_threads(1)
    print(machine_info())
    rows = []
    for params in [parse_count(x) for x in args.params.split(",")]:
        nbytes = params * 2
        base = memcpy_seconds(params, args.repeats)
        bw = nbytes / base
        print(f"\n{params / 1e6:,.0f}M bf16 parameters = {nbytes / 2**30:.2f} GiB; memcpy {base * 1e3:.1f} ms "
              f"({bw / 2**30:.2f} GiB/s)")
        print(f"{'transport':>9} {'actors':>6} {'publish-to-use':>15} {'GiB/s per actor':>16} {'vs memcpy':>9}")
        for transport in args.transports.split(","):
            for n in [int(x) for x in args.actors.split(",")]:
                if transport == "zmq" and n * 2 * nbytes > args.zmq_max_bytes:
                    print(f"{transport:>9} {n:>6} {'skipped (memory)':>15}")
                    continue
                r = run_one(params, n, transport, args.repeats)
                rate = nbytes / r["seconds"]
                row = {"params": params, "bytes": nbytes, "transport": transport, "actors": n,
                       "publish_to_use_s": r["seconds"], "runs_s": r["all"], "memcpy_s": base,
                       "ratio_vs_memcpy": rate / bw}
                rows.append(row)
                print(f"{transport:>9} {n:>6} {r['seconds'] * 1e3:>12.1f} ms {rate / 2**30:>16.2f} "
                      f"{rate / bw:>9.2f}", flush=True)
    if args.json:
        args.json.write_text(json.dumps({"machine": machine_info(), "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
