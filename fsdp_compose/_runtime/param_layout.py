"""Where a managed parameter is registered and how its shard is laid out: plain data and tensor helpers."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.placement_types import Placement, _StridedShard

from ..api.policies import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, collective_dtypes


@dataclass
class ParamPlace:
    """Where a parameter is registered: ``module._parameters[name]``."""

    module: nn.Module
    name: str


@dataclass(frozen=True)
class ParamLayout:
    """Where and in which dtypes one parameter lives: the shard, its gradient and optimizer state on
    ``storage_device``, the unsharded parameter on ``compute_device`` (they differ under CPU offload).
    A shard on the meta device has storage ``meta`` until ``to_empty`` materializes it."""

    compute_device: torch.device
    storage_device: torch.device
    gather_dtype: torch.dtype  # dtype of the all-gather and of the unsharded parameter
    reduce_dtype: torch.dtype  # dtype of the gradient reduce-scatter
    pin_memory: bool = False
    offload: bool = False  # CPUOffloadPolicy: the shard lives on the CPU

    @property
    def offloaded(self) -> bool:
        """Whether the shard and the unsharded parameter live on different devices."""
        return self.offload and self.compute_device.type != "cpu"


def contiguous_strides(shape: torch.Size) -> tuple[int, ...]:
    strides, running = [], 1
    for size in reversed(shape):
        strides.append(running)
        running *= max(size, 1)
    return tuple(reversed(strides))


# [Note: the aliasing copy-out target]
# The unsharded parameter is one object for the life of the group: autograd saves it in forward, and its
# storage is freed on reshard (``resize_(0)``) and given back on the next unshard, so a backward re-gather
# fills the very tensor autograd saved. Copy-out writes through a second tensor over the same storage
# (``alias``), with a version counter of its own: writing through the parameter itself would bump the
# version autograd recorded and fail its saved-tensor check. ``unsharded.Aliased`` copies out straight
# into such a target; ``Staged`` and the extension protocol's outputs use the same trick.


def alias(storage_owner: torch.Tensor, shape, strides) -> torch.Tensor:
    """A tensor over ``storage_owner``'s storage with its own version counter. See [Note: the aliasing
    copy-out target]."""
    out = torch.empty(0, dtype=storage_owner.dtype, device=storage_owner.device)
    return out.set_(storage_owner.untyped_storage(), 0, shape, strides)


def like_sharded(param: DTensor, local: torch.Tensor) -> DTensor:
    """A DTensor with ``param``'s layout around ``local``, reusing its spec (``from_local`` would validate
    and rebuild it through an autograd function; ``__init__`` does nothing)."""
    return DTensor.__new__(DTensor, local, param._spec, requires_grad=False)


def spmd_layout(dp_mesh: DeviceMesh, param: torch.Tensor, fqn: str, dim: int) -> tuple[DeviceMesh, list[Placement]]:
    """The mesh and placements of ``param``'s shard: data-parallel alone, or for a DTensor the data-parallel
    dims (replicate?, shard) followed by its own (TP/EP) dims, on one mesh cut from their common root, as
    torch's FSDP2 lays it out (``_StridedShard`` where the model-parallel dims already split ``dim``)."""
    if not isinstance(param, DTensor):
        return dp_mesh, [Replicate()] * (dp_mesh.ndim - 1) + [Shard(dim)]
    tp_mesh, tp_placements = param.device_mesh, list(param.placements)
    dp_names, tp_names = dp_mesh.mesh_dim_names or (), tp_mesh.mesh_dim_names or ()
    try:  # torch's FSDP2 joins them so too (2.11 to 2.14); it refuses meshes that overlap
        spmd = None if set(dp_names) & set(tp_names) else DeviceMesh._concatenate([dp_mesh, tp_mesh])
    except (RuntimeError, AssertionError):
        spmd = None
    if spmd is None:
        raise ValueError(
            f"parameter '{fqn}' is a DTensor on a {tp_mesh.device_type} mesh of shape {tuple(tp_mesh.shape)} with "
            f"dims {tp_names}; fully_shard can shard it further only when that mesh and the data-parallel mesh "
            f"{dp_names} are disjoint dims of one mesh, e.g. mesh = init_device_mesh(..., "
            "mesh_dim_names=('dp_replicate', 'dp_shard', 'tp')); fully_shard(m, mesh=mesh['dp_replicate', 'dp_shard'])"
        )
    if any(p.is_partial() for p in tp_placements):
        raise ValueError(f"parameter '{fqn}' is a Partial DTensor; shard or replicate it before fully_shard")
    dp_placement = dp_shard_placement(dim, tp_placements, tp_mesh.shape)
    return spmd, [Replicate()] * (dp_mesh.ndim - 1) + [dp_placement, *tp_placements]


def dp_shard_placement(dim: int, placements: Sequence[Placement], mesh_shape: Sequence[int]) -> Placement:
    """The data-parallel shard's placement of tensor dim ``dim``, ahead of model-parallel ``placements`` on mesh
    dims of sizes ``mesh_shape``: ``Shard(dim)``, or ``_StridedShard`` whose split factor is the ways those dims
    already split ``dim`` (they chunk first; FSDP splits what each leaves), as torch's FSDP2 lays it out."""
    split = 1
    for placement, size in zip(placements, mesh_shape, strict=True):
        if isinstance(placement, (Shard, _StridedShard)) and placement.dim == dim:
            split *= size
    return _StridedShard(dim, split_factor=split) if split > 1 else Shard(dim)


def grad_in_layout(grad: DTensor, spec, dp_dims: frozenset[int]) -> torch.Tensor:
    """The local gradient laid out like the parameter (``spec``) on every mesh dim but the data-parallel
    ones, which the reduction handles (DTensor may return, e.g., a replicated gradient of a TP weight)."""
    if tuple(grad.placements) == tuple(spec.placements):
        return grad._local_tensor
    pairs = enumerate(zip(grad.placements, spec.placements))
    want = [have if dim in dp_dims else target for dim, (have, target) in pairs]
    return grad.redistribute(grad.device_mesh, want)._local_tensor


def resolve_layout(
    dtype: torch.dtype,
    compute_device: torch.device,
    mp_policy: MixedPrecisionPolicy,
    offload_policy: OffloadPolicy,
    on_meta: bool = False,
) -> ParamLayout:
    """Where one parameter's shard lives and which dtypes its collectives use (``on_meta``: not yet,
    ``ShardedParam.refresh`` places it when ``to_empty`` materializes it)."""
    offload = isinstance(offload_policy, CPUOffloadPolicy)
    storage_device = torch.device("meta" if on_meta else "cpu" if offload else compute_device)
    # pinning needs an accelerator; on a CPU-only build the shard is already where it computes
    pin = offload and offload_policy.pin_memory and compute_device.type != "cpu"
    return ParamLayout(compute_device, storage_device, *collective_dtypes(dtype, mp_policy), pin, offload)
