"""One managed parameter's gradient path: autograd's unsharded ``.grad`` in, the sharded ``.grad`` out
(no-sync micro-batches sum in the reduce dtype; a rank without a gradient sends zero rows)."""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor

from .extensions import is_wrapper_subclass
from .param_layout import grad_in_layout, like_sharded
from .params import ShardedParam


def _autograd_grad(p: ShardedParam) -> torch.Tensor | None:
    grad = p.unsharded_param.grad if p.unsharded_param is not None else None
    if grad is None or type(grad) is torch.Tensor:
        return grad
    if isinstance(grad, DTensor):
        return grad_in_layout(grad, p.tp_spec, p.dp_dims)
    if is_wrapper_subclass(grad):  # a subclass parameter's gradient is reduced as a plain tensor
        plain = torch.empty(grad.shape, dtype=grad.dtype, device=grad.device)
        with torch.no_grad():
            plain.copy_(grad)
        return plain
    return grad


def unsharded_grad(p: ShardedParam) -> torch.Tensor | None:
    """The unsharded gradient to reduce (TP-local under TP): this backward's plus any gradient
    stashed by earlier no-sync micro-batches."""
    grad = _autograd_grad(p)
    accumulated = p.accumulated_grad
    if accumulated is None:
        return grad
    if grad is not None:
        accumulated.add_(grad.reshape(accumulated.shape))
    return accumulated


def stash_grad(p: ShardedParam) -> None:
    """After a no-sync backward: sum a low-precision unsharded gradient into an accumulator in the
    reduce dtype (fp32 rather than bf16); one already in the reduce dtype stays for autograd to add to."""
    grad = _autograd_grad(p)
    if grad is None or grad.dtype == p.layout.reduce_dtype:
        return
    with torch.no_grad():
        if p.accumulated_grad is None:
            p.accumulated_grad = grad.to(p.layout.reduce_dtype)
        else:
            p.accumulated_grad.add_(grad)
    p.unsharded_param.grad = None


def clear_unsharded_grad(p: ShardedParam) -> None:
    if p.unsharded_param is not None:
        p.unsharded_param.grad = None
    p.accumulated_grad = None


def padded_grad_rows(p: ShardedParam, grad: torch.Tensor | None) -> torch.Tensor:
    """The unsharded gradient as (world, padded_numel) in the reduce dtype, zero-padded (``RowLayout.pad_rows``)."""
    rows, dtype = p.row_layout, p.layout.reduce_dtype
    if grad is None:
        return torch.zeros(rows.world, rows.padded_numel, dtype=dtype, device=p.layout.compute_device)
    if not rows.shard_dim and grad.dtype == dtype and grad.numel() == rows.world * rows.padded_numel:
        return grad.reshape(rows.world, rows.padded_numel)  # the usual case: one view, no copy, no call of ours
    return rows.pad_rows(rows.to_comm(grad).to(dtype))


def accumulate_grad(p: ShardedParam, local_grad: torch.Tensor) -> None:
    """Add this rank's reduced gradient shard (laid out for the collective: ``comm_local_shape``)
    into the sharded ``.grad``, in the parameter's own dtype and on its storage device."""
    if p.row_layout.shard_dim:  # else the collective's layout is the shard's
        local_grad = p.row_layout.from_comm(local_grad).contiguous()
    current = p.sharded_param.grad
    if current is None:
        local_grad = local_grad.to(p.layout.storage_device, p.dtype, non_blocking=True)  # no copy where both match
        if p.layout.pin_memory:
            local_grad = local_grad.pin_memory()
        p.sharded_param.grad = like_sharded(p.sharded_param, local_grad)
    else:
        current._local_tensor.add_(local_grad.to(current._local_tensor.device))


class _ReducedGradient(torch.autograd.Function):
    """A reduced gradient shard made by ``backward(create_graph=True)``: a backward through it raises,
    naming the group, where it would otherwise fail saying only that the tensor has no ``grad_fn``."""

    @staticmethod
    def forward(ctx, label: str, grad: torch.Tensor, _anchor: torch.Tensor) -> torch.Tensor:
        ctx.label = label
        return grad.clone()

    @staticmethod
    def backward(ctx, _grad: torch.Tensor):
        raise RuntimeError(
            f"a backward reached the gradients of {ctx.label} made by backward(create_graph=True): they were "
            "reduce-scattered across ranks, which autograd cannot differentiate, so they lead back to no "
            "parameter. For a gradient penalty take the gradients with torch.autograd.grad(out, inputs, "
            "create_graph=True) before the step's backward (docs/composition.md)"
        )


def refuse_backward_through_grad(p: ShardedParam, label: str) -> None:
    """After a step's ``backward(create_graph=True)``: the sharded ``.grad``, same values, as a
    ``_ReducedGradient`` output (as torch's own are, it requires grad)."""
    grad = p.sharded_param.grad
    if grad is not None and not grad.requires_grad:
        anchor = torch.zeros((), requires_grad=True)  # an input that requires grad: the output then does
        with torch.enable_grad():
            p.sharded_param.grad = _ReducedGradient.apply(label, grad, anchor)
