"""Keeping torch.compile (dynamo) out of a sharded module's call and fully_shard's hooks.

The hooks issue collectives, swap parameters and keep Python state: nothing a graph can hold.
As with ``nn.Module``'s own call, whose frames dynamo skips, a sharded module's call and hooks
run eagerly and only the frames they call (the module's ``forward``) are compiled:

- ``FSDPModule._call_impl`` is ``frame_not_traced``: a compiled block's call (compiled before or
  after ``fully_shard``) starts compiling at ``forward``, so ``fullgraph=True`` holds; reached
  from a compiled caller (``torch.compile(model)``) it is a graph break.
- inside a compiled region (``dynamo_frame_callback()`` is not ``None``) the call takes
  ``nn.Module``'s general path, whose registered hooks are ``not_traced``: they and everything
  they call run eagerly.
- outside one (eager training), the fast path calls the undecorated hooks directly.

Both marks use dynamo's C entry points only, so ``import fsdp_compose`` does not import
``torch._dynamo`` (about a second; torch imports it later, at the first DTensor built).
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
    """Dynamo does not trace ``fn``'s own frame but still compiles the frames it calls.

    The frame mark is what ``torch._dynamo.decorators.skip`` sets (free per call: it lives on the
    code object); ``_torchdynamo_disable`` makes a call from a traced frame a graph break instead
    of an inlined call, explained by ``_torchdynamo_disable_msg`` in dynamo's graph-break logs.
    """
    set_code_exec_strategy(fn.__code__, _FrameExecStrategy(_FrameAction.SKIP, _FrameAction.DEFAULT))
    fn._torchdynamo_disable = True
    fn._torchdynamo_disable_msg = "fsdp_compose: a sharded module's call and hooks run eagerly"
    return fn


def not_traced(fn: F) -> F:
    """``fn`` as a function dynamo never traces, nor anything it calls.

    Outside a compiled region it calls ``fn`` directly (one frame and a C call more); inside one,
    through ``torch._dynamo.disable`` (already imported then: only torch.compile sets a callback).
    """
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
