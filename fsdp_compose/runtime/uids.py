"""Group ids that agree across ranks, also when ranks are threads of one process.

Ranks building the same model number their groups in the same creation order, so the n-th
group has id n on every rank; the handshake and the all-gather tag compare these ids. The
counter is kept per rank, not per process: torch's threaded process group (used by its own
``FSDPTestMultiThread`` tests) runs every rank as a thread of one process, and a single
process-wide counter would hand rank 1 the ids after rank 0's, so ranks building the same
model would disagree.
"""

from __future__ import annotations

import torch.distributed as dist

_next_uid: dict[tuple[int, int], int] = {}


def rank_key() -> tuple[int, int]:
    """(rank, world size) of the default group, per thread under the threaded group.

    The world size is part of the key so that a process that runs several worlds one after
    another (a test suite of threaded-rank tests of different sizes) still numbers groups alike
    on every rank of each world; (-1, 0) before the process group exists.
    """
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return -1, 0


def new_uid() -> int:
    """The next group id on this rank: 1, 2, 3, ... in creation order."""
    key = rank_key()
    _next_uid[key] = _next_uid.get(key, 0) + 1
    return _next_uid[key]
