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
_HOROVOD_CODES = ("average", "sum", "adasum", "min", "max", "product")  # horovod.torch.Average == 0, ...


def horovod_op_name(op, average=None) -> str:
    """The op of a Horovod collective call, by name ('average', 'sum', 'min', ...): Horovod's rule
    that `average` (deprecated) and `op` exclude each other, Average when neither is given."""
    import warnings

    from .comm.negotiation import op_name

    if op is not None and average is not None:
        raise ValueError("The op parameter supersedes average. Please provide only one of them.")
    if average is not None:
        warnings.warn("average is deprecated (as in Horovod): use op=Average or op=Sum", DeprecationWarning, 3)
        return "average" if average else "sum"
    if op is None:
        return "average"
    if isinstance(op, int) and not isinstance(op, bool) and 0 <= op < len(_HOROVOD_CODES):
        return _HOROVOD_CODES[op]  # a constant taken from Horovod itself
    return op_name(op)


def as_reduce_op(op) -> ReduceOp:
    """ReduceOp from hybridsync's Average/Sum, 'average'/'sum', or Horovod's constants."""
    import sys

    if isinstance(op, ReduceOp):
        return op
    if isinstance(op, str) and op.lower() in ("average", "sum"):
        return ReduceOp(op.lower())
    for module_name in ("horovod.torch", "horovod.tensorflow"):
        hvd = sys.modules.get(module_name)
        if hvd is not None:
            if op == getattr(hvd, "Average", object()):
                return ReduceOp.AVERAGE
            if op == getattr(hvd, "Sum", object()):
                return ReduceOp.SUM
    raise ValueError(f"op must be hybridsync Average or Sum, got {op!r}")
