"""hybridsync/lost_hosts.py: the keepalives mpirun needs to end a job whose host was lost, the
advice a rank prints when they are missing, and the backstop that ends a launcher process.
The whole story on real launchers: tests/parallel/test_cluster.py (the lost-host tests)."""
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from hybridsync import lost_hosts

ROOT = Path(__file__).resolve().parents[2]


def test_keepalives_notice_a_lost_daemon_within_the_peer_timeout():
    assert lost_hosts.keepalive_mca(60) == {"oob_tcp_keepalive_time": 6, "oob_tcp_keepalive_intvl": 6,
                                            "oob_tcp_keepalive_probes": 7}
    assert lost_hosts.keepalive_mca(15) == {"oob_tcp_keepalive_time": 1, "oob_tcp_keepalive_intvl": 1,
                                            "oob_tcp_keepalive_probes": 11}
    for timeout in (4, 5, 10, 15, 30, 60, 61, 120, 600, 3600):
        values = lost_hosts.keepalive_mca(timeout)
        env = {f"OMPI_MCA_{k}": str(v) for k, v in values.items()}
        noticed = lost_hosts.keepalive_seconds(env)
        # Before the ranks abort (then the kill message on the link stops the keepalives) ...
        assert noticed <= 0.8 * timeout, (timeout, values)
        # ... but not so eager that a busy daemon's short silence ends a healthy job.
        assert noticed >= min(0.5 * timeout, timeout - 2), (timeout, values)
        assert all(isinstance(v, int) and v >= 1 for v in values.values()), values
    assert lost_hosts.keepalive_mca(0) == {}  # peer timeout off: nothing to be within


def test_keepalive_seconds_reads_openmpis_defaults_and_the_users_values():
    assert lost_hosts.keepalive_seconds({}) == 300 + 20 * 9  # OpenMPI 4's defaults: 8 minutes
    assert lost_hosts.keepalive_seconds({"OMPI_MCA_oob_tcp_keepalive_time": "6", "OMPI_MCA_oob_tcp_keepalive_intvl": "6",
                                         "OMPI_MCA_oob_tcp_keepalive_probes": "7"}) == 48
    assert lost_hosts.keepalive_seconds({"OMPI_MCA_oob_tcp_keepalive_time": "0"}) is None  # turned off
    assert lost_hosts.keepalive_seconds({"OMPI_MCA_oob_tcp_keepalive_intvl": "soon"}) is None


def test_the_advice_names_the_exact_flags_and_exports_and_is_silent_when_they_are_set():
    advice = lost_hosts.launcher_advice(60, {})
    assert "only after 480 s" in advice and "HYBRIDSYNC_PEER_TIMEOUT_S=60" in advice, advice
    assert ("`--mca oob_tcp_keepalive_time 6 --mca oob_tcp_keepalive_intvl 6 --mca oob_tcp_keepalive_probes 7`"
            in advice), advice
    assert ("`export OMPI_MCA_oob_tcp_keepalive_time=6 OMPI_MCA_oob_tcp_keepalive_intvl=6 "
            "OMPI_MCA_oob_tcp_keepalive_probes=7`" in advice), advice
    assert "hybridsync-run" in advice and "docs/lost-hosts.md" in advice
    assert "are off" in lost_hosts.launcher_advice(60, {"OMPI_MCA_oob_tcp_keepalive_time": "0"})
    given = {f"OMPI_MCA_{k}": str(v) for k, v in lost_hosts.keepalive_mca(60).items()}
    assert lost_hosts.launcher_advice(60, given) is None
    assert lost_hosts.launcher_advice(0, {}) is None


def test_a_lost_peer_is_read_from_the_python_and_the_cpp_messages():
    python = RuntimeError("hybridsync: rank 3 on host node-b.cluster has not been heard from for 60 s (frozen, ...)")
    cpp = RuntimeError("hybridsync: rank 12 on host hs1 has not been heard from for 61 s (frozen, dead or unreachable;"
                       " HYBRIDSYNC_PEER_TIMEOUT_S=60) while waiting for pull")
    assert lost_hosts.lost_peer(python) == (3, "node-b.cluster")
    assert lost_hosts.lost_peer(cpp) == (12, "hs1")
    assert lost_hosts.lost_peer(RuntimeError("rank 1 (host a) has shut down")) is None


def test_a_frozen_peer_on_this_host_arms_nothing_and_says_nothing(capsys):
    lost_hosts.prepare_for_abort("here", "here", 60, env={})
    assert capsys.readouterr().err == ""


