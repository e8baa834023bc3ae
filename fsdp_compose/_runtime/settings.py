"""Every setting of one group: what ``fully_shard`` and the ``FSDPModule.set_*`` methods record (plain data)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from ..api.policies import MixedPrecisionPolicy
from .collectives import DIRECT_ALL_GATHER, DIRECT_REDUCE_SCATTER


@dataclass(slots=True, eq=False)
class GroupSettings:
    """One group's settings, in one home: ``fully_shard`` and the setters write them, the runtime reads them.
    The defaults are fsdp_compose's own behaviour. Slotted: a misspelt setting is an error, not a new attribute."""

    # ----- resharding, prefetch, precision
    reshard_after_forward: bool = True
    # the user chose reshard_after_forward (in fully_shard or set_reshard_after_forward): the
    # root then follows it too, as in torch's FSDP2; by default the root keeps its parameters
    reshard_after_forward_chosen: bool = False
    reshard_after_backward: bool = True
    unshard_in_backward: bool = True  # False: backward never needs the unsharded values (embedding)
    # explicit prefetch targets, as group states (None: follow the recorded order)
    forward_prefetch: list | None = None
    backward_prefetch: list | None = None
    mp_policy: MixedPrecisionPolicy = field(default_factory=MixedPrecisionPolicy)
    # ----- gradient reduction
    requires_gradient_sync: bool = True
    requires_all_reduce: bool = True
    is_last_backward: bool = True
    reduce_buffers: int | None = None  # reductions in flight before waiting; None: the root's reduce_limit
    # divide reduced gradients by this instead of the data-parallel size (``group.divide_factors``)
    gradient_divide_factor: float | None = None
    all_reduce_hook: Callable[[torch.Tensor], None] | None = None
    reduce_process_group: object | None = None  # set_separate_reduce_scatter_group
    # ----- collectives
    # the AllGather / ReduceScatter-protocol objects every collective goes through: the process
    # group directly unless the user set their own (set_custom_*, e.g. fsdp_compose_shm.use_shm)
    all_gather: object = DIRECT_ALL_GATHER
    reduce_scatter: object = DIRECT_REDUCE_SCATTER
    custom: bool = False  # the two above are set_custom_all_gather / set_custom_reduce_scatter's
    pg_allocation: bool = False  # the two above are set_allocate_memory_from_process_group_for_comm's
    post_optim_event: object | None = None  # waited by the root before its next forward (``schedule.begin_step``)
