"""`import hybridsync.keras as hvd`: horovod.keras's drop-in. On Keras 3 there is one Keras,
so this is hybridsync.tensorflow.keras (see it), with horovod.keras's callbacks and elastic
modules."""
from __future__ import annotations

from ..tensorflow.keras import *  # noqa: F401,F403
from ..tensorflow.keras import __all__, callbacks, elastic  # noqa: F401
