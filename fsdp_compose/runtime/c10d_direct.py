"""Calling a ``ProcessGroup`` directly: the data collectives, their options built once, and a
work object for a collective that completed without one (one rank; the synchronous shm
transport).

The runtime calls ``group.all_gather_single`` and friends itself, skipping the argument checks
``torch.distributed``'s functions run on every call (about 10 µs of Python): its tensors are
always plain, dense and on the group's device. Tests and benchmarks therefore count
collectives by wrapping ``ProcessGroup``'s methods, not ``torch.distributed``'s.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import AllgatherOptions, AllreduceOptions, ReduceScatterOptions

from .clean_tls import python_free_tls


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

    def is_completed(self) -> bool:
        return True


COMPLETED = CompletedWork()


def all_gather_into(output: torch.Tensor, input: torch.Tensor, group, world_size: int):
    """Issue an all-gather on ``group`` (asynchronously); one rank is a copy, not a collective."""
    if world_size == 1:
        if input.data_ptr() != output.data_ptr():  # several pieces were concatenated into output already
            output.copy_(input)
        return COMPLETED  # torch's FSDP2 skips these too
    with python_free_tls():
        return group.all_gather_single(output, input, ASYNC_ALL_GATHER)


def reduce_scatter_sum(output: torch.Tensor, input: torch.Tensor, group, world_size: int):
    """Issue a sum reduce-scatter on ``group`` (asynchronously); one rank is a copy."""
    if world_size == 1:
        output.copy_(input)
        return COMPLETED
    with python_free_tls():
        return group.reduce_scatter_single(output, input, ASYNC_SUM_REDUCE_SCATTER)
