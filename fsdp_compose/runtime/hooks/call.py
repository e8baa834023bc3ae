"""A sharded module's call without ``nn.Module``'s general hook loop, when it would run only ours.

When fully_shard's two hooks are the module's only hooks (no global ones, no JIT tracing, not in a
compiled region), ``call_sharded`` runs what ``_call_impl``'s loop would: pre-forward hook,
``forward``, post-forward hook, without the loop's bookkeeping (priced in docs/benchmarks.md).
"""

from __future__ import annotations

from functools import partial
from typing import Any

import torch
from torch import nn
from torch.nn.modules import module as _nn_module

from ..state import GroupState
from .forward import post_forward, post_forward_hook, pre_forward, pre_forward_hook

# the dicts torch's register_module_*_hook functions fill in place
_GLOBAL_HOOKS = (
    _nn_module._global_backward_pre_hooks,
    _nn_module._global_backward_hooks,
    _nn_module._global_forward_hooks,
    _nn_module._global_forward_pre_hooks,
)
_get_tracing_state = torch._C._get_tracing_state


def sole_hooks_state(module: nn.Module) -> GroupState | None:
    """The state whose two hooks are the only hooks ``module``'s call would run, else ``None``."""
    pre_hooks, post_hooks = module._forward_pre_hooks, module._forward_hooks
    if len(pre_hooks) != 1 or len(post_hooks) != 1 or module._backward_hooks or module._backward_pre_hooks:
        return None
    if any(_GLOBAL_HOOKS) or _get_tracing_state() is not None:
        return None
    pre, post = next(iter(pre_hooks.values())), next(iter(post_hooks.values()))
    if not (_is_partial_of(pre, pre_forward_hook) and _is_partial_of(post, post_forward_hook)):
        return None
    state = pre.args[0]
    return state if post.args[0] is state else None


def _is_partial_of(hook: object, function: object) -> bool:
    return type(hook) is partial and hook.func is function


def call_sharded(module: nn.Module, state: GroupState, args: tuple, kwargs: dict) -> Any:
    """Pre-forward hook, ``forward``, post-forward hook: what ``_call_impl`` runs for these hooks."""
    args, kwargs = pre_forward(state, module, args, kwargs)
    output = module.forward(*args, **kwargs)
    return post_forward(state, module, args, output)
