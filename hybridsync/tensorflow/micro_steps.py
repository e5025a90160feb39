"""Accumulation micro-steps of the Keras adaptive batch (AdaptiveDataset.autoscale_batch_size(...,
gradient_accumulation=True)). Keras applies once per apply(), so the exchange's Python side
holds each micro-step's gradient arrays until the step's last and then hands the sync core
their sum, which it scales by 1/k as it does PyTorch's summed .grad -- nothing is exchanged and
no Keras optimizer state moves in between.

A world of one has no all-reduce to give a second batch size; its gradient statistics come from
these micro-steps (as Pollux does): each one's |g_i|^2 at batch b and their mean's at k b.
"""
from __future__ import annotations

import numpy as np

from ..adaptive.collect import rows_squared_norm, squared_norm


def _squared_norm(kind: str, arrays) -> float:
    return squared_norm(arrays[0]) if kind == "dense" else rows_squared_norm([tuple(arrays)])


class MicroSteps:
    def __init__(self):
        self._held: list = []  # per micro-step: [(kind, arrays) per variable]
        self._taken: list | None = None  # the micro-steps of the step last taken, for observe()

    def __len__(self) -> int:
        return len(self._held)

    def add(self, per_variable: list) -> None:
        """One micro-step's [(kind, arrays)] (copied: numpy_function's inputs may be views)."""
        self._held.append([(kind, tuple(np.array(a, copy=True) for a in arrays)) for kind, arrays in per_variable])

    def take(self) -> list:
        """The held micro-steps' sum per variable, [(kind, arrays)] (sparse: rows concatenated,
        duplicates are summed where they are applied); empties the store."""
        held, self._held = self._held, []
        summed = []
        for parts in zip(*held):
            kind = parts[0][0]
            if kind == "dense":
                total = parts[0][1][0].copy()
                for _, (a,) in parts[1:]:
                    total += a
                summed.append((kind, (total,)))
            else:
                summed.append((kind, (np.concatenate([ids for _, (ids, _v) in parts]),
                                      np.concatenate([v for _, (_i, v) in parts]))))
        self._taken = held
        return summed

    def observe(self, controller, names: list, loss_scale: float) -> None:
        """A world of one, after take(): each variable's mean micro-step |g_i|^2 at batch b and
        the mean gradient's |g|^2 at batch k b, into the statistics."""
        held, self._taken = self._taken, None
        if not held:
            return
        b, k = controller.local_batch, len(held)
        if not b or k < 2:
            return
        unscale = loss_scale ** 2
        weight = k * b / (controller.base_batch or k * b)
        observations = []  # all or none: a non-finite step is left out whole (GradientStats.observe_step)
        for name, parts in zip(names, zip(*held)):
            kind = parts[0][0]
            micro = sum(_squared_norm(kind, arrays) for _, arrays in parts) / k
            if kind == "dense":
                total = squared_norm(sum(arrays[0].astype(np.float64) for _, arrays in parts))
            else:
                total = rows_squared_norm([arrays for _, arrays in parts])
            observations.append((name, micro / unscale, b, total / k ** 2 / unscale, k * b, weight))
        controller.stats.observe_step(observations)
