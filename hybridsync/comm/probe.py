"""A short link probe for the cost model of `sync: auto` (hybridsync/sync/cost_model.py):
latency and bandwidth of point-to-point messages and of all-reduce on this job's hosts, and
the memory bandwidth of one rank (what a local optimizer update costs per byte).

It runs once per host set: rank 0 writes the result to
`<HYBRIDSYNC_CACHE_DIR or ~/.cache/hybridsync>/links-<hash>.json`, the hash being that of the
sorted host names of every rank (so 2 ranks on host a and 2 on host b is one set, 4 on host a
another). Delete the file to probe again. The probe takes well under a second on 1 Gbit and
faster links: 8-byte ping-pongs between rank 0 and one rank (on another host when there is
one) for the latency, 4 MiB streamed one way in 1 MiB messages for the bandwidth (a single
message can ride a rate limiter's burst and look several times faster than the link), 8-byte
and 1 MiB all-reduces over every rank, and a streaming add on rank 0.

What the host set alone does not fix is measured at every start and never cached: how many
ranks share a host (they share its link) and how many CPUs those ranks may run on (more
ranks than CPUs: every CPU cost stretches).
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import socket
import time

import numpy as np

from .. import runtime
from ..settings import settings

SMALL, LARGE = 8, 1 << 20  # bytes
SMALL_REPEATS, LARGE_REPEATS = 40, 6
STREAM_MESSAGES, STREAM_REPEATS = 4, 3  # bandwidth: STREAM_MESSAGES x LARGE one way, then an ack
FORMAT = 2  # cache files of another format are probed again


@dataclasses.dataclass
class Links:
    """What the cost model knows about the job's links (seconds, bytes per second)."""

    p2p_latency_s: float
    p2p_bandwidth: float
    allreduce_latency_s: float
    allreduce_bandwidth: float  # payload bytes / s of a large all-reduce (algorithm bandwidth)
    memory_bandwidth: float  # bytes / s a rank streams through memory (a += b counts 3 passes)
    ranks: int = 1
    hosts: int = 1
    source: str = "probe"  # "probe" | "cache" | a caller's own
    format: int = FORMAT
    # Facts of this start (not cached; see the module docstring):
    ranks_per_host: int = 1  # most ranks on one host (they share its link)
    cpus_per_host: int = 0  # fewest CPUs a host's ranks may run on (0: unknown)
    collective_s: float = 0.0  # one small collective of the dense backend (0: not measured)

    def to_json(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, d: dict) -> "Links":
        known = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in known})


def cache_path(hostnames, cache_dir: str | None = None) -> str:
    """The cache file of a host set: links-<first 16 hex of sha256(sorted host names)>.json."""
    digest = hashlib.sha256(json.dumps(sorted(hostnames)).encode()).hexdigest()[:16]
    return os.path.join(cache_dir or settings().cache_dir, f"links-{digest}.json")


def links(comm=None) -> Links:
    """Collective: this job's links, from the cache of its host set or probed (then cached)."""
    comm = comm if comm is not None else runtime.mpi_comm()
    rank, size = comm.Get_rank(), comm.Get_size()
    hostnames = comm.allgather(socket.gethostname())
    path = cache_path(hostnames)
    cached = _read(path) if rank == 0 else None
    cached = comm.bcast(cached, root=0)
    if cached is not None:
        found = Links.from_json(cached)
        found.source = "cache"
    else:
        found = probe(comm, hostnames)
        if rank == 0:
            _write(path, found)
        found = comm.bcast(found if rank == 0 else None, root=0)
    found.ranks_per_host, found.cpus_per_host = _hosts(comm, hostnames)
    return found


def _hosts(comm, hostnames) -> tuple[int, int]:
    """(most ranks on one host, fewest CPUs the ranks of one host may use between them)."""
    mine = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
    everyone = comm.allgather(mine)
    ranks, cpus = {}, {}
    for host, allowed in zip(hostnames, everyone):
        ranks[host] = ranks.get(host, 0) + 1
        cpus.setdefault(host, set()).update(allowed)
    known = [len(c) for c in cpus.values() if c]
    return max(ranks.values()), (min(known) if len(known) == len(cpus) else 0)


