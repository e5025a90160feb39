"""The C++ core's own unit tests (tests/cpp: shard, update rules, partitioner, deduplication,
routing, row aggregation, the transport and rule registries, a Client over an in-memory
transport, threads sharing a Client), built with CMake and run here so that `make test` runs
them. The build directory build/cpp-tests is kept, so later runs only recompile what changed."""
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
BUILD = ROOT / "build" / "cpp-tests"


def _run(cmd, cwd, timeout):
    done = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, f"{' '.join(map(str, cmd))} failed:\n{done.stdout[-6000:]}\n{done.stderr[-6000:]}"
    return done.stdout


def test_cpp_unit_tests_pass():
    BUILD.mkdir(parents=True, exist_ok=True)
    if not (BUILD / "CMakeCache.txt").exists():
        _run(["cmake", str(ROOT), "-DCMAKE_BUILD_TYPE=Release", f"-DPython_EXECUTABLE={sys.executable}"], BUILD, 300)
    jobs = str(min(os.cpu_count() or 2, 4))
    _run(["cmake", "--build", ".", "--target", "hybridsync_cpp_tests", "-j", jobs], BUILD, 600)
    out = _run([str(BUILD / "hybridsync_cpp_tests")], BUILD, 120)
    assert " passed, 0 failed" in out, out
