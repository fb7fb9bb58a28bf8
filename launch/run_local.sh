#!/usr/bin/env bash
# Start one Tandem run on this machine: the learner and N actors, each its own process.
#
#   launch/run_local.sh [--config FILE] [--actors N] [--steps S] [--out DIR] [--resume]
#                       [--resume-from FILE] [--record] [--no-eval] [--mps] [--set KEY=VALUE ...]
#
# This help is the one list of the launcher's flags (the manual links here):
#   --config FILE     the run's JSON config (default configs/cartpole_ppo.json)
#   --actors N        actor processes (actors.num_actors)
#   --steps S         env steps to train for (trainer.total_steps)
#   --out DIR         the run directory (default <trainer.output_dir>/<trainer.exp_name>/<date-time>/)
#   --resume          continue the run in --out (default: the newest run of this config) from its newest
#                     intact checkpoint, exactly (damaged newer ones are skipped and named)
#   --resume-from FILE  continue from this checkpoint (the run in --out, default the checkpoint's own run);
#                     no fallback if it is damaged; newer checkpoints of that run are set aside
#   --record          store every trained batch (trainer.record=true)
#   --no-eval         start no evaluator process
#   --mps             run the processes under CUDA MPS
#   --set KEY=VALUE   override any config key (repeatable; the value is parsed as JSON, else a string)
#   -h, --help        print this help
#
# With no arguments it trains PPO on CartPole-v1 (configs/cartpole_ppo.json). On first use, when
# the project is not importable, it creates .venv/ and installs it there (torch==2.13.0 only when
# no torch is installed, so a CUDA build you already have is kept).
# The launcher supervises: a crashed actor or inference server (actors.inference "server": one per
# device) is restarted (with back-off, at most TANDEM_MAX_RESTARTS times each); if the learner dies
# the run stops and exits non-zero.
# Ctrl-C or SIGTERM, to the launcher or to its whole process group (as Slurm and Kubernetes send it),
# stops every process within ~10 s (the learner writes a final checkpoint); the exit code is 130 or 143
# (SIGHUP, a closed terminal: 129, with whatever the hang-up left running stopped the same way).
# --record stores every batch the learner trains on under OUT/record (launch/replay.py retrains on it).
# --no-eval starts no evaluator process: no eval/ metrics, no final evaluation, no videos (one process
# and its start-up less: for short runs, and where the CPUs are all taken by actors).
# --mps runs the run's processes under CUDA MPS (a control daemon of the run's own, stopped with it),
# so that on a GPU shared by the learner, actors and inference servers their kernels run side by side
# instead of taking turns in time slices (docs/guides/gpu_and_ddp.md).
set -uo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
CONFIG="$ROOT/configs/cartpole_ppo.json"
ACTORS=""; STEPS=""; OUT=""; RESUME=0; RESUME_FROM=""; LAUNCH_MARK=""; NO_EVAL=0; MPS=0; SETS=()
MAX_RESTARTS="${TANDEM_MAX_RESTARTS:-3}"

usage() { sed -n '2,${/^#/!q;p}' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//'; }
while [[ $# -gt 0 ]]; do
  case "$1" in
    --config) CONFIG="$2"; shift 2 ;;
    --actors) ACTORS="$2"; shift 2 ;;
    --steps) STEPS="$2"; shift 2 ;;
    --out) OUT="$2"; shift 2 ;;
    --resume) RESUME=1; shift ;;
    --resume-from) RESUME=1; RESUME_FROM="$2"; shift 2 ;;
    --record) SETS+=("trainer.record=true"); shift ;;
    --no-eval) NO_EVAL=1; shift ;;
    --mps) MPS=1; shift ;;
    --set) SETS+=("$2"); shift 2 ;;
    -h|--help) usage; exit 0 ;;
    *) echo "run_local.sh: unknown argument '$1'" >&2; usage >&2; exit 2 ;;
  esac
