"""Batched collectives: one byte all-gather and one reduce-scatter per dtype and group.

Shards travel as bytes, so a group mixing dtypes still needs one all-gather; copy-out splits the
``(world, total_bytes)`` result with one kernel. Every buffer and collective goes through the
group's ``AllGather`` / ``ReduceScatter`` objects (``fsdp_compose/comm.py``), issued asynchronously
and waited where the data is needed. ``grad_off`` and ``labelled`` are the scopes around them.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.autograd.profiler as _autograd_profiler
import torch.distributed as dist

from .c10d_direct import DIRECT_ALL_GATHER, DIRECT_REDUCE_SCATTER, python_free_tls, wait_named


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
    """An issued collective; ``finish`` waits and runs the copy-out once. ``name`` names it if the
    wait fails: a string, or a function that builds one only then."""

    __slots__ = ("work", "on_done", "done", "name")

    def __init__(
        self, work: object, on_done: Callable[[], None] | None, name: str | Callable[[], str] = "a collective"
    ) -> None:
        self.work = work
        self.on_done = on_done
        self.done = False
        self.name = name

    def finish(self) -> None:
        if self.done:
            return
        self.done = True
        work, self.work = self.work, None  # a gloo Work kept alive past shutdown aborts the process at exit
        if work is not None:
            wait_named(work, self.name)
            work = None  # drop the backend's hold on the input before copy-out allocates
        on_done, self.on_done = self.on_done, None
        on_done()


@dataclass
class GatherLayout:
    """Column widths (in bytes) of each parameter inside one group's flat buffer."""

    sizes: list[int]
    world_size: int
    total: int = field(init=False)

    def __post_init__(self) -> None:
        self.total = sum(self.sizes)


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


def copy_out(gathered: torch.Tensor, layout: GatherLayout, targets: list[torch.Tensor]) -> None:
    """Split the gathered columns into each parameter's (world, padded) target."""
    if len(targets) == 1:
        targets[0].copy_(gathered)
    else:
        torch.split_with_sizes_copy(gathered, layout.sizes, dim=1, out=targets)


def reduce_scatter_rows(
    rows: list[torch.Tensor],
    group,
    stats: CommStats,
    pre_divide: float = 1,
    comm=DIRECT_REDUCE_SCATTER,
    padding_rows: torch.Tensor | None = None,
) -> tuple[object, torch.Tensor]:
    """Start one reduce-scatter (sum) of (world, columns) blocks; rank r receives row r.

    With ``padding_rows`` the blocks hold only the first ranks' rows (no parameter reaches the
    later ranks) and the table's other rows are ``padding_rows``, copied in one go. ``rows`` is
    emptied once copied, so the unsharded gradients are freed while the collective is in flight.
    """
    first, dtype, device = rows[0].shape[0], rows[0].dtype, rows[0].device
    world = first if padding_rows is None else first + padding_rows.shape[0]
    width = sum(r.shape[1] for r in rows)
    buffer = comm.allocate((world * width,), dtype=dtype, device=device)
    table = buffer.view(world, width)
    torch.cat(rows, dim=1, out=table if padding_rows is None else table[:first])
    if padding_rows is not None:
        table[first:].copy_(padding_rows)
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


def group_name(label: str) -> str:
    """The module FQN inside a group label (``'blocks.3' (Block)`` after lazy init); else the label."""
    if label.startswith("'"):
        end = label.find("'", 1)
        if end > 0:
            return label[1:end]
    return label


def labelled(kind: str, group) -> contextlib.AbstractContextManager:
    """``record_function("fsdp_compose::<kind> <module fqn>")`` while a profiler runs, else a shared no-op."""
    if not _autograd_profiler._is_profiler_enabled:
        return _NULL
    return torch.profiler.record_function(f"fsdp_compose::{kind} {group_name(group.label)}")
