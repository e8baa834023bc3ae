"""Every rank raises the same error, or none does.

A check that fails on one rank (its copy of a file is truncated, rank 0 could not write) must not leave the
others waiting in a collective, or going on with work the failing rank did not do. ``raise_together`` is the one
way the package says so: each rank takes part in exactly one object collective whatever it found, so none is left
waiting, and every rank builds the message from the same exchanged findings, so each raises the same text.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch.distributed as dist


def raise_together(
    error: Any,
    *,
    group: dist.ProcessGroup | None = None,
    cls: type[Exception] = ValueError,
    source: int | None = None,
    message: Callable[[list[Any]], str] | None = None,
) -> None:
    """Raise ``cls`` on every rank of ``group`` (the default group) with the same message, or on none.

    ``error`` is this rank's finding: ``None`` when it found nothing wrong, else a message (or any picklable value
    ``message`` reads). With ``source=None`` the findings of every rank are gathered (one ``all_gather_object``);
    if any is not ``None``, the message is ``message(findings)`` (listed by rank in ``group``), by default the
    first failing rank's, naming that rank and how many others failed. With ``source=r`` (a rank of ``group``)
    only rank ``r``'s finding counts (one ``broadcast_object_list``), raised as it is. Without a process group,
    or in a group of one, no collective runs.
    """
    world = dist.get_world_size(group) if dist.is_initialized() else 1
    if source is not None:
        held = [error]
        if world > 1:
            src = source if group is None else dist.get_global_rank(group, source)
            dist.broadcast_object_list(held, src=src, group=group)
        if held[0] is not None:
            raise cls(held[0])
        return
    found = [error]
    if world > 1:
        found = [None] * world
        dist.all_gather_object(found, error, group=group)
    if any(e is not None for e in found):
        raise cls((message or first_failing)(found))


def first_failing(found: list[Any]) -> str:
    """The first failing rank's message, then which rank it was and how many others failed (among several)."""
    failed = [(rank, e) for rank, e in enumerate(found) if e is not None]
    rank, text = failed[0]
    if len(found) == 1:
        return str(text)
    others = f" and {len(failed) - 1} other rank(s)" if len(failed) > 1 else ""
    return f"{text} (rank {rank}{others})"
