"""The C++ core's own unit tests (tests/cpp: shard, update rules, partitioner, deduplication,
routing, row aggregation, the transport and rule registries, a Client over an in-memory
transport), built with CMake and run here so that `make test` runs them."""
import os
import subprocess
import sys
import sysconfig
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _build_dir() -> Path:
    # setup.py's CMake build directory: its compiled core is reused, only the tests compile.
    tag = sysconfig.get_platform() + "-" + sysconfig.get_python_version()
    build = ROOT / "build" / f"cmake-{tag}"
    if not (build / "CMakeCache.txt").exists():
        build = ROOT / "build" / "cpp-tests"
        build.mkdir(parents=True, exist_ok=True)
        subprocess.run(["cmake", str(ROOT), "-DCMAKE_BUILD_TYPE=Release", f"-DPython_EXECUTABLE={sys.executable}"],
                       cwd=build, check=True, capture_output=True, text=True)
    return build


def test_cpp_unit_tests_pass():
    build = _build_dir()
    made = subprocess.run(["cmake", "--build", ".", "--target", "hybridsync_cpp_tests", "-j", str(os.cpu_count() or 2)],
                          cwd=build, capture_output=True, text=True, timeout=600)
    assert made.returncode == 0, made.stdout[-4000:] + made.stderr[-4000:]
    ran = subprocess.run([str(build / "hybridsync_cpp_tests")], capture_output=True, text=True, timeout=120)
    assert ran.returncode == 0, ran.stdout + ran.stderr
    assert " passed, 0 failed" in ran.stdout, ran.stdout
