"""The cost model of `sync: auto`: per sparse variable, the time one step of each route would
take, from what was measured during the first steps (rows touched per rank and over all ranks)
and what the link probe measured (hybridsync/comm/probe.py). Plain arithmetic, no
communication: unit-tested on its own (tests/unit/test_cost_model.py).

Per step, with p ranks, N rows of R = 4*dim bytes, I = 8 id bytes, n rows touched per rank
(unique) and u rows touched by any rank:

allreduce-as-dense  all-reduce of N*R bytes with a collective's latency of its own (an
                    embedding's gradient is final last in backward, after the dense layers'
                    all-reduce started), plus the local dense update: about DENSE_PASSES
                    passes over N*R bytes of memory.
allgather           two variable-size all-gathers of the dense backend (ids, rows: the cost of
                    one small collective each, measured at start; 4 MPI latencies if not),
                    (p-1)*n*(R+I) bytes received per rank, and every rank applying the p*n
                    gathered rows (ALLGATHER_FRAMEWORK_S plus passes over their bytes).
ps, k shards        every rank sends its rows' share for remote shards (a fraction 1 - 1/p of
                    them, whatever k), and the busiest shard serves (p-1)*n/k rows from the
                    other ranks: the step waits for the larger of what a rank sends and
                    receives (sharded: a pull and a push, which the next step's pull follows
                    at once; replicated: a push answered by every changed row), over the p2p
                    bandwidth, plus the rounds' latencies, plus the shard applying the rows.
                    Fewer shards: fewer messages per round, more load on each; the best k is
                    the one with the smallest time.

Across hosts (the probe saw more than one), bytes are counted on the busiest host link, which
the q ranks of a host share: for allgather q*(p-q)*n*(R+I) each way; for the PS the rows of
the host's ranks whose shards are on other hosts, plus what its own shards answer them. When
a host runs more ranks than it has CPUs, every CPU term (updates, the server's work) is
stretched by ranks/CPUs: they take turns.

The choice: the fastest candidate, except that the route the variable is on (the parameter
server, where it was measured) is kept unless another one is predicted SWITCH_THRESHOLD faster
-- a switch costs a gather of the table, and the PS keeps memory per rank lowest.
"""
from __future__ import annotations

import os

import dataclasses

ID_BYTES = 8
DENSE_PASSES = 6.0  # densify, read the gradient, read/write optimizer state and parameter
SPARSE_PASSES = 8.0  # sort/coalesce the rows, then the same per row
SERVER_PASSES = 6.0  # sum the ranks' rows, read/write the slots and the row
# The framework's own work per all-gathered variable and step, beyond moving bytes: building a
# sparse gradient from the gathered ids and rows and running the optimizer's sparse update (a
# dozen framework ops). Calibrated on this project's DLRM benchmark (2 ranks, one host): allgather
# cost 0.17-0.22 ms more than the PS per table and step, of which the rest of the model explains
# ~0.06 ms.
ALLGATHER_FRAMEWORK_S = 150e-6
SWITCH_THRESHOLD = 0.10
PS, ALLGATHER, DENSE = "ps", "allgather", "allreduce-as-dense"


@dataclasses.dataclass
class TableStats:
    """What `sync: auto` measured for one variable (means per step)."""

    name: str
    num_rows: int
    dim: int
    world_size: int
    placement: str  # "sharded" | "replicated": where it is measured (its rounds per step)
    rows_per_rank: float  # unique rows a rank touched
    union_rows: float  # unique rows any rank touched
    compute_s: float = 0.0  # forward + backward (time outside the exchange), per step
    steps: int = 0
    candidates: tuple = (PS, ALLGATHER, DENSE)  # routes that apply the same update as the PS

    @property
    def density(self) -> float:
        """Fraction of the table's rows touched per step by some rank."""
        return self.union_rows / self.num_rows if self.num_rows else 0.0

    @property
    def bytes_per_step(self) -> float:
        """Gradient bytes a rank produced per step (unique rows with their ids)."""
        return self.rows_per_rank * (4 * self.dim + ID_BYTES)


@dataclasses.dataclass
class Decision:
    route: str
    shards: int  # PS shards (0 when not on the PS)
    predicted_s: dict  # route -> seconds per step (exchange + local update)
    ps_by_shards: dict  # k -> seconds per step on k shards
    margin: float  # (runner-up - choice) / runner-up; negative when kept by the threshold
    why: str
    ps_shards: int = 0  # the best PS shard count, whatever the choice

    def to_json(self) -> dict:
        return {"choice": self.route, "shards": self.shards, "ps_best_shards": self.ps_shards,
                "predicted_ms": {k: round(v * 1e3, 4) for k, v in self.predicted_s.items()},
                "ps_ms_by_shards": {str(k): round(v * 1e3, 4) for k, v in self.ps_by_shards.items()},
                "margin": round(self.margin, 4), "why": self.why}


