"""Environment variables, parsed once (the first time they are needed).

HYBRIDSYNC_BACKEND       dense all-reduce backend: horovod | mpi (default: horovod when installed, the job
                         has more than one rank and every local rank has a spare core; else mpi)
HYBRIDSYNC_CONFIG        path of a YAML config used when none is passed in code
HYBRIDSYNC_TIMEOUT_S     a PS operation waiting longer than this raises (default 600; 0 = never)
HYBRIDSYNC_SPIN_US       poll (yielding the core) this long before sleeping while waiting for peers
                         (default 20000)
HYBRIDSYNC_MAX_SLEEP_US  cap of the sleep back-off while waiting (default 200)
HYBRIDSYNC_TIMELINE      write a Chrome trace of each step's phases to this file
HYBRIDSYNC_BATCH_LOOKUPS 0 turns off batching all PS embedding pulls of a forward into one
HYBRIDSYNC_EXPLAIN       1: rank 0 prints each plan once it is made, and then what `sync: auto`
                         decided (hybridsync-run sets it)
HYBRIDSYNC_FUSION_MB     MPI backend: size of one fused all-reduce bucket in MiB (default 64)
HYBRIDSYNC_PEER_TIMEOUT_S a peer not heard from (heartbeat) this long fails the wait with an error
                         naming it; a peer that is alive but slow gets a warning after as long
                         (default 60; 0 = off)
HYBRIDSYNC_AUTO          off: sparse variables default to the parameter server and `sync: auto`
                         means ps, nothing is measured (default: on)
HYBRIDSYNC_AUTO_STEPS    steps `sync: auto` measures before it picks a route (default 20; a config's
                         `auto_steps` wins)
HYBRIDSYNC_CACHE_DIR     where link probes are cached (default ~/.cache/hybridsync)
HYBRIDSYNC_MAX_MESSAGE_BYTES the largest single PS network message; longer ones travel in fragments
                         and whole-table reads and writes go in chunks below it (default: 1 GiB;
                         the smallest value of any rank is used)
HYBRIDSYNC_LOST_HOST_BACKSTOP 0: a rank that aborts the job over a peer lost on another host does not
                         end its launcher process (orted / mpirun) if the job still runs 5 s later
                         (default: on; docs/lost-hosts.md)

Launch facts read from the launcher's variables (not set by users) are parsed here too:
launched_by_mpi(), launched_by_gloo() and gloo_world().
"""
import dataclasses
import functools
import os


class SettingsError(ValueError):
    """An environment variable has a value hybridsync cannot use."""


@dataclasses.dataclass(frozen=True)
class Settings:
    backend: str | None
    config_path: str | None
    timeout_s: float
    spin_us: float | None
    max_sleep_us: float
    timeline: str | None
    batch_lookups: bool
    overlap_dense: bool
    explain: bool
    fusion_bytes: int
    peer_timeout_s: float
    auto: bool = True
    auto_steps: int = 20
    cache_dir: str = ""
    max_message_bytes: int = 1 << 30
    lost_host_backstop: bool = True


BACKENDS = ("horovod", "mpi")


def _float(name: str, default: float | None) -> float | None:
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    try:
        value = float(raw)
    except ValueError:
        raise SettingsError(f"{name}={raw!r} is not a number") from None
    if value < 0:
        raise SettingsError(f"{name}={raw!r} must be >= 0")
    return value


@functools.lru_cache(maxsize=1)
def settings() -> Settings:
    backend = os.environ.get("HYBRIDSYNC_BACKEND") or None
    if backend is not None and backend not in BACKENDS:
        raise SettingsError(f"HYBRIDSYNC_BACKEND={backend!r}: expected one of {', '.join(BACKENDS)}")
    return Settings(
        backend=backend,
        config_path=os.environ.get("HYBRIDSYNC_CONFIG") or None,
        timeout_s=_float("HYBRIDSYNC_TIMEOUT_S", 600.0),
        spin_us=_float("HYBRIDSYNC_SPIN_US", None),
        max_sleep_us=_float("HYBRIDSYNC_MAX_SLEEP_US", 200.0),
        timeline=os.environ.get("HYBRIDSYNC_TIMELINE") or None,
        batch_lookups=os.environ.get("HYBRIDSYNC_BATCH_LOOKUPS", "1") not in ("0", "false", "no"),
        overlap_dense=os.environ.get("HYBRIDSYNC_OVERLAP_DENSE", "1") not in ("0", "false", "no"),
        explain=os.environ.get("HYBRIDSYNC_EXPLAIN", "0") in ("1", "true", "yes"),
        fusion_bytes=max(1, int(_float("HYBRIDSYNC_FUSION_MB", 64.0) * 2**20)),
        peer_timeout_s=_float("HYBRIDSYNC_PEER_TIMEOUT_S", 60.0),
        auto=_switch("HYBRIDSYNC_AUTO", True),
        auto_steps=_positive_int("HYBRIDSYNC_AUTO_STEPS", 20),
        cache_dir=os.environ.get("HYBRIDSYNC_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "hybridsync"),
        max_message_bytes=_positive_int("HYBRIDSYNC_MAX_MESSAGE_BYTES", 1 << 30),
        lost_host_backstop=_switch("HYBRIDSYNC_LOST_HOST_BACKSTOP", True),
    )


def _switch(name: str, default: bool) -> bool:
    raw = os.environ.get(name, "").strip().lower()
    if raw == "":
        return default
    if raw in ("1", "on", "true", "yes"):
        return True
    if raw in ("0", "off", "false", "no"):
        return False
    raise SettingsError(f"{name}={raw!r}: expected on or off")


def _positive_int(name: str, default: int) -> int:
    raw = os.environ.get(name, "").strip()
    if raw == "":
        return default
    try:
        value = int(raw)
    except ValueError:
        raise SettingsError(f"{name}={raw!r} is not an integer") from None
    if value < 1:
        raise SettingsError(f"{name}={raw!r} must be >= 1")
    return value


_MPI_LAUNCH_VARS = ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_RANK", "MPI_LOCALNRANKS", "SLURM_STEP_NUM_TASKS")


def launched_by_mpi() -> bool:
    """Started by mpirun / srun (or horovodrun in its MPI mode)."""
    return any(v in os.environ for v in _MPI_LAUNCH_VARS)


def launched_by_gloo() -> bool:
    """`horovodrun --gloo`: ranks exist, but not as an MPI job."""
    return "HOROVOD_GLOO_RENDEZVOUS_ADDR" in os.environ and not launched_by_mpi()


def gloo_world() -> tuple[int, int, int, int]:
    """(rank, size, local_rank, local_size) that `horovodrun --gloo` gives each process."""
    return tuple(int(os.environ.get(f"HOROVOD_{k}", d)) for k, d in
                 (("RANK", 0), ("SIZE", 1), ("LOCAL_RANK", 0), ("LOCAL_SIZE", 1)))


def wait_spin_us() -> float:
    """How long a waiting rank polls, yielding its core on every poll, before it sleeps.
    Polling with sched_yield costs nothing a co-located rank needs (it runs first), and it
    notices a peer's answer within microseconds, where a sleep wakes up 50-200 us late
    (docs/performance.md has the measurement)."""
    s = settings()
    return s.spin_us if s.spin_us is not None else 20000.0
