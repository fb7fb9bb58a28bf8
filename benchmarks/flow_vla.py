"""π0 against the action-token VLA: what acting and learning cost per call, per env step and per update.

    .venv/bin/python benchmarks/flow_vla.py                       # tiny models, CPU: docs/results/flow_vla_cpu.json
    .venv/bin/python benchmarks/flow_vla.py --quick --json /tmp/q.json   # a smoke run: a few seconds
    python benchmarks/flow_vla.py --gpu                            # full π0 shape, cuda:0: flow_vla_<gpu>.json

Two policies act on the same observations, a batch of ``tandem/Reach-v0`` resets (rgb 16x16, proprio,
instruction ids), and train on rows made from them:

- **pi0**: :class:`~shared.policies.flow_policy.FlowVLAPolicy` around transformers'
  ``PI0ForConditionalGeneration`` (a PaliGemma VLM and a Gemma action expert), Flow-Noise by default.
  A call encodes the prefix once and runs K expert passes that denoise a chunk of H actions.
- **tokens**: :class:`~shared.policies.action_tokens.ActionTokenPolicy` around a
  ``PaliGemmaForConditionalGeneration`` built from the π0 model's own VLM config (the same vision tower
  and language model), behind :class:`~shared.policies.vla.VLAPolicy`. A call decodes H x action_dim
  action tokens in one parallel pass (OpenVLA-OFT style); K does not apply to it.

Shapes (``--shape``): ``tiny`` is ``paligemma_config("tiny")`` as the VLM (2 layers, 16 image tokens)
with a 2-layer expert half its width, random weights; ``full`` is ``PI0Config``'s defaults (a PaliGemma
2B-class VLM, SigLIP at 224, and a 300M-class expert; chunk H, 32 action and state dims), random weights.
Both policies get LoRA (``--lora-r``, on q_proj and v_proj): π0 on its expert (``flow_config.lora_scope``),
the token policy on its backbone, as each is fine-tuned; the heads train in full.

For every H in ``--hs`` (and every K in ``--ks`` for π0) it measures, and prints as it goes:

- **acting**, ms per call at each batch of ``--batches``, and per env step (per call / actions per call;
  the actor executes the whole chunk, so actions per call = H), along each path of ``--paths``:
  ``forward`` (the policy's forward pass under inference mode on its device, inputs already there, the
  device synchronised) and ``server`` (one inference server, ``actors/inference_server.py``, on a thread
  of this process with a real ROUTER socket on loopback TCP, as ``tests/test_inference_server.py`` runs
  it; the time is the actor's round trip: encode, send, the server's batch and forward pass, the reply with
  the action chunk, log-probs, value and π0's chain, decode);
- **the learner's update** (see ``UPDATE``), seconds per update, and per env step it trains on;
- π0 against the token policy at the same H, batch and path (``x_tokens_*``: π0's time over the token
  policy's); and on CUDA the peak memory (``torch.cuda.max_memory_allocated``) while acting and while
  updating.

Each time is the median of ``--repeats`` calls (``--update-repeats`` updates) after ``--warmup`` calls
(one update) left out; ``torch.set_num_threads(--threads)`` is fixed and printed. ``--json FILE`` writes
the result file that ``benchmarks/results.py`` renders (date, machine, command, commit, one record per
policy, path, K and H); into ``docs/results/`` it rebuilds the pages there, elsewhere it writes the page
beside the file. Presets: the default (tiny, CPU, the full grid), ``--quick`` (K 1,4 x H 1,5, batches 1
and 8, two repeats: a smoke test) and ``--gpu`` (the full shape on cuda:0 in bfloat16, H = 50); an
explicit option wins over its preset.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import re
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from _common import ROOT  # also puts the repository on sys.path

import torch  # noqa: E402
from tensordict import TensorDict  # noqa: E402

from shared import keys  # noqa: E402
from shared.chunks import chunk_size, executed_sum  # noqa: E402
from shared.config import FlowConfig, LoRAConfig, PPOConfig, VLAConfig  # noqa: E402

ENV = "tandem/Reach-v0"
ACTION_DIM = 2                      # Reach's actions
TAG = "[flow_vla]"
RESULTS_DIR = ROOT / "docs" / "results"
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
# The tiny expert: half the tiny VLM's width, the same depth and attention layout (joint attention
# needs the VLM's layer count, KV heads and head size).
TINY_EXPERT = {"model_type": "gemma", "hidden_size": 16, "num_hidden_layers": 2, "intermediate_size": 32,
               "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 16}
PRESETS = {
    "cpu": dict(shape="tiny", device="cpu", dtype="float32", ks="1,4,10", hs="1,5,50", batches="1,8,32",
                paths="forward,server", repeats=20, warmup=2, update_repeats=5, rows=64, minibatches=4),
    "quick": dict(shape="tiny", device="cpu", dtype="float32", ks="1,4", hs="1,5", batches="1,8",
                  paths="forward,server", repeats=2, warmup=1, update_repeats=1, rows=8, minibatches=2),
    "gpu": dict(shape="full", device="cuda:0", dtype="bfloat16", ks="1,4,10", hs="50", batches="1,8,32",
                paths="forward,server", repeats=5, warmup=2, update_repeats=3, rows=32, minibatches=4),
}
UPDATE = ("one call of the learner's ppo_update (learner/ppo.py) with n_epochs 1: {rows} rows (one per "
          "policy call, its whole chunk of H actions executed) in {minibatches} shuffled minibatches of "
          "{per} rows; per minibatch, evaluate_actions with gradients (π0: the VLM once over the "
          "prefix, then the expert at the stored chain states: K passes under Flow-Noise, one under "
          "Flow-SDE; tokens: one pass over the prompt and the H x action_dim action tokens), the clipped "
          "policy loss plus the value loss, backward, gradient-norm clipping at 0.5 and an Adam step on "
          "the trainable tensors (LoRA adapters and heads)")


def update_text(args) -> str:
    """What one update is, with this run's rows and minibatches."""
    return UPDATE.format(rows=args.rows, minibatches=args.minibatches, per=args.rows // args.minibatches)


# ----------------------------------------------------------------------------- the two policies

def pi0_config(shape: str, chunk: int):
    """``PI0Config`` of `shape` with chunks of `chunk` actions."""
    from transformers import PI0Config
    from shared.policies.action_tokens import paligemma_config

    if shape == "full":
        return PI0Config(chunk_size=chunk)
    return PI0Config(vlm_config=paligemma_config("tiny").to_dict(), dit_config=dict(TINY_EXPERT),
                     chunk_size=chunk, max_state_dim=8, max_action_dim=8)


def lora(args) -> LoRAConfig:
    return LoRAConfig(r=args.lora_r, alpha=2.0 * args.lora_r)


def build_pi0(args, chunk: int, device: torch.device):
    """π0 at random (seeded), with LoRA on the expert, as a Flow-Noise (or ``--method``) policy."""
    from transformers import PI0ForConditionalGeneration
    from shared.policies.flow_policy import FlowVLAPolicy

    torch.manual_seed(args.seed)
    cfg = FlowConfig(num_steps=args.ks[0], dtype=args.dtype, lora=lora(args), lora_scope=args.lora_scope)
    with torch.device(device):
        model = PI0ForConditionalGeneration._from_config(pi0_config(args.shape, chunk), dtype=DTYPES[args.dtype])
        policy = FlowVLAPolicy(model.eval(), cfg, ACTION_DIM, method=args.method)
    return policy.to(device).eval()


def build_tokens(args, chunk: int, device: torch.device):
    """The action-token policy on the π0 model's VLM (seeded, random), with LoRA on its backbone."""
    from transformers import PaliGemmaForConditionalGeneration
    from shared.policies.action_tokens import ActionTokenPolicy
    from shared.policies.vla import VLAPolicy

    torch.manual_seed(args.seed)
    vlm = pi0_config(args.shape, chunk).vlm_config
    with torch.device(device):
        backbone = PaliGemmaForConditionalGeneration._from_config(vlm, dtype=DTYPES[args.dtype])
        model = ActionTokenPolicy(backbone, ACTION_DIM, chunk_size=chunk)
        policy = VLAPolicy(model, VLAConfig(model_class="ActionTokenPolicy", dtype=args.dtype, lora=lora(args)))
    return policy.to(device).eval()


def with_steps(policy, k: int):
    """π0 with K = `k` denoising steps: FlowVLAPolicy reads ``num_steps`` at every call (acting, the chain
    it stores, the learner's recompute), so every K runs the same model and weights."""
    policy.num_steps = k
    return policy


def param_counts(policy) -> tuple[int, int]:
    """(parameters, trainable parameters), each tensor once."""
    params = {id(p): p for p in policy.parameters()}.values()
    return sum(p.numel() for p in params), sum(p.numel() for p in params if p.requires_grad)


def release(device: torch.device) -> None:
    """Give back the memory of a policy the caller has dropped, before the next one is built."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


# ----------------------------------------------------------------------------- inputs and clocks

def reach_observations(n: int, seed: int) -> TensorDict:
    """The observations of `n` Reach envs after a seeded reset (on the CPU), the inputs of every call."""
    from shared.envs import make_env

    env = make_env(ENV, n)
    try:
        return env.reset(seed=seed)
    finally:
        env.close()


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def reset_peak(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)


def peak_mib(device: torch.device) -> float | None:
    return round(torch.cuda.max_memory_allocated(device) / 2**20, 1) if device.type == "cuda" else None


def median_ms(fn, device: torch.device, warmup: int, repeats: int) -> float:
    """Median wall milliseconds of `fn()` over `repeats` calls after `warmup` calls, the device synchronised."""
    times = []
    for i in range(warmup + repeats):
        sync(device)
        t0 = time.perf_counter()
        fn()
        sync(device)
        if i >= warmup:
            times.append(time.perf_counter() - t0)
    return 1000.0 * statistics.median(times)


class OneVersion:
    """The learner's weights socket as the server sees it, holding one version (0) of `policy`'s published state."""

    def __init__(self, policy):
        from shared.policies import weights_td
        self.msg = (weights_td(policy).clone(), {"kind": "weights", "version": 0, "incarnation": "benchmark"})

    def newest(self, timeout_ms: int = 0):
        msg, self.msg = self.msg, None
        return msg


class Served:
    """One inference server for `policy` on a thread of this process (a real ROUTER socket on loopback
    TCP), and the RemotePolicy an actor of up to `max_batch` envs acts through."""

    def __init__(self, policy, max_batch: int, device: torch.device, run_dir: Path):
        import zmq
        from actors.inference import bind_router
        from actors.inference_server import InferenceServer
        from actors.inference_topology import endpoint_path, layout_json, write_endpoint
        from actors.remote_policy import RemotePolicy
        from actors.weights_loader import WeightsLoader
        from shared.config import config_from_dict
        from shared.envs import env_spec
        from shared.policies import has_critic

        cfg = config_from_dict({"env": {"id": ENV}, "trainer": {"buffer_type": "async", "buffer_size": 8},
                                "algorithm": {"name": "ppo", "cfg": {"batch_size": 8}},
                                "actors": {"num_actors": 1, "num_envs": max_batch, "inference": "server",
                                           "server_max_wait_ms": 0.0}}, source="benchmarks/flow_vla.py")
        self.loader = WeightsLoader(policy, device, cfg.actors, "one process", "inference server 0")
        self.ctx = zmq.Context()
        path = endpoint_path(run_dir, 0)
        self.sock, endpoint = bind_router(self.ctx, "127.0.0.1", path)
        self.stop = threading.Event()
        self.server = InferenceServer(cfg, 0, policy, self.loader, OneVersion(policy), self.sock, env_spec(ENV),
                                      self.stop)
        write_endpoint(path, endpoint, has_critic(policy), self.loader.base_digest, None, layout_json(policy))
        self.thread = threading.Thread(target=self.server.run, name="inference-server", daemon=True)
        self.thread.start()
        self.remote = RemotePolicy.connect(self.ctx, path, 0, timeout_s=120.0)

    def __call__(self, obs: TensorDict) -> TensorDict:
        return self.remote(TensorDict({keys.OBS: obs}, batch_size=obs.batch_size))

    def close(self) -> None:
        self.stop.set()
        self.thread.join(timeout=30)
        self.remote.close()
        self.sock.close(linger=0)
        self.loader.close()
        self.ctx.term()
        if self.thread.is_alive():
            raise RuntimeError("the inference server's thread did not stop")


# ----------------------------------------------------------------------------- what is measured

def acting_ms(policy, path: str, obs: TensorDict, args, device: torch.device) -> dict[int, float]:
    """Median ms per call at each batch of ``args.batches`` along `path` ("forward" or "server")."""
    if path == "forward":
        def call(b: int):
            inputs = obs[:b].to(device)
            return lambda: policy(TensorDict({keys.OBS: inputs}, batch_size=[b]))
        with torch.inference_mode():
            return {b: median_ms(call(b), device, args.warmup, args.repeats) for b in args.batches}
    with tempfile.TemporaryDirectory(prefix="tandem-flow-vla-") as run_dir:
        served = Served(policy, max(args.batches), device, Path(run_dir))
        try:
            return {b: median_ms(lambda b=b: served(obs[:b]), device, args.warmup, args.repeats)
                    for b in args.batches}
        finally:
            served.close()


def update_batch(policy, obs: TensorDict, rows: int, device: torch.device, seed: int) -> TensorDict:
    """`rows` rows as the learner receives them: the policy's own calls on the observations (whole
    chunks executed, log-probs summed over them), with random advantages and value targets."""
    with torch.no_grad():
        batch = policy(TensorDict({keys.OBS: obs[:rows].to(device)}, batch_size=[rows]))
    executed = torch.full((rows,), chunk_size(policy), dtype=torch.int64, device=device)
    if batch[keys.LOG_PROB].dim() > 1:    # per chunk position: the row's is the executed positions' sum
        batch[keys.LOG_PROB] = executed_sum(batch[keys.LOG_PROB], executed)
    g = torch.Generator().manual_seed(seed)
    batch[keys.EXECUTED] = executed
    batch[keys.ADVANTAGE] = torch.randn(rows, generator=g).to(device)
    batch[keys.VALUE_TARGET] = torch.randn(rows, generator=g).to(device)
    return batch


def update_seconds(policy, obs: TensorDict, args, device: torch.device) -> float:
    """Median seconds of one update (``UPDATE``) after one left out."""
    from learner.ppo import ppo_update

    batch = update_batch(policy, obs, args.rows, device, args.seed)
    cfg = PPOConfig(n_epochs=1, batch_size=args.rows // args.minibatches, learning_rate=1e-5, max_grad_norm=0.5)
    optimizer = torch.optim.Adam([p for p in policy.parameters() if p.requires_grad], lr=cfg.learning_rate)
    generator = torch.Generator().manual_seed(args.seed)
    policy.train()
    try:
        return median_ms(lambda: ppo_update(policy, optimizer, batch, cfg, generator), device, 1,
                         args.update_repeats) / 1000.0
    finally:
        policy.eval()
        optimizer.zero_grad(set_to_none=True)


def measure(policy, name: str, k: int | None, h: int, obs: TensorDict, args, device: torch.device,
            against: dict[str, dict] | None = None) -> dict[str, dict]:
    """One record per path for `policy` (K = `k`, chunks of `h`), printed as it is measured; the update
    goes in the first path's record. `against`: the token policy's records at this H, for the ratios."""
    params, trainable = param_counts(policy)
    out = {}
    for path in args.paths:
        rec = {"policy": name, "path": path, "K": k, "H": h, "actions_per_call": h, "params": params,
               "trainable": trainable}
        reset_peak(device)
        for b, ms in acting_ms(policy, path, obs, args, device).items():
            rec[f"call_ms_b{b}"], rec[f"step_ms_b{b}"] = round(ms, 3), round(ms / h, 4)
        rec["act_peak_mib"] = peak_mib(device)
        first = path == args.paths[0]
        reset_peak(device)
        update_s = update_seconds(policy, obs, args, device) if first else None
        rec["update_s"] = round(update_s, 5) if first else None
        rec["update_ms_per_env_step"] = round(1000 * update_s / (args.rows * h), 4) if first else None
        rec["update_peak_mib"] = peak_mib(device) if first else None
        base = (against or {}).get(path)
        for b in args.batches:
            rec[f"x_tokens_b{b}"] = round(rec[f"call_ms_b{b}"] / base[f"call_ms_b{b}"], 3) if base else None
        rec["x_tokens_update"] = (round(rec["update_s"] / base["update_s"], 3)
                                  if base and first and base["update_s"] else None)
        print(row_text(rec, args.batches, device), flush=True)
        out[path] = rec
    return out


def run(args, device: torch.device) -> list[dict]:
    """Every (H, policy, K, path) record, the token policy first at each H (π0's ratios need it)."""
    obs = reach_observations(max([*args.batches, args.rows]), args.seed)
    print(header_text(args.batches, device), flush=True)
    records = []
    for h in args.hs:
        tokens = build_tokens(args, h, device)
        announce(tokens, "tokens", h, args)
        base = measure(tokens, "tokens", None, h, obs, args, device)
        records += base.values()
        del tokens
        release(device)
        pi0 = build_pi0(args, h, device)
        announce(pi0, "pi0", h, args)
        for k in args.ks:
            records += measure(with_steps(pi0, k), "pi0", k, h, obs, args, device, against=base).values()
        del pi0
        release(device)
    return records


# ----------------------------------------------------------------------------- output

def table_columns(batches: list[int], device: torch.device) -> list[tuple[str, str, str]]:
    """The printed table's (label, record key, format) cells."""
    cells = [("policy", "policy", "<6"), ("path", "path", "<7"), ("K", "K", ">3"), ("H", "H", ">3")]
    cells += [(f"call b{b}", f"call_ms_b{b}", ">9.2f") for b in batches]
    cells += [(f"step b{b}", f"step_ms_b{b}", ">9.3f") for b in batches]
    cells += [("s/update", "update_s", ">9.4f"), ("upd/step", "update_ms_per_env_step", ">9.4f")]
    cells += [(f"x b{b}", f"x_tokens_b{b}", ">7.2f") for b in batches] + [("x update", "x_tokens_update", ">8.2f")]
    if device.type == "cuda":
        cells += [("MiB act", "act_peak_mib", ">8.0f"), ("MiB upd", "update_peak_mib", ">8.0f")]
    return cells


def header_text(batches: list[int], device: torch.device) -> str:
    legend = (f"{TAG} call: ms per call; step: ms per env step (call / actions per call); s/update; upd/step: "
              f"update ms per env step; x: pi0 over tokens at the same H, batch and path"
              + ("; MiB: peak allocated, acting and update" if device.type == "cuda" else ""))
    cells = table_columns(batches, device)
    return legend + "\n" + TAG + " " + " ".join(f"{label:{fmt.split('.')[0]}}" for label, _, fmt in cells)


def row_text(rec: dict, batches: list[int], device: torch.device) -> str:
    def cell(value, fmt: str) -> str:
        width = fmt.split(".")[0]
        if value is None:
            return f"{'-':{width}}"
        return f"{value:{fmt}}" if isinstance(value, float) else f"{value:{width}}"
    return TAG + " " + " ".join(cell(rec[key], fmt) for _, key, fmt in table_columns(batches, device))


def announce(policy, name: str, h: int, args) -> None:
    params, trainable = param_counts(policy)
    what = (f"LoRA on the {args.lora_scope.replace('_', ' ')}'s q_proj and v_proj, {heads(args)}" if name == "pi0"
            else "LoRA on the backbone's q_proj and v_proj, the value head")
    print(f"{TAG} {name} (H = {h}, {args.shape}, {args.dtype}): {params:,} parameters, {trainable:,} trainable "
          f"({what}, r = {args.lora_r})", flush=True)


def heads(args) -> str:
    """π0's own heads, which train in full: Flow-SDE has no noise head."""
    return "the noise and value heads" if args.method == "noise" else "the value head"


def machine_text(device: torch.device) -> str:
    import peft
    import transformers

    versions = (f"Python {platform.python_version()}, torch {torch.__version__}, transformers "
                f"{transformers.__version__}, peft {peft.__version__}")
    cores = os.cpu_count()
    if device.type == "cuda":
        p = torch.cuda.get_device_properties(device)
        return f"{p.name}, {cores} CPU cores ({p.total_memory // 2**20:,} MiB; {versions})"
    cpu = next((line.split(":", 1)[1].strip() for line in _read("/proc/cpuinfo").splitlines()
                if line.startswith("model name")), platform.machine())
    return f"{cores}-core CPU, no GPU ({cpu}; {versions})"


def _read(path: str) -> str:
    try:
        return Path(path).read_text()
    except OSError:
        return ""


def commit_text() -> str:
    """The checkout's commit, and whether the code measured differs from it."""
    def git(*a):
        return subprocess.run(["git", *a], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    head = git("rev-parse", "--short", "HEAD") or "unknown"
    changed = git("status", "--porcelain", "--", "benchmarks/flow_vla.py", "shared", "actors", "learner")
    return f"{head} (with uncommitted changes)" if changed else head


def gpu_tag(device: torch.device) -> str:
    """``h200`` from "NVIDIA H200": the first word of the device's name with a digit in it."""
    words = torch.cuda.get_device_name(device).split()
    word = next((w for w in words if re.search(r"\d", w)), words[-1])
    return re.sub(r"[^a-z0-9]", "", word.lower())


def columns(batches: list[int], device: torch.device) -> list[dict]:
    cols = [{"key": f"call_ms_b{b}", "label": f"ms per call, batch {b}", "fmt": ".2f"} for b in batches]
    cols += [{"key": f"step_ms_b{b}", "label": f"ms per env step, batch {b}", "fmt": ".3f"} for b in batches]
    cols += [{"key": "update_s", "label": "s per update", "fmt": ".4f"},
             {"key": "update_ms_per_env_step", "label": "update ms per env step", "fmt": ".4f"}]
    cols += [{"key": f"x_tokens_b{b}", "label": f"x tokens, batch {b}", "fmt": ".2f"} for b in batches]
    cols += [{"key": "x_tokens_update", "label": "x tokens, update", "fmt": ".2f"}]
    if device.type == "cuda":
        cols += [{"key": "act_peak_mib", "label": "peak MiB, acting", "fmt": ".0f"},
                 {"key": "update_peak_mib", "label": "peak MiB, update", "fmt": ".0f"}]
    return [{**c, "agg": "first"} for c in cols]


def notes(records: list[dict], args, load: tuple[float, float]) -> list[str]:
    counts = {}
    for r in records:
        counts.setdefault(r["policy"], (r["params"], r["trainable"]))
    shape = ("PI0Config's defaults (a PaliGemma 2B-class VLM with SigLIP at 224 and a 300M-class Gemma expert)"
             if args.shape == "full" else "a tiny PaliGemma (2 layers, 16 image tokens) and a 2-layer expert")
    return [
        f"pi0: FlowVLAPolicy ({'Flow-Noise' if args.method == 'noise' else 'Flow-SDE'}) on transformers' "
        f"PI0ForConditionalGeneration, {shape}, random weights, {args.dtype}: {counts['pi0'][0]:,} parameters, "
        f"{counts['pi0'][1]:,} trainable (LoRA r = {args.lora_r} on q_proj and v_proj of the "
        f"{args.lora_scope.replace('_', ' ')}; {heads(args)}). K: denoising steps per call.",
        f"tokens: ActionTokenPolicy on a PaliGemmaForConditionalGeneration built from the same VLM config, "
        f"H x {ACTION_DIM} action tokens decoded in one parallel pass: {counts['tokens'][0]:,} parameters, "
        f"{counts['tokens'][1]:,} trainable (LoRA r = {args.lora_r} on q_proj and v_proj of the backbone; value "
        f"head). K does not apply to it (its K cell is empty).",
        f"Inputs: the same {ENV} observations for both (a seeded reset of {max([*args.batches, args.rows])} "
        f"envs; rgb 16x16, resized to the vision tower's size where it differs).",
        "Acting, forward: the policy's forward pass under inference mode on its device, inputs already there, "
        "the device synchronised. server: one inference server (actors/inference_server.py) on a thread of the "
        "benchmark's process, through its RemotePolicy over ZeroMQ on loopback TCP: the actor's round trip. "
        "ms per env step = ms per call / actions per call (H: the whole chunk is executed).",
        f"Update: {update_text(args)}. update ms per env step: per update / (rows x H). It is measured once "
        "per policy, K and H, in the first path's row.",
        "x tokens: pi0's time over the token policy's at the same H, batch and path (the update: the same rows).",
        f"Medians of {args.repeats} calls after {args.warmup} left out ({args.update_repeats} updates after 1); "
        f"torch threads {args.threads}; load average {load[0]:.2f} at the start, {load[1]:.2f} at the end.",
    ]


def results_doc(records: list[dict], args, device: torch.device, load: tuple[float, float], argv) -> dict:
    where = "on the CPU" if device.type == "cpu" else f"on an {torch.cuda.get_device_name(device)}"
    return {
        "title": f"π0 against the action-token VLA, {args.shape} models {where}",
        "question": "What does a flow-matching π0 cost against an action-token VLA on the same inputs: acting "
                    "time per call and per env step at several batches, and the learner's time per PPO update, "
                    "for K denoising steps and chunks of H actions?",
        "date": time.strftime("%Y-%m-%d", time.gmtime()),
        "machine": machine_text(device),
        "command": " ".join(["python", "benchmarks/flow_vla.py", *argv]),
        "commit": commit_text(),
        "records": records,
        "group_by": ["policy", "path", "K", "H"],
        "columns": columns(args.batches, device),
        "notes": notes(records, args, load),
        "settings": {k: getattr(args, k) for k in ("shape", "device", "dtype", "method", "lora_r", "lora_scope",
                                                   "ks", "hs", "batches", "paths", "repeats", "warmup",
                                                   "update_repeats", "rows", "minibatches", "threads", "seed")},
        "update": update_text(args),
    }


def write_doc(doc: dict, path: Path) -> None:
    """The result file, and its page: all of docs/results/ rebuilt when it lies there, else the page beside it."""
    import results

    page = results.render(doc, str(path))        # checks the file renders before anything is written
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(doc, indent=1, ensure_ascii=False) + "\n")
    if path.resolve().parent == RESULTS_DIR.resolve():
        results.main([])
    else:
        path.with_suffix(".md").write_text(page)
    print(f"{TAG} results written to {path}", flush=True)


# ----------------------------------------------------------------------------- the command line

def parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__.split("\n\n", 1)[1],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--quick", action="store_true", help="a few configurations and repeats: a smoke test")
    mode.add_argument("--gpu", action="store_true", help="the full π0 shape on cuda:0 in bfloat16")
    p.add_argument("--shape", choices=("tiny", "full"))
    p.add_argument("--device", help="cpu, cuda:0, ...")
    p.add_argument("--dtype", choices=tuple(DTYPES))
    p.add_argument("--ks", help="π0's denoising steps per call, comma-separated")
    p.add_argument("--hs", help="chunk sizes H, comma-separated")
    p.add_argument("--batches", help="acting batch sizes, comma-separated")
    p.add_argument("--paths", help="acting paths: forward, server (comma-separated)")
    p.add_argument("--repeats", type=int, help="acting calls timed per cell")
    p.add_argument("--warmup", type=int, help="acting calls left out before them")
    p.add_argument("--update-repeats", type=int, help="updates timed (after one left out)")
    p.add_argument("--rows", type=int, help="rows per update")
    p.add_argument("--minibatches", type=int, help="minibatches per update")
    p.add_argument("--method", choices=("noise", "sde"), default="noise", help="π0's chain: Flow-Noise or Flow-SDE")
    p.add_argument("--lora-r", type=int, default=8)
    p.add_argument("--lora-scope", choices=("expert", "expert_and_vlm"), default="expert")
    p.add_argument("--threads", type=int, default=1, help="torch.set_num_threads")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", type=Path, help="the result file (default: docs/results/flow_vla_<cpu|gpu>.json; "
                                             "none with --quick)")
    args = p.parse_args(argv)
    preset = PRESETS["quick" if args.quick else "gpu" if args.gpu else "cpu"]
    for key, value in preset.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    for key in ("ks", "hs", "batches"):
        setattr(args, key, [int(x) for x in str(getattr(args, key)).split(",") if x])
    args.paths = [x for x in args.paths.split(",") if x]
    bad = [x for x in args.paths if x not in ("forward", "server")]
    if bad or not args.paths or args.rows % args.minibatches or min(args.ks + args.hs + args.batches) < 1:
        p.error(f"--paths takes forward and server (got {bad}); --rows must be a multiple of --minibatches; "
                f"K, H and batches must be positive")
    return args


def measure_and_write(args, device: torch.device, argv: list[str]) -> int:
    """Measure everything `args` asks for, print it, and write the result file (with its page)."""
    start_load = os.getloadavg()[0]
    print(f"{TAG} {args.shape} models on {device} in {args.dtype}, torch threads {torch.get_num_threads()}, "
          f"load average {start_load:.2f} on {os.cpu_count()} cores"
          + (" (a busy machine: times and ratios mean most on an idle one)" if start_load > 0.5 * os.cpu_count()
             else ""), flush=True)
    print(f"{TAG} update: {update_text(args)}", flush=True)
    records = run(args, device)
    load = (start_load, os.getloadavg()[0])
    path = args.json or (None if args.quick else RESULTS_DIR / (
        "flow_vla_cpu.json" if device.type == "cpu" else f"flow_vla_{gpu_tag(device)}.json"))
    if path is not None:
        write_doc(results_doc(records, args, device, load, argv), path)
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parse(argv)
    try:
        from transformers import PI0ForConditionalGeneration  # noqa: F401
    except ImportError as e:
        print(f"{TAG} this transformers has no PI0ForConditionalGeneration ({e}): install the version "
              f"the project's .venv has (5.x)", file=sys.stderr)
        return 2
    device = torch.device(args.device)
    threads = torch.get_num_threads()
    torch.set_num_threads(args.threads)
    try:
        return measure_and_write(args, device, argv)
    finally:
        torch.set_num_threads(threads)      # a caller in the same process (a test) keeps its own


if __name__ == "__main__":
    sys.exit(main())