def test_a_peer_lost_on_another_host_gets_the_advice_from_one_rank_per_host(capsys):
    lost_hosts.prepare_for_abort("node-b", "node-a", 60, first_to_advise=lambda: True, backstop=False, env={})
    assert "pass mpirun `--mca oob_tcp_keepalive_time 6" in capsys.readouterr().err
    lost_hosts.prepare_for_abort("node-b", "node-a", 60, first_to_advise=lambda: False, backstop=False,
                                 env={})  # another rank of the host said it
    assert capsys.readouterr().err == ""
    given = {f"OMPI_MCA_{k}": str(v) for k, v in lost_hosts.keepalive_mca(60).items()}
    asked = []
    lost_hosts.prepare_for_abort("node-b", "node-a", 60, first_to_advise=lambda: asked.append(1) or True,
                                 backstop=False, env=given)  # launched right: nothing to say, no claim taken
    assert capsys.readouterr().err == "" and asked == []


def test_one_process_per_host_claims_a_name_and_the_claim_ends_with_it():
    from hybridsync import _liveness, _ps_testing

    name = f"hybridsync-test-claim-{os.getpid()}-{time.monotonic_ns()}"
    claim = [sys.executable, "-c", f"import sys; from hybridsync import _liveness; sys.exit(0 if _liveness.first_on_this_host({name!r}) else 3)"]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    assert subprocess.run(claim, env=env).returncode == 0  # first: claimed, and released as it ended
    assert _liveness.first_on_this_host(name)
    assert not _liveness.first_on_this_host(name)  # the same process again
    assert subprocess.run(claim, env=env).returncode == 3  # another process on this host


# What the backstop saw of itself: its session, its descriptors.
_SELF_REPORT = """import json, os, sys
fds = {}
for fd in range(64):
    try:
        os.fstat(fd)
    except OSError:
        continue
    fds[fd] = os.readlink(f"/proc/self/fd/{fd}")
json.dump({"own_session": os.getsid(0) == os.getpid(), "fds": fds}, open(sys.argv[1], "w"))
"""


def test_the_watchdogs_last_words_start_a_detached_backstop_and_advise_once_per_host(tmp_path, capfd):
    from hybridsync import _liveness, _ps_testing

    report = tmp_path / "report.json"
    claim = f"hybridsync-test-advice-{os.getpid()}-{time.monotonic_ns()}"
    backstop = [sys.executable, "-c", _SELF_REPORT, str(report)]
    _liveness.set_lost_host_last_words("ADVICE: pass mpirun the flags", claim, backstop, "NOTE: the backstop is armed")
    _ps_testing.say_lost_host_last_words()
    err = capfd.readouterr().err
    assert "ADVICE: pass mpirun the flags\n" in err and "NOTE: the backstop is armed\n" in err, err
    for _ in range(1200):  # (up to a minute: a loaded machine starts a Python process slowly)
        if report.exists() and report.stat().st_size:
            break
        time.sleep(0.05)
    seen = json.loads(report.read_text())
    # Detached: the daemon's kill of the rank's process group misses it, and it holds none of the
    # rank's pipes to its launcher or its sockets.
    assert seen["own_session"], seen
    assert seen["fds"] == {"0": "/dev/null", "1": "/dev/null", "2": "/dev/null"}, seen
    # Once: a second silent peer arms nothing more.
    report.unlink()
    _ps_testing.say_lost_host_last_words()
    time.sleep(0.5)
    assert capfd.readouterr().err == "" and not report.exists()
    # Another rank of this host advised first (it holds the claim): only the backstop, silently.
    _liveness.set_lost_host_last_words("ADVICE", claim, backstop, "NOTE")
    _ps_testing.say_lost_host_last_words()
    assert capfd.readouterr().err == ""
    for _ in range(1200):  # (up to a minute: a loaded machine starts a Python process slowly)
        if report.exists() and report.stat().st_size:
            break
        time.sleep(0.05)
    assert report.exists(), "the backstop did not start"


def test_the_watchdogs_last_words_are_the_advice_and_the_backstop_of_this_rank():
    advice, claim, backstop, note = lost_hosts.watchdog_last_words(60, "job7", backstop=True, env={})
    assert advice == lost_hosts.launcher_advice(60, {}) and claim == lost_hosts.advice_claim("job7")
    assert (backstop, note) == ([], "")  # under pytest the parent is no launcher: nothing to end
    given = {f"OMPI_MCA_{k}": str(v) for k, v in lost_hosts.keepalive_mca(60).items()}
    assert lost_hosts.watchdog_last_words(60, "job7", env=given)[0] == ""  # launched right: nothing to say
    assert lost_hosts.advice_claim("job7") != lost_hosts.advice_claim("job8")