def _ranks_per_host(s: TableStats, links) -> int:
    """Ranks that share one host's link (the whole world on one host)."""
    return min(max(1, getattr(links, "ranks_per_host", 1)), s.world_size) if links.hosts > 1 else s.world_size


def _cpu_stretch(s: TableStats, links) -> float:
    """How much longer CPU work takes than alone on a core: more ranks than CPUs on a host
    take turns."""
    cpus = getattr(links, "cpus_per_host", 0)
    per_host = min(max(1, getattr(links, "ranks_per_host", 1)), s.world_size)
    return max(1.0, per_host / cpus) if cpus else 1.0


def allreduce_as_dense(s: TableStats, links) -> float:
    table = s.num_rows * 4 * s.dim
    # An embedding's gradient is final last in backward, after the dense layers' all-reduce has
    # started: it pays a collective of its own (the backend's, measured at start, if known).
    collective = getattr(links, "collective_s", 0.0)
    latency = collective if collective > 0 else links.allreduce_latency_s
    update = DENSE_PASSES * table / links.memory_bandwidth * _cpu_stretch(s, links)
    return latency + table / links.allreduce_bandwidth + update


def allgather(s: TableStats, links) -> float:
    p, row, n = s.world_size, 4 * s.dim, s.rows_per_rank
    q = _ranks_per_host(s, links)
    if links.hosts > 1:  # the host link carries what its q ranks receive from the other hosts
        wire = q * (p - q) * n * (row + ID_BYTES) / links.p2p_bandwidth
    else:
        wire = (p - 1) * n * (row + ID_BYTES) / links.p2p_bandwidth
    # Ids, then rows, each gathered by one collective of the dense backend (counts, then data).
    collective = getattr(links, "collective_s", 0.0)
    latency = 2 * collective if collective > 0 else 4 * links.allreduce_latency_s
    apply = (ALLGATHER_FRAMEWORK_S + SPARSE_PASSES * p * n * row / links.memory_bandwidth) * _cpu_stretch(s, links)
    return latency + wire + apply


