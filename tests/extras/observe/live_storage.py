"""Ground truth for the memory checks: bytes of live CPU tensor storage, as c10's CPU allocator counts them.

``with LiveStorage() as live: ...``, then:

- ``live.peak_bytes``: the highest level of live storage during the block (from the last ``reset_peak()``
  on), measured from the level at entry;
- ``live.current_bytes``: the level at exit, from the same origin.

How: c10's CPU allocator keeps a running total of the storages it handed out (``ProfiledCPUMemoryReporter``)
on every thread once ``FLAGS_caffe2_report_cpu_memory_usage`` is set (``_count_every_thread``), and torch's
profiler (``profile_memory=True``) records it with each allocation on the threads it follows: the caller's,
and gloo's worker threads while they run a collective (c10d hands them the caller's thread-local state). So
gloo's own buffers count: its copy of a reduce-scatter input, an all-gather's staging buffers, and their frees
on gloo's threads after the collective (``test_live_storage.py`` checks them against sizes computed by hand).

It shares nothing with the library under test (``StorageTracker`` and ``CollectiveTimeline`` follow the
storages Python's dispatcher shows them; this counts below the dispatcher), and needs no ``LD_PRELOAD`` and
no dispatch mode. Not seen: storage that is not c10's CPU allocator's (a library's own ``malloc``: oneDNN's
scratchpads); a peak reached by an allocation on a thread the profiler does not follow (none in a gloo
step); the free of a storage allocated before the first block in the process (enter the block before the job
is built, and ``reset_peak()`` where the part to measure starts). One block at a time per process.
"""

from __future__ import annotations

import ctypes
from pathlib import Path
from types import TracebackType

import torch
from torch.profiler import ProfilerActivity, profile


class LiveStorage:
    """Bytes of live CPU tensor storage during a ``with`` block: ``peak_bytes``, ``current_bytes``."""

    def __init__(self) -> None:
        self._profile: profile | None = None
        self._marks: list[torch.Tensor] = []  # one-byte storages: entry, each reset_peak, exit
        self.peak_bytes = 0
        self.current_bytes = 0

    def __enter__(self) -> LiveStorage:
        _count_every_thread()
        self._profile = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
        self._profile.__enter__()
        self.reset_peak()  # the first mark: the level at entry
        return self

    def reset_peak(self) -> None:
        """From here on ``peak_bytes`` counts only higher levels (still measured from the level at entry)."""
        self._marks.append(torch.empty(1, dtype=torch.uint8))

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, trace: TracebackType | None
    ) -> None:
        self.reset_peak()  # the last mark: the level at exit, whichever thread freed last
        profiler, self._profile = self._profile, None
        profiler.__exit__(kind, error, trace)
        if kind is None:
            self.peak_bytes, self.current_bytes = _levels(_allocations(profiler), self._marks)
        self._marks.clear()


def _count_every_thread() -> None:
    """Have c10's CPU allocator keep its running total on every thread, not only those the profiler follows.

    The profiler's events carry the allocator's total, but the allocator updates it only on a thread that has
    the profiler's state, or everywhere with ``FLAGS_caffe2_report_cpu_memory_usage``: without the flag, a free
    on one of gloo's threads outside a collective (a finished work's buffers) would never leave the total.
    The flag also has the allocator log each allocation at INFO level, below c10's default threshold. It stays
    set for the rest of the process: cleared, the allocator would keep stale entries for the storages freed
    meanwhile and later count a reused address's free against them."""
    flag = ctypes.c_bool.in_dll(ctypes.CDLL(str(_LIBC10)), "FLAGS_caffe2_report_cpu_memory_usage")
    flag.value = True


_LIBC10 = Path(torch.__file__).with_name("lib") / "libc10.so"


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
    """(the peak from the last ``reset_peak`` to the end, the level at the end), from the level at entry.

    ``marks``: the one-byte storages allocated at entry, at each ``reset_peak`` and at exit. Levels are the
    allocator's own running total, which each event carries as it was under the allocator's lock: exact
    whatever the threads' interleaving (their timestamps are not); the time order only says which events lie
    between two marks. A mark is the last allocation at its address (it lives to the end; a freed one-byte
    storage may have had the address before); the marks' own bytes are left out."""
    last_at = {event.extra_fields.ptr: i for i, event in enumerate(events) if event.extra_fields.alloc_size > 0}
    entry, *resets, end = [last_at[mark.data_ptr()] for mark in marks]
    start = resets[-1] if resets else entry
    base = events[entry].extra_fields.total_allocated - 1
    peak = 0
    for i in range(start, end + 1):
        event = events[i]
        if event.extra_fields.alloc_size > 0:
            marked = 1 + sum(1 for at in resets if at <= i) + (i == end)  # marks allocated by then
            peak = max(peak, event.extra_fields.total_allocated - base - marked)
    return peak, events[end].extra_fields.total_allocated - base - len(marks)
