"""A host that drops off the network: what the MPI launchers need to end the job in time.

The ranks still up name the lost peer within HYBRIDSYNC_PEER_TIMEOUT_S and abort the job. The
abort reaches mpirun, which sends every daemon (orted) a kill message and waits for each to
confirm. The lost host's daemon never answers, and TCP retransmits the unacknowledged kill
message for about 15 minutes before mpirun gives up: the job outlives its error by that long.

Two things end it sooner, both framework-neutral (docs/lost-hosts.md):

- OpenMPI's TCP keepalives on mpirun's links to its daemons (the oob_tcp_keepalive_* MCA
  parameters) set to fire before the peer timeout: mpirun notices the lost daemon while its link
  is still idle and ends the job itself. Linux probes only idle links, so they must fire before
  the abort puts the kill message on the link. keepalive_mca() computes them from the peer
  timeout; launcher_advice() says how to pass them to mpirun and horovodrun when a rank finds
  them missing (mpirun hands its MCA parameters to the ranks as OMPI_MCA_* variables).
- A backstop on the ranks: a rank about to abort the job over a peer lost on another host (its
  excepthook: prepare_for_abort(); or the heartbeat's C++ watchdog, with the words
  watchdog_last_words() gave it) leaves a small detached process behind which, if the launcher
  process that started the rank (orted, or mpirun itself) is still there a few seconds later,
  kills it. Where mpirun runs on a host with ranks (their parent), the job then ends, non-zero.
  The launcher is named by its pid *and* its start time, read when the backstop's command is
  made (the watchdog's, when the heartbeat starts -- possibly hours before): a process that took
  over the pid since is not the launcher, and is left alone.
"""
from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys

# OpenMPI 4's own values (ompi_info --param oob tcp --level 9): the first probe after 5 idle
# minutes, a lost daemon noticed after 8.
OPENMPI_DEFAULTS = {"oob_tcp_keepalive_time": 300, "oob_tcp_keepalive_intvl": 20, "oob_tcp_keepalive_probes": 9}

# The share of the peer timeout within which mpirun's keepalives notice a lost daemon: before the
# ranks abort (at the peer timeout plus a second), while mpirun's links are still idle.
_KEEPALIVE_SHARE = 0.8

# Seconds after a rank aborted the job over a lost peer before its backstop ends the launcher
# process that started it (mpirun with keepalives has ended the job long before).
BACKSTOP_DELAY_S = 5.0

# The launcher processes a backstop may end: OpenMPI's daemon and mpirun (4.x and 5.x names).
_LAUNCHER_PROCESSES = ("orted", "mpirun", "orterun", "mpiexec", "prted", "prterun")

_LOST_PEER = re.compile(r"rank (\d+) on host (\S+) has not been heard from")


def keepalive_mca(peer_timeout_s: float) -> dict[str, int]:
    """The oob_tcp_keepalive_* values that have mpirun notice a lost daemon within 0.8 x the
    peer timeout (at least a few seconds): {} when the peer timeout is off (0).
    60 s -> time 6, intvl 6, probes 7 (noticed within 48 s)."""
    if peer_timeout_s <= 0:
        return {}
    step = max(1, int(peer_timeout_s / 10))
    probes = max(1, int((_KEEPALIVE_SHARE * peer_timeout_s - step) / step))
    return {"oob_tcp_keepalive_time": step, "oob_tcp_keepalive_intvl": step, "oob_tcp_keepalive_probes": probes}


def keepalive_seconds(env) -> float | None:
    """Seconds after which mpirun, launched with `env`, notices a daemon whose link went down
    (idle time + interval x probes); None when its keepalives are off or a value is unreadable."""
    values = {}
    for name, default in OPENMPI_DEFAULTS.items():
        raw = env.get(f"OMPI_MCA_{name}", default)
        try:
            values[name] = int(raw)
        except (TypeError, ValueError):
            return None
    if values["oob_tcp_keepalive_time"] <= 0:
        return None
    return values["oob_tcp_keepalive_time"] + values["oob_tcp_keepalive_intvl"] * values["oob_tcp_keepalive_probes"]


def mpirun_flags(peer_timeout_s: float) -> str:
    """`--mca oob_tcp_keepalive_time 6 ...`, as typed on mpirun's command line."""
    return " ".join(f"--mca {k} {v}" for k, v in keepalive_mca(peer_timeout_s).items())


def exports(peer_timeout_s: float) -> str:
    """`export OMPI_MCA_oob_tcp_keepalive_time=6 ...`, as typed before horovodrun (or mpirun)."""
    return "export " + " ".join(f"OMPI_MCA_{k}={v}" for k, v in keepalive_mca(peer_timeout_s).items())


def lost_peer(exc: BaseException) -> tuple[int, str] | None:
    """(rank, host) of the peer an error says went silent; None for any other error."""
    found = _LOST_PEER.search(str(exc))
    return (int(found.group(1)), found.group(2)) if found else None


def launcher_advice(peer_timeout_s: float, env) -> str | None:
    """What to pass the launcher so that mpirun ends the job by itself after a host is lost;
    None when the keepalives it was launched with already fire within the peer timeout."""
    if peer_timeout_s <= 0:
        return None
    noticed = keepalive_seconds(env)
    if noticed is not None and noticed <= peer_timeout_s:
        return None
    now = "are off" if noticed is None else f"notice a lost daemon only after {noticed:.0f} s"
    return (f"hybridsync: mpirun's TCP keepalives (oob_tcp_keepalive_*) {now}, later than "
            f"HYBRIDSYNC_PEER_TIMEOUT_S={peer_timeout_s:g}: it may wait ~15 minutes on the lost host's daemon. "
            f"To have it end the job within the peer timeout, pass mpirun `{mpirun_flags(peer_timeout_s)}`, "
            f"or before horovodrun `{exports(peer_timeout_s)}`, or launch with hybridsync-run "
            "(docs/lost-hosts.md)")


