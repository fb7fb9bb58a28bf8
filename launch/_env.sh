# Sourced by launch/run_local.sh and launch/test.sh (not run on its own): picks the Python
# interpreter Tandem runs with, and installs the project into .venv/ when nothing usable exists.
#
#   tandem_python ROOT [EXTRAS MODULE...]     sets PY
#
# PY is, in this order: $TANDEM_PYTHON; ROOT/.venv/bin/python; python3 on PATH; the first one that
# finds the runtime dependencies and every MODULE. When none can, ROOT/.venv is created if it
# does not exist and the project is installed there with pip install -e 'ROOT[EXTRAS]' (with
# $TANDEM_PYTHON set, into that interpreter instead). torch is installed as torch==2.13.0 (the CPU
# wheel) only when no torch is importable, so a CUDA build already there is kept; a bare "torch"
# is never asked for (pip would pull the CUDA wheels).

# Found, not imported: importing them takes 3-4 s on a small host, at every launch. An installed
# package that fails to import is reported by the process that imports it, naming the module.
_tandem_runtime_ok() { [[ -z "$(_tandem_missing "$1" torch tensordict zmq msgpack gymnasium tensorboard)" ]]; }

_tandem_missing() {  # print the MODULEs that PY cannot find (without importing them: fast)
  local py=$1; shift
  [[ $# -gt 0 ]] || return 0
  "$py" - "$@" <<'PYEOF' 2>/dev/null || echo "$*"
import importlib.util, sys
print(" ".join(m for m in sys.argv[1:] if importlib.util.find_spec(m) is None))
PYEOF
}

_tandem_usable() { local py=$1; shift; _tandem_runtime_ok "$py" && [[ -z "$(_tandem_missing "$py" "$@")" ]]; }

tandem_python() {
  local root=$1 extras=${2:-}; shift; shift || true
  local pip=(-m pip install -q --disable-pip-version-check) missing
  if [[ -n "${TANDEM_PYTHON:-}" ]]; then
    PY="$TANDEM_PYTHON"
    [[ $# -eq 0 ]] && return 0          # the caller's own choice, used as it is
    _tandem_usable "$PY" "$@" && return 0
  elif [[ -x "$root/.venv/bin/python" ]] && _tandem_usable "$root/.venv/bin/python" "$@"; then
    PY="$root/.venv/bin/python"; return 0
  elif command -v python3 >/dev/null && _tandem_usable python3 "$@"; then
    PY="$(command -v python3)"; return 0
  else
    PY="$root/.venv/bin/python"
    if [[ ! -x "$PY" ]]; then
      echo "[setup] creating $root/.venv (first use; installing takes a few minutes)"
      python3 -m venv "$root/.venv" || return 1
      "$PY" "${pip[@]}" --upgrade pip || return 1
    fi
  fi
  missing="$(_tandem_missing "$PY" "$@")"
  echo "[setup] installing tandem-rl${extras:+[$extras]} into $PY${missing:+ (missing: $missing)}"
  if ! "$PY" -c "import torch" >/dev/null 2>&1; then
    "$PY" "${pip[@]}" torch==2.13.0 || return 1
  fi
  "$PY" "${pip[@]}" -e "$root${extras:+[$extras]}" || return 1
  if ! _tandem_usable "$PY" "$@"; then
    echo "[setup] $PY still cannot import: $(_tandem_missing "$PY" "$@") (runtime check:" \
         "torch, tensordict, zmq, msgpack, gymnasium, tensorboard)" >&2
    return 1
  fi
}