def test_only_an_openmpi_launcher_process_is_a_backstop_target():
    assert lost_hosts.launcher_process(os.getpid()) is None  # python: not a launcher
    assert lost_hosts.launcher_process(2**22 + 7) is None  # no such process


@pytest.mark.skipif(not os.path.exists("/proc/self/comm"), reason="needs /proc")
def test_the_backstop_ends_a_launcher_process_that_outlives_the_abort(tmp_path):
    # A stand-in daemon: `sleep` under the name orted (the kernel names a process by its file).
    orted = tmp_path / "orted"
    shutil.copy(shutil.which("sleep"), orted)
    daemon = subprocess.Popen([str(orted), "60"])
    try:
        time.sleep(0.2)
        assert lost_hosts.launcher_process(daemon.pid) == daemon.pid
        started = lost_hosts.start_time(daemon.pid)
        backstop = subprocess.Popen(lost_hosts.backstop_command(daemon.pid, started, 0.5), start_new_session=True)
        assert daemon.wait(timeout=10) == -9  # killed by the backstop
        assert backstop.wait(timeout=10) == 0
    finally:
        if daemon.poll() is None:
            daemon.kill()
            daemon.wait()
    # A launcher that ended by itself is left alone (and its pid is not signalled again).
    gone = subprocess.Popen(lost_hosts.backstop_command(daemon.pid, started, 0.1))
    assert gone.wait(timeout=10) == 0


@pytest.mark.skipif(not os.path.exists("/proc/self/stat"), reason="needs /proc")
def test_the_backstop_signals_no_process_but_the_one_it_was_made_for():
    """The pid is there, but its start time is not the one recorded: another process."""
    other = subprocess.Popen(["sleep", "30"])
    try:
        assert lost_hosts.start_time(other.pid) is not None
        stale = str(int(lost_hosts.start_time(other.pid)) - 1)
        assert subprocess.run(lost_hosts.backstop_command(other.pid, stale, 0.05), timeout=10).returncode == 0
        assert other.poll() is None, "the backstop killed a process it was not made for"
    finally:
        other.kill()
        other.wait()
    assert lost_hosts.start_time(2**22 + 7) is None


# Runs as pid 1 of a fresh pid namespace, where the test may choose the next pid: a stand-in
# launcher (named orted) starts a rank, which makes the watchdog's last words as at heartbeat
# start; the launcher exits, an unrelated process gets its pid, and the backstop runs.
_LAUNCHER = """
import ctypes, subprocess, sys
ctypes.CDLL(None).prctl(15, b"orted", 0, 0, 0)  # PR_SET_NAME: /proc/<pid>/comm now says orted
rank = ("import json, hybridsync.lost_hosts as lh; lh.BACKSTOP_DELAY_S = 0.2; "
        "print(json.dumps(lh.watchdog_last_words(60, 'job', env={})[2]))")
sys.stdout.write(subprocess.run([sys.executable, "-c", rank], capture_output=True, text=True, check=True).stdout)
"""
_PID_REUSE = """
import json, subprocess, sys
first = subprocess.Popen([sys.executable, "-c", sys.argv[1]], stdout=subprocess.PIPE, text=True)
backstop = json.loads(first.communicate()[0])
assert first.returncode == 0 and backstop, "the stand-in launcher was not taken for one"
with open("/proc/sys/kernel/ns_last_pid", "w") as f:
    f.write(str(first.pid - 1))
reused = subprocess.Popen(["sleep", "30"])
assert reused.pid == first.pid, (reused.pid, first.pid)
subprocess.run(backstop, check=True, timeout=30)
print("REUSED-PID", "alive" if reused.poll() is None else "killed")
reused.kill()
reused.wait()
"""
_NAMESPACE = ["unshare", "--user", "--map-root-user", "--pid", "--fork", "--mount-proc"]


def _can_make_pid_namespaces() -> bool:
    try:
        return subprocess.run(_NAMESPACE + ["true"], capture_output=True, timeout=30).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


@pytest.mark.skipif(not _can_make_pid_namespaces(), reason="needs unshare and unprivileged pid namespaces")
def test_the_backstop_leaves_alone_a_process_that_took_over_the_launchers_pid():
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    done = subprocess.run(_NAMESPACE + [sys.executable, "-c", _PID_REUSE, _LAUNCHER], capture_output=True,
                          text=True, timeout=120, env=env)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "REUSED-PID alive" in done.stdout, done.stdout + done.stderr
