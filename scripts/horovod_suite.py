#!/usr/bin/env python
"""Runs one of Horovod's own test suites against hybridsync, or against Horovod itself with
--horovod, one test per `mpirun -np N` launch:

  --suite torch       test/parallel/test_torch.py            against hybridsync.torch
  --suite tensorflow  test/parallel/test_tensorflow.py        against hybridsync.tensorflow
  --suite keras       test/parallel/test_tensorflow2_keras.py against hybridsync.tensorflow.keras
                                                              and hybridsync.keras

Not part of the project's test suite: it needs a checkout of Horovod's repository.

    python scripts/horovod_suite.py --git-dir /path/to/horovod/.git --rev v0.28.1 --backend mpi
    python scripts/horovod_suite.py --git-dir /path/to/horovod/.git --suite keras
    python scripts/horovod_suite.py --git-dir /path/to/horovod/.git --suite tensorflow -k allreduce,allgather
    python scripts/horovod_suite.py path/to/test_torch.py --backend horovod --json out.json
    python scripts/horovod_suite.py path/to/test_torch.py --horovod          # real Horovod

The copies of Horovod's files differ from the originals only in their horovod import lines
(IMPORTS below; left as they are with --horovod). Horovod's test/utils/common.py needs packages
this project does not install (mock, horovod.runner), so the copy gets a small helper module of
our own with the functions the suites take from it, and a small `parameterized` of our own where
the package is not installed. Each test is one mpirun job under its own process group; one that
runs past --timeout is killed whole and counted as HUNG.
"""
from __future__ import annotations

import argparse
import ast
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
import typing
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OUTCOMES = ("passed", "failed", "hung", "skipped")


class Suite(typing.NamedTuple):
    files: tuple  # paths in Horovod's repository; the first is the test file, the rest what it imports
    imports: tuple  # (Horovod's import line, hybridsync's): each occurs in the files, at most once in each


SUITES = {
    "torch": Suite(("test/parallel/test_torch.py",), (("import horovod.torch as hvd", "import hybridsync.torch as hvd"),)),
    "tensorflow": Suite(
        ("test/parallel/test_tensorflow.py", "test/parallel/base_test_tensorflow.py"),
        (("import horovod.tensorflow as hvd", "import hybridsync.tensorflow as hvd"),
         ("from horovod.tensorflow.util import _executing_eagerly", "from hybridsync.tensorflow.util import _executing_eagerly"))),
    "keras": Suite(
        ("test/parallel/test_tensorflow2_keras.py",),
        (("import horovod.keras as hvd_keras", "import hybridsync.keras as hvd_keras"),
         ("import horovod.tensorflow.keras as hvd", "import hybridsync.tensorflow.keras as hvd"))),
}
IMPORT_LINE = re.compile(r"^import horovod\.torch as hvd[ \t]*$", re.M)  # (the torch suite's; kept for callers)

# What the TensorFlow suites import from the `parameterized` package (not a requirement here),
# written here: @parameterized.expand([...]) makes one test per parameter list, named
# <test>_<index>_<first parameter>, as the package names them.
PARAMETERIZED = '''\
import functools, re, sys


def _safe(value):
    return re.sub("[^a-zA-Z0-9_]", "_", str(value))


class parameterized:
    @staticmethod
    def expand(cases):
        def decorator(func):
            namespace = sys._getframe(1).f_locals
            for index, case in enumerate(cases):
                case = tuple(case) if isinstance(case, (list, tuple)) else (case,)

                def test(self, _case=case):
                    return func(self, *_case)

                name = f"{func.__name__}_{index}_{_safe(case[0])}" if case else f"{func.__name__}_{index}"
                namespace[name] = functools.wraps(func)(test)
                namespace[name].__name__ = name
            return None
        return decorator
'''

# What test_torch.py imports from Horovod's test/utils/common.py, written here (not copied).
COMMON_HELPERS = '''\
import contextlib, os, shutil, tempfile


def mpi_env_rank_and_size():
    """(rank, size) from the MPI launcher's environment; (0, 1) outside one."""
    for rank_var, size_var in (("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE"), ("PMI_RANK", "PMI_SIZE")):
        if rank_var in os.environ and size_var in os.environ:
            return int(os.environ[rank_var]), int(os.environ[size_var])
    return 0, 1


def skip_or_fail_gpu_test(test, message):
    if os.environ.get("HOROVOD_TEST_GPU", "0") not in ("", "0"):
        test.fail(message)
    test.skipTest(message)


@contextlib.contextmanager
def temppath():
    folder = tempfile.mkdtemp()
    try:
        yield os.path.join(folder, "temp_test_file")
    finally:
        shutil.rmtree(folder, ignore_errors=True)
'''


