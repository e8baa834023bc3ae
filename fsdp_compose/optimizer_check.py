"""An optimizer built before ``fully_shard`` fails at its first step instead of training nothing.

``fully_shard`` replaces each parameter it manages by a sharded DTensor; an optimizer built
earlier holds the replaced tensors, which the model no longer uses, so every step updates
nothing and gradients accumulate forever, in silence (torch's FSDP2 too). ``fully_shard`` marks
each replaced parameter with where it was; one global optimizer step pre-hook, installed by the
first call, checks an optimizer's parameters at its first step (and again only when its number
of parameter groups changes): one attribute read per step after that.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn
from torch.optim.optimizer import register_optimizer_step_pre_hook

_REPLACED_ATTR = "_fsdp_compose_replaced_by"
_CHECKED_ATTR = "_fsdp_compose_checked_groups"
_installed = False


def mark_replaced(param: nn.Parameter, where: Callable[[], str]) -> None:
    """``param`` was replaced by its shard; ``where()`` names it (built only for the error)."""
    setattr(param, _REPLACED_ATTR, where)


def install() -> None:
    """Register the step pre-hook once per process."""
    global _installed
    if not _installed:
        register_optimizer_step_pre_hook(_check_first_step)
        _installed = True


def _check_first_step(optimizer: torch.optim.Optimizer, args: tuple, kwargs: dict) -> None:
    groups = optimizer.param_groups
    if getattr(optimizer, _CHECKED_ATTR, None) == len(groups):
        return
    for group in groups:
        for param in group["params"]:
            where = getattr(param, _REPLACED_ATTR, None)
            if where is not None:
                raise RuntimeError(
                    f"{type(optimizer).__name__}.step(): the optimizer holds parameter {where()}, which fully_shard "
                    "replaced by its sharded DTensor; this optimizer was built before fully_shard, so every step "
                    "would update tensors the model no longer uses and nothing would train. Build the optimizer "
                    "after fully_shard, e.g. torch.optim.AdamW(model.parameters()) once every module is sharded"
                )
    setattr(optimizer, _CHECKED_ATTR, len(groups))
