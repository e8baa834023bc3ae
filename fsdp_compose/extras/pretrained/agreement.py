"""Every rank raises the same error, or none does: a check that fails on one rank (its copy of a file is
truncated) must not leave the others waiting in a collective or loading a model the failing rank did not."""

from __future__ import annotations

import torch.distributed as dist

from .safetensors_file import PretrainedCheckpointError


def agreed_error(error: str | None) -> str | None:
    """The first failing rank's error, naming that rank, on every rank; None if no rank's check failed (one
    object all-gather)."""
    errors = [error]
    if dist.is_initialized() and dist.get_world_size() > 1:
        errors = [None] * dist.get_world_size()
        dist.all_gather_object(errors, error)
    failed = [(rank, e) for rank, e in enumerate(errors) if e is not None]
    if not failed:
        return None
    rank, message = failed[0]
    others = f" and {len(failed) - 1} other rank(s)" if len(failed) > 1 else ""
    return message + (f" (rank {rank}{others})" if len(errors) > 1 else "")


def raise_on_every_rank(error: str | None) -> None:
    """Raise ``PretrainedCheckpointError`` on every rank if any rank's check failed."""
    message = agreed_error(error)
    if message is not None:
        raise PretrainedCheckpointError(message)