def load_sources(args, suite: Suite) -> dict:
    """{file name: source} of the suite's files, from --git-dir or beside the given test file."""
    if args.git_dir:
        return {Path(f).name: subprocess.run(["git", f"--git-dir={args.git_dir}", "show", f"{args.rev}:{f}"],
                                             check=True, capture_output=True, text=True).stdout for f in suite.files}
    folder = Path(args.test_file).parent
    return {Path(args.test_file).name: Path(args.test_file).read_text(),
            **{Path(f).name: (folder / Path(f).name).read_text() for f in suite.files[1:]}}


def load_source(args) -> str:
    return next(iter(load_sources(args, SUITES["torch"]).values()))


def switch_imports(sources: dict, suite: Suite) -> dict:
    """The sources with each of the suite's Horovod import lines replaced by hybridsync's."""
    out = dict(sources)
    for horovod_line, ours in suite.imports:
        pattern = re.compile(rf"^{re.escape(horovod_line)}[ \t]*$", re.M)
        counts = {name: len(pattern.findall(text)) for name, text in out.items()}
        if not any(counts.values()) or max(counts.values()) > 1:
            raise SystemExit(f"expected exactly one line `{horovod_line}` in {' or '.join(sorted(sources))}")
        out = {name: pattern.sub(ours, text) for name, text in out.items()}
    return out


def write_copy(source, real_horovod: bool, workdir: Path, suite: Suite = SUITES["torch"]) -> Path:
    """The suite's files (`source`: the test file's text, or {file name: text}) with their
    imports switched, in workdir/parallel/, beside workdir/utils/common.py (where the original's
    sys.path line looks for it). Returns the test file's copy."""
    sources = source if isinstance(source, dict) else {Path(suite.files[0]).name: source}
    if not real_horovod:
        sources = switch_imports(sources, suite)
    (workdir / "parallel").mkdir(parents=True, exist_ok=True)
    (workdir / "utils").mkdir(exist_ok=True)
    (workdir / "utils" / "common.py").write_text(COMMON_HELPERS)
    try:
        import parameterized  # noqa: F401
    except ImportError:
        (workdir / "parallel" / "parameterized.py").write_text(PARAMETERIZED)
    for name, text in sources.items():
        (workdir / "parallel" / name).write_text(text)
    return workdir / "parallel" / next(iter(sources))


def _expanded(func: ast.FunctionDef) -> list[str]:
    """Names @parameterized.expand([...]) gives a test method (the method itself if undecorated)."""
    for decorator in func.decorator_list:
        if isinstance(decorator, ast.Call) and ast.unparse(decorator.func).endswith("parameterized.expand"):
            cases = ast.literal_eval(decorator.args[0])
            names = []
            for index, case in enumerate(cases):
                case = tuple(case) if isinstance(case, (list, tuple)) else (case,)
                suffix = re.sub("[^a-zA-Z0-9_]", "_", str(case[0])) if case else ""
                names.append(f"{func.name}_{index}_{suffix}" if case else f"{func.name}_{index}")
            return names
    return [func.name]


def list_tests(source: str) -> list[str]:
    """`Class::test_name` of every test method of every unittest.TestCase subclass, in file order."""
    tests = []
    for node in ast.parse(source).body:
        if isinstance(node, ast.ClassDef) and any("TestCase" in ast.unparse(b) or "Tests" in ast.unparse(b)
                                                  for b in node.bases):
            tests += [f"{node.name}::{name}" for f in node.body
                      if isinstance(f, ast.FunctionDef) and f.name.startswith("test") for name in _expanded(f)]
    return tests


# pytest -q's last line on each rank, e.g. "[1,0]<stdout>:1 passed, 2 warnings in 3.82s"; the ranks'
# output interleaves, so a tag may start mid-line.
_SUMMARY = re.compile(r"\[\d+,(\d+)\]<stdout>:[= ]*(\d+ (?:passed|failed|skipped|errors?|deselected)\b[^\[\n]*?) "
                      r"in [\d.]+s")


def classify(rc: int, output: str, np_: int) -> str:
    """passed / failed / skipped from every rank's pytest summary line."""
    per_rank = {int(rank): summary for rank, summary in _SUMMARY.findall(output)}
    if len(per_rank) != np_:
        return "failed"  # a rank crashed or was aborted before pytest could report
    if any(re.search(r"\b(failed|error|errors)\b", s) for s in per_rank.values()):
        return "failed"
    if rc != 0:
        return "failed"
    if all("skipped" in s and "passed" not in s for s in per_rank.values()):
        return "skipped"
    # TensorFlow's run_all_in_graph_and_eager_modes runs a test as two subtests: a test whose
    # subtests were all skipped (a GPU test on a CPU machine) "passed" without running.
    if all("skipped" in s and "subtests passed" not in s for s in per_rank.values()):
        return "skipped"
    if all("passed" in s for s in per_rank.values()):
        return "passed"
    return "failed"  # e.g. skipped on one rank, passed on another


