"""How the core finds a frontend: from the object it was handed, never from which frameworks are
imported. A wrapped optimizer carries its frontend (`hybridsync_frontend`); any other object of a
framework names its framework by the module of one of its classes."""
from __future__ import annotations

import importlib
from typing import Protocol

# A class's top-level module -> the hybridsync frontend for its objects.
FRAMEWORK_OF_MODULE = {"torch": "torch", "keras": "tensorflow", "tensorflow": "tensorflow", "tf_keras": "tensorflow"}


class Frontend(Protocol):
    """What checkpoint, elastic and explain ask of a wrapped optimizer's frontend."""

    framework: str  # "torch" | "tensorflow"

    @property
    def checkpointing(self):
        """The frontend's checkpointing module: before_load, dense_state, load_dense_state."""

    def variables(self) -> list | None:
        """The plan's sync.base.Variables (None: not planned yet -- Keras plans at its first step)."""

    def adopt_auto(self, saved: dict) -> None:
        """Collective: `sync: auto` variables still measuring take a saved run's decisions."""


def of(optimizer) -> Frontend | None:
    """The frontend of a hybridsync DistributedOptimizer; None for any other object."""
    return getattr(optimizer, "hybridsync_frontend", None)


def framework_of(obj) -> str | None:
    """"torch" or "tensorflow" for an object of that framework (by its classes), else None."""
    for cls in type(obj).__mro__:
        name = FRAMEWORK_OF_MODULE.get(cls.__module__.split(".")[0])
        if name is not None:
            return name
    return None


def module_for(obj):
    """hybridsync.torch or hybridsync.tensorflow for an object of that framework, else None."""
    name = framework_of(obj)
    return importlib.import_module(f"hybridsync.{name}") if name else None
