#!/usr/bin/env bash
# Run Tandem's test suite: launch/test.sh [PYTEST ARGS...]   (what CI runs, through .ci/run)
#
# Uses the interpreter launch/run_local.sh uses ($TANDEM_PYTHON, .venv/, python3: see launch/_env.sh).
# When it cannot import what the tests need (pytest, pytest-timeout, hypothesis, torchrl, mujoco-warp, transformers, peft),
# it creates .venv/ if there is none and installs the project there with its test, warp and vla extras,
# torch==2.13.0 (the CPU wheel) only when no torch is installed. Then: python -m pytest -q ARGS.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
# shellcheck source=launch/_env.sh
source "$ROOT/launch/_env.sh"
tandem_python "$ROOT" "test,warp,vla" pytest pytest_timeout hypothesis torchrl mujoco_warp transformers peft
cd "$ROOT"
exec "$PY" -m pytest -q "$@"
