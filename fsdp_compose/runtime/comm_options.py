"""Per-group communication settings changed through ``FSDPModule.set_*`` (plain data)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from .collectives import DIRECT_ALL_GATHER, DIRECT_REDUCE_SCATTER


@dataclass
class CommOptions:
    """How one group's collectives run; the defaults are fsdp_compose's own behaviour."""

    # divide reduced gradients by this instead of the data-parallel size
    gradient_divide_factor: float | None = None
    # requested by set_force_sum_reduction_for_comms; fsdp_compose only ever uses ReduceOp.SUM
    # (scaling runs before/after the collective), so both values behave the same
    force_sum_reduction: bool = False
    # the AllGather / ReduceScatter-protocol objects every collective goes through: the process
    # group directly unless the user set their own (set_custom_*, e.g. fsdp_compose_shm.use_shm)
    all_gather: object = DIRECT_ALL_GATHER
    reduce_scatter: object = DIRECT_REDUCE_SCATTER
    custom: bool = False  # the two above are set_custom_all_gather / set_custom_reduce_scatter's
    pg_allocation: bool = False  # the two above are set_allocate_memory_from_process_group_for_comm's
    all_reduce_hook: Callable[[torch.Tensor], None] | None = None
    reduce_process_group: object | None = None  # set_separate_reduce_scatter_group
    post_optim_event: object | None = None  # waited by the root before its next forward
