"""Transports: ``AllGather`` / ``ReduceScatter``-protocol objects (``fsdp_compose/comm.py``) that
move a group's bytes another way than its process group's own collectives.

``fully_shard`` asks ``default_comms`` once per group; the runtime only ever calls the objects
it gets, so it never knows which transport is active.
"""

from __future__ import annotations

import os

from ..runtime.c10d_direct import DIRECT_ALL_GATHER, DIRECT_REDUCE_SCATTER
from .shm import SHM_ALL_GATHER, SHM_REDUCE_SCATTER, TRANSPORT_ENV


def default_comms() -> tuple[object, object]:
    """The all-gather and reduce-scatter of a group sharded now: through ``/dev/shm`` with
    ``FSDP_COMPOSE_TRANSPORT=shm`` (docs/cpu-transport.md), else the process group's own."""
    if os.environ.get(TRANSPORT_ENV) == "shm":
        return SHM_ALL_GATHER, SHM_REDUCE_SCATTER
    return DIRECT_ALL_GATHER, DIRECT_REDUCE_SCATTER
