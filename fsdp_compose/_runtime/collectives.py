"""Batched collectives: one byte all-gather and one reduce-scatter per dtype and group.

Shards travel as bytes, so a group mixing dtypes still needs one all-gather; copy-out splits the
``(world, total_bytes)`` result with one kernel. Every buffer and collective goes through the
group's ``AllGather`` / ``ReduceScatter`` objects (``fsdp_compose/api/comm.py``), issued asynchronously
and waited where the data is needed. ``grad_off`` and ``labelled`` are the scopes around them.

The default collectives are ``AllGather`` / ``ReduceScatter``-protocol objects that call a
``ProcessGroup`` directly with options built once, skipping the argument checks
``torch.distributed``'s functions run in Python (the runtime's tensors are always plain and dense);
tests therefore count collectives by wrapping ``ProcessGroup``'s methods. Every collective is
issued inside ``python_free_tls()``: a c10d ``Work`` copies the caller's thread-local state, which
in backward holds a Python object (and under checkpointing the saved-tensor hooks). gloo's worker
thread freeing such a ``Work`` needs the GIL; during interpreter shutdown that aborts the process
after a successful run (docs/troubleshooting.md).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.autograd.profiler as _autograd_profiler
import torch.distributed as dist
from torch._C._distributed_c10d import AllgatherOptions, AllreduceOptions, ProcessGroup, ReduceScatterOptions

# torch 2.13's names of the single-tensor collectives; 2.11 and 2.12 have them only under the older ones.
# Looked up at each call, so a wrapper a test sets on ProcessGroup sees every collective.
GATHER_METHOD = "all_gather_single" if hasattr(ProcessGroup, "all_gather_single") else "_allgather_base"
SCATTER_METHOD = "reduce_scatter_single" if hasattr(ProcessGroup, "reduce_scatter_single") else "_reduce_scatter_base"


class CollectiveError(RuntimeError):
    """A collective of a sharded module failed or timed out; names the group it was for."""

    __module__ = "fsdp_compose"  # its public home: tracebacks print fsdp_compose.<name>, pickle finds it there


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
# bound once: these run up to four times per group and step in backward
_is_key_in_tls = torch._C._is_key_in_tls
_get_obj_in_tls = torch._C._get_obj_in_tls
# before torch 2.13 (which added _remove_obj_from_tls) backward stashes no context: nothing to hide
_remove_obj_from_tls = getattr(torch._C, "_remove_obj_from_tls", None)
STASHES_CONTEXT = _remove_obj_from_tls is not None
_stash_obj_in_tls = torch._C._stash_obj_in_tls
_top_hooks = torch._C._autograd._top_saved_tensors_default_hooks
_pop_hooks = torch._C._autograd._pop_saved_tensors_default_hooks
_push_hooks = torch._C._autograd._push_saved_tensors_default_hooks


class python_free_tls:  # noqa: N801 - used like a function returning a context manager
    """Hides the backward's stashed context and any saved-tensor hooks from TLS on enter, and puts them
    back, in order, on exit."""

    __slots__ = ("context", "hooks")

    def __enter__(self) -> None:
        self.context = None
        if STASHES_CONTEXT and _is_key_in_tls(_CONTEXT_KEY):
            self.context = _get_obj_in_tls(_CONTEXT_KEY)
            _remove_obj_from_tls(_CONTEXT_KEY)
        self.hooks = ()  # the usual backward has none; the innermost ends up last, pushed back last
        while (top := _top_hooks(True)) is not None:
            self.hooks = (top, *self.hooks)
            _pop_hooks()

    def __exit__(self, *exc: object) -> None:
        if self.hooks:  # no iterator built in the usual case
            for pack, unpack in self.hooks:
                _push_hooks(pack, unpack)
        if self.context is not None:
            _stash_obj_in_tls(_CONTEXT_KEY, self.context)


# ----- batched collectives on flat buffers ---------------------------------------------
@dataclass
class CommStats:
    """Collectives issued by one group: for tests, ``explain`` and the benchmark."""

    all_gathers: int = 0
    all_gather_bytes: int = 0
    reduce_scatters: int = 0
    reduce_scatter_bytes: int = 0
    all_reduces: int = 0
    all_reduce_bytes: int = 0


class PendingCollective:
    """An issued collective; ``finish`` waits and runs the copy-out (``on_done``) once. ``name`` names it
    if the wait fails: a string, or a function that builds one only then."""

    __slots__ = ("work", "on_done", "name")

    def __init__(self, work: object, on_done: Callable[[], None], name: str | Callable[[], str]) -> None:
        self.work = work
        self.on_done = on_done  # None once finished
        self.name = name

    def finish(self) -> None:
        on_done, self.on_done = self.on_done, None
        if on_done is None:
            return
        work, self.work = self.work, None  # a gloo Work kept alive past shutdown aborts the process at exit
        if work is not None:
            wait_named(work, self.name)
            work = None  # drop the backend's hold on the input before copy-out allocates
        on_done()


class GatherLayout:
    """Column widths (in bytes) of each parameter inside one group's flat buffer, and their sum."""

    def __init__(self, sizes: list[int], world_size: int) -> None:
        self.sizes = sizes
        self.world_size = world_size
        self.total = sum(sizes)


