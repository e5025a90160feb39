"""Runs a scenario on N real MPI ranks (`mpirun -np N`) and checks that every rank passed it.

A parallel test file is both the pytest module and the program each rank runs:

    def rank_allreduce():          # runs on every rank; asserts raise, and a raise aborts the job
        ...
    @pytest.mark.parametrize("np_", [2, 3])
    def test_allreduce(np_):
        run_ranks(__file__, "rank_allreduce", np_)
    if __name__ == "__main__":
        rank_main(globals())

A rank that fails aborts the whole job (hybridsync's excepthook calls MPI_Abort), a job that
runs past its timeout is killed, and the test passes only if every rank printed its OK line.
"""
from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
OK_MARK = "HYBRIDSYNC-RANK-OK"


def mpirun_prefix(np_: int) -> list[str]:
    cmd = ["mpirun", "-np", str(np_), "--oversubscribe", "--bind-to", "none", "--tag-output"]
    if os.geteuid() == 0:
        cmd.append("--allow-run-as-root")
    return cmd


def launch(cmd: list[str], timeout: float, env: dict | None = None) -> tuple[int, str]:
    """Runs a launcher command in its own process group; kills the group if it hangs.

    The environment is passed explicitly: a test process that has initialised MPI itself
    (importing hybridsync._ps does) carries PMIx variables in its C-level environment that
    make a child mpirun exit silently."""
    import pytest

    full_env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    full_env.update(env or {})
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=full_env, cwd=ROOT, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        pytest.fail(f"{' '.join(cmd)} hung: killed after {timeout:.0f} s\n{out}")
    return proc.returncode, out


def run_program(np_: int, *argv: str, timeout: float = 240, env: dict | None = None) -> str:
    """Runs `python argv...` on np_ ranks; fails the test unless it exits 0. Returns the output."""
    import pytest

    rc, out = launch(mpirun_prefix(np_) + [sys.executable, "-u", *argv], timeout, env)
    if rc != 0:
        pytest.fail(f"{' '.join(argv)} on {np_} ranks exited {rc}\n{out}")
    return out


def run_ranks(script: str, scenario: str, np_: int, *args: str, timeout: float = 180,
              env: dict | None = None, launcher: list[str] | None = None) -> str:
    """Runs `python script scenario args...` on np_ ranks; returns the combined output."""
    import pytest

    cmd = (launcher or mpirun_prefix(np_)) + [sys.executable, "-u", script, scenario, *args]
    proc_returncode, out = launch(cmd, timeout, env)
    passed = {int(m) for m in re.findall(rf"{OK_MARK} rank=(\d+)", out)}
    if proc_returncode != 0 or passed != set(range(np_)):
        missing = sorted(set(range(np_)) - passed)
        pytest.fail(f"{scenario} on {np_} ranks failed (exit {proc_returncode}; "
                    f"ranks without OK: {missing})\n{out}")
    return out


EVENT_MARK = "HYBRIDSYNC-EVENT"


def mark_event(name: str) -> None:
    """Rank side: prints when `name` happened (wall clock, which every process on this machine
    shares), for seconds_since_event. Call it just before the event (a rank freezing, dying)."""
    import time

    print(f"{EVENT_MARK} {name} at={time.time():.3f}", flush=True)


def seconds_since_event(out: str, name: str) -> float:
    """Test side, right after the job ended: seconds since a rank marked `name`. A bound on how
    soon a job ends after an event is measured from the event, not from the launch: starting
    mpirun and importing torch take as long as the machine's load makes them."""
    import time

    import pytest

    found = re.findall(rf"{EVENT_MARK} {re.escape(name)} at=([0-9.]+)", out)
    if not found:
        pytest.fail(f"no rank marked the event {name!r}\n{out}")
    return time.time() - float(found[0])


def rank_main(namespace: dict) -> None:
    """The rank side: runs the scenario named by argv[1] with the remaining argv."""
    import hybridsync

    hybridsync.init()
    scenario = namespace[sys.argv[1]]
    scenario(*sys.argv[2:])
    print(f"{OK_MARK} rank={hybridsync.rank()}", flush=True)