def _ps_bytes(s: TableStats, links, k: int) -> tuple[float, float]:
    """(pull, pull + push): the bytes on the busiest link (host link across hosts, else a rank's
    own) for one step of a table on k shards, shard i on rank i, ranks numbered host by host.
    Sharded: a pull sends ids and gets rows back; a push sends ids and rows. Replicated: one
    round, a push answered by every changed row, counted as the pull (it is waited for)."""
    p, row, n, u = s.world_size, 4 * s.dim, s.rows_per_rank, s.union_rows
    q = _ranks_per_host(s, links) if links.hosts > 1 else 1  # one host: each rank is its own "link"
    pull = total = 0.0
    for h in range(-(-p // q)):
        ranks = min(q, p - h * q)
        held = max(0, min(k - h * q, ranks)) / k  # fraction of the rows these ranks' shards hold
        away, asked = ranks * n * (1 - held), (p - ranks) * n * held  # rows leaving / served here
        if s.placement == "sharded":
            pull_out, pull_in = away * ID_BYTES + asked * row, away * row + asked * ID_BYTES
            push_out, push_in = away * (ID_BYTES + row), asked * (ID_BYTES + row)
        else:
            changed = u * held
            pull_out = away * (ID_BYTES + row) + (p - ranks) * changed * (ID_BYTES + row)
            pull_in = asked * (ID_BYTES + row) + ranks * u * (1 - held) * (ID_BYTES + row)
            push_out = push_in = 0.0
        pull = max(pull, pull_out, pull_in)
        total = max(total, pull_out + push_out, pull_in + push_in)
    return pull, total


def ps(s: TableStats, links, shards: int) -> float:
    p, k, row, n, u = s.world_size, shards, 4 * s.dim, s.rows_per_rank, s.union_rows
    served = (p - 1) * n / k  # rows the busiest shard takes from other ranks
    round_latency = 2 * links.p2p_latency_s + 0.5 * (k - 1) * links.p2p_latency_s
    # Both rounds count: a sharded push leaves at the end of the step and the next step's pull
    # (lookups open the forward) comes right behind it on the same links.
    rounds = 2 if s.placement == "sharded" else 1
    wire = _ps_bytes(s, links, k)[1] / links.p2p_bandwidth
    local = 0.0 if s.placement == "sharded" else 2 * u * row / links.memory_bandwidth  # changed rows into the replica
    server = SERVER_PASSES * (served + n / k) * row / links.memory_bandwidth
    return rounds * round_latency + wire + (server + local) * _cpu_stretch(s, links)


def decide(s: TableStats, links, current_shards: int) -> Decision:
    """The route (and PS shard count) for one variable measured on the PS with current_shards."""
    by_shards = {k: ps(s, links, k) for k in range(1, s.world_size + 1)}
    best_k = min(by_shards, key=lambda k: (by_shards[k], k != current_shards))
    # Re-sharding moves every row: only worth it when clearly faster.
    if by_shards[current_shards] <= by_shards[best_k] * (1 + SWITCH_THRESHOLD):
        best_k = current_shards
    predicted = {PS: by_shards[best_k]}
    if ALLGATHER in s.candidates:
        predicted[ALLGATHER] = allgather(s, links)
    if DENSE in s.candidates:
        predicted[DENSE] = allreduce_as_dense(s, links)
    fastest = min(predicted, key=predicted.get)
    if fastest != PS and predicted[fastest] < predicted[PS] * (1 - SWITCH_THRESHOLD):
        choice = fastest
        why = f"{fastest} predicted {_pct(predicted[PS], predicted[fastest])} faster than ps"
    else:
        choice = PS
        if fastest == PS:
            why = "ps predicted fastest" if len(predicted) > 1 else "only ps applies this optimizer's update exactly"
        else:
            why = (f"{fastest} predicted only {_pct(predicted[PS], predicted[fastest])} faster: kept on ps "
                   f"(switch threshold {SWITCH_THRESHOLD:.0%})")
    others = [t for r, t in predicted.items() if r != choice]
    margin = (min(others) - predicted[choice]) / min(others) if others and min(others) > 0 else 0.0
    return Decision(choice, best_k if choice == PS else 0, predicted, by_shards, margin, why, best_k)


def _pct(slow: float, fast: float) -> str:
    return f"{(slow - fast) / slow:.0%}" if slow > 0 else "0%"


# -- memory per rank ---------------------------------------------------------------------------
SLOTS = {"sgd": 0, "adagrad": 1, "adam": 2}  # optimizer state per row, in rows


def memory_per_rank(route: str, num_rows: int, dim: int, world_size: int, shards: int = 0,
                    placement: str = "sharded", slots: int = 0, rows_per_rank: float = 0.0,
                    storage: dict | None = None) -> float:
    """Bytes one rank holds for a table on `route`: its rows, the optimizer's slots, the gradient
    and the exchange's buffers (float32 rows of dim; rows_per_rank: unique rows a rank touches
    per step, 0 before any step). A replica (allgather, allreduce-as-dense, ps replicated) holds
    the table whole on every rank; the sharded PS holds 1/shards of it on the ranks with a shard,
    rows as its storage says (16-bit rows; with a disk tier only memory_rows of them in memory)."""
    row = 4 * dim
    table = float(num_rows) * row
    touched = rows_per_rank * (row + ID_BYTES)
    shards = shards or world_size
    if route == PS:
        storage = storage or {}
        stored_row = (2 if storage.get("dtype") in ("float16", "bfloat16") else 4) * dim
        in_memory = float(num_rows) if not storage.get("path") else min(float(num_rows), storage["memory_rows"])
        on_shard = in_memory / shards * (stored_row + slots * row)  # rows and slots of the busiest shard
        exchange = 2 * touched * world_size / shards + 2 * touched  # what it serves and what it sends
        return on_shard + exchange + (table if placement == "replicated" else 0.0)
    local = table * (1 + slots)  # the replica and the wrapped optimizer's state
    if route == ALLGATHER:
        return local + 2 * touched * world_size  # the gathered ids and rows, and the sparse gradient
    return local + 2 * table  # allreduce-as-dense: the dense gradient and the all-reduce's buffer


def default_memory_per_rank(local_ranks: int) -> int:
    """The host's available memory when the job starts, shared by its ranks, times 0.8."""
    available = 0
    try:
        with open("/proc/meminfo") as fh:
            for line in fh:
                if line.startswith("MemAvailable:"):
                    available = int(line.split()[1]) * 1024
    except OSError:
        pass
    if not available:
        available = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    return int(available / max(1, local_ranks) * 0.8)


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)
