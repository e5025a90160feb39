"""Horovod's process sets for the PyTorch frontend: the framework-neutral registry of
hybridsync.process_sets (shared with hybridsync.tensorflow, as in Horovod)."""
from ...process_sets import (ProcessSet, add_process_set, engine_of, global_process_set, is_global,  # noqa: F401
                            remove_process_set, reset)
