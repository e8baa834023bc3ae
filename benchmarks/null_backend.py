"""An O(1) fake process-group backend for the CPU-overhead benchmark: every collective returns a
completed work at once, touching no tensor, and counts itself.

torch's own fake backend (``init_process_group("fake", store=FakeStore())``) also moves no data,
but each of its all-gathers and reduce-scatters costs host time that grows with the world size
(about 0.5 ms per call at 1024 ranks, whatever the bytes). That is an artefact of the test
backend: on a real one (NCCL) the cost of a larger world is on the wire, not in the caller's
CPU. This backend costs the same few microseconds at any world size, so a step's time on it is
what the library itself does on the host.

    import null_backend                       # registers the "null" backend
    dist.init_process_group("null", store=FakeStore(), rank=0, world_size=1024)
    null_backend.CALLS                        # {"all_gather_single": 96, ...}

Like torch's fake backend, outputs are left as they are (uninitialised memory, usually).
"""

from __future__ import annotations

from collections import Counter

import torch.distributed as dist

NAME = "null"
CALLS: Counter = Counter()
"""Collectives issued on any null group since the last ``CALLS.clear()``, by method name."""


class DoneWork(dist.Work):
    """A collective that completed when it was issued."""

    def wait(self, timeout=None) -> bool:
        return True

    def is_completed(self) -> bool:
        return True

    def is_success(self) -> bool:
        return True


class NullProcessGroup(dist.ProcessGroup):
    """A process group of ``world_size`` ranks whose collectives do nothing, in O(1) time.

    Each method only counts the call and returns a completed work; the names are those that
    ``torch.distributed``'s functions and fsdp_compose's runtime call on a group."""

    def __init__(self, rank: int, world_size: int) -> None:
        super().__init__(rank, world_size)
        self._world = world_size
        self._work = DoneWork()

    def size(self) -> int:
        return self._world

    def getBackendName(self) -> str:
        return NAME

    def name(self) -> str:
        return NAME

    @property
    def group_name(self) -> str:  # the C++ name is kept on a backend this group does not have
        return dist.distributed_c10d._world.pg_names[self]

    def _done(self, method: str) -> DoneWork:
        CALLS[method] += 1
        return self._work

    def all_gather_single(self, output, input, opts=None):
        return self._done("all_gather_single")

    def _allgather_base(self, output, input, opts=None):
        return self._done("all_gather_single")

    def reduce_scatter_single(self, output, input, opts=None):
        return self._done("reduce_scatter_single")

    def _reduce_scatter_base(self, output, input, opts=None):
        return self._done("reduce_scatter_single")

    def allreduce(self, tensors, opts=None):
        return self._done("allreduce")

    def allreduce_coalesced(self, tensors, opts=None):
        return self._done("allreduce")

    def allgather(self, outputs, inputs, opts=None):
        return self._done("allgather")

    def allgather_into_tensor_coalesced(self, outputs, inputs, opts=None):
        return self._done("all_gather_single")

    def reduce_scatter_tensor_coalesced(self, outputs, inputs, opts=None):
        return self._done("reduce_scatter_single")

    def reduce_scatter(self, output, inputs, opts=None):
        return self._done("reduce_scatter")

    def broadcast(self, tensors, opts=None):
        return self._done("broadcast")

    def barrier(self, opts=None):
        return self._done("barrier")

    def __repr__(self) -> str:
        return f"NullProcessGroup(rank={self.rank()}, world_size={self._world})"


def _create(store, rank: int, world_size: int, timeout) -> NullProcessGroup:
    return NullProcessGroup(rank, world_size)


if NAME not in dist.Backend.backend_list:
    dist.Backend.register_backend(NAME, _create, devices=["cpu", "cuda"])  # cuda: benchmarks/gpu_check.py
