"""The default collectives: objects of the ``AllGather`` / ``ReduceScatter`` protocol
(``fsdp_compose/comm.py``) that call a ``ProcessGroup`` directly, with options built once.

Calling ``group.all_gather_single`` and friends skips the argument checks
``torch.distributed``'s functions run on every call (about 10 µs of Python): the runtime's
tensors are always plain, dense and on the group's device. Tests and benchmarks therefore count
collectives by wrapping ``ProcessGroup``'s methods, not ``torch.distributed``'s.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import AllgatherOptions, AllreduceOptions, ReduceScatterOptions


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
        return _finished(group.all_gather_single(output_tensor, input_tensor, ASYNC_ALL_GATHER), async_op)


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
        return _finished(group.reduce_scatter_single(output_tensor, input_tensor, ASYNC_SUM_REDUCE_SCATTER), async_op)


DIRECT_ALL_GATHER = DirectAllGather()
DIRECT_REDUCE_SCATTER = DirectReduceScatter()
