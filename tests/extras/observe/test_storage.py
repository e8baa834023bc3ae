"""``StorageTracker`` against sizes computed by hand (issue 39, item 4): explain()'s and estimate()'s
memory figures, and the full-state-dict bound, are checked with this tracker, so it is checked once
against an independent measure here: what each allocation, view, free and ``resize_`` must count."""

import gc

import torch

from fsdp_compose.extras.observe.storage import StorageTracker


def test_allocations_views_and_frees_count_their_bytes():
    with StorageTracker() as tracker:
        a = torch.empty(1000)  # 4000 bytes
        b = torch.ones(10, dtype=torch.float64)  # 80 bytes
        assert tracker.current == 4080, tracker.current
        view = a[:10].view(2, 5)  # a view shares a's storage: nothing new
        c = view + 1  # a new 10-element float32 result: 40 bytes
        assert tracker.current == 4120, tracker.current
        del a, view
        gc.collect()
        assert tracker.current == 120, tracker.current
        assert tracker.peak == 4120, tracker.peak
        del b, c
        gc.collect()
        assert tracker.current == 0, tracker.current


def test_storage_resize_counts_as_free_and_allocation():
    """How unsharded parameters are freed and re-allocated: ``UntypedStorage.resize_``."""
    with StorageTracker() as tracker:
        t = torch.zeros(100, dtype=torch.bfloat16)  # 200 bytes
        storage = t.untyped_storage()
        storage.resize_(0)
        assert tracker.current == 0, tracker.current
        storage.resize_(800)
        assert tracker.current == 800, tracker.current
        tracker.reset_peak()
        storage.resize_(0)
        assert (tracker.current, tracker.peak) == (0, 800)


def test_tensors_made_before_count_once_tracked():
    before = torch.empty(50)  # 200 bytes, made outside the tracker
    with StorageTracker() as tracker:
        assert tracker.current == 0
        tracker.track([before, before[5:]])  # the same storage twice: counted once
        assert tracker.current == 200, tracker.current
        x = before * 2  # 200 more
        assert tracker.current == 400, tracker.current
        del x
        gc.collect()
        assert tracker.current == 200, tracker.current
