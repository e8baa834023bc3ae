"""What ``reshard_after_forward=<int>`` keeps after forward, and how backward re-gathers from it."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from .collectives import GatherLayout

if TYPE_CHECKING:
    from .group import ParamGroup


class PostForwardShard:
    """What ``reshard_after_forward=<int>`` keeps: an N-way slice of every gathered parameter.

    The padded ``(world, padded)`` layout splits into N contiguous row blocks, one per member
    of this rank's N-rank group (consecutive ranks, e.g. one node), so the backward all-gather
    runs within that group and copy-out reuses the same column split.
    """

    def __init__(self, group: ParamGroup, ranks: int, process_group) -> None:
        self.ranks = ranks
        self.process_group = process_group
        self.index = group.mesh.get_local_rank(group.mesh.ndim - 1) % ranks
        self.layout = GatherLayout([size * group.world_size // ranks for size in group.layout.sizes], ranks)

    def keep(self, targets: list[torch.Tensor]) -> torch.Tensor:
        return torch.cat([t.view(self.ranks, -1)[self.index] for t in targets])
