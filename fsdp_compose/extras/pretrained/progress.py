"""A progress bar for long loads and saves: tqdm's, on rank 0, shown only once one takes a few seconds.

It counts the bytes rank 0 itself reads or writes (its rows, not the whole checkpoint), so its rate is
that rank's; ``load_pretrained(progress=False)`` / ``save_pretrained(progress=False)`` turn it off.
"""

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
def progress_bar(my_bytes: int, description: str, enabled: bool = True) -> Iterator[Progress]:
    """A bar counting ``my_bytes`` (what this rank reads or writes) on rank 0 when ``enabled`` and tqdm is
    installed; a silent one otherwise."""
    rank0 = not dist.is_initialized() or dist.get_rank() == 0
    if not enabled or not rank0:
        yield _Silent()
        return
    try:
        from tqdm.auto import tqdm
    except ImportError:
        yield _Silent()
        return
    bar = tqdm(total=my_bytes, desc=description, unit="B", unit_scale=True, delay=SHOW_AFTER_S, leave=False)
    try:
        yield bar
    finally:
        bar.close()
