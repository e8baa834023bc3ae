"""What one group costs per step, computed from its facts (``extras_api.group_facts``): sizes, collectives, prefetch.

Every figure mirrors the code that moves the bytes (``ParamGroup.start_unshard``,
``start_reduce``, ``collectives.py``), so predicted bytes equal what ``CommStats`` counts.
Assumption: each module of a group runs once per forward, in the order the modules are defined.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from ...extras_api import GroupFacts, ParamFacts


@dataclass
class GroupPlan:
    """One ``fully_shard`` group: the row ``explain`` prints."""

    name: str  # module FQN(s) of the call, '<root>' for the model itself
    params: int  # parameter elements (global shapes)
    dtypes: str  # shard dtype(s), '->gather dtype' under mixed precision
    sharded_bytes: int  # this rank's shards
    unsharded_bytes: int  # the gathered parameters while in use
    all_gathers: int  # per step, forward + backward
    all_gather_bytes: int  # gathered buffer sizes, as CommStats counts them
    reduce_scatters: int
    reduce_scatter_bytes: int  # reduce-scatter inputs, as CommStats counts them
    all_reduces: int
    all_reduce_bytes: int
    reshard_after_forward: bool | int
    sent_bytes: int = 0  # what this rank sends per step (ring algorithms): (n-1)/n of each collective
    forward_prefetch: list[str] = field(default_factory=list)
    backward_prefetch: list[str] = field(default_factory=list)
    offload: bool = False
    is_root: bool = False


@dataclass
class GroupSizes:
    """Byte sizes of one group's buffers, for the memory simulation."""

    send: int  # this rank's all-gather input (padded shards)
    gathered: int  # all-gather output
    unsharded: int
    kept: int  # reshard_after_forward=<int>: slice kept after forward (0 without)
    kept_gathered: int  # all-gather output when re-gathering from the slice
    reduce_tables: list[int]  # one reduce-scatter input per reduce dtype
    reduce_outputs: list[int]
    sharded_grad_copies: list[int]  # per reduce dtype: bytes of the sharded grad if copied, 0 if a view


def module_names(model: nn.Module) -> dict[nn.Module, str]:
    return {m: name for name, m in model.named_modules(remove_duplicate=False)}


def group_name(g: GroupFacts, names: dict[nn.Module, str]) -> str:
    found = [names.get(m, "?") or "<root>" for m in g.modules]
    return ", ".join(found) + g.mesh_text


def itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def _unsharded_row_bytes(p: ParamFacts) -> int:
    """One rank's share of the unsharded parameter: what it gathers, except for a quantized wire
    format, which is dequantized into the compute dtype (the wire bytes are freed once it is)."""
    if p.quantized:
        return p.padded_numel * p.gather_dtype.itemsize
    return p.gather_bytes


def sizes_of(g: GroupFacts) -> GroupSizes:
    world = g.world
    send = sum(p.gather_bytes for p in g.params)
    kept = kept_gathered = 0
    if g.post_forward_ranks is not None and g.reshard_after_forward:
        ranks = g.post_forward_ranks
        kept = sum(size * world // ranks for size in g.gather_widths)
        kept_gathered = ranks * kept
    tables, outputs, copies = [], [], []
    for reduction in g.reductions if g.requires_gradient_sync else ():  # the runtime's own plan
        dtype, params, row = reduction.dtype, reduction.params, reduction.row_bytes
        tables.append(world * row)
        outputs.append(row)
        view = all(p.dtype == dtype and not p.offloaded for p in params)
        copies.append(0 if view else sum(p.local_numel * itemsize(p.dtype) for p in params))
    return GroupSizes(
        send=send if g.params else 0,
        gathered=world * send if g.params else 0,
        unsharded=sum(world * _unsharded_row_bytes(p) for p in g.params),
        kept=kept,
        kept_gathered=kept_gathered,
        reduce_tables=tables,
        reduce_outputs=outputs,
        sharded_grad_copies=copies,
    )


def plan_group(
    g: GroupFacts,
    name: str,
    reshards: bool,
    is_root: bool,
    forward_prefetch: list[str],
    backward_prefetch: list[str],
) -> GroupPlan:
    """``reshards``: whether the group frees its parameters after forward (the schedule's rule)."""
    sizes = sizes_of(g)
    calls = len(g.modules)
    world = g.world
    gathers = gather_bytes = 0
    sent = 0.0
    if g.params:
        # forward: the first call gathers; later calls of a group resharded after forward gather again
        gathers, gather_bytes = 1, sizes.gathered
        sent = sizes.gathered * (world - 1) / world
        regather = sizes.kept_gathered if sizes.kept else sizes.gathered
        regather_ranks = g.post_forward_ranks if sizes.kept else world
        if reshards:
            gathers += calls  # calls - 1 more in forward, one in backward
            gather_bytes += calls * regather
            sent += calls * regather * (regather_ranks - 1) / regather_ranks
    sent += sum(sizes.reduce_tables) * (world - 1) / world
    # HSDP (a 2-D mesh, even with one replica): one all-reduce per reduce-scatter
    all_reduces = len(sizes.reduce_outputs) if g.hsdp and g.requires_all_reduce else 0
    replicas = g.replicas
    if all_reduces:
        sent += sum(sizes.reduce_outputs) * 2 * (replicas - 1) / replicas
    reshard: bool | int = reshards
    if reshards and g.post_forward_ranks is not None:
        reshard = g.post_forward_ranks
    return GroupPlan(
        name=name,
        params=sum(p.shape.numel() for p in g.params),
        dtypes=_dtypes(g),
        sharded_bytes=sum(p.local_bytes for p in g.params),
        unsharded_bytes=sizes.unsharded,
        all_gathers=gathers,
        all_gather_bytes=gather_bytes,
        reduce_scatters=len(sizes.reduce_tables),
        reduce_scatter_bytes=sum(sizes.reduce_tables),
        all_reduces=all_reduces,
        all_reduce_bytes=sum(sizes.reduce_outputs) if all_reduces else 0,
        reshard_after_forward=reshard,
        sent_bytes=round(sent),
        forward_prefetch=forward_prefetch,
        backward_prefetch=backward_prefetch,
        offload=any(p.offloaded for p in g.params),
        is_root=is_root,
    )


def _short(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _dtypes(g: GroupFacts) -> str:
    pairs = sorted({(_short(p.dtype), _short(p.gather_dtype)) for p in g.params})
    return ",".join(a if a == b else f"{a}->{b}" for a, b in pairs) or "-"
