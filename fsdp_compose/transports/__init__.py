"""Transports: ``AllGather`` / ``ReduceScatter``-protocol objects (``fsdp_compose/comm.py``) that
move a group's bytes another way than its process group's own collectives.

``fully_shard`` asks ``default_comms`` once per group; the runtime only ever calls the objects
it gets, so it never knows which transport is active.
"""

from __future__ import annotations

import os

from ..runtime.c10d_direct import DIRECT_ALL_GATHER, DIRECT_REDUCE_SCATTER
from . import shm

TRANSPORT_ENV = shm.TRANSPORT_ENV


def default_comms() -> tuple[object, object]:
    """The all-gather and reduce-scatter of a group sharded now: through ``/dev/shm`` with
    ``FSDP_COMPOSE_TRANSPORT=shm`` (docs/cpu-transport.md), else the process group's own."""
    if os.environ.get(TRANSPORT_ENV) == "shm":
        return shm.SHM_ALL_GATHER, shm.SHM_REDUCE_SCATTER
    return DIRECT_ALL_GATHER, DIRECT_REDUCE_SCATTER
