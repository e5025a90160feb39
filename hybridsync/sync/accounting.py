"""Bytes each variable moves per step, counted in one place for every route and frontend.
explain() shows them; the benchmark checks them against the transports' own counters."""
from __future__ import annotations

ID_BYTES = 8  # int64 row ids
ROW_VALUE_BYTES = 4  # float32 row values on the parameter server


def ps_row_bytes(dim: int) -> int:
    return ID_BYTES + ROW_VALUE_BYTES * dim


def dense(plan, buffer, world_size: int) -> None:
    """All-reduce: the buffer's bytes (nothing in a world of one)."""
    plan.bytes_per_step = int(buffer.nbytes) if world_size > 1 else 0  # NumPy arrays and torch tensors


def allgather(plan, ids, values) -> None:
    """All-gather: every rank's ids and rows, received by every rank."""
    plan.bytes_per_step = int(ids.nbytes + values.nbytes)


def ps_sharded(plan, unique_rows: int, dim: int) -> None:
    """Sharded PS: the unique rows pulled in forward, and about as many pushed back."""
    plan.bytes_per_step = 2 * unique_rows * ps_row_bytes(dim)


def ps_replicated(plan, pushed: int, changed: int, dim: int) -> None:
    """Replicated PS: the pushed gradient rows, and every changed row sent back."""
    plan.bytes_per_step = (pushed + changed) * ps_row_bytes(dim)
