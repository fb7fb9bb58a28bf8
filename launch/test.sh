#!/usr/bin/env bash
# Run Tandem's test suite: launch/test.sh [PYTEST ARGS...]   (what CI runs, through .ci/run)
#
# Uses the interpreter launch/run_local.sh uses ($TANDEM_PYTHON, .venv/, python3: see launch/_env.sh).
# When it cannot import what the tests need (pytest, pytest-timeout, hypothesis, torchrl, mujoco-warp, transformers, peft, av,
# ray), it creates .venv/ if there is none and installs the project there with its test, warp, vla, video and ray extras,
# torch==2.13.0 (the CPU wheel) only when no torch is installed. Once, it runs launch/setup_maniskill.sh
# (the maniskill extra and, without a GPU, a project-local lavapipe); if that fails, the ManiSkill tests
# are skipped and say why. Then: python -m pytest -q ARGS.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
# shellcheck source=launch/_env.sh
source "$ROOT/launch/_env.sh"
tandem_python "$ROOT" "test,warp,vla,video,ray" pytest pytest_timeout hypothesis torchrl mujoco_warp transformers peft av ray
if [[ ! -f "${TANDEM_VULKAN_DIR:-$ROOT/.vulkan}/ok" ]] || ! "$PY" -c "import mani_skill" >/dev/null 2>&1; then
  TANDEM_PYTHON="$PY" bash "$ROOT/launch/setup_maniskill.sh" \
    || echo "[test] ManiSkill3 set-up failed (above): tests/test_maniskill.py will be skipped" >&2
fi
cd "$ROOT"
exec "$PY" -m pytest -q "$@"
