"""Builds hybridsync and its C++ extension hybridsync._ps with CMake.

The CMake build directory is kept under build/ so that `pip install -e .` after a C++ change
recompiles only what changed.
"""
import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

from setuptools import Extension, find_packages, setup
from setuptools.command.build_ext import build_ext

ROOT = Path(__file__).resolve().parent


class CMakeExtension(Extension):
    def __init__(self, name):
        super().__init__(name, sources=[])


class CMakeBuild(build_ext):
    CORE = "libhybridsync_ps.so"  # the core the modules share, found beside them ($ORIGIN)

    def copy_extensions_to_source(self):
        """In place (pip install -e, build_ext --inplace): the shared core goes with the modules."""
        super().copy_extensions_to_source()
        package_dir = Path(self.get_finalized_command("build_py").get_package_dir("hybridsync"))
        shutil.copyfile(Path(self.build_lib) / "hybridsync" / self.CORE, package_dir / self.CORE)

    def build_extension(self, ext):
        out_dir = Path(self.get_ext_fullpath(ext.name)).resolve().parent
        tag = sysconfig.get_platform() + "-" + sysconfig.get_python_version()
        build_dir = ROOT / "build" / f"cmake-{tag}"
        build_dir.mkdir(parents=True, exist_ok=True)
        cfg = os.environ.get("HYBRIDSYNC_BUILD_TYPE", "Release")
        subprocess.check_call(
            [
                "cmake",
                str(ROOT),
                f"-DCMAKE_BUILD_TYPE={cfg}",
                f"-DCMAKE_LIBRARY_OUTPUT_DIRECTORY={out_dir}",
                f"-DPython_EXECUTABLE={sys.executable}",
            ],
            cwd=build_dir,
        )
        jobs = str(os.cpu_count() or 2)
        target = ext.name.rsplit(".", 1)[1]  # (the shared core library is built with the first)
        subprocess.check_call(["cmake", "--build", ".", "--target", target, "-j", jobs], cwd=build_dir)


setup(
    name="hybridsync",
    version="0.1.0",
    description="Hybrid synchronization for distributed training: all-reduce for dense, a C++ parameter server for sparse",
    packages=find_packages(include=["hybridsync", "hybridsync.*"]) + ["hybridsync_launch"],
    package_dir={"hybridsync_launch": "launch"},
    entry_points={"console_scripts": ["hybridsync-run=hybridsync_launch.run:main"]},
    ext_modules=[CMakeExtension("hybridsync._ps"), CMakeExtension("hybridsync._liveness"),
                 CMakeExtension("hybridsync._ps_testing")],
    cmdclass={"build_ext": CMakeBuild},
    python_requires=">=3.9",
    install_requires=["numpy", "mpi4py", "pyyaml"],
    zip_safe=False,
)
