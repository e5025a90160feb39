"""The plan: one route per variable, as plain data. It serialises to JSON, and a plan written as
JSON loads back as a config; report.py renders it (explain())."""
from __future__ import annotations

import dataclasses
import json

from ..types import GradKind, Placement, Route


@dataclasses.dataclass
class VariablePlan:
    name: str
    shape: tuple
    dtype: str
    kind: GradKind | None  # None: decided by the first backward pass
    route: Route | None
    placement: Placement = Placement.NONE
    shards: int = 0  # PS shards holding the table (0: not on the PS)
    partition: str = "cyclic"
    compression: str = "none"
    optimizer: dict | None = None  # server-side rule, e.g. {"name": "adagrad", "lr": 0.1}
    optimizer_source: str = "-"  # "wrapped" (follows the optimizer, LR schedules too) | "config"
    reason: str = ""
    bytes_per_step: int | None = None  # measured after the first steps
    # sync: auto -- {"status": "measuring" | "decided", "steps": K, then the measured density,
    # each candidate's predicted ms, "choice", "margin"} (hybridsync.planning.measure)
    auto: dict | None = None
    staleness: int = 0  # bounded staleness of a PS table (0: synchronous; docs/staleness.md)
    # what this rank's pulls of it missed: {"pulls", "last_lag", "max_lag", "mean_lag", "held", "wait_s"}
    lag: dict | None = None
    # a dynamic table's options {"capacity", "admit_after", "evict", "ttl_steps"} (None: not dynamic)
    dynamic: dict | None = None
    memory_bytes: int | None = None  # a sparse table's predicted bytes per rank on its route
    # how the shards store its rows (hybridsync.ps.storage; None: float32, all in memory)
    storage: dict | None = None

    def to_json(self) -> dict:
        d = dataclasses.asdict(self)
        d["shape"] = list(self.shape)
        d["kind"] = self.kind.value if self.kind else None
        d["route"] = self.route.value if self.route else None
        d["placement"] = self.placement.value
        return d

    @classmethod
    def from_json(cls, d: dict) -> "VariablePlan":
        d = dict(d)
        d["shape"] = tuple(d["shape"])
        d["kind"] = GradKind(d["kind"]) if d.get("kind") else None
        d["route"] = Route(d["route"]) if d.get("route") else None
        d["placement"] = Placement(d.get("placement", "-"))
        known = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in known})


@dataclasses.dataclass
class Plan:
    variables: list[VariablePlan]
    framework: str = "torch"
    backend: str = ""
    world_size: int = 1
    backend_reason: str = ""
    adaptive: dict | None = None  # hybridsync.adaptive's summary (noise scale, batch, gain), if on
    offline: bool = False  # made by `python -m hybridsync explain`: no step has run, nothing measured

    def by_name(self) -> dict[str, VariablePlan]:
        return {v.name: v for v in self.variables}

    def to_json(self) -> dict:
        return {"framework": self.framework, "backend": self.backend, "backend_reason": self.backend_reason,
                "world_size": self.world_size, "variables": [v.to_json() for v in self.variables],
                **({"adaptive": self.adaptive} if self.adaptive else {})}

    def dumps(self) -> str:
        return json.dumps(self.to_json(), indent=2)

    @classmethod
    def from_json(cls, d: dict) -> "Plan":
        return cls([VariablePlan.from_json(v) for v in d["variables"]], d.get("framework", "torch"),
                   d.get("backend", ""), d.get("world_size", 1), d.get("backend_reason", ""))


