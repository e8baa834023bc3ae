"""A sharded module called inside ``torch.func`` transforms (jvp, vmap, grad).

Upstream: pytorch/pytorch#182641 (open: "Cannot jvp through FSDP2", torch 2.11); torch's own answer,
pytorch/pytorch#182732, keeps FSDP2's unshard and reshard outside the active transforms as this file does. A torch
gap (tensors made inside a transform are its wrappers), not a bug to wait out. Three gaps between eager autograd
and the transforms, on torch 2.11 to 2.14.1:

- A first all-gather inside ``torch.func.jvp`` would make the gather buffers and the unsharded parameter the
  transform's wrapper tensors, which have no storage to alias (torch's FSDP2 builds them below the transform too):
  ``outside_transforms``.
- Inside ``torch.func.jvp`` a tensor made outside the transform that requires grad (``e = enc(x)`` then
  ``jvp(lambda _: dec(e), ...)``, torch's ``test_no_warmup_jvp_reshard_after_forward_false``) gives a view with
  ``requires_grad=False`` and no ``grad_fn``, though the outer graph still records it: the hooks' identity on a
  module's inputs has no node to hook, and an old-style ``autograd.Function`` (one without ``setup_context``)
  raises under any transform. ``signal_inside_transform`` routes the inputs through a ``setup_context``-style
  function instead, as torch's FSDP2 does (``RegisterPostBackwardFunction``); the transform lowers it to the
  graph the tensors belong to. Used only there: binding its arguments costs every call several microseconds.
  The module's output reports ``requires_grad=False`` there too (inside ``vmap`` as well), so its pre-backward
  hook goes on the tensor it wraps in the outer graph: ``outside_transforms_tensor``.
- Inside ``torch.func.grad`` the inner backward's pre-backward hook asks whether that backward accumulates into
  a parameter (``hooks/backward._accumulates``); ``get_gradient_edge`` takes a view of the unsharded parameter,
  which has no node there either: the question is asked below the transform (``outside_transforms``).

Uses two private switches of ``torch._C`` and two functions of ``torch._C._functorch``, present on torch 2.11 to
2.14.1 and looked up once; where a switch is missing, nothing is disabled, and where a function is missing, no
output's pre-backward hook moves to the outer graph (the fallbacks are tested in
``tests/workarounds/test_functorch.py``). torch's FSDP2 does the same below the transforms
(``_fully_shard/_fsdp_common._disable_functorch_if_active``, ``RegisterPreBackwardFunction``).
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
_is_wrapped = getattr(torch._C._functorch, "is_functorch_wrapped_tensor", None)
_unwrapped = getattr(torch._C._functorch, "get_unwrapped", None)


def _never() -> bool:
    return False


# True while a function transform runs (one C call); always False where torch lacks the switch
transforms_active: Callable[[], bool] = _transforms_active or _never


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


class _InputsSignal(torch.autograd.Function):
    """Identity on a module's inputs whose backward calls ``callback``: the transform-safe form (``setup_context``,
    a jvp rule and a generated vmap rule) of the hooks' ``PostBackwardSignal``."""

    generate_vmap_rule = True

    @staticmethod
    def forward(callback: Callable[[], None], *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return tensors

    @staticmethod
    def setup_context(ctx, inputs: tuple, output: object) -> None:
        ctx.callback = inputs[0]

    @staticmethod
    def backward(ctx, *grads: torch.Tensor):
        ctx.callback()
        return (None, *grads)

    @staticmethod
    def jvp(ctx, _callback_tangent: object, *tangents: torch.Tensor):
        return tangents


def signal_inside_transform(callback: Callable[[], None], tensors: list[torch.Tensor]) -> tuple[torch.Tensor, ...]:
    """``tensors`` routed through an identity whose backward calls ``callback`` once their gradients are ready,
    in the graph each tensor belongs to (the outer one for a tensor made outside ``torch.func.jvp``)."""
    return _InputsSignal.apply(callback, *tensors)


def outside_transforms_tensor(x: torch.Tensor) -> torch.Tensor | None:
    """What ``x`` wraps below every active transform (``x`` itself if it wraps nothing): inside ``jvp`` and ``vmap``
    a module's output reports ``requires_grad=False`` while the tensor it wraps is in the outer graph, whose
    backward needs the module's parameters again. None where torch lacks the private functions."""
    if _is_wrapped is None or _unwrapped is None:
        return None
    while _is_wrapped(x):
        x = _unwrapped(x)
    return x
