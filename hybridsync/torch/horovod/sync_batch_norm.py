"""SyncBatchNorm: batch normalisation with statistics over the whole global batch.

Built from the differentiable all-reduce (Sum), so its backward is exact: N ranks x batch b
train as one process with batch N*b. Unlike Horovod's, CPU tensors work too."""
from __future__ import annotations

import torch
from torch.nn.modules.batchnorm import _BatchNorm

from . import mpi_ops


class SyncBatchNorm(_BatchNorm):
    """torch.nn.BatchNorm{1,2,3}d whose training statistics are computed over every rank's
    batch (in eval mode, or on one rank, it is plain batch norm)."""

    def __init__(self, num_features, eps=1e-5, momentum=0.1, affine=True, track_running_stats=True):
        super().__init__(num_features, eps, momentum, affine, track_running_stats)

    def _check_input_dim(self, input):
        if input.dim() < 2:
            raise ValueError(f"expected at least 2D input (got {input.dim()}D input)")

    def _plain(self, input):
        return torch.nn.functional.batch_norm(input, self.running_mean, self.running_var, self.weight, self.bias,
                                              self.training or not self.track_running_stats, self.momentum, self.eps)

    def forward(self, input):
        self._check_input_dim(input)
        if self.training and self.track_running_stats:
            self.num_batches_tracked.add_(1)
        if (not self.training and self.track_running_stats) or mpi_ops.ops.set_size() == 1:
            return self._plain(input)
        dims = [0] + list(range(2, input.dim()))
        count = torch.tensor([input.numel() // input.shape[1]], dtype=input.dtype, device=input.device)
        # One all-reduce of [count, sum(x), sum(x^2)] per channel; its gradient flows back.
        stats = torch.cat([count, input.sum(dims), (input * input).sum(dims)])
        total = mpi_ops.allreduce(stats, op=mpi_ops.Sum, name=None)
        n, channels = total[0], input.shape[1]
        mean = total[1:1 + channels] / n
        var = (total[1 + channels:] / n - mean * mean).clamp(min=0)
        shape = [1, channels] + [1] * (input.dim() - 2)
        out = (input - mean.view(shape)) * torch.rsqrt(var.view(shape) + self.eps)
        if self.affine:
            out = out * self.weight.view(shape) + self.bias.view(shape)
        if self.track_running_stats:
            momentum = self.momentum if self.momentum is not None else 1.0 / float(self.num_batches_tracked)
            with torch.no_grad():
                unbiased = var * (n / (n - 1).clamp(min=1))
                self.running_mean.mul_(1 - momentum).add_(mean.detach(), alpha=momentum)
                self.running_var.mul_(1 - momentum).add_(unbiased.detach(), alpha=momentum)
        return out
