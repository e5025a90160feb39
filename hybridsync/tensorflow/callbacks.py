"""Keras callbacks for hybridsync jobs, also at hybridsync.tensorflow's top level:
Horovod's, from hybridsync.tensorflow.keras.callbacks."""
from __future__ import annotations

from .keras.callbacks import (BestModelCheckpoint, BroadcastGlobalVariablesCallback,  # noqa: F401
                              LearningRateScheduleCallback, LearningRateWarmupCallback, MetricAverageCallback)
