"""Treat a method other than ``forward`` (e.g. ``generate``) as a forward of a sharded module.

Only ``nn.Module.__call__`` runs forward hooks, so a method that uses the module's parameters
directly would see the sharded DTensors. The wrapper runs the very same hook functions
(``pre_forward`` / ``post_forward``) around the method, so it unshards and reshards exactly as
``forward`` would, including the root's lazy initialization and backward bookkeeping.
"""

from __future__ import annotations

import functools
import types

from torch import nn

from .module import FSDPModule
from .._runtime.hooks.forward import post_forward_hook, pre_forward_hook
from .._runtime.state import class_name, state_of


def register_fsdp_forward_method(module: nn.Module, method_name: str) -> None:
    """Make ``module.<method_name>(...)`` unshard before and reshard after, like ``forward``.

    A no-op when ``module`` is not sharded, so the same model code runs with and without
    ``fully_shard`` (as with torch FSDP2). Registering twice wraps the method once.
    """
    if not isinstance(module, FSDPModule):
        return
    method = getattr(type(module), method_name, None)
    if not callable(method):
        raise ValueError(f"register_fsdp_forward_method: {class_name(module)} has no method {method_name!r}")
    states = state_of(module).call_states  # one per mesh the call's parameters are on

    @functools.wraps(method)
    def run_as_forward(self: nn.Module, *args, **kwargs):
        for state in states:
            args, kwargs = pre_forward_hook(state, self, args, kwargs)
        output = method(self, *args, **kwargs)
        for state in states:
            output = post_forward_hook(state, self, args, output)
        return output

    setattr(module, method_name, types.MethodType(run_as_forward, module))


__all__ = ["register_fsdp_forward_method"]
