"""Before each collective, ranks agree on which one they are about to run.

gloo cannot report a collective whose ranks disagree: buffers of different sizes abort the
process inside gloo ("op.preamble.length <= op.nbytes"), and different collectives hang. So,
by default, each group's all-gather is preceded by a 32-byte all-gather of (magic, group id,
kind, bytes); if any rank's entry differs, every rank raises the same ``ExecutionOrderError``
naming what each rank was about to run, before the real collective is issued. This catches a
rank that skipped a sharded module (data-dependent control flow), ran a different number of
forward calls, or gathered a different group of any size. Reduce-scatters follow the
autograd graph of an already-checked forward, so only ``strict`` mode checks them as well
(for a rank that skips ``backward`` altogether).

``FSDP_COMPOSE_CHECK_ORDER`` picks the mode: ``1`` (default) handshake before all-gathers and
the in-data tag; ``strict`` handshake before reduce-scatters too; ``tag`` the 16-byte tag
inside each all-gather only (no extra collective, catches reordered groups of equal size);
``0`` none.

A rank that stops altogether is reported by the others when the process group's timeout
expires (``init_process_group(timeout=...)``): ``CollectiveError`` names the collective and
group they waited for.
"""

from __future__ import annotations

import os
from collections.abc import Callable

import torch
import torch.distributed as dist

from .clean_tls import python_free_tls
from .order_check import CHECK_ENV, MAGIC, ExecutionOrderError

KINDS = {1: "all-gather", 2: "reduce-scatter"}
ALL_GATHER, REDUCE_SCATTER = 1, 2


class CollectiveError(RuntimeError):
    """A collective of a sharded module failed or timed out; names the group it was for."""


def handshake_kinds() -> frozenset[int]:
    """Which collectives get a handshake, from ``FSDP_COMPOSE_CHECK_ORDER``."""
    mode = os.environ.get(CHECK_ENV, "1")
    if mode in ("0", "tag"):
        return frozenset()
    return frozenset((ALL_GATHER, REDUCE_SCATTER)) if mode == "strict" else frozenset((ALL_GATHER,))


def handshake(uid: int, kind: int, nbytes: int, group, describe: Callable[[int], str], device: torch.device) -> None:
    """All-gather (magic, uid, kind, nbytes) on ``group``; raise on every rank unless all agree."""
    world = dist.get_world_size(group)
    if world == 1:
        return
    mine = torch.tensor([MAGIC, uid, kind, nbytes], dtype=torch.int64, device=device)
    rows = mine.new_empty(world * 4)
    with python_free_tls():
        gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        work = gather(rows, mine, group=group, async_op=True)
    wait_named(work, f"the handshake before the {KINDS[kind]} of {describe(uid)}")
    rows = rows.view(world, 4)
    if torch.equal(rows, mine.expand_as(rows)):
        return
    lines = []
    ranks = dist.get_process_group_ranks(group)
    for rank, (magic, other_uid, other_kind, other_bytes) in zip(ranks, rows.tolist()):
        if magic != MAGIC or other_kind not in KINDS:
            lines.append(f"  rank {rank}: <not a fully_shard collective>")
        else:
            lines.append(f"  rank {rank}: {KINDS[other_kind]} of {describe(other_uid)}, {other_bytes} bytes")
    raise ExecutionOrderError(
        "Ranks diverged: they were about to run different collectives of sharded modules (a rank skipped "
        "a sharded module, ran a different number of forward calls, or ran modules in another order; "
        "check data-dependent control flow):\n" + "\n".join(lines)
    )


def wait_named(work, what: str) -> None:
    """``work.wait()``, re-raising a failure (e.g. the process group's timeout) naming ``what``."""
    try:
        work.wait()
    except RuntimeError as error:
        rank = dist.get_rank() if dist.is_initialized() else 0
        raise CollectiveError(
            f"rank {rank}: {what} failed; another rank stopped, crashed or ran something else "
            f"(the wait is bounded by init_process_group(timeout=...)): {error}"
        ) from error
