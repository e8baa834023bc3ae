"""Ranks that built different weights fail at ``fully_shard``, not after days of a mixed model.

Each rank's shard is cut from its own copy of a parameter, so ranks that built different values
(``torch.manual_seed(rank)`` before the model, pretrained weights loaded on rank 0 only) train a
mix of several initialisations, in silence (torch's FSDP2 too). While the full values exist,
``fully_shard`` compares each parameter's float64 sum and sum of squares across the data-parallel
ranks as the divergence check compares its rounds (``handshake.disagreement``), at construction
only. Skipped: meta and fake parameters (no values yet), tensor subclasses (their own arithmetic),
a world of one, and ``FSDP_COMPOSE_CHECK_INIT=0`` (ranks that differ on purpose).
"""

from __future__ import annotations

import os

import torch
from torch import nn
from torch._subclasses.fake_tensor import is_fake
from torch.distributed.device_mesh import DeviceMesh

from .runtime.handshake import disagreement

CHECK_ENV = "FSDP_COMPOSE_CHECK_INIT"


def check_same_values(owner: str, params: dict[str, torch.Tensor], mesh: DeviceMesh, device: torch.device) -> None:
    """Raise on every rank if the data-parallel ranks of ``mesh`` hold different ``params`` (name -> value)."""
    if os.environ.get(CHECK_ENV, "1") == "0" or not params or mesh.size() == 1:
        return
    pieces = {name: p.to_local() if hasattr(p, "to_local") else p for name, p in params.items()}  # TP: this rank's
    if any(v.is_meta or is_fake(v) for v in pieces.values()):
        return
    # plain tensors only: a subclass (float8, NF4, the extension protocol's) defines its own arithmetic
    params = {name: v for name, v in pieces.items() if type(v) in (torch.Tensor, nn.Parameter)}
    if not params:
        return
    with torch.no_grad():
        prints = torch.stack([torch.stack([v.double().sum(), v.double().square().sum()]) for v in params.values()])
        prints = torch.nan_to_num(prints.to(device), nan=1.0e300).flatten()  # NaN compares equal to itself here
        groups = tuple(mesh.get_group(dim) for dim in range(mesh.ndim))
        found = disagreement(torch.cat([prints, -prints]), groups, f"fully_shard({owner})'s comparison of weights")
        differs = (found[: prints.numel()] | found[prints.numel() :]).view(-1, 2).any(dim=1).tolist()
    if any(differs):
        names = [name for name, different in zip(params, differs) if different]
        listed = ", ".join(f"'{n}'" for n in names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")
        raise ValueError(
            f"fully_shard({owner}): ranks hold different values of {listed}; each rank's shard would come from its "
            "own copy, so the model would train as a mix of several initialisations. Build the model with the same "
            "seed on every rank (torch.manual_seed before building it), load pretrained weights on every rank, or "
            "make them equal first (fsdp_compose.sync_module_states(model) before fully_shard). If ranks differ "
            f"on purpose, set {CHECK_ENV}=0"
        )
