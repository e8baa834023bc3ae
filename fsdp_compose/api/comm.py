"""The collective protocol every all-gather and reduce-scatter of a group goes through.

The protocol follows torch's FSDP2 (same class names): an object that allocates the
communication buffers and runs the collective, so a user can choose where buffers live (a
memory pool, a persistent buffer) and how the bytes move (another process group, a
compressed transport: ``FSDPModule.set_custom_all_gather`` / ``set_custom_reduce_scatter``).
A group's defaults are objects of it too: ``DefaultAllGather`` / ``DefaultReduceScatter`` call
the process group directly. The core names no transport: an opt-in one (the package
``fsdp_compose_shm``, beside this one) is installed by its own function through those setters.
Subclassing is optional: any object with these methods works.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Sequence

import torch
import torch.distributed as dist

from .._runtime.collectives import DirectAllGather, DirectReduceScatter


class Comm(ABC):
    """A collective that also owns the allocation of its buffers."""

    @abstractmethod
    def allocate(self, size: Sequence[int], *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """Return an uninitialized 1-D buffer of ``size`` (a one-element sequence) for the collective."""


class AllGather(Comm):
    """``comm(output_tensor, input_tensor, group, async_op)``: all-gather ``input`` into ``output``.

    fsdp_compose gathers one flat ``uint8`` buffer per group (all parameters' bytes), so
    ``allocate`` is asked for ``(world_size * input_numel,)`` bytes.
    """

    @abstractmethod
    def __call__(
        self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: dist.ProcessGroup, async_op: bool = False
    ) -> dist.Work | None:
        """Run the all-gather; return its ``Work`` when ``async_op`` (or ``None`` once done)."""


class ReduceScatter(Comm):
    """``comm(output_tensor, input_tensor, group, op, async_op)``: reduce-scatter ``input`` into ``output``.

    fsdp_compose always passes ``op=ReduceOp.SUM`` (scaling runs before and after), and
    allocates both the input (``world_size * n``) and the output (``n``) through ``allocate``.
    """

    @abstractmethod
    def __call__(
        self,
        output_tensor: torch.Tensor,
        input_tensor: torch.Tensor,
        group: dist.ProcessGroup,
        op: object,
        async_op: bool = False,
    ) -> dist.Work | None:
        """Run the reduce-scatter; return its ``Work`` when ``async_op`` (or ``None`` once done)."""


def check_comm(comm: object, what: str, module_name: str) -> None:
    """Refuse an object that cannot serve as a custom collective, naming what is missing."""
    missing = [name for name in ("allocate", "__call__") if not callable(getattr(comm, name, None))]
    if missing:
        raise TypeError(
            f"{module_name}.{what}({type(comm).__name__}): a custom collective needs the methods "
            f"allocate(size, *, dtype, device) and __call__(output_tensor, input_tensor, group, ...); "
            f"missing: {', '.join(missing)}"
        )


class ProcessGroupAllocated:
    """Built-in collectives whose buffers come from the process group's own allocator.

    Backends that offer one (NCCL with zero-copy transports) hand out registered memory;
    others (gloo) do not, and the buffers come from the default allocator.
    """

    def __init__(self, group: dist.ProcessGroup, device: torch.device) -> None:
        self.backend = group._get_backend(device)
        self.supported = bool(self.backend.supports_tensor_alloc(device))

    def allocate(self, size: Sequence[int], *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        if self.supported:
            return self.backend.allocate_tensor(math.prod(size), dtype=dtype, device=device)
        return torch.empty(*size, dtype=dtype, device=device)


# the defaults (_runtime/collectives.py, below this layer) are of the protocol without importing it
DefaultAllGather = AllGather.register(DirectAllGather)
DefaultReduceScatter = ReduceScatter.register(DirectReduceScatter)


class ProcessGroupAllGather(ProcessGroupAllocated, DefaultAllGather):
    pass


class ProcessGroupReduceScatter(ProcessGroupAllocated, DefaultReduceScatter):
    pass


__all__ = ["Comm", "AllGather", "ReduceScatter", "DefaultAllGather", "DefaultReduceScatter"]
