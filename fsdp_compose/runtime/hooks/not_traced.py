"""Keeping torch.compile (dynamo) out of a sharded module's call and fully_shard's hooks.

The hooks issue collectives and keep Python state, nothing a graph can hold, so they run eagerly
and only what they call (the module's ``forward``) is compiled. ``FSDPModule._call_impl`` is
``frame_not_traced`` (a compiled block starts compiling at ``forward``; from a compiled caller it is
a graph break); inside a compiled region the call takes ``nn.Module``'s general path, whose hooks
are ``not_traced``. Only dynamo's C entry points are used: ``import fsdp_compose`` stays light.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import TypeVar

from torch._C._dynamo.eval_frame import (
    _FrameAction,
    _FrameExecStrategy,
    get_eval_frame_callback,
    set_code_exec_strategy,
)

F = TypeVar("F", bound=Callable)

# set (not None) while torch.compile runs a compiled region; a C function, so a frame dynamo
# skips can call it without starting a frame dynamo would trace
dynamo_frame_callback = get_eval_frame_callback


def frame_not_traced(fn: F) -> F:
    """Dynamo does not trace ``fn``'s own frame (the mark ``skip`` sets, on the code object) but compiles
    the frames it calls; a call from a traced frame is a graph break, explained in dynamo's logs."""
    set_code_exec_strategy(fn.__code__, _FrameExecStrategy(_FrameAction.SKIP, _FrameAction.DEFAULT))
    fn._torchdynamo_disable = True
    fn._torchdynamo_disable_msg = "fsdp_compose: a sharded module's call and hooks run eagerly"
    return fn


def not_traced(fn: F) -> F:
    """``fn`` as a function dynamo never traces, nor anything it calls (``torch._dynamo.disable`` inside
    a compiled region, a direct call outside one)."""
    disabled: list[Callable] = []

    @functools.wraps(fn)
    def run_eagerly(*args, **kwargs):
        if dynamo_frame_callback() is None:
            return fn(*args, **kwargs)
        if not disabled:
            import torch._dynamo

            disabled.append(torch._dynamo.disable(fn, recursive=True, reason="fsdp_compose's hooks run eagerly"))
        return disabled[0](*args, **kwargs)

    return frame_not_traced(run_eagerly)