done
[[ -f "$CONFIG" ]] || { echo "run_local.sh: config file '$CONFIG' not found" >&2; exit 2; }
[[ -z "$ACTORS" || "$ACTORS" =~ ^[1-9][0-9]*$ ]] || { echo "run_local.sh: --actors must be a positive integer" >&2; exit 2; }
[[ -z "$STEPS" || "$STEPS" =~ ^[1-9][0-9]*$ ]] || { echo "run_local.sh: --steps must be a positive integer" >&2; exit 2; }
if [[ $MPS -eq 1 ]] && ! command -v nvidia-cuda-mps-control >/dev/null; then
  echo "run_local.sh: --mps: no nvidia-cuda-mps-control on PATH (it comes with the NVIDIA driver)" >&2; exit 2
fi
[[ -n "$ACTORS" ]] && SETS+=("actors.num_actors=$ACTORS")
[[ -n "$STEPS" ]] && SETS+=("trainer.total_steps=$STEPS")

# ---------------------------------------------------------------- python environment
# shellcheck source=launch/_env.sh
source "$ROOT/launch/_env.sh"
if grep -q '"vla_config"' "$CONFIG"; then   # a pretrained VLA: transformers, peft and tokenizers (the vla extra)
  tandem_python "$ROOT" "vla" transformers peft tokenizers || exit 1
else
  tandem_python "$ROOT" || exit 1
fi
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
export PYTHONUNBUFFERED=1

# ---------------------------------------------------------------- run directory
set_args=(); for s in "${SETS[@]+"${SETS[@]}"}"; do set_args+=(--set "$s"); done
read -r NUM_ACTORS WORLD SERVERS EXP_DIR < <("$PY" - "$CONFIG" "${SETS[@]+"${SETS[@]}"}" <<'PYEOF'
import sys
from pathlib import Path
from shared.config import ConfigError, load_config
try:
    cfg = load_config(sys.argv[1], sys.argv[2:])
except ConfigError as e:
    print(e, file=sys.stderr); print("0 0 0 -"); sys.exit(0)
# as actors.inference_topology.server_devices counts them (importing it here would load torch)
servers = len(dict.fromkeys(cfg.actors.devices)) * cfg.actors.servers_per_device if cfg.actors.inference == "server" else 0
print(cfg.actors.num_actors, max(1, len(cfg.learner.devices)), servers, Path(cfg.trainer.output_dir) / cfg.trainer.exp_name)
PYEOF
)
[[ "$NUM_ACTORS" -gt 0 ]] 2>/dev/null || exit 2
if [[ -z "$OUT" && -n "$RESUME_FROM" ]]; then   # --resume-from a run's checkpoint: that run goes on
  [[ -f "$RESUME_FROM" ]] || { echo "run_local.sh: --resume-from: $RESUME_FROM: no such file" >&2; exit 2; }
  [[ "$(basename "$(dirname "$RESUME_FROM")")" == checkpoints ]] \
    || { echo "run_local.sh: --resume-from $RESUME_FROM is not in a run's checkpoints/: give --out" >&2; exit 2; }
  OUT="$(cd "$(dirname "$RESUME_FROM")/.." && pwd)"
fi
if [[ -z "$OUT" ]]; then
  if [[ $RESUME -eq 1 ]]; then
    OUT="$(ls -1d "$EXP_DIR"/*/ 2>/dev/null | sort | tail -n 1)"
    [[ -n "$OUT" ]] || { echo "run_local.sh: --resume: no earlier run under $EXP_DIR" >&2; exit 2; }
  else
    OUT="$EXP_DIR/$(date +%Y%m%d-%H%M%S)"
  fi
fi
OUT="${OUT%/}"
mkdir -p "$OUT/logs"
rm -f "$OUT/endpoints.json"   # a stale file from a crashed run would point actors at nothing
LAUNCH_MARK="$OUT/logs/.launch_started"   # summary.json newer than this is this launch's
touch "$LAUNCH_MARK"
# The same for inference servers' endpoint files; their TensorBoard steps go on only across --resume.
for f in "$OUT"/inference/server_*.json; do
  [[ $RESUME -eq 1 && "$f" == *.progress.json ]] || rm -f "$f"
done

# ---------------------------------------------------------------- processes
declare -A ACTOR_PID=() SERVER_PID=() RESTARTS=()   # RESTARTS by "actor I" / "inference server S"
LEARNER_PID=""
STOPPING=0
TEE_PIDS=()

