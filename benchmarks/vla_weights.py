"""The large-model path of the action-token VLA, measured (issue 13): a ~0.5B-parameter
PaliGemma-class model (random initialisation: no hub here) behind ``ActionTokenPolicy``.

    .venv/bin/python benchmarks/vla_weights.py [--size 0.5b] [--lora-r 8] [--batch 1,4] [--actors 1,2]
                                               [--repeats 3] [--json out.json]

Reports, all measured in this run on this machine:
- load time: ``save_pretrained`` of the backbone (sharded safetensors + index), then
  ``load_pretrained`` of that directory (``from_pretrained``, local files only), against reading the
  same bytes with a plain ``torch`` copy (the memory-copy baseline);
- time per acting step (``action_dist`` + sample + ``value``) at each batch size, in float32 and
  bfloat16;
- bytes per weights message: what :func:`shared.policies.published_state` sends with LoRA against
  full fine-tuning (every parameter trains), and their ratio (issue 13: at most 2%);
- publish-to-use to 1 and 2 local actors, ZeroMQ against shared memory, for the LoRA message and the
  full model, as ratios to one in-process memory copy of the same bytes
  (``benchmarks/weights_broadcast.py`` does the timing).
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
for p in (ROOT, ROOT / "benchmarks"):
    if str(p) not in sys.path:
        sys.path.insert(0, str(p))

import torch  # noqa: E402
from tensordict import TensorDict  # noqa: E402

from _common import machine_info  # noqa: E402
from shared.config import LoRAConfig  # noqa: E402
from shared.policies import published_state  # noqa: E402
from shared.policies.action_tokens import PaliGemmaActionTokenPolicy  # noqa: E402
from shared.policies.vla import apply_lora, load_pretrained  # noqa: E402


def nbytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def obs(batch: int, image_size: int) -> TensorDict:
    g = torch.Generator().manual_seed(0)
    return TensorDict({"rgb": torch.randint(0, 256, (batch, image_size, image_size, 3), generator=g, dtype=torch.uint8),
                       "proprio": torch.randn(batch, 4, generator=g),
                       "instruction": torch.randint(0, 100, (batch, 8), generator=g)}, batch_size=[batch])


@torch.inference_mode()
def step_seconds(policy, batch: int, image_size: int, repeats: int) -> float:
    o = obs(batch, image_size)
    times = []
    for i in range(repeats + 1):
        t0 = time.perf_counter()
        dist = policy.action_dist(o)
        dist.sample()
        policy.value(o)
        if i:
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size", default="0.5b")
    p.add_argument("--lora-r", type=int, default=8)
    p.add_argument("--batch", default="1,4")
    p.add_argument("--actors", default="1,2")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--no-broadcast", action="store_true", help="skip the publish-to-use measurements")
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args()
    torch.set_num_threads(max(1, torch.get_num_threads()))
    out: dict = {"machine": machine_info(), "size": args.size}

    t0 = time.perf_counter()
    torch.manual_seed(0)
    policy = PaliGemmaActionTokenPolicy(size=args.size, action_dim=7, reserve_tail=64).eval()   # PaliGemma: <image> is id 257152
    out["build_s"] = time.perf_counter() - t0
    backbone = policy.model
    total_params = sum(p.numel() for p in policy.parameters())
    out["params_total"] = total_params
    image_size = backbone.config.vision_config.image_size
    print(f"[vla] {args.size}: {total_params / 1e6:.1f}M parameters, built in {out['build_s']:.1f} s", flush=True)

    tmp = Path(tempfile.mkdtemp(prefix="tandem-vla-"))
    try:
        t0 = time.perf_counter()
        backbone.save_pretrained(tmp, max_shard_size="400MB")
        out["save_s"] = time.perf_counter() - t0
        shards = sorted(tmp.glob("*.safetensors"))
        t0 = time.perf_counter()
        loaded = load_pretrained(str(tmp), "transformers.PaliGemmaForConditionalGeneration", {})
        out["load_s"] = time.perf_counter() - t0
        state = {k: v for k, v in loaded.state_dict().items()}
        copy = {k: torch.empty_like(v) for k, v in state.items()}
        t0 = time.perf_counter()
        for k, v in state.items():
            copy[k].copy_(v)
        out["memcpy_s"] = time.perf_counter() - t0
        del loaded, copy, state
        print(f"[vla] save_pretrained {out['save_s']:.1f} s ({len(shards)} shards); load_pretrained "
              f"{out['load_s']:.1f} s = {out['load_s'] / out['memcpy_s']:.1f}x one memory copy "
              f"({out['memcpy_s']:.2f} s)", flush=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)

    batches = [int(b) for b in args.batch.split(",")]
    out["step_s"] = {}
    for dtype in (torch.float32, torch.bfloat16):
        policy.to(dtype)
        for b in batches:
            s = step_seconds(policy, b, image_size, args.repeats)
            out["step_s"][f"{str(dtype).split('.')[-1]}_b{b}"] = s
            print(f"[vla] acting step, {dtype}, batch {b}: {s:.3f} s ({s / b:.3f} s per env)", flush=True)
    policy.to(torch.bfloat16)

    full_bytes = nbytes(published_state(policy).values())   # every parameter trains
    apply_lora(policy, LoRAConfig(r=args.lora_r, alpha=2.0 * args.lora_r, target_modules=["q_proj", "v_proj"]),
               "PaliGemmaActionTokenPolicy")
    lora_state = published_state(policy)
    lora_bytes = nbytes(lora_state.values())
    trainable = sum(p.numel() for p in policy.parameters() if p.requires_grad)
    out.update(full_message_bytes=full_bytes, lora_message_bytes=lora_bytes, params_trainable_lora=trainable,
               lora_share=lora_bytes / full_bytes)
    print(f"[vla] weights message: full fine-tuning {full_bytes / 2**20:.1f} MiB, LoRA r={args.lora_r} "
          f"{lora_bytes / 2**20:.2f} MiB ({len(lora_state)} tensors, {trainable / 1e6:.2f}M trainable of "
          f"{total_params / 1e6:.1f}M) = {100 * lora_bytes / full_bytes:.2f}% of full", flush=True)

    if not args.no_broadcast:
        import weights_broadcast as wb
        out["broadcast"] = []
        for label, n_bytes in (("lora", lora_bytes), ("full", full_bytes)):
            params = max(1, n_bytes // 2)        # weights_broadcast sends bf16 tensors: 2 bytes each
            memcpy = wb.memcpy_seconds(params, args.repeats)
            for n_actors in (int(a) for a in args.actors.split(",")):
                for transport in ("zmq", "shm"):
                    r = wb.run_one(params, n_actors, transport, args.repeats)
                    row = {"message": label, "bytes": n_bytes, "actors": n_actors, "transport": transport,
                           "publish_to_use_s": r["seconds"], "memcpy_s": memcpy, "ratio": memcpy / r["seconds"]}
                    out["broadcast"].append(row)
                    print(f"[vla] publish-to-use {label:4s} ({n_bytes / 2**20:8.2f} MiB) to {n_actors} actor(s) "
                          f"over {transport}: {r['seconds']:.4f} s = {memcpy / r['seconds']:.2f}x memcpy speed",
                          flush=True)
    if args.json:
        args.json.write_text(json.dumps(out, indent=2) + "\n")
    return 0 if out["lora_share"] <= 0.02 else 1


if __name__ == "__main__":
    sys.exit(main())
