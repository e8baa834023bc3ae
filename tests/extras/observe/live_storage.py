"""Ground truth for the memory checks: bytes of live CPU tensor storage, as c10's CPU allocator reports them.

``with LiveStorage() as live: ...`` runs the block under torch's profiler with ``profile_memory=True``: c10's
CPU allocator then reports every storage it allocates or frees, with its size, on every thread that carries
the profiler's state. That includes gloo's worker threads (c10d hands them the caller's thread-local state),
so gloo's own buffers count: its copy of a reduce-scatter input, an all-gather's staging buffer
(``test_live_storage.py`` checks both against sizes computed by hand). After the block:

- ``live.peak_bytes``: the highest level of live storage during the block (since the last ``reset_peak()``),
  measured from the level at entry;
- ``live.current_bytes``: the level at exit, from the same origin.

It shares nothing with the library under test (``StorageTracker`` and ``CollectiveTimeline`` follow the
storages Python's dispatcher shows them; this counts below the dispatcher) and needs no ``LD_PRELOAD`` and
no dispatch mode. Not seen: storage that is not c10's CPU allocator's (a library's own ``malloc``: oneDNN's
scratchpads), and the free of a storage allocated while no profiler counted (enter the block before the job
is built, and ``reset_peak()`` where the part to measure starts). One block at a time per process.
"""

from __future__ import annotations

from types import TracebackType

import torch
from torch.profiler import ProfilerActivity, profile


class LiveStorage:
    """Bytes of live CPU tensor storage during a ``with`` block: ``peak_bytes``, ``current_bytes``."""

    def __init__(self) -> None:
        self._profile: profile | None = None
        self._marks: list[torch.Tensor] = []  # one-byte storages whose allocation marks each reset_peak
        self.peak_bytes = 0
        self.current_bytes = 0

    def __enter__(self) -> LiveStorage:
        self._profile = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
        self._profile.__enter__()
        return self

    def reset_peak(self) -> None:
        """From here on ``peak_bytes`` counts only higher levels (still measured from the level at entry)."""
        self._marks.append(torch.empty(1, dtype=torch.uint8))

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, trace: TracebackType | None
    ) -> None:
        profiler, self._profile = self._profile, None
        profiler.__exit__(kind, error, trace)
        if kind is None:
            self.peak_bytes, self.current_bytes = _levels(_allocations(profiler), self._marks)
        self._marks.clear()


def _allocations(profiler: profile) -> list:
    """Every allocation and free the allocator reported, every thread's, in time order."""
    events, stack = [], list(profiler.profiler.kineto_results.experimental_event_tree())
    while stack:
        event = stack.pop()
        stack.extend(event.children)
        if event.tag.name == "Allocation" and event.extra_fields.device.type == "cpu":
            events.append(event)
    return sorted(events, key=lambda event: event.start_time_ns)


def _levels(events: list, marks: list[torch.Tensor]) -> tuple[int, int]:
    """(peak since the last mark, level at the end), both from the level at entry; the marks' own bytes left
    out. A mark is the last allocation at its address (it lives to the end; a freed one-byte storage may
    have had the address before)."""
    last_at = {event.extra_fields.ptr: i for i, event in enumerate(events) if event.extra_fields.alloc_size > 0}
    at_marks = [last_at[mark.data_ptr()] for mark in marks]
    level = peak = 0
    for i, event in enumerate(events):
        if i in at_marks:
            if i == at_marks[-1]:
                peak = level  # the last reset_peak: earlier levels no longer count
            continue
        level += event.extra_fields.alloc_size
        peak = max(peak, level)
    return peak, level
