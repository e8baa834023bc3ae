"""``state_dict()`` / ``load_state_dict()`` hooks: the sharded DTensors are the state, always.

Between a forward and its backward a group may have its unsharded (plain) parameters
registered; ``state_dict()`` must still return the sharded DTensors, and ``load_state_dict()``
must write into the shards, never into a gathered copy that the next reshard throws away.
Loading also accepts plain full tensors (each rank keeps its own rows) and DTensors with
other placements.
"""

from __future__ import annotations

from functools import partial

import torch
from torch import nn

from .._runtime.params import ShardedParam
from .._runtime.refresh import follow_module
from .._runtime.state import GroupState
from .model_groups import check_idle


def _keys_by_param(state: GroupState, module: nn.Module) -> list[tuple[ShardedParam, list[str]]]:
    """Every state-dict key (relative to ``module``, one of the group's modules) of each parameter."""
    paths: dict[int, list[str]] = {}
    for name, sub in module.named_modules(remove_duplicate=False):
        paths.setdefault(id(sub), []).append(f"{name}." if name else "")
    keys = [
        (p, [path + place.name for place in p.places for path in paths.get(id(place.module), [])])
        for p in state.group.params
    ]
    return [(p, names) for p, names in keys if names]


def _on_state_dict(keys: list, module: nn.Module, state_dict: dict, prefix: str, local_metadata) -> None:
    for p, names in keys:
        for name in names:
            value = state_dict.get(prefix + name)
            if value is None or value is p.sharded_param:
                continue
            # gathered (plain, or a TP DTensor): report the shard the optimizer holds
            keep_vars = isinstance(value, nn.Parameter)
            state_dict[prefix + name] = p.sharded_param if keep_vars else p.sharded_param.detach()


def _on_load_state_dict(state: GroupState, keys: list, module: nn.Module, state_dict: dict, prefix: str, *_) -> None:
    check_idle(state, "load_state_dict")
    state.group.reshard()  # load into the shards (not a gathered copy or post-forward slice)
    for p, names in keys:
        for name in names:
            value = state_dict.get(prefix + name)
            if not isinstance(value, torch.Tensor) or value.shape != p.shape:
                continue  # nn.Module reports missing keys and size mismatches by name
            state_dict[prefix + name] = p.as_shard(value)


def register_state_dict_hooks(state: GroupState, module: nn.Module) -> None:
    """Attach the hooks to one of the group's modules (called by ``fully_shard`` for each)."""
    keys = _keys_by_param(state, module)
    module.register_state_dict_post_hook(partial(_on_state_dict, keys))
    module.register_load_state_dict_pre_hook(partial(_on_load_state_dict, state, keys))
    # load_state_dict(assign=True) registers the loaded shards in place of ours: adopt them
    module.register_load_state_dict_post_hook(lambda _module, _keys: follow_module(state))
