"""Group ids that agree across ranks: the n-th group built has id n on every rank.

Counted per rank, not per process: torch's threaded process group runs every rank as a thread of
one process, where one counter would give rank 1 the ids after rank 0's.
"""

from __future__ import annotations

import torch.distributed as dist

_next_uid: dict[tuple[int, int], int] = {}


def rank_key() -> tuple[int, int]:
    """(rank, world size) of the default group, per thread under the threaded group (the size tells
    worlds run one after another apart); (-1, 0) before the process group exists."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return -1, 0


def new_uid() -> int:
    """The next group id on this rank: 1, 2, 3, ... in creation order."""
    key = rank_key()
    _next_uid[key] = _next_uid.get(key, 0) + 1
    return _next_uid[key]
