#!/usr/bin/env bash
# The wheels a lent GPU machine lacks (its image has torch, transformers, peft, msgpack, safetensors,
# tensorboard, pytest, hypothesis, but not these), downloaded into .whl/ for `gpu_session.sh` to install:
#
#   benchmarks/gpu_wheels.sh            # then: device run --carry .whl 'bash benchmarks/gpu_session.sh $OUT'
#
# The versions are this checkout's own (.venv), for CPython 3.12 on manylinux x86-64 (the machine's
# python3). About 40 MB: with the repository it stays under a device call's 64 MiB. .whl/ is added to
# .git/info/exclude, so the wheels never reach a commit.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PY="${TANDEM_PYTHON:-$ROOT/.venv/bin/python}"
cd "$ROOT"
mkdir -p .whl .git/info
grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo '/.whl/' >> .git/info/exclude
version() { "$PY" -c "import importlib.metadata as m; print(m.version('$1'))"; }
PKGS=()
for p in tensordict pyzmq gymnasium mujoco mujoco-core mujoco-studio; do PKGS+=("$p==$(version "$p")"); done
# the image's transformers (5.17) may predate PI0ForConditionalGeneration (benchmarks/flow_vla.py): ours, with
# the huggingface_hub it needs (about 12 MB more)
for p in transformers huggingface-hub; do PKGS+=("$p==$(version "$p")"); done
PKGS+=(orjson pyvers importlib_metadata farama-notifications glfw pyopengl websockets)   # their dependencies
PLAT=()
for t in manylinux_2_17 manylinux2014 manylinux_2_24 manylinux_2_26 manylinux_2_27 manylinux_2_28 manylinux_2_31 \
         manylinux_2_34 manylinux_2_35 manylinux1; do PLAT+=(--platform "${t}_x86_64"); done
for p in "${PKGS[@]}"; do
  "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    "${PLAT[@]}" --platform any -d .whl "$p" 2>&1 | grep -v "^WARNING: Location" || true
done
ls -1 .whl
du -sh .whl
