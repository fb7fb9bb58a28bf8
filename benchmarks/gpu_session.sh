#!/usr/bin/env bash
# Every CUDA check and measurement Tandem has, as one command for a GPU lent for a few minutes
# (benchmarks/README.md, "CUDA"): each step has its own time limit, a step that fails does not stop
# the next, and the whole stays inside BUDGET seconds (later steps get what is left).
#
#   [TANDEM_GPU_STEPS="gpu-tests vla-weights ..."] benchmarks/gpu_session.sh OUTDIR [BUDGET_S]
#
# TANDEM_GPU_STEPS picks steps by name (default: all but reach-long, in the order below).
# OUTDIR gets log.txt (everything printed), vla_weights.json and runs.tgz (each run's summary.json,
# logs and TensorBoard events). A .whl/ folder in the repository root, if any, is installed first
# into /tmp/site (wheels carried to a machine that has no package registry; benchmarks/gpu_wheels.sh
# downloads the ones the lent machines lack: tensordict, pyzmq, gymnasium, mujoco and their needs). Python: $TANDEM_PYTHON,
# else python3; the project is used from this checkout (PYTHONPATH), not installed.
#
# Steps, in order of what matters most:
#   1. the device and the packages (always); gpu-tests: pytest -m gpu (tests/test_cuda.py, the collector on CUDA,
#      the rollout ring through CUDA IPC and its dead producer)
#   1b. gpu-pipeline: benchmarks/gpu_pipeline.py: the update per learner.compile mode against a graph-captured
#      floor, env steps/s of the serial runner against the launcher (standard, vla, vla with the CUDA-IPC ring) at minibatches 4,096 and
#      32,768, and MuJoCo Warp HalfCheetah at mjlab's settings where mujoco-warp imports (gpu_pipeline.json);
#      more arguments from $TANDEM_GPU_PIPELINE_ARGS (for example "--actors 1 --modes graph")
#   2. vla-weights: benchmarks/vla_weights.py: the ~0.5B action-token VLA, acting step on CPU and CUDA in float32,
#      bfloat16 and bf16 autocast at batch 1/8/32, a LoRA training step, peak memory
#   3. cheetah: HalfCheetah PPO (configs/halfcheetah_ppo.json, 61,440 steps): learner on cpu, then on cuda:0
#   3b. cheetah-vla: the same on cuda:0 in async mode (trainer.buffer_type=async)
#   4. reach: the pretrained action-token Reach model, LoRA PPO, 16,384 steps: learner and actors on
#      cpu, then on cuda:0
#   5. vla0p5b: the 0.5B action-token model through the launcher in vla mode on cuda:0 (bf16 autocast): each
#      process builds it, the model's own forward pass is the inference cost
#   6. unit-tests: the unit tests (not slow), in parallel where pytest-xdist is installed
#   7. reach-long: step 4 on cuda:0 for 102,400 steps, evaluated (1,000 episodes) at 51,200 and at the end
#   8. reach-full: the Reach configs as shipped (PPO 200k, then GRPO 400k; 1,000-episode evaluations
#      every 20k) with learner and actors on cuda:0
#   9. mjwarp: MuJoCo Warp on the device: tests/test_mjwarp.py there (physics against C MuJoCo, the
#      batched protocol, a launcher run), benchmarks/sim_throughput.py (env steps/s alone and in an
#      actor's collector, 256-16384 envs, against gymnasium's C MuJoCo on one CPU core), and PPO through
#      the launcher with 2 actors of 1,024 envs and the learner on the device
#  10. reach-gains: benchmarks/reach_gains.py on the device: Reach fine-tuning settings x seeds, runs in
#      parallel on the machine's cores, each run's and the starting model's success on the first and
#      held-out sets. Its arguments come from $TANDEM_REACH_GAINS (default: the GRPO config on seeds 1-3).
#  11. inference-server: benchmarks/inference_server.py on the device: 8 actors x 4 envs of the 0.5B
#      action-token model (bf16 autocast), actors.inference local (8 copies) against server (one copy,
#      batched): env steps/s, device memory per role (nvidia-smi per process), the server's batches
#      (the inference server's 3x target); the model is built once (--prebuild) and loaded by every process, so the step needs
#      about 3.5 minutes
#  11b. inference-server-free: the same with trainer.lag_policy=drop: the actors run free of the learner,
#      so env steps/s is what acting reaches beside a busy learner on the same GPU (under pace, step 11,
#      both modes run at the learner's pace there), with the samples trained per second beside it;
#      reuses step 11's prebuilt model when it ran first (about 3 minutes)
#  11d. inference-server-free-mps: step 11b under CUDA MPS (launch/run_local.sh --mps: each run starts
#      a daemon of its own and stops it), so one call measures both: without MPS the GPU time-slices between the CUDA contexts and
#      the 8 local copies took most of the slices (docs/results/inference_server_h100.md); under MPS the
#      server's small kernels may run beside the learner's. Skipped, saying why, where MPS cannot start
#      or TANDEM_GPU_MPS=1 already runs the whole session under it (about 2.5 minutes)
#  11e. inference-server-acting: step 11 with --no-updates: acting alone on the GPU. The learner keeps its
#      copy there but never trains (lag_policy drop), so env steps/s is what the 8 local copies and the
#      one server reach on the device without the learner's kernels beside them, as where the learner has
#      a GPU of its own; under pace (step 11) both modes run at the learner's rate on a shared GPU
#      (docs/results/inference_server_h100.md). Reuses an earlier step's prebuilt model (about 2.5 minutes)
#  11c. server-a0-cpu: no GPU used: the inference server's a = 0 parity target (at least as fast as local copies) on the lent machine's CPU cores
#      (the 2-core VM has fewer cores than the run has processes): benchmarks/async_speedup.py --latency 0
#      with four actors sharing one device (local copies taking turns), through a server, and each on its
#      own device, seeds $TANDEM_A0_SEEDS (default 1 2 3), one sitting (about 1 minute a seed)
#  12. reach-ds: benchmarks/reach_gains.py: the Reach GRPO config in vla mode with and without
#      algorithm.cfg.dynamic_sampling, seeds 1-3, gains over the starting model
#  13. flow-vla: benchmarks/flow_vla.py --gpu: the full π0 shape (PI0Config's defaults: a PaliGemma 2B-class
#      VLM and a 300M-class expert, random weights, bf16, LoRA on the expert) against the action-token policy
#      on the same VLM, chunks of 50, on the same Reach observations: acting ms per call at batch 1/8/32 (the
#      forward pass on the device, and through one inference server), the learner's seconds per PPO update and
#      peak memory, for K = 1, 4, 10 (flow_vla.json, a results.py file; about 2-3 minutes). It needs transformers
#      with PI0ForConditionalGeneration (5.x, as .venv has) and says so where the machine's has none. With
#      TANDEM_GPU_DEVICE=cpu it runs the tiny models' --quick instead
#
# MuJoCo Warp where no registry is reachable: the warp-lang wheel (149 MB) is more than one device call
# carries, so it travels in pieces, staged by earlier calls into $WARP_STAGE (default /tmp/warp-stage):
# warp.so.xz.NN (Warp's CUDA library, xz-compressed, split; warp.so.xz.sha256), warp_pkg.tar.xz (the
# rest of the package, without its CPU compiler warp-clang.so: Warp's CPU device is then unavailable)
# and wheels/*.whl (mujoco-warp and its pure-Python dependencies). A call stages what it carries with
#   mkdir -p /tmp/warp-stage && cp -r .warp/*/* /tmp/warp-stage/
set -uo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
OUTDIR="${1:?usage: benchmarks/gpu_session.sh OUTDIR [BUDGET_S]}"
BUDGET="${2:-540}"
mkdir -p "$OUTDIR"
OUTDIR="$(cd "$OUTDIR" && pwd)"
exec > >(tee -a "$OUTDIR/log.txt") 2>&1
START=$(date +%s)
RUNS=/tmp/tandem-gpu-runs
rm -rf "$RUNS"; mkdir -p "$RUNS"
cd "$ROOT" || exit 1

