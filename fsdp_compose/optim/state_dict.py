"""Owner-held whole-matrix momentum to and from row-sharded state dicts (one collective per shard group).

``OwnerComputedMuon`` keeps each ``Shard(0)`` matrix's momentum as one whole tensor on that matrix's owner.
A state dict presents it laid out like its parameter: a DTensor with the parameter's mesh and placements,
each rank holding its rows, so ``torch.distributed.checkpoint`` saves, loads and reshards it like any
FSDP2 optimizer state. Loading sends the rows back to the (possibly different) owners as whole tensors.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from .exchange import Matrix, ShardGroup, gather_to_owners, scatter_from_owners
from .muon import MOMENTUM


def common_dtype(params: Sequence[torch.Tensor]) -> torch.dtype:
    dtype = params[0].dtype
    for p in params[1:]:
        dtype = torch.promote_types(dtype, p.dtype)
    return dtype


def _matrices(params: Sequence[torch.Tensor], owners: Sequence[int], size: int) -> list[Matrix]:
    return [Matrix.from_shape(p.shape, o, size) for p, o in zip(params, owners)]


def momentum_to_shards(
    shard_group: ShardGroup, params: Sequence[torch.Tensor], owners: Sequence[int], state: dict[Any, dict[str, Any]]
) -> list[DTensor]:
    """Each parameter's momentum as a DTensor laid out like it, from the owners' whole buffers (one all_to_all).

    ``params`` are the matrices of one sharded group that have momentum (the same list on every rank).
    """
    if not params:
        return []
    me = shard_group.rank
    matrices = _matrices(params, owners, shard_group.size)
    dtype = common_dtype(params)
    owned = {i: state[p][MOMENTUM] for i, p in enumerate(params) if owners[i] == me}
    rows = scatter_from_owners(shard_group, matrices, owned, dtype)
    return [
        DTensor.from_local(r.to(p.dtype).clone(), p.device_mesh, p.placements, shape=p.shape, stride=p.stride())
        for p, r in zip(params, rows)
    ]


def shards_to_momentum(
    shard_group: ShardGroup, params: Sequence[torch.Tensor], owners: Sequence[int], shards: Sequence[torch.Tensor]
) -> dict[int, torch.Tensor]:
    """The whole momentum, by index into ``params``, of those this rank owns, from row shards (one all_to_all).

    ``shards`` are DTensors laid out like their parameters (as a state dict loaded by DCP gives them).
    """
    if not params:
        return {}
    matrices = _matrices(params, owners, shard_group.size)
    local = []
    for p, m, s in zip(params, matrices, shards):
        if not isinstance(s, DTensor) or tuple(s.shape) != tuple(p.shape):
            raise ValueError(f"momentum for a {tuple(p.shape)} Shard(0) matrix must be a DTensor of that shape")
        if s.placements != p.placements or s.device_mesh != p.device_mesh:
            s = s.redistribute(p.device_mesh, p.placements)
        rows = s.to_local()
        if tuple(rows.shape) != (m.row_counts[shard_group.rank], m.cols):
            raise ValueError(f"momentum rows {tuple(rows.shape)} do not match the parameter's Shard(0) rows")
        local.append(rows)
    dtype = common_dtype(params)
    return {i: full.to(params[i].dtype) for i, full in gather_to_owners(shard_group, matrices, local, dtype).items()}


def param_indices(param_groups: list[dict[str, Any]]) -> dict[int, int]:
    """Each parameter's index in torch's optimizer state dict (in group order, each parameter once)."""
    index: dict[int, int] = {}
    for group in param_groups:
        for p in group["params"]:
            index.setdefault(id(p), len(index))
    return index


def rows_like(saved: Any, param: torch.Tensor) -> torch.Tensor:
    """A 3-D batch's saved momentum (a DTensor, possibly laid out for another world size) as this rank's rows."""
    if not isinstance(saved, DTensor) or tuple(saved.shape) != tuple(param.shape):
        raise ValueError(f"momentum for a {tuple(param.shape)} batch of matrices must be a DTensor of its shape")
    if saved.placements != param.placements or saved.device_mesh != param.device_mesh:
        saved = saved.redistribute(param.device_mesh, param.placements)
    return saved.to_local().clone()
