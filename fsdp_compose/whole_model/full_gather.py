"""Full parameters gathered straight from the shards, outside training: what ``full_state_dict``
and ``summon_full_params`` show.

The group's unshard (``_runtime/group.py``) fills the persistent unsharded parameters for forward and
backward, in the gather dtype and through the all-gather extension protocol. Whole-model views
must work whatever state the group is in and show exact values, so this reads each parameter's
local shard (the source of truth) and gathers a group's shards as bytes in one collective: an
all-gather, or with ``to_all=False`` a ``dist.gather`` to the shard group's first rank, whose
other ranks only send. Tensor-subclass shards (NF4, float8 weights) are not their bytes: DTensor
gathers those, one collective each."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from .._runtime.collectives import CommStats, GatherLayout, all_gather_flat
from .._runtime.extensions import has_protocol, is_wrapper_subclass
from .._runtime.params import ShardedParam


def gather_full_params(
    params: list[ShardedParam], *, keep: bool, to_all: bool, as_module: bool = False, device: str | None = None
) -> list[torch.Tensor | None]:
    """The full value of each of ``params`` (one group's), or ``None`` where not ``keep``.

    Every rank calls it. By default each value is global, in the parameter's
    own dtype: a tensor-parallel parameter is completed across the TP mesh (a collective, so then
    every rank receives whatever ``to_all``). ``as_module`` gives what the module holds when
    unsharded instead: the gather dtype (mixed precision's ``param_dtype``) and, under TP, a DTensor
    in the TP layout. ``device`` moves each value as it is made, so at most one is held twice.
    """
    subclasses = [is_wrapper_subclass(p.local_tensor()) for p in params]
    by_bytes = [p for p, subclass in zip(params, subclasses) if not subclass]
    gathered = iter(_gather_bytes(by_bytes, keep, to_all, as_module, device) if by_bytes else [])
    result = []
    for p, subclass in zip(params, subclasses):
        if not subclass:
            result.append(next(gathered))
            continue
        full = p.sharded_param.detach().full_tensor()  # a collective: every rank
        result.append(full.to(device or full.device) if keep else None)
    return result


def _gather_bytes(
    params: list[ShardedParam], keep: bool, to_all: bool, as_module: bool, device: str | None
) -> list[torch.Tensor | None]:
    """One gather of the padded shards, as bytes, in each parameter's shard layout (the shard dim of
    its mesh), so HSDP and tensor-parallel shards gather like 1-D ones."""
    complete_tp = not as_module and any(p.tp_spec is not None for p in params)
    if complete_tp:  # completing TP tensors is a collective over the TP mesh: every rank takes part
        to_all = True
    dtypes = [_value_dtype(p, as_module) for p in params]
    pieces, widths = [], []
    for p, dtype in zip(params, dtypes):
        local = p.row_layout.to_comm(p.local_tensor()).to(p.layout.compute_device, dtype)
        pieces.append(p.row_layout.pad(local).view(torch.uint8))
        widths.append(pieces[-1].numel())
    first = params[0]
    pg = first.mesh.get_group(first.mesh.ndim - 1)
    world = first.row_layout.world
    if to_all:
        work, out = all_gather_flat(pieces, GatherLayout(widths, world), pg, CommStats())
        work.wait()
        rows = list(out.unbind(0))
    else:
        flat = torch.cat(pieces) if len(pieces) > 1 else pieces[0].contiguous()
        dst = dist.get_global_rank(pg, 0)
        rows = [flat.new_empty(flat.numel()) for _ in range(world)] if dist.get_rank() == dst else None
        dist.gather(flat, rows, dst=dst, group=pg)
        del flat
    del pieces
    if rows is None or not (keep or complete_tp):
        return [None] * len(params)
    result, offset = [], 0
    for p, dtype, width in zip(params, dtypes, widths):
        padded = torch.cat([row[offset : offset + width] for row in rows]).view(dtype)
        full = p.row_layout.from_comm(p.row_layout.unpad(padded)).contiguous()
        if p.tp_spec is not None:
            full = DTensor(full, p.tp_spec, requires_grad=False)
            full = full if as_module else full.full_tensor()
        result.append(full.to(device or full.device) if keep else None)
        offset += width
    return result


def _value_dtype(p: ShardedParam, as_module: bool) -> torch.dtype:
    """The gather dtype for the module's view, except where the extension protocol (a shard's own, or a
    quantized wire format) makes the module's copy: that may be lossy, so its own values are shown."""
    if not as_module or p.wire is not None or has_protocol(p.local_tensor(), f"the shard of parameter '{p.fqn}'"):
        return p.dtype
    return p.layout.gather_dtype
