"""The default collectives: ``AllGather`` / ``ReduceScatter``-protocol objects (``fsdp_compose/comm.py``)
that call a ``ProcessGroup`` directly with options built once, skipping the argument checks
``torch.distributed``'s functions run in Python (the runtime's tensors are always plain and dense).
Tests therefore count collectives by wrapping ``ProcessGroup``'s methods.

Every collective is issued inside ``python_free_tls()``: a c10d ``Work`` copies the caller's
thread-local state, which in backward holds a Python object (and under checkpointing the
saved-tensor hooks). gloo's worker thread freeing such a ``Work`` needs the GIL; during
interpreter shutdown that aborts the process after a successful run (docs/troubleshooting.md).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import AllgatherOptions, AllreduceOptions, ProcessGroup, ReduceScatterOptions

# torch 2.13's names of the single-tensor collectives; 2.11 and 2.12 have them only under the older ones.
# Looked up at each call, so a wrapper a test sets on ProcessGroup sees every collective.
_NAMED_SINGLE = hasattr(ProcessGroup, "all_gather_single")
GATHER_METHOD = "all_gather_single" if _NAMED_SINGLE else "_allgather_base"
SCATTER_METHOD = "reduce_scatter_single" if _NAMED_SINGLE else "_reduce_scatter_base"


class CollectiveError(RuntimeError):
    """A collective of a sharded module failed or timed out; names the group it was for."""


def wait_named(work, what: str | Callable[[], str]) -> None:
    """``work.wait()``, re-raising a failure (e.g. the timeout) naming ``what`` (or what it builds)."""
    try:
        work.wait()
    except RuntimeError as error:
        rank = dist.get_rank() if dist.is_initialized() else 0
        what = what if isinstance(what, str) else what()
        raise CollectiveError(
            f"rank {rank}: {what} failed; another rank stopped, crashed or ran something else "
            f"(the wait is bounded by init_process_group(timeout=...)): {error}"
        ) from error


def _options(cls, **values):
    options = cls()
    for name, value in values.items():
        setattr(options, name, value)
    return options


ASYNC_ALL_GATHER = _options(AllgatherOptions, asyncOp=True)
ASYNC_SUM_REDUCE_SCATTER = _options(ReduceScatterOptions, reduceOp=dist.ReduceOp.SUM, asyncOp=True)
ASYNC_MAX_ALL_REDUCE = _options(AllreduceOptions, reduceOp=dist.ReduceOp.MAX, asyncOp=True)


class CompletedWork:
    """A collective already done when issued: nothing to wait for."""

    def wait(self, timeout=None) -> bool:
        return True


COMPLETED = CompletedWork()


def _finished(work, async_op: bool):
    """The protocol's return value: the work when asynchronous, else ``None`` once it is done."""
    if async_op:
        return work
    work.wait()
    return None


class DirectAllGather:
    """All-gather straight on the process group; on one rank a copy, no collective (as torch's FSDP2)."""

    __slots__ = ()

    def allocate(self, size: Sequence[int], *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(size, dtype=dtype, device=device)

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group, async_op: bool = False):
        if group.size() == 1:
            if input_tensor.data_ptr() != output_tensor.data_ptr():  # pieces concatenated into output already
                output_tensor.copy_(input_tensor)
            return _finished(COMPLETED, async_op)
        return _finished(getattr(group, GATHER_METHOD)(output_tensor, input_tensor, ASYNC_ALL_GATHER), async_op)


class DirectReduceScatter:
    """Sum reduce-scatter straight on the process group (``op`` is always ``SUM``); one rank is a copy."""

    __slots__ = ()

    def allocate(self, size: Sequence[int], *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(size, dtype=dtype, device=device)

    def __call__(
        self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group, op: object = None, async_op: bool = False
    ):
        if group.size() == 1:
            output_tensor.copy_(input_tensor)
            return _finished(COMPLETED, async_op)
        scatter = getattr(group, SCATTER_METHOD)
        return _finished(scatter(output_tensor, input_tensor, ASYNC_SUM_REDUCE_SCATTER), async_op)


DIRECT_ALL_GATHER = DirectAllGather()
DIRECT_REDUCE_SCATTER = DirectReduceScatter()


_CONTEXT_KEY = "context"  # torch.autograd.graph._engine_run_backward stashes it during backward
_autograd = torch._C._autograd
# bound once: these run up to four times per group and step in backward
_is_key_in_tls = torch._C._is_key_in_tls
_get_obj_in_tls = torch._C._get_obj_in_tls
# before torch 2.13 (which added _remove_obj_from_tls) backward stashes no context: nothing to hide
_remove_obj_from_tls = getattr(torch._C, "_remove_obj_from_tls", None)
STASHES_CONTEXT = _remove_obj_from_tls is not None
_stash_obj_in_tls = torch._C._stash_obj_in_tls
_top_hooks = _autograd._top_saved_tensors_default_hooks
_pop_hooks = _autograd._pop_saved_tensors_default_hooks
_push_hooks = _autograd._push_saved_tensors_default_hooks


class python_free_tls:  # noqa: N801 - used like a function returning a context manager
    """Hides the backward's stashed context and any saved-tensor hooks from TLS on enter, and puts them
    back, in order, on exit."""

    __slots__ = ("context", "hooks")

    def __enter__(self) -> None:
        self.context = None
        if STASHES_CONTEXT and _is_key_in_tls(_CONTEXT_KEY):
            self.context = _get_obj_in_tls(_CONTEXT_KEY)
            _remove_obj_from_tls(_CONTEXT_KEY)
        self.hooks = None  # the usual backward has none: no list then
        while (top := _top_hooks(True)) is not None:
            if self.hooks is None:
                self.hooks = []
            self.hooks.append(top)
            _pop_hooks()

    def __exit__(self, *exc: object) -> None:
        if self.hooks is not None:
            for pack, unpack in reversed(self.hooks):
                _push_hooks(pack, unpack)
        if self.context is not None:
            _stash_obj_in_tls(_CONTEXT_KEY, self.context)
