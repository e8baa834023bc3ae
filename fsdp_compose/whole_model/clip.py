"""``clip_grad_norm_`` for models mixing sharded DTensor gradients and plain ones.

Each rank sums ``|g|^p`` over its local shards (in float64, per parameter, whatever the
dtypes), then one all-reduce per set of sharded mesh dimensions adds up the ranks' sums; a
plain or replicated gradient is the same on every rank, so its sum is added once, locally.
Only the mesh dimensions a gradient is sharded on are reduced over, which is what HSDP's
(replicate, shard) layout and CPU-offloaded shards (reduced on the mesh's device) need.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.placement_types import _StridedShard


def _params(target: nn.Module | torch.Tensor | Iterable[torch.Tensor]) -> list[torch.Tensor]:
    if isinstance(target, nn.Module):
        return list(target.parameters())
    if isinstance(target, torch.Tensor):
        return [target]
    return list(target)


def _local_stat(grad: torch.Tensor, p: float) -> torch.Tensor:
    """``sum |g|^p`` (``max |g|`` for p = inf, nonzero count for p = 0) of one tensor, float64."""
    if grad.numel() == 0:
        return torch.zeros((), dtype=torch.float64, device=grad.device)
    if math.isinf(p):
        return grad.detach().abs().max().to(torch.float64)
    norm = torch.linalg.vector_norm(
        grad.detach(), p, dtype=torch.float64 if grad.dtype == torch.float64 else torch.float32
    )
    return norm.to(torch.float64) if p == 0 else norm.to(torch.float64) ** p


def _combine(stats: list[torch.Tensor], p: float, device: torch.device) -> torch.Tensor:
    if not stats:
        return torch.zeros((), dtype=torch.float64, device=device)
    stacked = torch.stack([s.to(device) for s in stats])
    return stacked.max() if math.isinf(p) else stacked.sum()


def _sharded_dims(grad: DTensor, index: int) -> tuple[int, ...]:
    for placement in grad.placements:
        if placement.is_partial():
            raise ValueError(
                f"clip_grad_norm_: the gradient of parameter {index} is a DTensor with a Partial "
                "placement (unreduced); reduce gradients before clipping"
            )
    # _StridedShard (dp splitting rows TP already split) is not a Shard subclass but shards too
    return tuple(
        dim
        for dim, placement in enumerate(grad.placements)
        if placement.is_shard() or isinstance(placement, _StridedShard)
    )


def total_grad_norm(params: list[torch.Tensor], norm_type: float) -> torch.Tensor:
    """The norm of all gradients as if unsharded and concatenated (float64, on the first grad's device)."""
    p = float(norm_type)
    if p < 0 or math.isnan(p):
        raise ValueError(f"clip_grad_norm_: norm_type must be >= 0 or inf, got {norm_type!r}")
    local: list[torch.Tensor] = []
    sharded: dict[tuple, list[torch.Tensor]] = {}
    for index, param in enumerate(params):
        grad = param.grad
        if grad is None:
            continue
        if isinstance(grad, DTensor):
            dims = _sharded_dims(grad, index)
            stat = _local_stat(grad.to_local(), p)
            if dims:
                sharded.setdefault((grad.device_mesh, dims), []).append(stat)
                continue
        else:
            stat = _local_stat(grad, p)
        local.append(stat)
    devices = [s.device for s in local] + [s.device for stats in sharded.values() for s in stats]
    home = devices[0] if devices else torch.device("cpu")
    parts = [_combine(local, p, home)]
    op = dist.ReduceOp.MAX if math.isinf(p) else dist.ReduceOp.SUM
    for (mesh, dims), stats in sharded.items():
        reduced = _combine(stats, p, torch.device(mesh.device_type))
        for dim in dims:  # one all-reduce per sharded mesh dimension
            dist.all_reduce(reduced, op=op, group=mesh.get_group(dim))
        parts.append(reduced.to(home))
    total = _combine(parts, p, home)
    return total if math.isinf(p) or p == 0 else total ** (1.0 / p)


def clip_grad_norm_(
    parameters: nn.Module | torch.Tensor | Iterable[torch.Tensor],
    max_norm: float,
    norm_type: float = 2.0,
    error_if_nonfinite: bool = False,
) -> torch.Tensor:
    """Scale gradients in place so their total norm is at most ``max_norm``; return the norm.

    Same result as ``torch.nn.utils.clip_grad_norm_`` on the unsharded model. Takes a module
    or parameters; call it on every rank (it all-reduces). The returned norm is float32
    (float64 when every gradient is float64).
    """
    params = _params(parameters)
    total = total_grad_norm(params, norm_type)
    if error_if_nonfinite and not torch.isfinite(total):
        raise RuntimeError(f"clip_grad_norm_: the total norm of order {norm_type} is not finite ({total.item()})")
    grads = [g for g in (p.grad for p in params) if g is not None]
    dtypes = {g.dtype for g in grads}
    out_dtype = torch.float64 if dtypes == {torch.float64} else torch.float32
    total = total.to(out_dtype)
    coef = (float(max_norm) / (total + 1e-6)).clamp(max=1.0)
    with torch.no_grad():
        for grad in grads:
            local = grad.to_local() if isinstance(grad, DTensor) else grad
            local.mul_(coef.to(device=local.device, dtype=local.dtype))
    return total