# Each process writes to the terminal and to OUT/logs/NAME.log through its own tee. SIGTERM or
# SIGINT sent to the whole process group (Slurm, Kubernetes, Ctrl-C) must not end a tee before the
# learner has printed its last lines and written its final checkpoint and summary.json, so the tees
# ignore both (an ignored signal stays ignored across exec) and end when the last process writing
# to them has closed the pipe. With -p (GNU tee) a tee also goes on writing the log file after the
# reader of the launcher's own output went away. The launcher ignores SIGPIPE for the same reason:
# a closed stdout must not end the supervisor while the run goes on.
TEE=(tee -a); tee -p </dev/null >/dev/null 2>&1 && TEE=(tee -p -a)
trap '' PIPE
open_log() {  # LOG_FD: a pipe to a new tee that appends to OUT/logs/$1.log
  exec {LOG_FD}> >(trap '' TERM INT; exec "${TEE[@]}" "$OUT/logs/$1.log")
  TEE_PIDS+=($!)
}

start_actor() {
  local i=$1
  open_log "actor_$i"
  "$PY" -m actors --config "$CONFIG" --actor-id "$i" --run-dir "$OUT" "${set_args[@]+"${set_args[@]}"}" \
    >&"$LOG_FD" 2>&1 {LOG_FD}>&- &
  ACTOR_PID[$i]=$!
  exec {LOG_FD}>&-   # the launcher keeps no copy: the tee ends with the actor
}

start_server() {  # actors.inference "server": one inference server per device (actors/inference.py)
  local s=$1
  open_log "inference_$s"
  "$PY" -m actors.inference --config "$CONFIG" --server-id "$s" --run-dir "$OUT" "${set_args[@]+"${set_args[@]}"}" \
    >&"$LOG_FD" 2>&1 {LOG_FD}>&- &
  SERVER_PID[$s]=$!
  exec {LOG_FD}>&-
}

# A supervised process (actor or inference server) WHAT exited with CODE != 0: restart it with START...
# after a back-off (1, 2, 4 ... 30 s), unless it has failed more than MAX_RESTARTS times (returns 1).
restart_after_failure() {
  local what=$1 code=$2 n delay; shift 2
  n=$(( ${RESTARTS[$what]:-0} + 1 )); RESTARTS[$what]=$n
  if [[ $n -gt $MAX_RESTARTS ]]; then
    echo "[launch] $what failed $n times (last exit code $code): stopping the run"
    return 1
  fi
  delay=$(( n > 6 ? 30 : 1 << (n - 1) )); (( delay > 30 )) && delay=30
  echo "[launch] $what exited with code $code: restart $n/$MAX_RESTARTS in ${delay}s"
  sleep "$delay" & wait $!          # in the background, so INT/TERM traps run at once
  kill -0 "$LEARNER_PID" 2>/dev/null && "$@"
  return 0
}

