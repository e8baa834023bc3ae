"""The never-low checks' ground truth (``allocator_counter.py``) against sizes computed by hand, so that
``estimate``'s figure is not checked against itself: allocations, views, frees, ``UntypedStorage.resize_``,
and what gloo allocates inside a collective, which the library's ``StorageTracker`` cannot see."""

from __future__ import annotations

import gc

import pytest
import torch
import torch.distributed as dist

from fsdp_compose.extras.observe.storage import StorageTracker
from tests.extras.observe.allocator_counter import LiveStorage, library, run_counted

pytestmark = pytest.mark.skipif(library() is None, reason="no C compiler to build live_storage.c")


def _by_hand() -> list[int]:
    counter = LiveStorage()
    gc.collect()
    base = counter.current()
    seen = []
    a = torch.empty(1000)  # 4000 bytes
    b = torch.ones(10, dtype=torch.float64)  # 80
    seen.append(counter.current() - base)  # 4080
    view = a[:10].view(2, 5)  # shares a's storage
    c = view + 1  # 40 more
    seen.append(counter.current() - base)  # 4120
    del a, view
    seen.append(counter.current() - base)  # 120
    storage = c.untyped_storage()
    storage.resize_(0)
    seen.append(counter.current() - base)  # 80
    storage.resize_(800)
    seen.append(counter.current() - base)  # 880
    counter.reset_peak()
    storage.resize_(0)
    seen += [counter.current() - base, counter.peak() - base]  # 80, 880
    del b, c, storage
    seen.append(counter.current() - base)  # 0
    return seen


def test_allocations_views_frees_and_resize_count_their_bytes():
    assert run_counted(3, _by_hand)[0] == [4080, 4120, 120, 80, 880, 80, 880, 0]


def _reduce_scatter() -> tuple[int, int, int]:
    counter = LiveStorage()
    gc.collect()
    base = counter.current()
    counter.reset_peak()
    tracker = StorageTracker()
    with tracker:
        table = torch.ones(3 * 1000)  # 12000 bytes, every rank's rows
        out = torch.empty(1000)  # 4000
        work = dist.reduce_scatter_single(out, table, async_op=True)
        del table
        work.wait()
        del work
    held = counter.current() - base
    del out
    return counter.peak() - base, held, tracker.peak


def test_gloo_copies_a_reduce_scatter_input_which_only_the_counter_sees():
    """gloo copies the input when the collective is issued and keeps the copy with the work: 12000 + 4000 +
    12000 bytes at once. The storage tracker, which sees only what Python's dispatcher shows it, counts 16000.
    (3 ranks: the never-low checks' pool.)"""
    for peak, held, tracked in run_counted(3, _reduce_scatter):
        assert (peak, held, tracked) == (28000, 4000, 16000)
