"""Full (unsharded) state dicts that never hold more than one group unsharded at a time.

``torch.distributed.checkpoint.state_dict.get_model_state_dict(full_state_dict=True)`` works
on our models too, but gathers parameter by parameter with no bound on what is live; these
helpers walk the ``fully_shard`` groups in tree order with one collective per group, straight
from the shards (the source of truth, whatever state the group is in), so a rank's extra
memory is about one group on top of the result.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from .._checks.agreement import raise_together
from .._runtime.params import ShardedParam
from .._runtime.state import GroupState
from .full_gather import gather_full_params
from .model_groups import check_idle, group_states, reshard_idle


def _keys_by_group(
    model: nn.Module, live: dict[str, Any]
) -> tuple[dict[GroupState, list[tuple[str, ShardedParam]]], set[str]]:
    """State-dict keys of each group's parameters (tied parameters appear under every key)."""
    owners = {id(p.sharded_param): (s, p) for s in group_states(model) for p in s.group.params}
    by_group: dict[GroupState, list[tuple[str, ShardedParam]]] = {}
    for key, value in live.items():
        if id(value) in owners:
            state, p = owners[id(value)]
            by_group.setdefault(state, []).append((key, p))
    managed = {key for items in by_group.values() for key, _ in items}
    return by_group, managed


def full_state_dict(model: nn.Module, *, rank0_only: bool = True) -> dict[str, Any]:
    """The unsharded model's ``state_dict()``, on CPU, gathered one group at a time.

    Call on every rank. With ``rank0_only`` the other ranks take part in the gathers and
    return ``{}``, so only rank 0 pays the CPU memory of a whole model.
    """
    for state in group_states(model):
        check_idle(state, "full_state_dict")
    keep = not rank0_only or dist.get_rank() == 0
    live = model.state_dict(keep_vars=True)
    by_group, managed = _keys_by_group(model, live)
    out: dict[str, Any] = {}
    for items in by_group.values():
        unique = list({id(p): p for _, p in items}.values())
        fulls = dict(zip(map(id, unique), gather_full_params(unique, keep=keep, to_all=not rank0_only, device="cpu")))
        if keep:
            for key, p in items:
                out[key] = fulls[id(p)]
    for key, value in live.items():
        if key in managed:
            continue
        if isinstance(value, DTensor):
            value = value.full_tensor()  # a DTensor we do not manage: collective on every rank
        if keep:
            out[key] = value.detach().to("cpu", copy=True) if isinstance(value, torch.Tensor) else value
    return {key: out[key] for key in live if key in out} if keep else {}


def _validation_error(live: dict[str, Any], given: dict[str, Any], strict: bool) -> str | None:
    problems = []
    if strict:
        missing = [k for k in live if k not in given]
        unexpected = [k for k in given if k not in live]
        if missing:
            problems.append(f"missing key(s): {', '.join(map(repr, missing))}")
        if unexpected:
            problems.append(f"unexpected key(s): {', '.join(map(repr, unexpected))}")
    for key, value in given.items():
        target = live.get(key)
        if not isinstance(target, torch.Tensor):
            continue
        if not isinstance(value, torch.Tensor):
            problems.append(f"key {key!r}: expected a tensor, got {type(value).__name__}")
        elif isinstance(value, DTensor):
            problems.append(f"key {key!r}: expected a full tensor, got a DTensor (use load_state_dict)")
        elif value.shape != target.shape:
            problems.append(
                f"key {key!r}: shape {tuple(value.shape)} in the state dict, {tuple(target.shape)} in the model"
            )
    if not problems:
        return None
    return "load_full_state_dict: " + "; ".join(problems)


def _broadcast_group(items: list[tuple[str, ShardedParam]], given: dict[str, Any], rank: int) -> None:
    """One broadcast of the group's full parameters (as bytes); each rank keeps its rows."""
    firsts: dict[int, tuple[str, ShardedParam]] = {}
    for key, p in items:
        firsts.setdefault(id(p), (key, p))
    params = list(firsts.values())
    sizes = [p.shape.numel() * p.sharded_param.element_size() for _, p in params]
    device = params[0][1].sharded_param.device
    if rank == 0:
        pieces = [
            given[key].detach().to(device=device, dtype=p.dtype).reshape(-1).view(torch.uint8) for key, p in params
        ]
        flat = torch.cat(pieces) if len(pieces) > 1 else pieces[0].clone()
    else:
        flat = torch.empty(sum(sizes), dtype=torch.uint8, device=device)
    dist.broadcast(flat, src=0)
    with torch.no_grad():
        for (_, p), chunk in zip(params, torch.split(flat, sizes)):
            full = chunk.view(p.dtype).view(p.shape)
            p.local_tensor().copy_(p.shard_of(full))


def load_full_state_dict(model: nn.Module, state_dict: dict[str, Any] | None, *, strict: bool = True) -> None:
    """Load a full (unsharded) state dict held by rank 0, broadcasting one group at a time.

    Call on every rank; ranks other than 0 may pass ``None``. Rank 0 checks keys and shapes
    first and every rank raises the same ``ValueError`` before anything is loaded.
    """
    reshard_idle(model, "load_full_state_dict")
    rank = dist.get_rank()
    given = state_dict if rank == 0 else {}
    live = model.state_dict(keep_vars=True)
    error = None
    if rank == 0:  # every check runs on rank 0; every rank raises its error
        if not isinstance(given, dict):
            error = f"load_full_state_dict: rank 0 needs a dict, got {type(given).__name__}"
        else:
            error = _validation_error(live, given, strict)
    raise_together(error, cls=ValueError, source=0)
    by_group, managed = _keys_by_group(model, live)
    present = [sorted({k for k, _ in items if k in given}) if rank == 0 else None for items in by_group.values()]
    dist.broadcast_object_list(present, src=0)  # with strict=False a group may be partly absent
    for items, keys in zip(by_group.values(), present):
        kept = [(k, p) for k, p in items if k in keys]
        if kept:
            _broadcast_group(kept, given, rank)
    rest = [{k: v for k, v in given.items() if k not in managed} if rank == 0 else None]
    dist.broadcast_object_list(rest, src=0)  # buffers and extra state: small
    model.load_state_dict(rest[0], strict=False)
