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

Starting ranks costs seconds (each imports torch or TensorFlow), so scenarios that share a world
size and environment can share one launch: `run_scenarios(__file__, np_, "rank_a", ("rank_b",
arg))` runs them one after the other in the same processes, each with its own asserts, and a
failure names the sub-case that failed.
"""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
OK_MARK = "HYBRIDSYNC-RANK-OK"
ONE_THREAD_PER_RANK = ("OMP_NUM_THREADS", "TF_NUM_INTRAOP_THREADS", "TF_NUM_INTEROP_THREADS")


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
    # One compute thread per rank unless the caller says otherwise: the suite runs 2-3 ranks per
    # core, and torch's and TensorFlow's pools of a thread per core each then spin on cores that
    # other ranks need (a tenth of a TensorFlow test's CPU time).
    for var in ONE_THREAD_PER_RANK:
        full_env.setdefault(var, "1")
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


SUBCASE_MARK = "HYBRIDSYNC-SUBCASE"
SEQUENCE_ARG = "--scenarios"


def _subcase_name(index: int, spec: list) -> str:
    name, *args = spec
    return f"#{index + 1} {name}({', '.join(map(repr, args))})"


def run_scenarios(script: str, np_: int, *scenarios, timeout: float = 240,
                  env: dict | None = None, launcher: list[str] | None = None) -> str:
    """Runs several scenarios in ONE `mpirun -np np_` launch, in order, in the same processes:
    each entry is a scenario name or a (name, *args) tuple. A failure names the first sub-case
    that not every rank finished (the ranks that finished it, the traceback in the output).
    Returns the combined output."""
    import pytest

    specs = [[s] if isinstance(s, str) else [s[0], *map(str, s[1:])] for s in scenarios]
    cmd = (launcher or mpirun_prefix(np_)) + [sys.executable, "-u", script, SEQUENCE_ARG, json.dumps(specs)]
    returncode, out = launch(cmd, timeout, env)
    # (the lines mpirun tagged, reassembled, and the output as it is: a launcher may not tag)
    marks = out + "\n" + "\n".join(line for _, line in rank_lines(out) if SUBCASE_MARK in line or OK_MARK in line)
    for index, spec in enumerate(specs):
        done = {int(m) for m in re.findall(rf"{SUBCASE_MARK} done #{index + 1} rank=(\d+)", marks)}
        if done != set(range(np_)):
            passed = ", ".join(_subcase_name(i, s) for i, s in enumerate(specs[:index])) or "none"
            pytest.fail(f"sub-case {_subcase_name(index, spec)} of {Path(script).name} on {np_} ranks "
                        f"failed (exit {returncode}; ranks that finished it: {sorted(done)}; "
                        f"sub-cases passed before it: {passed})\n{out}")
    passed = {int(m) for m in re.findall(rf"{OK_MARK} rank=(\d+)", marks)}
    if returncode != 0 or passed != set(range(np_)):
        pytest.fail(f"{Path(script).name} on {np_} ranks: every sub-case passed, but the job failed "
                    f"(exit {returncode}; ranks without OK: {sorted(set(range(np_)) - passed)})\n{out}")
    return out


_TAG = re.compile(r"\[\d+,(\d+)\]<(std(?:out|err))>:")


def rank_lines(out: str) -> list[tuple[int, str]]:
    """(rank, line) for each line the ranks printed, in the order the lines were completed.
    mpirun --tag-output tags what it forwards, not lines: a long line can arrive in pieces
    with another rank's output between them, each piece tagged anew."""
    lines, pending = [], {}
    tags = list(_TAG.finditer(out))
    for tag, following in zip(tags, tags[1:] + [None]):
        key = (int(tag.group(1)), tag.group(2))
        parts = out[tag.end():following.start() if following else len(out)].split("\n")
        pending[key] = pending.get(key, "") + parts[0]
        if len(parts) > 1:  # (text after the newline and before the next tag is mpirun's own)
            lines.append((key[0], tag.group(0) + pending.pop(key)))
    return lines + [(key[0], f"[1,{key[0]}]<{key[1]}>:{text}") for key, text in pending.items()]


def subcase_output(out: str, index: int) -> str:
    """The lines sub-case #index (from 1) of a run_scenarios output printed, on every rank:
    each rank's lines between its start and done marks of that sub-case."""
    lines, inside = [], set()
    for rank, line in rank_lines(out):
        if f"{SUBCASE_MARK} start #{index} " in line:
            inside.add(rank)
        elif f"{SUBCASE_MARK} done #{index} " in line:
            inside.discard(rank)
        elif rank in inside:
            lines.append(line)
    return "\n".join(lines)


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
    """The rank side: runs the scenario named by argv[1] with the remaining argv, or, after
    --scenarios, each scenario of the JSON list in turn (run_scenarios)."""
    import hybridsync

    hybridsync.init()
    if sys.argv[1] == SEQUENCE_ARG:
        for index, spec in enumerate(json.loads(sys.argv[2])):
            name = _subcase_name(index, spec)
            print(f"{SUBCASE_MARK} start {name} rank={hybridsync.rank()}", flush=True)
            try:
                namespace[spec[0]](*spec[1:])
            except BaseException:
                print(f"{SUBCASE_MARK} FAILED {name} rank={hybridsync.rank()}", flush=True)
                raise
            print(f"{SUBCASE_MARK} done #{index + 1} rank={hybridsync.rank()}", flush=True)
    else:
        namespace[sys.argv[1]](*sys.argv[2:])
    print(f"{OK_MARK} rank={hybridsync.rank()}", flush=True)