if compgen -G "$ROOT/.whl/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
    "$ROOT"/.whl/*.whl || echo "[gpu] installing the carried wheels failed"
  export PYTHONPATH="/tmp/site${PYTHONPATH:+:$PYTHONPATH}"
fi
WARP_STAGE="${WARP_STAGE:-/tmp/warp-stage}"
install_warp() {   # from the pieces in $WARP_STAGE (above) into /tmp/site
  local parts=("$WARP_STAGE"/warp.so.xz.[0-9][0-9])
  mkdir -p /tmp/site && cat "${parts[@]}" > /tmp/warp.so.xz || return 1
  if [[ -f "$WARP_STAGE/warp.so.xz.sha256" ]]; then
    (cd /tmp && sha256sum --quiet -c "$WARP_STAGE/warp.so.xz.sha256") || { echo "[gpu] ${parts[*]}: checksum differs"; return 1; }
  fi
  tar -xJf "$WARP_STAGE/warp_pkg.tar.xz" -C /tmp/site && xz -dc /tmp/warp.so.xz > /tmp/site/warp/bin/warp.so || return 1
  rm -f /tmp/warp.so.xz
  if compgen -G "$WARP_STAGE/wheels/*.whl" >/dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
      "$WARP_STAGE"/wheels/*.whl || return 1
  fi
}
if [[ -f "$WARP_STAGE/warp_pkg.tar.xz" ]] && compgen -G "$WARP_STAGE/warp.so.xz.[0-9][0-9]" >/dev/null; then
  install_warp && echo "[gpu] MuJoCo Warp installed from $WARP_STAGE" || echo "[gpu] installing MuJoCo Warp from $WARP_STAGE failed"
  [[ ":${PYTHONPATH:-}:" == *":/tmp/site:"* ]] || export PYTHONPATH="/tmp/site${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
# No run here renders; MuJoCo's EGL backend fails at import where libEGL is missing (CUDA images).
export MUJOCO_GL="${MUJOCO_GL:-disable}"
STEPS=" ${TANDEM_GPU_STEPS:-gpu-tests gpu-pipeline vla-weights cheetah cheetah-vla reach vla0p5b unit-tests} "
want() { [[ "$STEPS" == *" $1 "* ]]; }
export TANDEM_PYTHON="${TANDEM_PYTHON:-$(command -v python3)}"
PY="$TANDEM_PYTHON"
# TANDEM_GPU_DEVICE=cpu runs the same steps on the CPU: to check this script on a machine without a GPU.
DEV="${TANDEM_GPU_DEVICE:-cuda:0}"
export TANDEM_TEST_CUDA_DEVICE="$DEV"
[[ "$DEV" == cpu ]] && DEVICES=cpu || DEVICES="cpu,$DEV"

# step NAME LIMIT_S CMD...: run CMD under at most LIMIT_S seconds, and never past the budget.
step() {
  local name=$1 limit=$2 left; shift 2
  left=$(( BUDGET - ($(date +%s) - START) - 15 ))
  (( limit > left )) && limit=$left
  if (( limit < 20 )); then echo "=== [$name] skipped: ${left}s of the budget left"; return; fi
  echo "=== [$name] start $(date -u +%T), limit ${limit}s: $*"
  local t0=$(date +%s%N)
  timeout -k 10 "$limit" "$@"
  local rc=$? ms=$(( ($(date +%s%N) - t0) / 1000000 ))
  echo "=== [$name] exit $rc after $(( ms / 1000 )).$(( ms % 1000 / 100 )) s"
}

run() {  # run NAME LIMIT_S --config ... : launch/run_local.sh into $RUNS/NAME
  local name=$1 limit=$2; shift 2
  step "$name" "$limit" "$ROOT/launch/run_local.sh" --out "$RUNS/$name" "$@"
  [[ -f "$RUNS/$name/summary.json" ]] && "$PY" - "$RUNS/$name/summary.json" <<'EOF'
import json, sys
s = json.load(open(sys.argv[1]))
u = max(1, s.get("updates") or 0)
print(f"[gpu] {sys.argv[1].split('/')[-2]}: env_steps {s.get('env_steps')}, updates {s.get('updates')}, "
      f"wall {s.get('wall_s', 0):.1f} s, update wall {s.get('time/update_wall_s', 0):.1f} s "
      f"({s.get('time/update_wall_s', 0) / u:.3f} s per update), collect wall {s.get('time/collect_wall_s', 0):.1f} s, "
      f"dropped {s.get('dropped_lag')}/{s.get('dropped_other')}, malformed {s.get('malformed')}, exit {s.get('exit_code')}")
EOF
}

# TANDEM_GPU_MPS=1: run every step under CUDA MPS (nvidia-cuda-mps-control), so the kernels of the
# actors and the learner on one GPU run side by side instead of time-slicing: does MPS help a shared GPU?
if [[ "${TANDEM_GPU_MPS:-0}" == 1 ]] && command -v nvidia-cuda-mps-control >/dev/null; then
  export CUDA_MPS_PIPE_DIRECTORY=/tmp/mps-pipe CUDA_MPS_LOG_DIRECTORY=/tmp/mps-log
  mkdir -p "$CUDA_MPS_PIPE_DIRECTORY" "$CUDA_MPS_LOG_DIRECTORY"
  nvidia-cuda-mps-control -d && echo "[gpu] CUDA MPS started" || echo "[gpu] CUDA MPS did not start"
  trap 'echo quit | nvidia-cuda-mps-control 2>/dev/null' EXIT
fi
echo "=== [device] $(date -u) on $(hostname), $(nproc) cores"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>&1
"$PY" - <<'EOF'
import importlib, sys
import torch
print("[gpu] python", sys.version.split()[0], "torch", torch.__version__, "cuda available", torch.cuda.is_available(),
      torch.cuda.get_device_name(0) if torch.cuda.is_available() else "")
for m in ("tensordict", "zmq", "msgpack", "gymnasium", "mujoco", "safetensors", "transformers", "peft", "tensorboard",
          "warp", "mujoco_warp"):
    try:
        print(f"[gpu]   {m} {getattr(importlib.import_module(m), '__version__', '?')}")
    except Exception as e:
        print(f"[gpu]   {m} NOT IMPORTABLE: {type(e).__name__}: {e}")
EOF

want gpu-tests && step gpu-tests 100 "$PY" -m pytest -q -p no:cacheprovider -m gpu tests/test_cuda.py tests/test_envs_policies.py \
  tests/test_rollout_ring.py tests/test_shm_weights.py
# the GPU targets: the update per learner.compile mode against the captured floor, the pipeline
# against the serial runner at minibatches 4,096 and 32,768, and MuJoCo Warp at mjlab's settings
want gpu-pipeline && step gpu-pipeline 330 "$PY" benchmarks/gpu_pipeline.py --device "$DEV" --pipeline \
  $("$PY" -c "import mujoco_warp" 2>/dev/null && echo --warp) --timeout 90 --total-steps $((4096 * 32 * 12)) \
  ${TANDEM_GPU_PIPELINE_ARGS:-} \
  --out "$OUTDIR/gpu_pipeline.json" --keep-runs "$RUNS/gpu_pipeline"
want vla-weights && step vla-weights 200 "$PY" benchmarks/vla_weights.py --devices "$DEVICES" --batch 1,8,32 --cpu-batch 1 \
  --train-batch 8 --no-broadcast --repeats 3 --json "$OUTDIR/vla_weights.json"

CHEETAH=(--config configs/halfcheetah_ppo.json --steps 61440 --set trainer.eval_freq=0 --set trainer.save_freq=0)
if want cheetah; then
  run cheetah_cpu 100 "${CHEETAH[@]}"
  run cheetah_dev 100 "${CHEETAH[@]}" --set learner.device=$DEV
fi
want cheetah-vla && run cheetah_vla_dev 100 "${CHEETAH[@]}" --set learner.device=$DEV --set trainer.buffer_type=async

REACH=(--config configs/vla_tokens_reach_ppo.json --set trainer.save_freq=0
       --set policy.vla_config.model_path=benchmarks/pretrained/tokens_reach_intel)
if want reach; then
  run reach_tokens_cpu 120 "${REACH[@]}" --steps 16384 --set trainer.eval_freq=0
  run reach_tokens_dev 120 "${REACH[@]}" --steps 16384 --set trainer.eval_freq=0 --set learner.device=$DEV \
    --set "actors.devices=[\"$DEV\"]"
fi
want vla0p5b && run vla0p5b_dev 150 --config configs/vla_tokens_reach_0p5b_smoke.json --set learner.device=$DEV \
  --set "actors.devices=[\"$DEV\"]" --set policy.vla_config.autocast=true --set trainer.total_steps=64

if "$PY" -c "import xdist" 2>/dev/null; then PAR=(-n 8); else PAR=(); fi
want unit-tests && step unit-tests 600 "$PY" -m pytest -q -p no:cacheprovider -m "not slow and not gpu" "${PAR[@]}" tests
want reach-long && run reach_tokens_long_dev 300 "${REACH[@]}" --steps 102400 --set trainer.eval_freq=51200 \
  --set learner.device=$DEV --set "actors.devices=[\"$DEV\"]"
if want reach-full; then
  for algo in ppo grpo; do
    run "reach_${algo}_full_dev" 600 --config "configs/vla_tokens_reach_${algo}.json" \
      --set policy.vla_config.model_path=benchmarks/pretrained/tokens_reach_intel \
      --set learner.device=$DEV --set "actors.devices=[\"$DEV\"]"
  done
fi
if want mjwarp; then
  TANDEM_TEST_MJWARP_DEVICE=$DEV step mjwarp-tests 200 "$PY" -m pytest -q -p no:cacheprovider tests/test_mjwarp.py
  step mjwarp-throughput 200 "$PY" benchmarks/sim_throughput.py --devices "$DEV" --num-envs 256,1024,4096,16384 \
    --baseline HalfCheetah-v5 --baseline-envs 16 --seconds 5 --json "$OUTDIR/sim_throughput.json"
  run mjwarp_dev 150 --config configs/mjwarp_halfcheetah_ppo.json --steps 655360 --set actors.num_envs=1024 \
    --set "actors.devices=[\"$DEV\"]" --set learner.device=$DEV --set algorithm.cfg.batch_size=4096 \
    --set trainer.eval_device=$DEV --set trainer.eval_freq=327680 --set trainer.save_freq=0
fi

if want reach-gains; then
  # shell words, quotes respected: --variant "LABEL KEY=JSON ..." stays one argument
  eval "RG_ARGS=(${TANDEM_REACH_GAINS:---config configs/vla_tokens_reach_grpo.json --seeds 1,2,3 --parallel 3 \
    --set policy.vla_config.model_path=benchmarks/pretrained/tokens_reach_intel})"
  # its runs and evaluations go into runs.tgz (a device call returns only a few files); gains.json also here
  step reach-gains 560 "$PY" benchmarks/reach_gains.py "${RG_ARGS[@]}" --device "$DEV" --out "$RUNS/reach_gains"
  cp "$RUNS/reach_gains/gains.json" "$OUTDIR/" 2>/dev/null
fi

# Each run starts 9 processes (8 local actors and the learner) that would each build the 0.5B model at
# random on the CPU: on an H100 (2026-11-27) the actors' first rollout came 64 s after the launch. With
# --prebuild the model is built once and every process loads it (about 2 s instead of 15-18 s of CPU
# on the 2-core VM). 1,024 steps (4 rounds of the 8 actors) gave windows of 3.5-6.5 s on an H200
# (2026-11-27), too short to compare; 4,096 steps make the two runs and the build about 200 s. Both
# modes step Reach on the CPU (env.device): on cuda:0 each server-mode actor held a CUDA context of
# its own, 5.6 GB of the server run's 8.2 GB (docs/results/inference_server_h200.md).
# server_bench NAME [--set ...]: step 11's run of benchmarks/inference_server.py as step NAME, into
# $RUNS/NAME and $OUTDIR/NAME.json; the model is step 11's if it was saved whole (the adapter's
# keywords are written last), else built here once (--prebuild)
server_bench() {
  local name=$1; shift
  local pre=(--prebuild /tmp/tandem-0p5b)
  [[ -f /tmp/tandem-0p5b/tandem_adapter.json ]] && pre=(--set policy.vla_config.model_path=/tmp/tandem-0p5b)
  step "$name" 250 "$PY" benchmarks/inference_server.py --config configs/vla_tokens_reach_0p5b_smoke.json \
    --device "$DEV" --actors 8 --num-envs 4 --steps 4096 --env-device cpu --buffer-size 8 --timeout 115 "${pre[@]}" \
    --set policy.vla_config.autocast=true --set learner.device=$DEV "$@" \
    --out "$RUNS/${name//-/_}" --json "$OUTDIR/${name//-/_}.json"
}
want inference-server && server_bench inference-server
want inference-server-free && server_bench inference-server-free --set trainer.lag_policy=drop
if want inference-server-free-mps; then   # each run under a daemon of its own: launch/run_local.sh --mps
  if [[ "${TANDEM_GPU_MPS:-0}" == 1 ]]; then
    echo "=== [inference-server-free-mps] skipped: TANDEM_GPU_MPS=1 already runs every step under MPS"
  elif ! command -v nvidia-cuda-mps-control >/dev/null; then
    echo "=== [inference-server-free-mps] skipped: no nvidia-cuda-mps-control on this machine"
  else
    server_bench inference-server-free-mps --mps --set trainer.lag_policy=drop
  fi
fi
want inference-server-acting && server_bench inference-server-acting --no-updates
if want server-a0-cpu; then
  for s in ${TANDEM_A0_SEEDS:-1 2 3}; do
    step "server-a0-cpu-s$s" 150 "$PY" benchmarks/async_speedup.py --latency 0 \
      --variants vla4-1dev,server4-1dev,vla4-4dev --set trainer.seed=$s --json "$OUTDIR/server_a0_cpu_s$s.json"
  done
fi
if want reach-ds; then
  step reach-ds 560 "$PY" benchmarks/reach_gains.py --config configs/vla_tokens_reach_grpo.json --seeds 1,2,3 \
    --parallel 6 --set policy.vla_config.model_path=benchmarks/pretrained/tokens_reach_intel \
    --set trainer.buffer_type=async --variant vla --variant "dynamic algorithm.cfg.dynamic_sampling=true" \
    --device "$DEV" --out "$RUNS/reach_ds"
  cp "$RUNS/reach_ds/gains.json" "$OUTDIR/reach_ds_gains.json" 2>/dev/null
fi

if want flow-vla; then   # the full shape needs the GPU's memory: on the CPU, the tiny models' smoke run
  [[ "$DEV" == cpu ]] && FLOW=(--quick) || FLOW=(--gpu --device "$DEV")
  step flow-vla 300 "$PY" benchmarks/flow_vla.py "${FLOW[@]}" --json "$OUTDIR/flow_vla.json"
fi

tar -czf "$OUTDIR/runs.tgz" --exclude='*.pt' -C "$RUNS" . 2>/dev/null
nvidia-smi --query-compute-apps=pid,name --format=csv,noheader 2>/dev/null
echo "=== [done] $(( $(date +%s) - START )) s"