def launcher_process(pid: int | None = None) -> int | None:
    """The OpenMPI launcher process that started this rank (its parent: orted, or mpirun on
    mpirun's own host); None under any other parent (a batch system's step daemon, a shell)."""
    pid = os.getppid() if pid is None else pid
    return pid if _name(pid) in _LAUNCHER_PROCESSES else None


def start_time(pid: int) -> str | None:
    """When process `pid` started (field 22 of /proc/<pid>/stat: clock ticks since boot): with the
    pid, what tells the process from a later one that reuses its pid. None when there is none."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
    except OSError:
        return None
    fields = stat.rpartition(")")[2].split()  # after the name, which may hold spaces and ')'
    return fields[19] if len(fields) > 19 else None


def backstop_command(target: int, started: str, delay_s: float) -> list[str]:
    """A shell that, after delay_s, kills `target` if it is still the process that started at
    `started` (start_time(target) when the launcher was chosen): a process that reused the pid
    meanwhile is not signalled. SIGKILL, not SIGTERM: mpirun already aborting answers a TERM
    with "abort is already in progress" and keeps waiting, and a second one (every rank of the
    host leaves a backstop) makes OpenMPI 4.1's forced exit crash in PMIx_Finalize (a segfault
    and its stack trace)."""
    script = (f"sleep {delay_s:g}; "
              f"stat=$(cat /proc/{target}/stat 2>/dev/null) || exit 0; "
              'set -- ${stat##*") "}; '  # fields from the 3rd on: the start time is the 20th
              f'[ "${{20}}" = {shlex.quote(str(started))} ] || exit 0; '
              f"kill -KILL {target} 2>/dev/null; exit 0")
    return ["/bin/sh", "-c", script]


def _launcher_backstop(delay_s: float) -> tuple[int, list[str]] | None:
    """(the launcher process, the command that ends it after delay_s), or None where there is
    no launcher to end."""
    target = launcher_process()
    started = start_time(target) if target is not None else None
    if started is None:
        return None
    return target, backstop_command(target, started, delay_s)


def arm_backstop(delay_s: float = BACKSTOP_DELAY_S) -> int | None:
    """Leaves the backstop behind, detached (its own session: the daemon's kill of this rank
    does not reach it; stdio on /dev/null: it holds none of the launcher's pipes open). Returns
    the launcher process it watches, or None where there is none to end."""
    found = _launcher_backstop(delay_s)
    if found is None:
        return None
    target, command = found
    try:
        subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                         stderr=subprocess.DEVNULL, start_new_session=True, close_fds=True)
    except OSError:
        return None
    return target


def backstop_note(target: int) -> str:
    """The line that says a backstop now watches launcher process `target`."""
    return (f"hybridsync: if the job still runs {BACKSTOP_DELAY_S:g} s after this abort, this rank's "
            f"launcher process ({shlex.quote(_name(target))}, pid {target}) is killed")


def advice_claim(job_key: str) -> str:
    """The name under which one rank per host claims the advice (_liveness.first_on_this_host): the
    job's key (the same on every rank) keeps jobs sharing a host apart."""
    return f"hybridsync-lost-host-advice-{job_key}"


def watchdog_last_words(peer_timeout_s: float, job_key: str, backstop: bool = True, env=None):
    """The heartbeat watchdog's last words (_liveness.set_lost_host_last_words), computed when it starts:
    where nothing can raise (a rank blocked in Horovod's own collectives) the C++ watchdog aborts
    the job, past every Python hook, so it says the advice (the first rank on its host to get
    there) and starts the backstop itself. Returns (advice, advice_claim, backstop argv, note)."""
    advice = launcher_advice(peer_timeout_s, os.environ if env is None else env) or ""
    found = _launcher_backstop(BACKSTOP_DELAY_S) if backstop else None
    if found is None:
        return advice, advice_claim(job_key), [], ""
    target, command = found
    return advice, advice_claim(job_key), command, backstop_note(target)


def prepare_for_abort(lost_host: str, my_host: str, peer_timeout_s: float, first_to_advise=lambda: True,
                      backstop: bool = True, env=None) -> None:
    """A peer on another host went silent and this rank is about to abort the job: say what the
    launcher needs when it lacks it (if first_to_advise(): one rank per host does) and arm the
    backstop (unless HYBRIDSYNC_LOST_HOST_BACKSTOP=0)."""
    if lost_host == my_host:
        return  # a frozen peer on this host: its daemon is reachable and ends it
    advice = launcher_advice(peer_timeout_s, os.environ if env is None else env)
    advise = bool(advice) and first_to_advise()
    if advise:
        sys.stderr.write(advice + "\n")
    target = arm_backstop() if backstop else None
    if target is not None and advise:
        sys.stderr.write(backstop_note(target) + "\n")
    sys.stderr.flush()


def _name(pid: int) -> str:
    """The process's name (its executable's, as ps shows it); '?' when there is no such process."""
    try:
        with open(f"/proc/{pid}/comm") as f:
            return f.read().strip()
    except OSError:
        return "?"