is_my_child() {  # /proc/PID/stat is "PID (COMM) STATE PPID ..."
  local st; read -r st 2>/dev/null < "/proc/$1/stat" || return 1
  st=${st##*) }; [[ "${st#* }" == "$$ "* ]]
}

stop_all() {  # TERM everyone, give them 10 s in all, then KILL what is left
  local pids=("${ACTOR_PID[@]+"${ACTOR_PID[@]}"}" "${SERVER_PID[@]+"${SERVER_PID[@]}"}" $LEARNER_PID) deadline=$((SECONDS + 10)) stuck=()
  [[ -n "${TICK:-}" ]] && kill "$TICK" 2>/dev/null   # the supervision loop's tick (below)
  kill -TERM "${pids[@]}" 2>/dev/null
  for p in "${pids[@]}"; do
    while kill -0 "$p" 2>/dev/null && [[ $SECONDS -lt $deadline ]]; do sleep 0.1; done
  done
  for p in "${pids[@]}"; do
    kill -0 "$p" 2>/dev/null || continue
    # first ask for its threads' stacks (SIGUSR1: shared/console.py), so that the log says where it
    # hung; torchrun does not take the signal, its ranks do
    if [[ "$p" == "$LEARNER_PID" && "$WORLD" -gt 1 ]]; then pkill -USR1 -P "$p" 2>/dev/null; else kill -USR1 "$p" 2>/dev/null; fi
    stuck+=("$p")
  done
  (( ${#stuck[@]} )) && sleep 1
  for p in "${stuck[@]+"${stuck[@]}"}"; do
    echo "[launch] killing $p (did not stop in time; its threads' stacks are in its log)"
    pkill -KILL -P "$p" 2>/dev/null; kill -KILL "$p" 2>/dev/null   # children first: torchrun's ranks would outlive it
  done
  wait 2>/dev/null
  # The tees end once their writers have: wait for them (the logs are complete when the launcher
  # returns), and leave none behind.
  deadline=$((SECONDS + 5))
  for p in "${TEE_PIDS[@]}"; do
    while kill -0 "$p" 2>/dev/null && [[ $SECONDS -lt $deadline ]]; do sleep 0.1; done
    kill -0 "$p" 2>/dev/null && is_my_child "$p" && kill -KILL "$p" 2>/dev/null   # a pid seen gone may be someone else's by now
  done
  TEE_PIDS=()
  # A killed learner cannot remove its endpoints file, its shared-memory weights (weights_transport
  # "shm") or its rollout ring (actors.rollout_transport "ring").
  if [[ -f "$OUT/endpoints.json" ]]; then
    shm="$(sed -n 's/.*"shm": *"\([^"]*\)".*/\1/p' "$OUT/endpoints.json")"
    [[ "$shm" == /dev/shm/tandem-*.weights ]] && rm -f "$shm"
    ring="$(sed -n 's/.*"rollout_ring": *"\([^"]*\)".*/\1/p' "$OUT/endpoints.json")"
    [[ "$ring" == /dev/shm/tandem-*.rollouts ]] && rm -f "$ring"
    rm -f "$OUT/endpoints.json"
  fi
  # Nor can a killed inference server remove its Unix socket (actors.server_transport "unix"), which
  # lives in a private directory under $TMPDIR, outside OUT.
  local f sock
  for f in "$OUT"/inference/server_*.json; do
    [[ -f "$f" ]] || continue
    sock="$(sed -n 's/.*"unix": *"\([^"]*\)".*/\1/p' "$f")"
    if [[ "$sock" == */tandem-"$(id -u)"-*/server_*.sock ]]; then
      rm -f "$sock"
      rmdir "$(dirname "$sock")" 2>/dev/null   # when no other server of this run is in it
    fi
  done
  stop_mps
}

# --mps: one MPS control daemon for this run, its pipes in a short private directory (they are Unix
# sockets, whose paths are limited), its log in OUT/logs/mps; every process started after inherits both.
start_mps() {
  export CUDA_MPS_PIPE_DIRECTORY="${TMPDIR:-/tmp}/tandem-mps-$$" CUDA_MPS_LOG_DIRECTORY="$(cd "$OUT" && pwd)/logs/mps"
  mkdir -p "$CUDA_MPS_PIPE_DIRECTORY" "$CUDA_MPS_LOG_DIRECTORY"
  MPS_STARTED=1                      # first: a signal from here on stops it (a quit to no daemon is harmless)
  trap stop_mps EXIT                 # and any other way out of the launcher but SIGKILL
  if ! nvidia-cuda-mps-control -d </dev/null >/dev/null 2>&1; then
    echo "run_local.sh: --mps: the MPS control daemon did not start (its log: $CUDA_MPS_LOG_DIRECTORY)" >&2
    exit 1
  fi
  echo "[launch] CUDA MPS: the run's processes share each GPU through one MPS server (log: $CUDA_MPS_LOG_DIRECTORY)"
}
stop_mps() {  # after every process of the run has ended
  [[ ${MPS_STARTED:-0} -eq 1 ]] || return 0
  echo quit | nvidia-cuda-mps-control >/dev/null 2>&1 || echo "[launch] the MPS control daemon did not take 'quit'"
  rm -rf "$CUDA_MPS_PIPE_DIRECTORY"
  MPS_STARTED=0
}

on_signal() {
  [[ $STOPPING -eq 1 ]] && return
  STOPPING=1
  echo "[launch] $1: stopping the learner and $NUM_ACTORS actors"
  stop_all
  report_summary
  exit "$2"
}
report_summary() {  # this launch's summary.json only: never one an earlier launch left in the run directory
  if [[ -f "$OUT/summary.json" && "$OUT/summary.json" -nt "$LAUNCH_MARK" ]]; then
    echo "[launch] summary: $(tr -d '\n ' < "$OUT/summary.json")"
  else
    echo "[launch] no summary from this launch: the learner ended before writing one (its log: $OUT/logs/learner.log)"
  fi
}
trap 'on_signal SIGINT 130' INT
trap 'on_signal SIGTERM 143' TERM
trap 'on_signal SIGHUP 129' HUP    # a closed terminal: the same clean stop

[[ $MPS -eq 1 ]] && start_mps
learner_args=(--config "$CONFIG" --run-dir "$OUT" "${set_args[@]+"${set_args[@]}"}")
if [[ -n "$RESUME_FROM" ]]; then learner_args+=(--resume-from "$RESUME_FROM")
elif [[ $RESUME -eq 1 ]]; then learner_args+=(--resume); fi
[[ $NO_EVAL -eq 1 ]] && learner_args+=(--no-eval)
echo "[launch] run dir $OUT | config $CONFIG | $NUM_ACTORS actors | $WORLD learner rank(s)$([[ $SERVERS -gt 0 ]] && echo " | $SERVERS inference server(s)") | python $PY"
open_log learner
if [[ "$WORLD" -gt 1 ]]; then   # several learner ranks (learner.devices): torchrun starts one process per rank
  "$PY" -m torch.distributed.run --standalone --nnodes 1 --nproc_per_node "$WORLD" --module learner \
    "${learner_args[@]}" >&"$LOG_FD" 2>&1 {LOG_FD}>&- &
else
  "$PY" -m learner "${learner_args[@]}" >&"$LOG_FD" 2>&1 {LOG_FD}>&- &
fi
LEARNER_PID=$!
exec {LOG_FD}>&-
for ((s = 0; s < SERVERS; s++)); do start_server "$s"; done
for ((i = 0; i < NUM_ACTORS; i++)); do start_actor "$i"; done

# bash's `wait -n` reports only children that end while it waits: one that ended before (while the
# actors were being started, or during a restart's back-off) would go unnoticed until another ends.
# So each round first takes any child already gone, and `wait -n` also waits for a 2 s tick, after
# which the round looks again.
TICK=""
ended_before() {  # sets finished and code for a supervised child that is already gone
  local p
  for p in $LEARNER_PID "${SERVER_PID[@]+"${SERVER_PID[@]}"}" "${ACTOR_PID[@]+"${ACTOR_PID[@]}"}"; do
    kill -0 "$p" 2>/dev/null && continue
    finished=$p; wait "$p"; code=$?
    return 0
  done
  return 1
}
status=0
while true; do
  finished=""
  if ! ended_before; then
    [[ -n "$TICK" ]] && kill -0 "$TICK" 2>/dev/null || { sleep 2 & TICK=$!; }
    wait -n -p finished "$LEARNER_PID" "${ACTOR_PID[@]+"${ACTOR_PID[@]}"}" "${SERVER_PID[@]+"${SERVER_PID[@]}"}" "$TICK"
    code=$?
    [[ -z "$finished" ]] && continue            # interrupted by a signal; the trap handles it
    [[ "$finished" == "$TICK" ]] && { TICK=""; continue; }
  fi
  if [[ "$finished" == "$LEARNER_PID" ]]; then
    status=$code
    [[ $code -ne 0 ]] && echo "[launch] the learner exited with code $code: stopping the actors"
    LEARNER_PID=""
    stop_all
    break
  fi
  for s in "${!SERVER_PID[@]}"; do   # a server that failed is restarted; its actors wait for it meanwhile
    [[ "${SERVER_PID[$s]}" == "$finished" ]] || continue
    unset "SERVER_PID[$s]"
    if [[ $code -ne 0 ]] && ! restart_after_failure "inference server $s" "$code" start_server "$s"; then
      status=1; stop_all; break 2
    fi
  done
  for i in "${!ACTOR_PID[@]}"; do
    [[ "${ACTOR_PID[$i]}" == "$finished" ]] || continue
    unset "ACTOR_PID[$i]"
    if [[ $code -ne 0 ]] && ! restart_after_failure "actor $i" "$code" start_actor "$i"; then
      status=1; stop_all; break 2
    fi
  done
done
report_summary
echo "[launch] done (exit $status): $OUT"
exit "$status"
