"""Collective negotiation, as Horovod's coordinator does it: before any data moves, the ranks of a
communicator compare what each has submitted, so a mismatch is an error on every rank instead
of a hang, a wrong result or a corrupted heap.

Pure Python on plain data (no MPI here): `Desc` describes one submitted collective, `digest()`
summarises a rank's in-flight list for the cheap first exchange, and `analyze()` turns every
rank's full list into the same verdict on every rank: what runs now, what failed and why.
"""
from __future__ import annotations

import dataclasses
import hashlib
import warnings

from ..types import HOROVOD_OP_CODES

# Kinds whose tensors must agree in every dimension; the others (allgather, alltoall) all but the first.
_FULL_SHAPE = ("allreduce", "broadcast", "reducescatter", "process_set", "process_set_remove")
# What a rank that called join() can take part in (it contributes zeros), as in Horovod.
JOIN_OK = ("allreduce", "barrier")
DUPLICATE = "duplicate"  # a poisoned entry: the name was submitted again while in flight


OPS = ("average", "sum", "min", "max", "product", "adasum")


def op_name(op) -> str:
    """'average' | 'sum' | 'min' | 'max' | 'product' | 'adasum' from a ReduceOp or a string."""
    name = str(getattr(op, "value", op)).lower()
    if name not in OPS:
        raise ValueError(f"unknown reduction op {op!r} (known: {', '.join(OPS)})")
    return name


class CollectiveMismatchError(RuntimeError):
    """Ranks submitted collectives that do not match (raised on every rank involved)."""


@dataclasses.dataclass(frozen=True)
class Desc:
    """One submitted collective as the other ranks see it."""

    kind: str  # allreduce | allgather | broadcast | alltoall | reducescatter | barrier | *_object | ...
    name: str
    dtype: str = ""
    shape: tuple = ()
    root: int = -1
    op: str = ""
    scales: tuple = (1.0, 1.0)

    def checked(self) -> tuple:
        """What must be equal on every rank (Horovod's rules: dim 0 may differ for gathers)."""
        shape = self.shape if self.kind in _FULL_SHAPE else (len(self.shape), self.shape[1:])
        return (self.kind, self.dtype, shape, self.root, self.op, self.scales)

    def label(self) -> str:
        return f"{self.kind} '{self.name}'"



def horovod_op_name(op, average=None) -> str:
    """The op of a Horovod collective call, by name ('average', 'sum', 'min', ...): Horovod's rule
    that `average` (deprecated) and `op` exclude each other, Average when neither is given."""
    if op is not None and average is not None:
        raise ValueError("The op parameter supersedes average. Please provide only one of them.")
    if average is not None:
        warnings.warn("average is deprecated (as in Horovod): use op=Average or op=Sum", DeprecationWarning, 3)
        return "average" if average else "sum"
    if op is None:
        return "average"
    if isinstance(op, int) and not isinstance(op, bool) and 0 <= op < len(HOROVOD_OP_CODES):
        return HOROVOD_OP_CODES[op]  # a constant taken from Horovod itself
    return op_name(op)

def digest(entries: list[Desc]) -> int:
    """63-bit fingerprint of a rank's in-flight list (sorted by name): equal everywhere means
    every rank submitted the same collectives and nothing more needs to be exchanged."""
    text = ";".join(repr((e.name,) + e.checked()) for e in entries)
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little") >> 1


@dataclasses.dataclass
class Verdict:
    runnable: list  # names every active rank submitted, consistently: run them now (sorted)
    failed: dict  # name -> message, on every rank: drop these everywhere and raise
    joined: list  # ranks that called join()
    all_joined: bool = False


def _ranks(ranks) -> str:
    ranks = sorted(ranks)
    return f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {ranks}"


def _disagreement(label: str, by_rank: dict) -> str | None:
    """Names the first field on which ranks differ, grouping ranks by the value they gave."""
    fields = (("kind", lambda d: d.kind), ("dtype", lambda d: d.dtype),
              ("shape" if next(iter(by_rank.values())).kind in _FULL_SHAPE else "shape beyond dim 0",
               lambda d: d.checked()[2] if d.kind in _FULL_SHAPE else d.shape[1:]),
              ("number of dimensions", lambda d: len(d.shape)), ("root rank", lambda d: d.root),
              ("reduction op", lambda d: d.op), ("(prescale, postscale)", lambda d: d.scales))
    for field, get in fields:
        groups: dict = {}
        for rank, d in by_rank.items():
            groups.setdefault(get(d), []).append(rank)
        if len(groups) > 1:
            parts = "; ".join(f"{value!r} on {_ranks(ranks)}" for value, ranks in groups.items())
            return f"{label}: ranks disagree on {field}: {parts}"
    return None


def analyze(entries: list[list[Desc]], joined: list[bool], waiting: list[str | None]) -> Verdict:
    """The verdict every rank reaches from every rank's in-flight list. waiting[r]: the label of
    what rank r is blocked on, or None when it only polls (then nothing runnable is no deadlock:
    it may still submit what the others wait for). A rank counts as blocked only on one of its
    own entries: one that waits for something it has not offered in this exchange may still
    offer it in the next (an async op started before it, awaited after it, as Horovod allows)."""
    size = len(entries)
    active = [r for r in range(size) if not joined[r]]
    verdict = Verdict([], {}, [r for r in range(size) if joined[r]])
    if not active:
        verdict.all_joined = True
        return verdict
    by_name: dict = {}
    for r, mine in enumerate(entries):
        for d in mine:
            by_name.setdefault(d.name, {})[r] = d
    for name in sorted(by_name):
        by_rank = by_name[name]
        dups = [r for r, d in by_rank.items() if d.kind == DUPLICATE]
        if dups:
            verdict.failed[name] = (f"{by_rank[dups[0]].dtype} '{name}' was submitted again on {_ranks(dups)} while "
                                    "one with that name was still in flight; names of in-flight collectives must "
                                    "be unique")
            continue
        label = next(iter(by_rank.values())).label()
        if any(r not in by_rank for r in active):
            continue  # not everyone has submitted it yet: it waits (checked for deadlock below)
        problem = _disagreement(label, by_rank)
        if problem is None and verdict.joined and by_rank[active[0]].kind not in JOIN_OK:
            problem = (f"{label}: {by_rank[active[0]].kind} is not supported while {_ranks(verdict.joined)} "
                       "have called join() (Horovod allows only allreduce then)")
        if problem:
            verdict.failed[name] = problem
        else:
            verdict.runnable.append(name)
    blocked = [r for r in active if waiting[r] is not None and any(d.label() == waiting[r] for d in entries[r])]
    if not verdict.runnable and not verdict.failed and len(blocked) == len(active):
        # Every rank is blocked in this exchange and nothing can run: a certain deadlock.
        lines = []
        for name in sorted(by_name):
            have = sorted(by_name[name])
            missing = [r for r in active if r not in by_name[name]]
            lines.append(f"{next(iter(by_name[name].values())).label()} submitted by {_ranks(have)} but not by "
                         f"{_ranks(missing)}")
            verdict.failed[name] = ""
        waits = "; ".join(f"rank {r} waits for {waiting[r]}" for r in active)
        message = ("ranks submitted different collectives, so none can run: " + "; ".join(lines) + f" ({waits})")
        verdict.failed = {name: message for name in verdict.failed}
    return verdict
