"""An optimizer built before ``fully_shard`` fails at its first step instead of training nothing,
and one training unsharded parameters next to sharded ones, whose gradients differ across ranks,
warns that they will drift apart.

An optimizer built before ``fully_shard`` holds the tensors it replaced, which the model no longer
uses: every step would update nothing, in silence (torch's FSDP2 too). Their owner mark carries
their name (``_runtime/state.py``); one global step pre-hook looks at an optimizer's parameters at
its first step (again only if its parameter groups change): one attribute read per step after.

Trainable parameters no ``fully_shard`` manages next to sharded ones are fine if something keeps
them in step (torch's ``replicate()``, a user's own all-reduce of their gradients) and wrong if
nothing does (typically a forgotten ``fully_shard(model)``). Only their gradients tell: at that
first step, and only when there are such parameters, the ranks of the sharded parameters' mesh
compare each one's gradient fingerprint (one all-reduce, as ``_checks/weights.py`` compares weights)
and warn, on every rank, if any differs. A warning, not an error: a user may mean it.
``ignored_params`` and frozen parameters are left alone.
The hook is a process-wide effect (``_runtime/process_wide.py``): ``FSDP_COMPOSE_DISABLE=optimizer_check`` keeps it out.
"""

from __future__ import annotations

import warnings

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.optim.optimizer import register_optimizer_step_pre_hook

from .._runtime.process_wide import install_once
from .._runtime.state import owner_of, replaced_at
from .weights import differ_across_ranks

_IGNORED_ATTR = "_fsdp_compose_ignored"
_CHECKED_ATTR = "_fsdp_compose_checked_groups"


def mark_ignored(param: nn.Parameter) -> None:
    """``param`` was passed in ``ignored_params``: meant to stay unsharded."""
    setattr(param, _IGNORED_ATTR, True)


WHY = (
    "a global optimizer step pre-hook: an optimizer built before fully_shard raises at its first step, and "
    "unmanaged parameters whose gradients differ across ranks warn"
)


def install_optimizer_check() -> None:
    """Register the step pre-hook once per process, unless opted out."""
    install_once("optimizer_check", WHY, lambda: register_optimizer_step_pre_hook(_check_first_step))


def _check_first_step(optimizer: torch.optim.Optimizer, args: tuple, kwargs: dict) -> None:
    groups = optimizer.param_groups
    if getattr(optimizer, _CHECKED_ATTR, None) == len(groups):
        return
    unmanaged, mesh_owner = [], None
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
                if mesh_owner is None or owner.group.mesh.size() > mesh_owner.group.mesh.size():
                    mesh_owner = owner
            elif param.requires_grad and not hasattr(param, _IGNORED_ATTR) and not hasattr(param, "device_mesh"):
                unmanaged.append(param)
    if unmanaged and mesh_owner is not None and mesh_owner.group.mesh.size() > 1:
        drifting = _unequal_grads(unmanaged, mesh_owner.group.mesh, mesh_owner.group.device)  # a collective
        if drifting:
            _warn_drifting(optimizer, drifting)
    setattr(optimizer, _CHECKED_ATTR, len(groups))


def _unequal_grads(params: list[torch.Tensor], mesh: DeviceMesh, device: torch.device) -> list[torch.Tensor]:
    """The ``params`` whose gradients (zeros without one) differ across the ranks of ``mesh``."""
    grads = [p.grad.detach() if p.grad is not None else torch.zeros(1) for p in params]
    differs = differ_across_ranks(grads, mesh, device, "the optimizer check's comparison of gradients")
    return [p for p, different in zip(params, differs) if different]


def _warn_drifting(optimizer: torch.optim.Optimizer, params: list[torch.Tensor]) -> None:
    shapes = ", ".join(str(tuple(p.shape)) for p in params[:4]) + (", ..." if len(params) > 4 else "")
    warnings.warn(
        f"{type(optimizer).__name__}.step(): the optimizer trains {len(params)} parameter(s) no fully_shard "
        f"manages next to sharded ones (shapes {shapes}), and their gradients differ across ranks: nothing "
        "reduced them, so the ranks' copies drift apart from this step (e.g. the embedding and head when "
        "fully_shard(model) was not called on the root). Call fully_shard on the root too, after its blocks; "
        "pass parameters meant to stay local in ignored_params; or keep them in step yourself (torch's "
        "replicate(), or an all-reduce of their gradients before step())",
        stacklevel=4,
    )
