"""horovod.tensorflow's LocalGradientAggregationHelper: Horovod's machinery for summing
backward_passes_per_step gradients locally inside TensorFlow 1 optimizers. hybridsync's
DistributedOptimizer does that itself (DistributedOptimizer(..., backward_passes_per_step=k,
average_aggregated_gradients=...)), and TensorFlow 1 optimizers are not distributed here."""
from __future__ import annotations


class LocalGradientAggregationHelper:
    _OPTIMIZER_TYPE_KERAS = "optimizer_type_keras"
    _OPTIMIZER_TYPE_LEGACY = "optimizer_type_legacy"

    def __init__(self, *args, **kwargs):
        raise NotImplementedError(
            "LocalGradientAggregationHelper is Horovod's internal helper for TensorFlow 1 optimizers; with hybridsync "
            "pass backward_passes_per_step (and average_aggregated_gradients) to hvd.DistributedOptimizer, which "
            "sums the gradients of that many steps locally and exchanges them once")
