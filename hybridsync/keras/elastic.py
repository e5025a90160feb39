"""horovod.keras.elastic: hybridsync.tensorflow.keras.elastic."""
from ..tensorflow.keras.elastic import *  # noqa: F401,F403
from ..tensorflow.keras.elastic import (CommitStateCallback, KerasState, UpdateBatchStateCallback,  # noqa: F401
                                        UpdateEpochStateCallback, run)
