"""A progress bar for long loads and saves: tqdm's, on rank 0, shown only once one takes a few seconds."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Protocol

import torch.distributed as dist

SHOW_AFTER_S = 3.0


class Progress(Protocol):
    def update(self, n: int) -> object: ...


class _Silent:
    def update(self, n: int) -> None:
        pass


@contextlib.contextmanager
def progress(total_bytes: int, description: str) -> Iterator[Progress]:
    """A bar counting ``total_bytes`` on rank 0 when tqdm is installed; a silent one otherwise."""
    rank0 = not dist.is_initialized() or dist.get_rank() == 0
    try:
        from tqdm.auto import tqdm
    except ImportError:
        tqdm = None
    if tqdm is None or not rank0:
        yield _Silent()
        return
    bar = tqdm(total=total_bytes, desc=description, unit="B", unit_scale=True, delay=SHOW_AFTER_S, leave=False)
    try:
        yield bar
    finally:
        bar.close()
