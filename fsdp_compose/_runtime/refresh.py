"""Follow what a sharded module holds now: converted or replaced parameters.

Users change parameters after ``fully_shard`` as torch's FSDP2 allows: by conversion
(``model.to(torch.float64)``, ``to_empty``: ``_apply`` swaps new contents into the DTensor, whose
dtype or device changes) or by replacement (``module.weight = nn.Parameter(...)``,
``load_state_dict(assign=True)``: a new full tensor or DTensor). ``follow_module``, the one entry
point, compares each managed parameter with what the module registers and refreshes the group
(``ParamGroup.refresh``, ``ShardedParam.refresh``). It runs at the root's lazy init, after
``_apply``, at an ``unshard()`` before the first forward and after ``load_state_dict``.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from ..api.policies import collective_dtypes
from .param_layout import ParamLayout
from .params import ShardedParam
from .state import GroupState, class_name, register_owner


def follow_module(state: GroupState) -> None:
    """Adopt replaced parameters and new dtypes of ``state``'s group, and follow its shards' device.

    While the group is unsharded its modules hold the unsharded parameters, so there is nothing
    to compare; callers that convert the module reshard first.
    """
    group = state.group
    if group.is_unsharded or group.pending_unshard is not None:
        return
    replaced: dict[ShardedParam, tuple[nn.Parameter, ParamLayout]] = {}
    for p in group.params:
        held = _registered(state, p)
        if held is not p.sharded_param:
            held = _as_shard(state, p, held)
        # also where nothing changed: a swap (``_apply``) moved the mark to the discarded object
        register_owner(held, state)
        if held is not p.sharded_param or held.dtype != p.dtype or held.requires_grad != p.requires_grad:
            gather_dtype, reduce_dtype = collective_dtypes(held.dtype, state.settings.mp_policy)
            replaced[p] = held, dataclasses.replace(p.layout, gather_dtype=gather_dtype, reduce_dtype=reduce_dtype)
    group.refresh(replaced)


def _registered(state: GroupState, p: ShardedParam) -> torch.Tensor:
    """The one tensor every place of ``p`` registers now. Tied weights each given a new tensor
    (``load_state_dict(assign=True)`` assigns a state dict's keys one by one) stay tied: the first
    place's tensor is registered in all, as in torch's FSDP2."""
    held = [place.module._parameters.get(place.name) for place in p.places]
    if any(h is None for h in held):
        raise ValueError(
            f"parameter '{p.fqn}' of fully_shard({class_name(state.module)}) was removed or set to None "
            "after fully_shard; keep it, or pass it in ignored_params"
        )
    if any(h is not held[0] for h in held[1:]) and any(h is p.sharded_param for h in held):
        paths = {id(m): f"{name}." if name else "" for name, m in state.module.named_modules(remove_duplicate=False)}
        names = ", ".join(f"'{paths.get(id(place.module), '?.')}{place.name}'" for place in p.places)
        raise ValueError(
            f"parameter '{p.fqn}' of fully_shard({class_name(state.module)}) is shared by {names}, and only "
            "some of them were given a new parameter after fully_shard; assign a new parameter to all of them"
        )
    return held[0]


def _as_shard(state: GroupState, p: ShardedParam, new: torch.Tensor) -> nn.Parameter:
    """``new`` (a full tensor, or a DTensor on the shard's mesh) laid out like ``p``'s shard."""
    target = p.sharded_param
    where = f"parameter '{p.fqn}' of fully_shard({class_name(state.module)})"
    if new.shape != p.shape:
        raise ValueError(
            f"{where} was replaced by a tensor of shape {tuple(new.shape)} after fully_shard sharded it "
            f"with shape {tuple(p.shape)}; a replacement must keep the shape"
        )
    if isinstance(new, DTensor) and new.device_mesh != target.device_mesh:
        raise ValueError(
            f"{where} was replaced by a DTensor on {new.device_mesh}; pass a plain tensor of the "
            f"full shape or a DTensor on the shard's mesh {target.device_mesh}"
        )
    if not isinstance(new, DTensor) and p.tp_spec is not None:
        raise ValueError(
            f"{where} is tensor-parallel and was replaced by a plain tensor; replace it by a DTensor "
            f"on {target.device_mesh}"
        )
    with torch.no_grad():
        shard = p.as_shard(new)
    if shard is new and isinstance(new, nn.Parameter):
        return new  # already a shard like ours: keep the user's object (torch does too)
    shard = nn.Parameter(shard, requires_grad=new.requires_grad)
    return _in_place_of(new, shard) if isinstance(new, DTensor) else shard


def _in_place_of(new: DTensor, shard: nn.Parameter) -> nn.Parameter:
    """``new``'s object holding ``shard``, so earlier references (an optimizer) see the shard; ``shard``
    itself where torch cannot swap (``new`` is referenced elsewhere, e.g. by autograd)."""
    shard.__dict__.update(new.__dict__)  # the user's attributes stay with the user's object
    try:
        torch.utils.swap_tensors(new, shard)
    except RuntimeError:
        return shard
    return new
