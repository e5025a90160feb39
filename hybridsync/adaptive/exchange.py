"""The adaptive batch's collectives, in a form a rank that called hvd.join() takes part in.

Horovod lets a joined rank take part in all-reduces only (it contributes zeros), and the ranks
with data left keep stepping -- each step exchanges its gradient statistics, and every few steps
the loaders agree on the batch. So both exchanges are one sum all-reduce of a (world, 1 + n)
table on the optimizer's own dense backend, where each rank fills only its own row, flagged
with a 1: the sum is every taking-part rank's row exactly (each entry is one rank's value plus
zeros), and a joined rank's row is all zeros, flag included -- it is simply absent.
"""
from __future__ import annotations

import numpy as np

from .goodput import KINDS, BatchChoice


def gather_rows(allreduce_sum, rank: int, world: int, row, name: str) -> dict[int, np.ndarray]:
    """Collective over the ranks still stepping (joined ranks stand in with zeros): rank ->
    its `row` (float64, the same length on every rank), for every rank that took part.
    allreduce_sum(array, name) -> the array summed over ranks."""
    row = np.asarray(row, dtype=np.float64).reshape(-1)
    table = np.zeros((world, 1 + len(row)))
    table[rank, 0] = 1.0
    table[rank, 1:] = row
    table = allreduce_sum(table, name) if world > 1 else table
    return {r: table[r, 1:] for r in range(world) if table[r, 0] == 1.0}


_CHOICE_FIELDS = 10  # present flag + BatchChoice's nine fields (its kind by index)


def _encode_choice(choice: BatchChoice | None) -> list[float]:
    if choice is None:
        return [0.0] * _CHOICE_FIELDS
    return [1.0, choice.local_batch, choice.accumulation, choice.world, choice.goodput, choice.efficiency,
            KINDS.index(choice.kind), choice.gain, choice.threshold, choice.noise_scale]


def _decode_choice(values) -> BatchChoice | None:
    if values[0] != 1.0:
        return None
    return BatchChoice(int(values[1]), int(values[2]), int(values[3]), float(values[4]), float(values[5]),
                       KINDS[int(values[6])], float(values[7]), float(values[8]), float(values[9]))


def agree_on_decision(allreduce_sum, rank: int, world: int, change, choice):
    """Collective over the ranks still stepping: the (change, choice) of the lowest of them
    (every rank decides from the same statistics; this makes them one decision, as a broadcast
    from rank 0 did before a rank could have joined)."""
    rows = gather_rows(allreduce_sum, rank, world, _encode_choice(change) + _encode_choice(choice),
                       "hybridsync.adaptive.batch")
    first = rows[min(rows)]
    return _decode_choice(first[:_CHOICE_FIELDS]), _decode_choice(first[_CHOICE_FIELDS:])
