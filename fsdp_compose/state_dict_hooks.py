"""``state_dict()`` / ``load_state_dict()`` hooks: the sharded DTensors are the state, always.

Between a forward and its backward a group may have its unsharded (plain) parameters
registered; ``state_dict()`` must still return the sharded DTensors, and ``load_state_dict()``
must write into the shards, never into a gathered copy that the next reshard throws away.
Loading also accepts plain full tensors (each rank keeps its own rows) and DTensors with
other placements.
"""

from __future__ import annotations

import math
from functools import partial

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Shard

from .params import ShardedParam
from .state import GroupState
from .walk import check_idle


def local_rows(dtensor: DTensor) -> slice:
    """The dim-0 rows this rank holds of a ``Shard(0)`` DTensor (``torch.chunk`` layout)."""
    mesh = dtensor.device_mesh
    dim0 = dtensor.shape[0]
    per_rank = math.ceil(dim0 / mesh.size())
    start = min(mesh.get_local_rank() * per_rank, dim0)
    return slice(start, min(start + per_rank, dim0))


def shard_like(value: torch.Tensor, target: DTensor) -> DTensor:
    """``value`` (a full tensor, or a DTensor of any layout) laid out exactly like ``target``."""
    if isinstance(value, DTensor):
        if value.device_mesh == target.device_mesh:
            if tuple(value.placements) == tuple(target.placements):
                return value
            return value.redistribute(target.device_mesh, target.placements)
        value = value.full_tensor()
    local = value.detach()[local_rows(target)].to(target.device)
    return DTensor.from_local(
        local, target.device_mesh, target.placements, run_check=False, shape=target.shape, stride=target.stride()
    )


def _keys_by_param(state: GroupState) -> list[tuple[ShardedParam, list[str]]]:
    """Every state-dict key (relative to the group's module) under which each parameter appears."""
    paths: dict[int, list[str]] = {}
    for name, sub in state.module.named_modules(remove_duplicate=False):
        paths.setdefault(id(sub), []).append(f"{name}." if name else "")
    return [
        (p, [path + place.name for place in p.places for path in paths.get(id(place.module), [])])
        for p in state.group.params
    ]


def _on_state_dict(keys: list, module: nn.Module, state_dict: dict, prefix: str, local_metadata) -> None:
    for p, names in keys:
        for name in names:
            value = state_dict.get(prefix + name)
            if value is None or isinstance(value, DTensor):
                continue
            keep_vars = isinstance(value, nn.Parameter)
            state_dict[prefix + name] = p.sharded_param if keep_vars else p.sharded_param.detach()


def _on_load_state_dict(state: GroupState, keys: list, module: nn.Module, state_dict: dict, prefix: str, *_) -> None:
    check_idle(state, "load_state_dict")
    if state.group.is_unsharded or state.group.pending_unshard is not None:
        state.group.reshard()  # load into the shards; the next forward gathers the new values
    for p, names in keys:
        target = p.sharded_param
        for name in names:
            value = state_dict.get(prefix + name)
            if not isinstance(value, torch.Tensor) or value.shape != target.shape:
                continue  # nn.Module reports missing keys and size mismatches by name
            state_dict[prefix + name] = shard_like(value, target)


def register_state_dict_hooks(state: GroupState) -> None:
    """Attach the hooks to the group's module (called once by ``fully_shard``)."""
    keys = _keys_by_param(state)
    state.module.register_state_dict_post_hook(partial(_on_state_dict, keys))
    state.module.register_load_state_dict_pre_hook(partial(_on_load_state_dict, state, keys))
