"""What calling a ``ProcessGroup`` directly needs: its options, built once, and a work object
for a collective that completed without one (one rank; the synchronous shm transport).

The runtime calls ``group.all_gather_single`` and friends itself, skipping the argument checks
``torch.distributed``'s functions run on every call (about 10 µs of Python): its tensors are
always plain, dense and on the group's device. Tests and benchmarks therefore count
collectives by wrapping ``ProcessGroup``'s methods, not ``torch.distributed``'s.
"""

from __future__ import annotations

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