def all_gather_flat(
    pieces: list[torch.Tensor],
    layout: GatherLayout,
    group,
    stats: CommStats,
    comm=DIRECT_ALL_GATHER,
    rank: int | None = None,
    numel: int | None = None,
) -> tuple[object, torch.Tensor]:
    """Start one all-gather of the concatenated pieces; return (work, (world, total) output).

    The pieces are concatenated straight into this rank's row of the output, which is then the
    input: no copy-in buffer is held while the gather is in flight (a single piece goes as it is).
    """
    first = pieces[0]
    if numel is None:  # ``numel``: the pieces' total, where the caller knows it already
        numel = sum(p.numel() for p in pieces)
    output = comm.allocate((layout.world_size * numel,), dtype=first.dtype, device=first.device)
    if len(pieces) > 1:
        if rank is None:
            rank = dist.get_rank(group)
        flat = output[rank * numel : (rank + 1) * numel]
        torch.cat(pieces, out=flat)
    else:
        flat = first.contiguous()
    stats.all_gathers += 1
    stats.all_gather_bytes += output.numel() * output.element_size()
    with python_free_tls():
        work = comm(output, flat, group, async_op=True)
    return work, output.view(layout.world_size, -1)


def copy_out(gathered: torch.Tensor, layout: GatherLayout, targets: list[torch.Tensor], free: bool = False) -> None:
    """Split the gathered columns into each parameter's (world, padded) target; ``free``: then free the
    buffer's storage, whoever still refers to it (a CPU buffer on gloo, whose worker thread keeps a finished
    work, and the output it refers to, until the thread next runs: under load after the caller's next
    allocations, a peak one gathered group above the step's)."""
    if len(targets) == 1:
        targets[0].copy_(gathered)
    else:
        torch.split_with_sizes_copy(gathered, layout.sizes, dim=1, out=targets)
    if free:
        gathered.untyped_storage().resize_(0)


def reduce_scatter_rows(
    rows: list[torch.Tensor],
    group,
    stats: CommStats,
    pre_divide: float = 1,
    comm=DIRECT_REDUCE_SCATTER,
) -> tuple[object, torch.Tensor]:
    """Start one reduce-scatter (sum) of (world, columns) blocks; rank r receives row r. ``rows`` is
    emptied once copied, so the unsharded gradients are freed while the collective is in flight."""
    world, dtype, device = rows[0].shape[0], rows[0].dtype, rows[0].device
    width = sum(r.shape[1] for r in rows)
    buffer = comm.allocate((world * width,), dtype=dtype, device=device)
    table = buffer.view(world, width)
    torch.cat(rows, dim=1, out=table)
    rows.clear()
    if pre_divide != 1:
        table.div_(pre_divide)
    output = comm.allocate((width,), dtype=dtype, device=device)
    stats.reduce_scatters += 1
    stats.reduce_scatter_bytes += buffer.numel() * buffer.element_size()
    with python_free_tls():
        work = comm(output, buffer, group, op=dist.ReduceOp.SUM, async_op=True)
    return work, output


def all_reduce_sum(tensor: torch.Tensor, group, stats: CommStats) -> None:
    """Sum a reduced gradient shard across HSDP replicas, in place."""
    stats.all_reduces += 1
    stats.all_reduce_bytes += tensor.numel() * tensor.element_size()
    with python_free_tls():
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=group)


_set_grad_enabled = torch._C._set_grad_enabled
_is_grad_enabled = torch._C.is_grad_enabled
_is_inference_mode_enabled = torch.is_inference_mode_enabled


class grad_off:  # noqa: N801 - used like torch.no_grad
    """``torch.no_grad()`` at about half its cost (no Python frames); entered a few times per group and step.

    It also leaves ``torch.inference_mode``: what a group allocates here (unsharded parameters, gathered
    buffers) outlives the call, and an inference tensor could never be written again in training."""

    __slots__ = ("previous", "inference")

    def __enter__(self) -> None:
        self.previous = _is_grad_enabled()
        self.inference = None
        if _is_inference_mode_enabled():
            self.inference = torch.inference_mode(False)
            self.inference.__enter__()
        _set_grad_enabled(False)

    def __exit__(self, *exc: object) -> None:
        _set_grad_enabled(self.previous)
        if self.inference is not None:
            self.inference.__exit__(*exc)


_NULL = contextlib.nullcontext()


def labelled(kind: str, group) -> contextlib.AbstractContextManager:
    """``record_function("fsdp_compose::<kind> <module fqn>")`` while a profiler runs, else a shared no-op
    (before the first forward the class name stands for the FQN)."""
    if not _autograd_profiler._is_profiler_enabled:
        return _NULL
    return torch.profiler.record_function(f"fsdp_compose::{kind} {group.fqn or group.class_name}")
