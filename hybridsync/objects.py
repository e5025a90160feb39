"""Python objects across ranks, as Horovod's broadcast_object / allgather_object move them:
pickled with cloudpickle (lambdas and local classes survive; plain pickle where it is missing),
sent as bytes by a process set's collectives. Shared by every frontend."""
from __future__ import annotations

import io

try:
    import cloudpickle as _pickle
except ImportError:  # pragma: no cover
    import pickle as _pickle

_unnamed: dict = {}  # process set id -> objects sent without a name


def dumps(obj) -> bytes:
    buf = io.BytesIO()
    _pickle.dump(obj, buf)
    return buf.getvalue()


def loads(blob: bytes):
    return _pickle.loads(blob)


def auto_name(kind: str, name, process_set):
    """`name`, or a name numbered per process set. Horovod names an unnamed object by its type,
    which differs between the root and the others in `broadcast_object(x if rank == 0 else
    None)` (Horovod then waits forever): a counter per process set is the same on every member."""
    if name is not None:
        return name
    key = process_set.process_set_id if process_set is not None else 0
    _unnamed[key] = _unnamed.get(key, 0) + 1
    return f"{kind}.noname.{_unnamed[key]}"


def broadcast(engine, obj, root_rank: int, me: int, name: str):
    """root_rank's `obj` on every member of `engine`'s set (root_rank is a global rank)."""
    blob = engine.broadcast_object(dumps(obj) if me == root_rank else None, root_rank, name=name)
    return obj if me == root_rank else loads(blob)


def allgather(engine, obj, name: str) -> list:
    """Every member's `obj`, in rank order."""
    return [loads(b) for b in engine.allgather_object(dumps(obj), name=name)]
