"""The differentiable collectives behind hvd.allreduce/allgather/broadcast/alltoall/reducescatter
(and their grouped forms). Backward passes compute what Horovod's do, so gradients match a
Horovod run: allreduce (Sum/Average) and alltoall give the exact gradient of the sum of every
rank's loss; allgather and broadcast average the incoming gradients over ranks (Horovod's
convention); reducescatter all-gathers them (times the set size for Sum). For Min, Max and
Product, where Horovod reduces the gradients with the same op (not a gradient), the exact
gradient of the sum of the ranks' losses is computed instead.
"""
from __future__ import annotations

import torch

from . import ops
from .process_sets import is_global


def _sync(handle):
    return handle.wait()


def allreduce_out(tensor, name, op, pre, post, process_set):
    """All-reduce into a new tensor (no autograd)."""
    return _sync(ops.route(process_set).allreduce_async_(ops._contiguous_out(tensor), name, op, pre, post))


class Allreduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, name, op, pre, post, process_set):
        ctx.op, ctx.scales, ctx.process_set = op, (pre, post), process_set
        if op in ("sum", "average") or not tensor.is_floating_point():
            return allreduce_out(tensor, name, op, pre, post, process_set)
        # Min/Max/Product: keep the pre-scaled inputs and the reduction to differentiate them
        # (decided by dtype, not requires_grad, so every rank submits the same collective).
        scaled = tensor.detach() * pre
        reduced = allreduce_out(scaled, name, op, 1.0, 1.0, process_set)
        ctx.save_for_backward(scaled, reduced)
        return reduced * post

    @staticmethod
    def backward(ctx, grad):
        op, (pre, post), ps = ctx.op, ctx.scales, ctx.process_set
        if op in ("sum", "average"):
            return allreduce_out(grad, None, op, pre, post, ps), None, None, None, None, None
        scaled, reduced = ctx.saved_tensors
        total = allreduce_out(grad, None, "sum", 1.0, 1.0, ps)  # every rank's output depends on x
        if op == "product":
            everyone = _sync(ops.route(ps).allgather_async(scaled.unsqueeze(0).contiguous(), None))
            mine = _set_rank(ps)
            others = torch.cat([everyone[:mine], everyone[mine + 1:]]).prod(dim=0)
            return total * pre * post * others, None, None, None, None, None
        hit = (scaled == reduced).to(grad.dtype)  # this rank holds the min/max; ties share it
        ties = allreduce_out(hit, None, "sum", 1.0, 1.0, ps)
        return total * pre * post * hit / ties.clamp(min=1), None, None, None, None, None


def _set_rank(process_set) -> int:
    return ops.global_rank() if is_global(process_set) else process_set.rank()


class GroupedAllreduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx, name, op, pre, post, process_set, *tensors):
        ctx.op, ctx.scales, ctx.process_set = op, (pre, post), process_set
        route = ops.route(process_set)
        handles = [route.allreduce_async_(ops._contiguous_out(t), _member(name, i), op, pre, post)
                   for i, t in enumerate(tensors)]
        return tuple(_sync(h) for h in handles)

    @staticmethod
    def backward(ctx, *grads):
        if ctx.op not in ("sum", "average"):
            raise RuntimeError(f"grouped_allreduce with op={ctx.op} is not differentiable; use allreduce per tensor")
        route = ops.route(ctx.process_set)
        handles = [route.allreduce_async_(ops._contiguous_out(g), None, ctx.op, *ctx.scales) for g in grads]
        return (None,) * 5 + tuple(_sync(h) for h in handles)


def _member(name, i):
    return None if name is None else f"{name}.{i}"


def _slice_of_mine(grad_reduced, dim0, process_set):
    """This rank's rows of an all-gathered gradient (offsets from every rank's dim 0)."""
    dims = _sync(ops.route(process_set).allgather_async(torch.tensor([dim0], dtype=torch.int64), None))
    start = int(dims[:_set_rank(process_set)].sum())
    return grad_reduced.narrow(0, start, dim0)


class Allgather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, name, process_set):
        ctx.dim0, ctx.process_set = tensor.shape[0] if tensor.dim() else 0, process_set
        return _sync(ops.route(process_set).allgather_async(tensor, name))

    @staticmethod
    def backward(ctx, grad):
        reduced = allreduce_out(grad, None, "average", 1.0, 1.0, ctx.process_set)
        return _slice_of_mine(reduced, ctx.dim0, ctx.process_set), None, None


class GroupedAllgather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, name, process_set, *tensors):
        ctx.dims, ctx.process_set = [t.shape[0] if t.dim() else 0 for t in tensors], process_set
        route = ops.route(process_set)
        handles = [route.allgather_async(t, _member(name, i)) for i, t in enumerate(tensors)]
        return tuple(_sync(h) for h in handles)

    @staticmethod
    def backward(ctx, *grads):
        out = [_slice_of_mine(allreduce_out(g, None, "average", 1.0, 1.0, ctx.process_set), d, ctx.process_set)
               for g, d in zip(grads, ctx.dims)]
        return (None, None, *out)


class Broadcast(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, root_rank, name, process_set):
        ctx.root_rank, ctx.process_set = root_rank, process_set
        return _sync(ops.route(process_set).broadcast_async_(ops._contiguous_out(tensor), root_rank, name))

    @staticmethod
    def backward(ctx, grad):
        reduced = allreduce_out(grad, None, "average", 1.0, 1.0, ctx.process_set)
        if ops.global_rank() != ctx.root_rank:
            reduced = reduced * 0
        return reduced, None, None, None


class Alltoall(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, splits, name, process_set):
        output, received = _sync(ops.route(process_set).alltoall_async(tensor, splits, name))
        ctx.received, ctx.process_set = received, process_set
        if splits is None:
            return output
        ctx.mark_non_differentiable(received)
        return output, received

    @staticmethod
    def backward(ctx, grad, *unused):
        back, _ = _sync(ops.route(ctx.process_set).alltoall_async(grad.contiguous(), ctx.received, None))
        return back, None, None, None


def _reducescatter_grad(grad, op, pre, post, process_set):
    if op == "sum":
        grad = grad * ops.set_size(process_set)
    return grad * (pre * post) if pre * post != 1.0 else grad


class Reducescatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, name, op, process_set, pre, post):
        ctx.args = (op, pre, post, process_set)
        return _sync(ops.route(process_set).reducescatter_async(tensor, name, op, pre, post))

    @staticmethod
    def backward(ctx, grad):
        op, pre, post, ps = ctx.args
        g = _reducescatter_grad(grad, op, pre, post, ps)
        return _sync(ops.route(ps).allgather_async(g.contiguous(), None)), None, None, None, None, None


class GroupedReducescatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx, name, op, process_set, pre, post, *tensors):
        ctx.args = (op, pre, post, process_set)
        route = ops.route(process_set)
        handles = [route.reducescatter_async(t, _member(name, i), op, pre, post) for i, t in enumerate(tensors)]
        return tuple(_sync(h) for h in handles)

    @staticmethod
    def backward(ctx, *grads):
        op, pre, post, ps = ctx.args
        route = ops.route(ps)
        handles = [route.allgather_async(_reducescatter_grad(g, op, pre, post, ps).contiguous(), None) for g in grads]
        return (None,) * 5 + tuple(_sync(h) for h in handles)
