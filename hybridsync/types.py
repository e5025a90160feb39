"""Enums and plain-data types shared by the plan, the config and the frontends."""
from __future__ import annotations

import enum


class GradKind(enum.Enum):
    """What a variable's gradient looks like."""

    DENSE = "dense"
    SPARSE = "sparse"  # row-sparse: torch sparse COO from sparse embeddings, tf.IndexedSlices


class Route(enum.Enum):
    """How a variable's gradient is synchronized."""

    ALLREDUCE = "allreduce"  # dense all-reduce (Horovod ring / MPI)
    PS = "ps"  # rows to the C++ parameter server, optimizer applied server-side
    ALLGATHER = "allgather"  # Horovod-style: every rank gathers every sparse gradient
    SPARSE_AS_DENSE = "allreduce-as-dense"  # densify the sparse gradient, then all-reduce


class Placement(enum.Enum):
    """Where the rows of a PS-routed table live."""

    NONE = "-"  # not on the PS
    SHARDED = "sharded"  # only on the PS shards (memory per rank ~ table / N)
    REPLICATED = "replicated"  # every rank keeps a replica; the PS keeps them identical


class ReduceOp(enum.Enum):
    AVERAGE = "average"
    SUM = "sum"


Average = ReduceOp.AVERAGE
Sum = ReduceOp.SUM


class MoreOps(enum.Enum):
    """Horovod's other reduction ops for its collectives (a DistributedOptimizer takes Average
    and Sum, the PyTorch one Adasum too); shared by the frontends' hvd.Adasum, hvd.Min, ..."""

    ADASUM = "adasum"
    MIN = "min"
    MAX = "max"
    PRODUCT = "product"


Adasum, Min, Max, Product = MoreOps.ADASUM, MoreOps.MIN, MoreOps.MAX, MoreOps.PRODUCT
HOROVOD_OP_CODES = ("average", "sum", "adasum", "min", "max", "product")  # horovod.torch.Average == 0, ...


def as_reduce_op(op) -> ReduceOp:
    """ReduceOp from hybridsync's Average/Sum, 'average'/'sum', or Horovod's constants."""
    if isinstance(op, ReduceOp):
        return op
    if isinstance(op, str) and op.lower() in ("average", "sum"):
        return ReduceOp(op.lower())
    if not isinstance(op, bool) and isinstance(op, int) and 0 <= op < 2:
        return ReduceOp(HOROVOD_OP_CODES[op])  # a constant taken from Horovod itself
    raise ValueError(f"op must be hybridsync Average or Sum, got {op!r}")
