"""The memory checks' ground truth (``live_storage.py``) against sizes computed by hand, so that ``estimate``'s
figure is not checked against itself: allocations, views, frees, ``UntypedStorage.resize_``, and what gloo
allocates inside a collective, on its own threads too, which the library's ``StorageTracker`` cannot see."""

from __future__ import annotations

import gc
import time

import torch
import torch.distributed as dist

from fsdp_compose.extras.observe.storage import StorageTracker
from tests.extras.observe.live_storage import LiveStorage
from tests.harness import run_on_ranks


def _levels(step) -> tuple[int, int]:
    with LiveStorage() as live:
        step(live)
    return live.peak_bytes, live.current_bytes


def test_allocations_views_frees_and_resize_count_their_bytes():
    gc.collect()
    kept = {}

    def allocate(live: LiveStorage) -> None:
        a = torch.empty(1000)  # 4000 bytes
        kept["b"] = torch.ones(10, dtype=torch.float64)  # 80
        view = a[:10].view(2, 5)  # shares a's storage
        c = view + 1  # 40 more: 4120
        del a, view  # 120
        storage = c.untyped_storage()
        storage.resize_(0)  # 80
        storage.resize_(800)  # 880
        live.reset_peak()
        storage.resize_(0)  # 80
        del c, storage

    assert _levels(allocate) == (880, 80)
    assert _levels(lambda live: kept.clear()) == (0, -80)  # a storage allocated before the block, freed in it
    assert _levels(lambda live: allocate(live) or kept.clear()) == (880, 0)
    assert _levels(lambda live: torch.empty(1000)) == (4000, 0)


def _reduce_scatter() -> tuple[int, int, int]:
    tracker = StorageTracker()
    with LiveStorage() as live, tracker:
        table = torch.ones(3 * 1000)  # 12000 bytes, every rank's rows
        out = torch.empty(1000)  # 4000
        work = dist.reduce_scatter_tensor(out, table, async_op=True)
        del table
        work.wait()
        del work
        kept = out
        time.sleep(0.5)  # gloo's thread lets go of the finished work (and the copy) just after the wait
    return live.peak_bytes, live.current_bytes, tracker.peak


def _all_gather() -> tuple[int, int]:
    with LiveStorage() as live:
        out = torch.empty(3 * 1000)  # 12000 bytes
        rows = torch.ones(1000)  # 4000
        dist.all_gather_into_tensor(out, rows, async_op=True).wait()
        del out, rows
        time.sleep(0.5)  # gloo's thread lets go of the finished work (its staging, out and rows) just after
    return live.peak_bytes, live.current_bytes


def test_gloo_buffers_count_on_every_thread():
    """gloo copies a reduce-scatter's input when the collective is issued and keeps the copy with the work:
    12000 + 4000 + 12000 bytes at once; the storage tracker, which sees only what Python's dispatcher shows it,
    counts 16000. An all-gather stages its output in an output-sized buffer while issued (on the caller's
    thread) and in another on gloo's worker thread: 16000 + 12000 at most. (3 ranks.)"""
    for peak, held, tracked in run_on_ranks(3, _reduce_scatter):
        assert (peak, held, tracked) == (28000, 4000, 16000)
    for peak, held in run_on_ranks(3, _all_gather):
        assert (peak, held) == (28000, 0)
