"""Deferred initialization: materialize a meta-device model shard by shard.

Build the model under ``torch.device("meta")``, call ``fully_shard``, then
``model.to_empty(device=...)`` allocates only each rank's shards. ``init_sharded_parameters``
then runs each module's initializer at full size, one module at a time, and keeps this rank's
rows: peak memory is the shards plus one module's full parameters, never the whole model.

Why not just ``reset_parameters()`` on the sharded DTensors? On a CPU mesh, DTensor's random
ops draw the same local values on every rank, so every shard would repeat the first one.
Here every rank draws the full tensor from the same generator state, exactly as an eager
``torch.manual_seed(s); Model()`` does when modules initialize in ``model.modules()`` order.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from ..extras_api import group_facts, groups_in, write_full


def _reset(module: nn.Module) -> None:
    reset = getattr(module, "reset_parameters", None)
    if callable(reset):
        reset()


@torch.no_grad()
def init_sharded_parameters(model: nn.Module, init_fn: Callable[[nn.Module], None] | None = None) -> None:
    """Run ``init_fn(module)`` (default ``module.reset_parameters()``) for every module, at full size.

    Each module's own sharded parameters are temporarily replaced by full-size tensors on the
    shard's device; after ``init_fn`` this rank's rows are copied into its shard.
    """
    init_fn = init_fn or _reset
    shards = {id(p.parameter): p for _, group in groups_in(model) for p in group_facts(group).params}
    for module in model.modules():
        swapped = []
        for name, param in module._parameters.items():
            p = shards.get(id(param))
            if p is None:
                continue
            if p.tensor_parallel:
                raise NotImplementedError(
                    f"init_sharded_parameters: '{p.fqn}' is tensor-parallel; initialize it before "
                    "parallelize_module, or with DTensor ops on a device whose RNG DTensor supports"
                )
            device = p.parameter.to_local().device
            full = nn.Parameter(torch.empty(p.shape, dtype=p.dtype, device=device), requires_grad=p.requires_grad)
            module._parameters[name] = full
            swapped.append((name, p.parameter, full))
        try:
            init_fn(module)
        except BaseException:
            for name, shard, _ in swapped:
                module._parameters[name] = shard  # shards untouched by a failed init
            raise
        for name, shard, full in swapped:
            write_full(shard, full)
            module._parameters[name] = shard


@torch.no_grad()
def sync_module_states(module: nn.Module, src: int = 0, group: dist.ProcessGroup | None = None) -> None:
    """Broadcast ``src``'s parameters and buffers so every rank starts identical.

    Call it before ``fully_shard`` (FSDP1's ``sync_module_states=True``): once sharded, each rank
    holds different rows and there is no full copy to broadcast.
    """
    for name, tensor in [*module.named_parameters(), *module.named_buffers()]:
        if isinstance(tensor, DTensor):
            raise ValueError(
                f"sync_module_states: '{name}' is already sharded; call sync_module_states before fully_shard"
            )
        dist.broadcast(tensor.detach(), src=src, group=group)
