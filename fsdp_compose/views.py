"""What the extras (``fsdp_compose/extras/``, ``fsdp_compose_shm``) may use of the core besides its public names.

Read-only views of the runtime: the state of a module or parameter, the state classes, and the schedule's
functions, which ``explain`` runs on a scratch ``RootState`` to replay a step, never on a model's. Plus the
two entries an extra plugs in through: a parameter's gather codec, and putting idle groups back in sharded
form before a whole-model operation. For a transport (``fsdp_compose_shm``): the default collectives it
falls back to, and how a collective is issued and waited. Whatever an extra needs of the core is added here,
so the core can change behind it.
"""

from .runtime.collectives import (
    ASYNC_ALL_GATHER,
    COMPLETED,
    DIRECT_ALL_GATHER,
    DIRECT_REDUCE_SCATTER,
    GATHER_METHOD,
    wait_named,
)
from .runtime.extensions import set_gather_codec
from .runtime.schedule import (
    backward_prefetch_targets,
    end_backward,
    forward_prefetch_targets,
    record_post_forward,
    record_pre_forward,
    reshards_after_forward,
)
from .runtime.state import GroupState, RootState, owner_of, state_of, states_in
from .runtime.unsharded import row_layout
from .whole_model.model_groups import reshard_idle

__all__ = [
    "GroupState",
    "RootState",
    "state_of",
    "states_in",
    "owner_of",
    "forward_prefetch_targets",
    "backward_prefetch_targets",
    "record_pre_forward",
    "record_post_forward",
    "end_backward",
    "reshards_after_forward",
    "set_gather_codec",
    "row_layout",
    "reshard_idle",
    "DIRECT_ALL_GATHER",
    "DIRECT_REDUCE_SCATTER",
    "GATHER_METHOD",
    "ASYNC_ALL_GATHER",
    "COMPLETED",
    "wait_named",
]
