"""A Chrome-trace timeline of each step's phases per rank: HYBRIDSYNC_TIMELINE=trace.json.

Phases: forward (with the PS pull inside it, and the server work of that pull), backward,
synchronize (PS push, dense all-reduce), and the optimizer's dense update; the C++ engine adds
'server apply' and 'serve pulls'. Open the file in chrome://tracing or https://ui.perfetto.dev.

Each rank streams its events to <trace>.rank<r>.json while training (nothing is lost if the job
dies); at shutdown rank 0 merges every rank's finished file into <trace> (one process row per
rank), waiting at most 30 s for the others.
"""
from __future__ import annotations

import contextlib
import glob
import json
import os
import threading
import time

from . import runtime
from .settings import settings

_FLUSH_EVERY = 256
_MERGE_WAIT_S = 30.0


class Timeline:
    def __init__(self, path: str, rank: int, size: int):
        self.path, self.rank, self.size = path, rank, size
        stem, ext = os.path.splitext(path)
        self.rank_path = f"{stem}.rank{rank}{ext or '.json'}"
        self._partial = self.rank_path + ".partial"
        self._events: list[dict] = []
        self._lock = threading.Lock()
        self._fh = open(self._partial, "w")
        self._fh.write("[\n")
        self._first = True
        self._add({"name": "process_name", "ph": "M", "pid": rank, "args": {"name": f"rank {rank}"}})

    def _add(self, event: dict) -> None:
        with self._lock:
            self._events.append(event)
            if len(self._events) >= _FLUSH_EVERY:
                self._flush()

    def _flush(self) -> None:
        for e in self._events:
            self._fh.write(("" if self._first else ",\n") + json.dumps(e))
            self._first = False
        self._events.clear()
        self._fh.flush()

    def complete(self, name: str, start_ns: int, end_ns: int, cat: str = "phase", **args) -> None:
        """A finished span: times from time.perf_counter_ns (or the engine's steady clock)."""
        event = {"name": name, "cat": cat, "ph": "X", "pid": self.rank, "tid": 0,
                 "ts": start_ns / 1e3, "dur": max(0, end_ns - start_ns) / 1e3}
        if args:
            event["args"] = args
        self._add(event)

    def counter(self, name: str, values: dict, cat: str = "adaptive") -> None:
        """Values plotted over time (a Chrome-trace counter track), e.g. the noise scale."""
        self._add({"name": name, "cat": cat, "ph": "C", "pid": self.rank, "tid": 0,
                   "ts": time.perf_counter_ns() / 1e3, "args": values})

    @contextlib.contextmanager
    def span(self, name: str, cat: str = "phase", **args):
        start = time.perf_counter_ns()
        try:
            yield
        finally:
            self.complete(name, start, time.perf_counter_ns(), cat, **args)

    def engine_events(self) -> None:
        """Moves the PS engine's server-side events into the timeline."""
        from . import ps

        engine = ps.current()
        if engine is None:
            return
        for name, start, end, rows in engine.take_trace():
            self.complete(name, start, end, cat="server", rows=rows)

    def close(self) -> None:
        with self._lock:
            if self._fh.closed:
                return
            self._flush()
            self._fh.write("\n]\n")
            self._fh.close()
        os.replace(self._partial, self.rank_path)  # a finished rank file appears whole
        if self.rank == 0:
            self._merge()

    def _merge(self) -> None:
        stem, ext = os.path.splitext(self.path)
        deadline = time.monotonic() + _MERGE_WAIT_S
        pattern = f"{glob.escape(stem)}.rank*{ext or '.json'}"
        while len([p for p in glob.glob(pattern) if not p.endswith(".partial")]) < self.size:
            if time.monotonic() > deadline:
                return  # some rank did not finish: its events stay in the per-rank files
            time.sleep(0.05)
        events = []
        for p in sorted(glob.glob(pattern)):
            if not p.endswith(".partial"):
                with open(p) as fh:
                    events += json.load(fh)
        tmp = self.path + ".tmp"
        with open(tmp, "w") as fh:
            json.dump({"traceEvents": events, "displayTimeUnit": "ms"}, fh)
        os.replace(tmp, self.path)


_timeline: Timeline | None = None
_checked = False
_lock = threading.Lock()


def get() -> Timeline | None:
    """The timeline of this process, or None when HYBRIDSYNC_TIMELINE is not set."""
    global _timeline, _checked
    if _checked:
        return _timeline
    with _lock:
        if not _checked:
            path = settings().timeline
            if path:
                world = runtime.world()
                _timeline = Timeline(path, world.rank, world.size)
                runtime.on_shutdown(_close)
            _checked = True
    return _timeline


def _close() -> None:
    global _timeline, _checked
    if _timeline is not None:
        _timeline.close()
    _timeline, _checked = None, False


@contextlib.contextmanager
def span(name: str, cat: str = "phase", **args):
    """Records `name` around the block when a timeline is on; free otherwise."""
    tl = get()
    if tl is None:
        yield
        return
    with tl.span(name, cat, **args):
        yield
