#!/usr/bin/env bash
# A staleness sweep: train one config at several controlled policy lags, with and without an
# off-policy correction, then write the report (launch/staleness.py).
#
#   launch/sweep_staleness.sh CONFIG [--out DIR] [--sync "1 4 16"] [--corrections "none vtrace"]
#                             [--delays "0"] [--seeds "1"] [--steps S] [--set KEY=VALUE ...]
#
# Every run uses trainer.buffer_type=async with trainer.lag_policy=pace and a max_policy_lag large
# enough that nothing is dropped, so all runs train on the same amount of data and the lag is set by
# actors.sync_every (an actor takes new weights only at rollout boundaries, actors.weights_at=rollout,
# and only every K rollouts) and, optionally,
# actors.weights_delay_s (seconds a weights message waits before an actor may load it).
# Two ways to make a lag of L, which train very differently:
#   --sync 2L: a sawtooth. Actors keep one version for 2L rollouts, so over a whole run only
#     total_updates / 2L distinct policies ever act (3 in a 200k-step HalfCheetah run at sync 16).
#   --sync 1 --set actors.weights_lag_versions=L-1 --set trainer.buffer_capacity=A (A actors): a
#     constant lag. A new version acts at every rollout, always L-1 versions behind the newest, as in
#     a pipeline of many slow actors. Give it its own --out (run names do not carry the knob).
#     (A deep queue, trainer.buffer_capacity=L*A, makes a lag only where collection outruns the
#     update by that much: on the 2-core VM HalfCheetah at capacity 16 stayed at a lag of 1.4-2.3.)
# Runs go to DIR/sync{K}_delay{D}_{correction}_s{seed} (DIR defaults to outputs/sweep_<config>);
# the report to DIR/report. An existing run directory with a summary.json is kept (the sweep resumes).
set -uo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
usage() { sed -n '2,22p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//'; }
[[ $# -ge 1 && "$1" != -h && "$1" != --help ]] || { usage; [[ $# -ge 1 ]]; exit $?; }
CONFIG="$1"; shift
OUT=""; SYNCS="1 4 16"; CORRECTIONS="none vtrace"; DELAYS="0"; SEEDS="1"; STEPS=""; SETS=()
while [[ $# -gt 0 ]]; do
  case "$1" in
    --out) OUT="$2"; shift 2 ;;
    --sync) SYNCS="$2"; shift 2 ;;
    --corrections) CORRECTIONS="$2"; shift 2 ;;
    --delays) DELAYS="$2"; shift 2 ;;
    --seeds) SEEDS="$2"; shift 2 ;;
    --steps) STEPS="$2"; shift 2 ;;
    --set) SETS+=("$2"); shift 2 ;;
    -h|--help) usage; exit 0 ;;
    *) echo "sweep_staleness.sh: unknown argument '$1'" >&2; usage >&2; exit 2 ;;
  esac
done
[[ -f "$CONFIG" ]] || { echo "sweep_staleness.sh: config file '$CONFIG' not found" >&2; exit 2; }
for c in $CORRECTIONS; do
  [[ "$c" =~ ^(none|is|vtrace|appo|ewma|mask|trust)$ ]] || { echo "sweep_staleness.sh: --corrections: unknown correction '$c' (none, is, vtrace, appo, ewma, mask, trust)" >&2; exit 2; }
done
for k in $SYNCS; do
  [[ "$k" =~ ^[1-9][0-9]*$ ]] || { echo "sweep_staleness.sh: --sync: '$k' is not a positive integer" >&2; exit 2; }
done
name="$(basename "$CONFIG" .json)"
OUT="${OUT:-$ROOT/outputs/sweep_$name}"
mkdir -p "$OUT"
max_sync=1; for k in $SYNCS; do (( k > max_sync )) && max_sync=$k; done
max_lag=$(( 8 * max_sync + 64 ))   # nothing is dropped for lag: the lag is the controlled variable

PY="$ROOT/.venv/bin/python"; [[ -x "$PY" ]] || PY=python3
# a finished run's last evaluation, read from its summary.json by shared/run_dir.py
last_return() {
  PYTHONPATH="$ROOT" "$PY" -c 'import sys; from shared.run_dir import RunDir
print((RunDir(sys.argv[1]).summary() or {}).get("last_eval/return_mean"))' "$1" 2>&1 | tail -1
}

stopping=0
trap 'stopping=1' INT TERM
runs=(); labels=(); failed=0
for seed in $SEEDS; do for k in $SYNCS; do for d in $DELAYS; do for c in $CORRECTIONS; do
  [[ $stopping -eq 1 ]] && break 4
  label="sync${k}_delay${d}_${c}_s${seed}"
  run="$OUT/$label"
  runs+=("$run"); labels+=("$label")
  if [[ -f "$run/summary.json" ]]; then echo "[sweep] $label: done before, kept"; continue; fi
  rm -rf "$run"
  args=(--config "$CONFIG" --out "$run" --set trainer.buffer_type=async --set trainer.lag_policy=pace
        --set "trainer.max_policy_lag=$max_lag" --set "actors.sync_every=$k" --set "actors.weights_delay_s=$d"
        --set "algorithm.cfg.correction=$c" --set "trainer.seed=$seed" --set actors.weights_at=rollout)
  [[ -n "$STEPS" ]] && args+=(--steps "$STEPS")
  for s in "${SETS[@]+"${SETS[@]}"}"; do args+=(--set "$s"); done
  echo "[sweep] $label"
  start=$(date +%s)
  "$ROOT/launch/run_local.sh" "${args[@]}" > "$OUT/$label.log" 2>&1 &
  child=$!
  while kill -0 "$child" 2>/dev/null; do
    if [[ $stopping -eq 1 ]]; then kill -TERM "$child" 2>/dev/null; fi
    sleep 1
  done
  wait "$child"; rc=$?
  if [[ $rc -ne 0 ]]; then
    echo "[sweep] $label failed (exit $rc); see $OUT/$label.log" >&2; failed=1
  else
    echo "[sweep] $label done in $(( $(date +%s) - start )) s: last eval return $(last_return "$run")"
  fi
done; done; done; done
[[ $stopping -eq 1 ]] && { echo "[sweep] stopped" >&2; exit 130; }

existing=(); existing_labels=()
for i in "${!runs[@]}"; do
  [[ -d "${runs[$i]}" ]] && { existing+=("${runs[$i]}"); existing_labels+=("${labels[$i]}"); }
done
[[ ${#existing[@]} -gt 0 ]] || { echo "[sweep] no runs to report" >&2; exit 1; }
labels_csv="$(IFS=,; echo "${existing_labels[*]}")"
PYTHONPATH="$ROOT" "$PY" "$ROOT/launch/staleness.py" "${existing[@]}" --out "$OUT/report" --labels "$labels_csv" || exit 1
echo "[sweep] report: $OUT/report/report.md"
exit $failed