def run_one(copy: Path, test: str, args, env: dict) -> tuple[str, float, str]:
    cmd = ["mpirun", "-np", str(args.np), "--oversubscribe", "--bind-to", "none", "--tag-output"]
    if os.geteuid() == 0:
        cmd.append("--allow-run-as-root")
    cmd += [sys.executable, "-m", "pytest", f"{copy}::{test}", "-x", "-q", "-p", "no:cacheprovider", "--color=no",
            "-W", "ignore::DeprecationWarning"]
    start = time.monotonic()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                            cwd=copy.parent, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=args.timeout)
        outcome = classify(proc.returncode, out, args.np)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # mpirun and every rank it started
        out, _ = proc.communicate()
        outcome = "hung"
    except BaseException:  # Ctrl-C: leave no ranks behind
        os.killpg(proc.pid, signal.SIGKILL)
        raise
    return outcome, time.monotonic() - start, out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("test_file", nargs="?", help="path of the suite's test file in Horovod's test/parallel/")
    parser.add_argument("--suite", choices=sorted(SUITES), default="torch", help="which of Horovod's suites (torch)")
    parser.add_argument("--git-dir", help="a Horovod git directory (instead of test_file)")
    parser.add_argument("--rev", default="v0.28.1", help="revision in --git-dir (default v0.28.1)")
    parser.add_argument("--backend", choices=("horovod", "mpi"), default="horovod",
                        help="hybridsync's dense backend (HYBRIDSYNC_BACKEND; the TensorFlow frontend always uses mpi)")
    parser.add_argument("--horovod", action="store_true", help="run against real Horovod (no import switch)")
    parser.add_argument("--np", type=int, default=2, help="ranks per test (default 2)")
    parser.add_argument("--timeout", type=float, default=120, help="seconds per test before it counts as hung")
    parser.add_argument("-k", "--select", help="only tests whose name contains one of these comma-separated substrings")
    parser.add_argument("--json", help="where to write per-test outcomes (default: horovod_suite.<label>.json)")
    parser.add_argument("--logs", help="folder for each non-passing test's output")
    args = parser.parse_args(argv)
    if bool(args.test_file) == bool(args.git_dir):
        parser.error("give either test_file or --git-dir")

    from tqdm import tqdm

    suite = SUITES[args.suite]
    sources = load_sources(args, suite)
    wanted = [w for w in (args.select or "").split(",") if w]
    tests = [t for t in list_tests(next(iter(sources.values()))) if not wanted or any(w in t for w in wanted)]
    label = "horovod" if args.horovod else f"hybridsync-{args.backend}"
    if args.suite != "torch":
        label = f"{label if args.horovod else 'hybridsync'}-{args.suite}"
    env = dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
               PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    if not args.horovod:
        env["HYBRIDSYNC_BACKEND"] = args.backend
    logs = Path(args.logs) if args.logs else None
    if logs:
        logs.mkdir(parents=True, exist_ok=True)
    results = {}
    with tempfile.TemporaryDirectory(prefix="horovod_suite.") as tmp:
        copy = write_copy(sources, args.horovod, Path(tmp), suite)
        bar = tqdm(tests, desc=label, unit="test")
        for test in bar:  # one at a time: each job already takes every core of a small host
            outcome, seconds, out = run_one(copy, test, args, env)
            results[test] = {"outcome": outcome, "seconds": round(seconds, 1)}
            bar.set_postfix({k: sum(r["outcome"] == k for r in results.values()) for k in OUTCOMES})
            if outcome in ("failed", "hung"):
                tqdm.write(f"{outcome.upper():7} {test}")
                if logs:
                    (logs / f"{test.replace('::', '.')}.log").write_text(out)
    counts = {k: sum(r["outcome"] == k for r in results.values()) for k in OUTCOMES}
    print(f"\n{label} ({args.rev if args.git_dir else args.test_file}, -np {args.np}, {len(tests)} tests)")
    print(" | ".join(f"{k} {counts[k]}" for k in OUTCOMES))
    for test, r in results.items():
        if r["outcome"] in ("failed", "hung"):
            print(f"  {r['outcome']:7} {test}")
    out_path = Path(args.json or f"horovod_suite.{label}.json")
    out_path.write_text(json.dumps({"label": label, "np": args.np, "counts": counts, "tests": results}, indent=1))
    print(f"per-test outcomes: {out_path}")
    return 0 if counts["failed"] == counts["hung"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
