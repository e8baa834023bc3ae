"""Cross-rank execution-order check carried inside every all-gather, at no extra collective.

Each rank prepends a 16-byte tag (magic, group id) to its all-gather input; after the gather
every rank sees every rank's tag and raises the same error, naming the modules, if ranks
gathered different groups. The tag is constant per group, so the check costs one small copy
and one comparison per all-gather. A rank that skips or repeats a gather surfaces at the next
gather, whose partners then differ. It runs in mode ``FSDP_COMPOSE_CHECK_ORDER=tag``; the
default mode's handshake (``handshake.py``) checks the same and more before each all-gather.

Limit: gloo aborts the process when ranks gather buffers of different sizes, so the tag can
report divergence only between groups of equal size (for example identical blocks run in
different orders, the case that silently trains on mixed-up shards); groups of different sizes
never train silently either, but end in gloo's own size-mismatch abort.
"""

from __future__ import annotations

import os
from collections.abc import Callable

import torch

CHECK_ENV = "FSDP_COMPOSE_CHECK_ORDER"
MAGIC = 0x4653_4450_4F52_4452
HEADER_BYTES = 16


class ExecutionOrderError(RuntimeError):
    """Ranks all-gathered different groups: their forward/backward order differs."""


def tag_in_data() -> bool:
    """Only mode ``tag`` carries the tag. In the default and ``strict`` modes the handshake runs
    first and proves that every rank is about to gather the same group with the same size on
    the same process group (collectives on one group run in issue order), so a tag would only
    repeat that check, at 16 bytes and two tensor ops per all-gather."""
    return os.environ.get(CHECK_ENV, "1") == "tag"


def make_header(uid: int, device: torch.device) -> torch.Tensor:
    return torch.tensor([MAGIC, uid], dtype=torch.int64, device=device).view(torch.uint8)


def verify_headers(headers: torch.Tensor, expected: torch.Tensor, describe: Callable[[int], str]) -> None:
    """``headers``: the gathered ``(world, 16)`` uint8 tags; raise unless every row is ``expected``."""
    if torch.equal(headers, expected.expand_as(headers)):
        return
    rows = headers.reshape(-1).clone().view(torch.int64).view(-1, 2).tolist()
    lines = []
    for rank, (magic, other_uid) in enumerate(rows):
        what = describe(other_uid) if magic == MAGIC else "<not a fully_shard all-gather>"
        lines.append(f"  rank {rank}: {what}")
    raise ExecutionOrderError(
        "Ranks all-gathered different sharded modules; every rank must run fully_shard modules "
        "in the same order (check data-dependent control flow):\n" + "\n".join(lines)
    )
