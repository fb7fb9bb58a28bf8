#!/usr/bin/env bash
# One-time set-up for ManiSkill3 tasks (env.id "maniskill/<EnvId>"):   launch/setup_maniskill.sh
#
# 1. Installs the project's 'maniskill' extra (mani-skill, SAPIEN) into the interpreter that
#    launch/run_local.sh uses (.venv/ by default; see launch/_env.sh).
# 2. SAPIEN needs a Vulkan device even for state observations. When none works (a machine without a
#    GPU; Debian 12's own lavapipe, Mesa 22.3, lacks VK_KHR_external_semaphore_fd), it fetches a newer
#    lavapipe (Mesa's CPU Vulkan driver) from Debian's bookworm-backports with apt-get download, into
#    a private apt state, and unpacks it with dpkg -x into .vulkan/ in the repository. The system's
#    Mesa is not touched and nothing needs root. shared/envs/maniskill.py selects .vulkan/ for its
#    own process (VK_ICD_FILENAMES and friends), so nothing else is needed by hand.
# 3. Checks the result: builds PushCube-v1 on the CPU backend and steps it.
#
# TANDEM_VULKAN_DIR overrides .vulkan/; TANDEM_FORCE_LAVAPIPE=1 installs lavapipe even when a
# Vulkan driver already works.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
# shellcheck source=launch/_env.sh
source "$ROOT/launch/_env.sh"
t0=$SECONDS
tandem_python "$ROOT" "maniskill" mani_skill sapien
VK="${TANDEM_VULKAN_DIR:-$ROOT/.vulkan}"

check() {  # builds and steps a ManiSkill task; quiet unless it fails
  (cd "$ROOT" && timeout 300 "$PY" - <<'PYEOF'
import warnings; warnings.filterwarnings("ignore")
import time, torch
from shared.envs.maniskill import ManiSkillEnv, use_local_vulkan
local = use_local_vulkan()
t = time.perf_counter()
env = ManiSkillEnv("PushCube-v1", 1, {"control_mode": "pd_ee_delta_pos"})
for _ in range(50):
    env.step(torch.zeros(1, 4))
from shared.envs.maniskill import vulkan_dir
print(f"[setup] ManiSkill3 works ({f'lavapipe from {vulkan_dir()}' if local else 'the Vulkan driver already set up'}): "
      f"PushCube-v1 built and stepped in {time.perf_counter() - t:.1f} s")
env.close()
PYEOF
  )
}

if [[ "${TANDEM_FORCE_LAVAPIPE:-0}" != 1 && ! -f "$VK/lvp_icd.json" ]] && check 2>/dev/null; then
  mkdir -p "$VK" && touch "$VK/ok"    # launch/test.sh runs this script again only without it
  echo "[setup] done in $((SECONDS - t0)) s"; exit 0
fi

if [[ ! -f "$VK/lvp_icd.json" ]]; then
  . /etc/os-release 2>/dev/null || true
  if [[ "${VERSION_CODENAME:-}" != bookworm ]]; then
    echo "[setup] no working Vulkan driver, and this is not Debian 12 (bookworm) but '${PRETTY_NAME:-unknown}':" >&2
    echo "[setup] install Mesa >= 24.3 (lavapipe, package mesa-vulkan-drivers) or a GPU driver, then run this again." >&2
    exit 1
  fi
  work="$(mktemp -d)"; trap 'rm -rf "$work"' EXIT
  mkdir -p "$work"/{lists/partial,cache/archives/partial,debs,root}
  cat > "$work/sources.list" <<EOF
deb http://deb.debian.org/debian bookworm-backports main
deb http://deb.debian.org/debian bookworm main
EOF
  apt=(-o "Dir::Etc::SourceList=$work/sources.list" -o Dir::Etc::SourceParts=/dev/null
       -o "Dir::State::Lists=$work/lists" -o "Dir::Cache=$work/cache" -o Debug::NoLocking=1
       -o APT::Sandbox::User="$(id -un)")
  echo "[setup] fetching lavapipe (mesa-vulkan-drivers) from bookworm-backports"
  apt-get "${apt[@]}" -qq update
  pkgs=(mesa-vulkan-drivers/bookworm-backports libdrm2/bookworm-backports libdrm-amdgpu1/bookworm-backports)
  (cd "$work/debs" && apt-get "${apt[@]}" -qq download "${pkgs[@]}")
  for deb in "$work"/debs/*.deb; do dpkg -x "$deb" "$work/root"; done
  lib="$work/root/usr/lib/x86_64-linux-gnu"
  # libraries the driver needs that this system lacks (libLLVM of the backport's Mesa, usually)
  for _ in 1 2 3; do
    missing=$(LD_LIBRARY_PATH="$lib" ldd "$lib/libvulkan_lvp.so" | awk '/not found/ {print $1}')
    [[ -z "$missing" ]] && break
    for so in $missing; do
      pkg=$(apt-cache "${apt[@]}" search --names-only "^lib$(echo "${so%%.so*}" | sed 's/^lib//; s/-\([0-9]\)/\1/' | tr 'A-Z' 'a-z')\$" | awk '{print $1; exit}')
      [[ -n "$pkg" ]] || { echo "[setup] lavapipe needs $so and no bookworm package was found for it" >&2; exit 1; }
      echo "[setup] also fetching $pkg (for $so)"
      (cd "$work/debs" && apt-get "${apt[@]}" -qq download "$pkg") && dpkg -x "$work/debs/${pkg}"_*.deb "$work/root"
    done
  done
  missing=$(LD_LIBRARY_PATH="$lib" ldd "$lib/libvulkan_lvp.so" | awk '/not found/ {print $1}')
  [[ -z "$missing" ]] || { echo "[setup] lavapipe still lacks: $missing" >&2; exit 1; }
  mkdir -p "$VK/lib"
  cp -a "$lib"/libvulkan_lvp.so "$lib"/libdrm*.so* "$VK/lib/"
  cp -a "$lib"/libLLVM*.so* "$VK/lib/" 2>/dev/null || true
  printf '{"file_format_version": "1.0.0", "ICD": {"api_version": "1.4.305", "library_path": "%s"}}\n' \
    "$VK/lib/libvulkan_lvp.so" > "$VK/lvp_icd.json"
  echo "[setup] lavapipe installed in $VK ($(du -sh "$VK" | cut -f1))"
fi
check
touch "$VK/ok"
echo "[setup] done in $((SECONDS - t0)) s"
