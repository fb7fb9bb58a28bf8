"""The large-model path of the action-token VLA, measured: a ~0.5B-parameter
PaliGemma-class model (random initialisation: no hub here) behind ``ActionTokenPolicy``.

    .venv/bin/python benchmarks/vla_weights.py [--size 0.5b] [--lora-r 8] [--batch 1,4] [--actors 1,2]
                                               [--repeats 3] [--devices cpu[,cuda:0]] [--cpu-batch 1]
                                               [--train-batch 8] [--json out.json]

Reports, all measured in this run on this machine:
- load time: ``save_pretrained`` of the backbone (sharded safetensors + index), then
  ``load_pretrained`` of that directory (``from_pretrained``, local files only), against reading the
  same bytes with a plain ``torch`` copy (the memory-copy baseline);
- time per acting step (``action_dist`` + sample + ``value``) at each batch size, in float32 and
  bfloat16 (bfloat16 weights), and on CUDA also float32 weights under bfloat16 ``autocast``
  (``vla_config.autocast``), on each device of ``--devices``; on CUDA with the peak memory;
- on CUDA, and on the CPU where ``--train-batch`` is given with ``cpu`` in ``--devices``, one LoRA
  training step (the action's log-prob and the value, backward, an AdamW step on what trains) under
  bfloat16 autocast: time and peak memory;
- bytes per weights message: what :func:`shared.policies.published_state` sends with LoRA against
  full fine-tuning (every parameter trains), and their ratio (the target: at most 2%);
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


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def reset_peak(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)


def peak_gib(device: torch.device) -> float | None:
    return torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None


def autocast_ctx(device: torch.device, on: bool):
    return torch.autocast(device.type, dtype=torch.bfloat16, enabled=on)


def median_seconds(fn, device: torch.device, repeats: int) -> float:
    """Median wall time of `fn()` over `repeats` calls after one warm-up, the device synchronised."""
    times = []
    for i in range(repeats + 1):
        sync(device)
        t0 = time.perf_counter()
        fn()
        sync(device)
        if i:
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


@torch.inference_mode()
def step_seconds(policy, batch: int, image_size: int, repeats: int, device: torch.device = torch.device("cpu"),
                 autocast: bool = False) -> float:
    o = obs(batch, image_size).to(device)

    def act():
        with autocast_ctx(device, autocast):
            policy.action_dist(o).sample()
            policy.value(o)
    return median_seconds(act, device, repeats)


def train_step_seconds(policy, batch: int, image_size: int, repeats: int, device: torch.device) -> float:
    """One learner step on what trains: log-prob of given actions + value, backward, AdamW, under bf16 autocast."""
    o = obs(batch, image_size).to(device)
    opt = torch.optim.AdamW([p for p in policy.parameters() if p.requires_grad], lr=1e-5)
    with torch.no_grad(), autocast_ctx(device, True):
        actions = policy.action_dist(o).sample()

    def step():
        with autocast_ctx(device, True):
            loss = -policy.action_dist(o).log_prob(actions).float().mean() + policy.value(o).float().pow(2).mean()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
    seconds = median_seconds(step, device, repeats)
    opt.zero_grad(set_to_none=True)
    return seconds


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size", default="0.5b")
    p.add_argument("--lora-r", type=int, default=8)
    p.add_argument("--batch", default="1,4")
    p.add_argument("--actors", default="1,2")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--no-broadcast", action="store_true", help="skip the publish-to-use measurements")
    p.add_argument("--devices", default="cpu", help="comma-separated: where acting steps are timed (cpu, cuda:0)")
    p.add_argument("--cpu-batch", default=None, help="batch sizes on the CPU (default: --batch)")
    p.add_argument("--train-batch", type=int, default=None,
                   help="batch of the LoRA training step (default: 8 on CUDA, not timed on the CPU)")
    p.add_argument("--json", type=Path, default=None)
    return p


def _build(args, out: dict) -> tuple[PaliGemmaActionTokenPolicy, int, int]:
    """The --size policy, seeded; returns it, its image size and its parameter count."""
    t0 = time.perf_counter()
    torch.manual_seed(0)
    # PaliGemma: <image> is id 257152, so the bin block ends 64 ids before the vocabulary does (tiny: 255, below it)
    policy = PaliGemmaActionTokenPolicy(size=args.size, action_dim=7, reserve_tail=0 if args.size == "tiny" else 64).eval()
    out["build_s"] = time.perf_counter() - t0
    backbone = policy.model
    total_params = sum(p.numel() for p in policy.parameters())
    out["params_total"] = total_params
    image_size = backbone.config.vision_config.image_size
    print(f"[vla] {args.size}: {total_params / 1e6:.1f}M parameters, built in {out['build_s']:.1f} s", flush=True)
    return policy, image_size, total_params


def _time_save_and_load(backbone, out: dict) -> None:
    """save_pretrained and load_pretrained of the backbone, against one memory copy of its weights."""
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


def _time_acting(policy, devices: list[torch.device], args, image_size: int, out: dict) -> None:
    """An acting step on every device, dtype (and autocast on CUDA) and batch size."""
    out["step_s"], out["peak_gib"] = {}, {}
    for d in devices:
        batches = [int(b) for b in ((args.cpu_batch or args.batch) if d.type == "cpu" else args.batch).split(",")]
        modes = [(torch.float32, False), (torch.bfloat16, False)] + ([(torch.float32, True)] if d.type == "cuda" else [])
        for dtype, autocast in modes:
            policy.to(device=d, dtype=dtype)
            for b in batches:
                reset_peak(d)
                s = step_seconds(policy, b, image_size, args.repeats, d, autocast)
                name = "autocast" if autocast else str(dtype).split('.')[-1]
                key = f"{name}_b{b}" if d.type == "cpu" else f"{d}_{name}_b{b}"   # CPU keys as before
                out["step_s"][key] = s
                mem = peak_gib(d)
                if mem is not None:
                    out["peak_gib"][key] = mem
                print(f"[vla] acting step on {d}, {name}, batch {b}: {s:.4f} s ({s / b:.4f} s per env)"
                      + (f", peak {mem:.2f} GiB" if mem is not None else ""), flush=True)


def _lora_message(policy, args, total_params: int, out: dict) -> tuple[int, int]:
    """LoRA applied to `policy`: the bytes of a weights message with full fine-tuning and with LoRA."""
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
    return full_bytes, lora_bytes


def _time_training(policy, devices: list[torch.device], args, image_size: int, out: dict) -> None:
    """A LoRA training step on every device (on the CPU only with --train-batch)."""
    out["train_step_s"] = {}
    for d in devices:
        if d.type == "cpu" and args.train_batch is None:
            continue
        b = args.train_batch or 8
        policy.to(device=d, dtype=torch.float32)
        reset_peak(d)
        s = train_step_seconds(policy, b, image_size, args.repeats, d)
        mem = peak_gib(d)
        out["train_step_s"][f"{d}_b{b}"] = s
        if mem is not None:
            out["peak_gib"][f"{d}_train_b{b}"] = mem
        print(f"[vla] LoRA training step on {d} (float32 weights, bf16 autocast), batch {b}: {s:.4f} s"
              + (f", peak {mem:.2f} GiB" if mem is not None else ""), flush=True)


def _time_broadcast(args, lora_bytes: int, full_bytes: int, out: dict) -> None:
    """Publish-to-use of a LoRA and a full weights message, to each number of actors, over each transport."""
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


def main() -> int:
    p = _parser()
    args = p.parse_args()
    torch.set_num_threads(max(1, torch.get_num_threads()))
    out: dict = {"machine": machine_info(), "size": args.size}
    policy, image_size, total_params = _build(args, out)
    _time_save_and_load(policy.model, out)
    devices = [torch.device(d) for d in args.devices.split(",")]
    for d in devices:
        if d.type == "cuda" and not torch.cuda.is_available():
            p.error(f"--devices names {d} but torch.cuda.is_available() is False")
    out["devices"] = {str(d): (torch.cuda.get_device_name(d) if d.type == "cuda" else "cpu") for d in devices}
    _time_acting(policy, devices, args, image_size, out)
    policy.to(device="cpu", dtype=torch.bfloat16)
    if any(d.type == "cuda" for d in devices):
        torch.cuda.empty_cache()
    full_bytes, lora_bytes = _lora_message(policy, args, total_params, out)
    _time_training(policy, devices, args, image_size, out)
    policy.to(device="cpu", dtype=torch.bfloat16)
    if not args.no_broadcast:
        _time_broadcast(args, lora_bytes, full_bytes, out)
    if args.json:
        args.json.write_text(json.dumps(out, indent=2) + "\n")
    return 0 if out["lora_share"] <= 0.02 else 1


if __name__ == "__main__":
    sys.exit(main())
