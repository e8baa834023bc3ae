"""An optimizer built before ``fully_shard`` fails at its first step instead of training nothing,
and one training unsharded parameters next to sharded ones warns that they will drift apart.

An optimizer built before ``fully_shard`` holds the tensors it replaced, which the model no longer
uses: every step would update nothing, in silence (torch's FSDP2 too). Their owner mark carries
their name (``runtime/state.py``); one global step pre-hook looks at an optimizer's parameters at
its first step (again only if its parameter groups change): one attribute read per step after.

It also warns about trainable parameters no ``fully_shard`` manages next to sharded ones, on
several ranks: nothing reduces their gradients (typically a forgotten ``fully_shard(model)``). Not
an error: torch's ``replicate()`` or a user's own all-reduce keep them in step legitimately,
unseen from here. ``ignored_params`` and frozen parameters are left alone.
"""

from __future__ import annotations

import functools
import warnings

import torch
from torch import nn
from torch.optim.optimizer import register_optimizer_step_pre_hook

from .runtime.state import owner_of, replaced_at

_IGNORED_ATTR = "_fsdp_compose_ignored"
_CHECKED_ATTR = "_fsdp_compose_checked_groups"


def mark_ignored(param: nn.Parameter) -> None:
    """``param`` was passed in ``ignored_params``: meant to stay unsharded."""
    setattr(param, _IGNORED_ATTR, True)


@functools.cache
def install_optimizer_check() -> None:
    """Register the step pre-hook once per process."""
    register_optimizer_step_pre_hook(_check_first_step)


def _check_first_step(optimizer: torch.optim.Optimizer, args: tuple, kwargs: dict) -> None:
    groups = optimizer.param_groups
    if getattr(optimizer, _CHECKED_ATTR, None) == len(groups):
        return
    unmanaged, sharded_ranks = [], 1
    for group in groups:
        for param in group["params"]:
            owner, name = owner_of(param), replaced_at(param)
            if name is not None and owner is not None:
                raise RuntimeError(
                    f"{type(optimizer).__name__}.step(): the optimizer holds parameter '{name}' of "
                    f"{owner.group.label}, which fully_shard replaced by its sharded DTensor; this optimizer was "
                    "built before fully_shard, so every step would update tensors the model no longer uses and "
                    "nothing would train. Build the optimizer after fully_shard, e.g. "
                    "torch.optim.AdamW(model.parameters()) once every module is sharded"
                )
            if owner is not None:
                mesh = getattr(param, "device_mesh", None)
                sharded_ranks = max(sharded_ranks, mesh.size() if mesh is not None else 1)
            elif param.requires_grad and not hasattr(param, _IGNORED_ATTR) and not hasattr(param, "device_mesh"):
                unmanaged.append(param)
    if unmanaged and sharded_ranks > 1:
        shapes = ", ".join(str(tuple(p.shape)) for p in unmanaged[:4]) + (", ..." if len(unmanaged) > 4 else "")
        warnings.warn(
            f"{type(optimizer).__name__}.step(): the optimizer trains {len(unmanaged)} parameter(s) no fully_shard "
            f"manages next to sharded ones (shapes {shapes}): nothing reduces their gradients across ranks, so the "
            "ranks' copies drift apart from the first step (e.g. the embedding and head when fully_shard(model) "
            "was not called on the root). Call fully_shard on the root too, after its blocks; pass parameters "
            "meant to stay local in ignored_params; or keep them in step yourself (torch's replicate(), or an "
            "all-reduce of their gradients)",
            stacklevel=3,
        )
    setattr(optimizer, _CHECKED_ATTR, len(groups))
