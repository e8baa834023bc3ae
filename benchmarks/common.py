"""Shared pieces of the benchmarks: peak-RSS probes, collective byte counters, timing."""

from __future__ import annotations

import statistics
import time
from contextlib import contextmanager

import torch.distributed as dist

COUNTED = {"all_gather_single": "gather", "reduce_scatter_single": "scatter"}


def rss_bytes(field: str = "VmRSS") -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(field)


def reset_peak_rss() -> None:
    """Linux: writing 5 to clear_refs resets VmHWM, the peak resident set size."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


@contextmanager
def count_bytes():
    """Bytes each rank receives through all-gathers and sends through reduce-scatters."""
    totals = {"gather": 0, "scatter": 0, "gather_calls": 0, "scatter_calls": 0}
    originals = {name: getattr(dist, name) for name in COUNTED}

    def wrap(name, kind):
        def call(output, input, *args, **kwargs):
            world = dist.get_world_size(kwargs.get("group"))
            tensor = output if kind == "gather" else input
            totals[kind] += tensor.numel() * tensor.element_size() * (world - 1) // world
            totals[kind + "_calls"] += 1
            return originals[name](output, input, *args, **kwargs)

        return call

    for name, kind in COUNTED.items():
        setattr(dist, name, wrap(name, kind))
    try:
        yield totals
    finally:
        for name, fn in originals.items():
            setattr(dist, name, fn)


def median_time(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)
