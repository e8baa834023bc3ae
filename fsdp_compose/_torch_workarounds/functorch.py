"""Unshard and reshard below ``torch.func`` transforms (jvp, vmap, grad).

Upstream: pytorch/pytorch#182641 (open: "Cannot jvp through FSDP2", torch 2.11); torch's own answer,
pytorch/pytorch#182732, keeps FSDP2's unshard and reshard outside the active transforms as this file does. A torch
gap (tensors made inside a transform are its wrappers), not a bug to wait out: applies to torch 2.11 to 2.14.1.

A first all-gather inside ``torch.func.jvp`` would make the gather buffers and the unsharded parameter the
transform's wrapper tensors, which have no storage to alias (torch's FSDP2 builds them below the transform too).
Uses two private switches of ``torch._C``, present on torch 2.11 to 2.14.1 and looked up once; where either is
missing, nothing is disabled (the fallback is tested in ``tests/workarounds/test_functorch.py``).
"""

from __future__ import annotations

from collections.abc import Callable
from functools import wraps
from typing import TypeVar

import torch

F = TypeVar("F", bound=Callable)
# torch's private switches for function transforms (torch.func.jvp, vmap, grad); absent: nothing is disabled
_transforms_active = getattr(torch._C, "_are_functorch_transforms_active", None)
_DisableTransforms = getattr(torch._C, "_DisableFuncTorch", None)


def outside_transforms(fn: F) -> F:
    """``fn`` run below any active function transform: a first all-gather inside ``torch.func.jvp`` would
    otherwise make its buffers and the unsharded parameter the transform's wrappers, which have no storage
    to alias. The values are plain either way; the transform still sees the module use them."""
    if _transforms_active is None or _DisableTransforms is None:
        return fn

    @wraps(fn)
    def plain(*args, **kwargs):
        if not _transforms_active():
            return fn(*args, **kwargs)
        with _DisableTransforms():
            return fn(*args, **kwargs)

    return plain