def probe(comm, hostnames) -> Links:
    """Collective: measures the links now (results valid on rank 0)."""
    rank, size = comm.Get_rank(), comm.Get_size()
    partner = next((r for r, h in enumerate(hostnames) if h != hostnames[0]), 1 if size > 1 else 0)
    small, stream = _pingpong(comm, partner, SMALL, SMALL_REPEATS), _stream(comm, partner)
    ar_small, ar_large = _allreduce(comm, SMALL, SMALL_REPEATS), _allreduce(comm, LARGE, LARGE_REPEATS)
    memory = _memory_bandwidth() if rank == 0 else 0.0
    return Links(
        p2p_latency_s=small, p2p_bandwidth=STREAM_MESSAGES * LARGE / max(stream - small, 1e-9),
        allreduce_latency_s=ar_small, allreduce_bandwidth=(LARGE - SMALL) / max(ar_large - ar_small, 1e-9),
        memory_bandwidth=memory, ranks=size, hosts=len(set(hostnames)), source="probe")


def _pingpong(comm, partner: int, nbytes: int, repeats: int) -> float:
    """One-way time of an nbytes message between rank 0 and `partner` (median; rank 0's view)."""
    rank = comm.Get_rank()
    buf = np.zeros(nbytes, np.uint8)
    times = []
    comm.Barrier()
    if partner != 0 and rank in (0, partner):
        other = partner if rank == 0 else 0
        for i in range(repeats + 2):
            start = time.perf_counter()
            if rank == 0:
                comm.Send(buf, dest=other, tag=77)
                comm.Recv(buf, source=other, tag=77)
            else:
                comm.Recv(buf, source=other, tag=77)
                comm.Send(buf, dest=other, tag=77)
            if i >= 2:  # warm-up round trips do not count
                times.append((time.perf_counter() - start) / 2)
    comm.Barrier()
    return float(np.median(times)) if times else 0.0


def _stream(comm, partner: int) -> float:
    """Time to send STREAM_MESSAGES x LARGE bytes from rank 0 to `partner` and hear back
    (median; rank 0's view)."""
    rank = comm.Get_rank()
    buf, ack = np.zeros(LARGE, np.uint8), np.zeros(SMALL, np.uint8)
    times = []
    comm.Barrier()
    if partner != 0 and rank in (0, partner):
        for i in range(STREAM_REPEATS + 1):
            start = time.perf_counter()
            if rank == 0:
                for _ in range(STREAM_MESSAGES):
                    comm.Send(buf, dest=partner, tag=78)
                comm.Recv(ack, source=partner, tag=79)
            else:
                for _ in range(STREAM_MESSAGES):
                    comm.Recv(buf, source=0, tag=78)
                comm.Send(ack, dest=0, tag=79)
            if i >= 1:  # the first pass sets up the connection's buffers
                times.append(time.perf_counter() - start)
    comm.Barrier()
    return float(np.median(times)) if times else 0.0


def _allreduce(comm, nbytes: int, repeats: int) -> float:
    """Time of an nbytes float32 sum all-reduce over every rank (median)."""
    from mpi4py import MPI

    send = np.ones(max(1, nbytes // 4), np.float32)
    recv = np.empty_like(send)
    times = []
    comm.Barrier()
    for i in range(repeats + 2):
        start = time.perf_counter()
        comm.Allreduce(send, recv, op=MPI.SUM)
        if i >= 2:
            times.append(time.perf_counter() - start)
    # Every rank uses the slowest rank's view: a collective ends for all when the last one is done.
    return float(comm.allreduce(float(np.median(times)), op=MPI.MAX))


def _memory_bandwidth() -> float:
    a, b = np.ones(1 << 23, np.float32), np.ones(1 << 23, np.float32)  # 32 MiB each: beyond the caches
    times = []
    for _ in range(5):
        start = time.perf_counter()
        np.add(a, b, out=a)
        times.append(time.perf_counter() - start)
    return 3 * a.nbytes / max(float(np.median(times)), 1e-9)  # two reads and a write


def _read(path: str):
    try:
        with open(path) as fh:
            data = json.load(fh)
        Links.from_json(data)  # a file that does not parse as links is probed again
        return data if data.get("format") == FORMAT else None
    except (OSError, ValueError, TypeError):
        return None


def _write(path: str, found: Links) -> None:
    """Atomically (a half-written cache is never read); a cache that cannot be written is skipped."""
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        tmp = f"{path}.{os.getpid()}.tmp"
        with open(tmp, "w") as fh:
            json.dump(found.to_json(), fh, indent=2)
        os.replace(tmp, path)
    except OSError:
        pass
