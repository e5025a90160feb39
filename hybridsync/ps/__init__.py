"""The parameter server's Python face, mirroring csrc/ps: this process's engine (client.py, over
the C++ Client), a fixed table (table.py) and a dynamic table over raw ids (dynamic.py; its
options and the twins of its C++ rules in dynamic_options.py), the server rules that follow an
optimizer (rules.py) and the row partition (partition.py). Frameworks reach the engine only
through tables.
"""
from .client import RemoteError, TransportError, current, engine, join, joins, settle, wait_spin_us

__all__ = ["engine", "current", "join", "joins", "settle", "wait_spin_us", "RemoteError", "TransportError"]
