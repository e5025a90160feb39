#!/usr/bin/env bash
# Installs everything hybridsync needs on a Debian machine with Python 3.11:
#   Debian's OpenMPI + build tools, a venv at <repo>/.venv, the Python packages of
#   scripts/requirements.txt, mpi4py built against the system MPI, Horovod 0.28.1 built
#   from its sdist with a C++17 fix (wheel cached outside the checkout), and hybridsync itself.
# Idempotent: every step checks first, so a second run takes seconds.
#
# Environment:
#   PYTHON            interpreter for the venv (default: python3.11, else python3)
#   HYBRIDSYNC_VENV   venv location (default: <repo>/.venv)
#   HYBRIDSYNC_CACHE  wheel cache (default: ~/.cache/hybridsync)
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
VENV=${HYBRIDSYNC_VENV:-$ROOT/.venv}
CACHE=${HYBRIDSYNC_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/hybridsync}
TORCH_VERSION=2.13.0
HOROVOD_VERSION=0.28.1
REQS=$ROOT/scripts/requirements.txt

log() { printf '[install] %s\n' "$*"; }
as_root() { if [ "$(id -u)" = 0 ]; then "$@"; else sudo "$@"; fi; }
# Runs a command quietly; on failure prints everything it said.
quiet() {
  local out
  out=$(mktemp)
  if ! "$@" >"$out" 2>&1; then
    cat "$out" >&2
    rm -f "$out"
    log "FAILED: $*"
    return 1
  fi
  rm -f "$out"
}

# --- 1. System packages: OpenMPI, compilers, cmake -------------------------------------
missing=()
command -v mpirun >/dev/null || missing+=(openmpi-bin)
command -v mpicxx >/dev/null || missing+=(libopenmpi-dev)
command -v cmake >/dev/null || missing+=(cmake)
command -v g++ >/dev/null || missing+=(g++)
command -v make >/dev/null || missing+=(make)
if [ ${#missing[@]} -gt 0 ]; then
  log "apt-get install ${missing[*]}"
  quiet as_root apt-get update
  quiet as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends "${missing[@]}"
fi

# --- 2. The venv -----------------------------------------------------------------------
if [ ! -x "$VENV/bin/python" ]; then
  PY=${PYTHON:-$(command -v python3.11 || command -v python3)}
  log "creating $VENV with $PY"
  if ! "$PY" -m venv "$VENV" 2>/dev/null; then
    quiet as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y python3-venv
    "$PY" -m venv "$VENV"
  fi
  quiet "$VENV/bin/python" -m pip install --upgrade pip setuptools wheel
fi
PIP=("$VENV/bin/python" -m pip)
stamp_of() { sha256sum "$@" | sha256sum | cut -c1-16; }

# --- 3. Python packages ----------------------------------------------------------------
req_stamp=$VENV/.hybridsync-requirements
if [ "$(cat "$req_stamp" 2>/dev/null)" != "$(stamp_of "$REQS")" ]; then
  log "pip install -r scripts/requirements.txt (torch, tensorflow-cpu, ...)"
  quiet "${PIP[@]}" install -r "$REQS"
  stamp_of "$REQS" >"$req_stamp"
fi
# mpi4py from source, so that it links the same libmpi as Horovod and our extension
# (wheel cached per MPI version).
pytag=$("$VENV/bin/python" -c 'import sys; print(f"cp{sys.version_info[0]}{sys.version_info[1]}")')
if ! "$VENV/bin/python" -c 'import mpi4py.MPI' 2>/dev/null; then
  mpi_version=$(mpirun --version 2>/dev/null | head -n1 | tr -cs 'A-Za-z0-9.' '-' | sed 's/-$//')
  mpi4py_dir=$CACHE/wheels/mpi4py-$mpi_version-$pytag
  if ! ls "$mpi4py_dir"/mpi4py-*.whl >/dev/null 2>&1; then
    log "building mpi4py against $(command -v mpicc) (cached in $mpi4py_dir)"
    mkdir -p "$mpi4py_dir"
    quiet env MPICC="$(command -v mpicc)" "${PIP[@]}" wheel --no-deps --no-binary mpi4py -w "$mpi4py_dir" mpi4py
  fi
  quiet "${PIP[@]}" install --no-deps "$mpi4py_dir"/mpi4py-*.whl
fi

# --- 4. Horovod 0.28.1, patched for C++17 (today's torch needs it) ----------------------
wheel_dir=$CACHE/wheels/horovod-$HOROVOD_VERSION-torch-$TORCH_VERSION-$pytag
hvd_ok() { "$VENV/bin/python" -c "import horovod, horovod.torch; assert horovod.__version__ == '$HOROVOD_VERSION'" 2>/dev/null; }
if ! hvd_ok; then
  if ! ls "$wheel_dir"/horovod-*.whl >/dev/null 2>&1; then
    log "building horovod $HOROVOD_VERSION (about 4 minutes on 2 cores; cached in $wheel_dir)"
    work=$(mktemp -d)
    trap 'rm -rf "$work"' EXIT
    quiet "${PIP[@]}" download --no-deps --no-binary :all: --no-build-isolation -d "$work" "horovod==$HOROVOD_VERSION"
    tar xzf "$work/horovod-$HOROVOD_VERSION.tar.gz" -C "$work"
    src=$work/horovod-$HOROVOD_VERSION
    # The three C++17 edits: torch 2.x headers no longer compile as C++14/C++11.
    sed -i 's/set(CMAKE_CXX_STANDARD 14)/set(CMAKE_CXX_STANDARD 17)/' \
      "$src/CMakeLists.txt" "$src/horovod/torch/CMakeLists.txt"
    sed -i 's/-std=c++11 -fPIC/-std=c++17 -fPIC/' "$src/third_party/gloo/CMakeLists.txt"
    grep -q 'CMAKE_CXX_STANDARD 17' "$src/horovod/torch/CMakeLists.txt"
    mkdir -p "$wheel_dir"
    quiet env HOROVOD_WITH_PYTORCH=1 HOROVOD_WITHOUT_TENSORFLOW=1 HOROVOD_WITHOUT_MXNET=1 \
      HOROVOD_WITH_MPI=1 HOROVOD_WITH_GLOO=1 \
      CMAKE_POLICY_VERSION_MINIMUM=3.5 MAKEFLAGS=-j$(nproc) \
      "${PIP[@]}" wheel --no-deps --no-build-isolation -w "$wheel_dir" "$src"
  fi
  log "installing cached horovod wheel from $wheel_dir"
  quiet "${PIP[@]}" install --no-deps --force-reinstall "$wheel_dir"/horovod-*.whl
  hvd_ok
fi

# --- 5. hybridsync itself (editable; rebuilt when the C++ sources change) ---------------
src_stamp=$(stamp_of "$ROOT/setup.py" "$ROOT/CMakeLists.txt" $(find "$ROOT/csrc" -type f | sort))
if [ "$(cat "$VENV/.hybridsync-build" 2>/dev/null)" != "$src_stamp" ] || \
   ! "$VENV/bin/python" -c 'import hybridsync._ps, hybridsync._liveness, hybridsync._ps_testing' 2>/dev/null; then
  log "building hybridsync (pip install -e .)"
  quiet "${PIP[@]}" install --no-deps --no-build-isolation -e "$ROOT"
  echo "$src_stamp" >"$VENV/.hybridsync-build"
fi
log "ready: $VENV"
