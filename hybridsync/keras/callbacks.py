"""horovod.keras.callbacks: hybridsync.tensorflow.keras.callbacks."""
from ..tensorflow.keras.callbacks import *  # noqa: F401,F403
from ..tensorflow.keras.callbacks import (BestModelCheckpoint, BroadcastGlobalVariablesCallback,  # noqa: F401
                                          LearningRateScheduleCallback, LearningRateWarmupCallback,
                                          MetricAverageCallback)
