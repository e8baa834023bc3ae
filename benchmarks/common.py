"""Shared pieces of the benchmarks: peak-RSS probes, collective byte counters, timing."""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import sys
import time
from contextlib import contextmanager

from torch.distributed import ProcessGroup

from fsdp_compose._runtime.collectives import GATHER_METHOD, SCATTER_METHOD

COUNTED = {GATHER_METHOD: "gather", SCATTER_METHOD: "scatter"}  # this torch's names for them


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
    """Bytes each rank receives through all-gathers and sends through reduce-scatters.

    Counted where the collectives reach the process group (``ProcessGroup.all_gather_single``,
    which ``dist.all_gather_single`` calls and fsdp_compose calls directly), leaving out
    fsdp_compose's order check and shared-memory syncs, which move no parameter data."""
    totals = {"gather": 0, "scatter": 0, "gather_calls": 0, "scatter_calls": 0}
    originals = {name: getattr(ProcessGroup, name) for name in COUNTED}
    raw = {name: vars(ProcessGroup)[name] for name in COUNTED}  # what restoring needs (pybind)

    def wrap(name, kind):
        def call(group, output, input, *args, **kwargs):
            if not sys._getframe(1).f_code.co_filename.endswith(("_checks/order.py", "fsdp_compose_shm/__init__.py")):
                world = group.size()
                tensor = output if kind == "gather" else input
                totals[kind] += tensor.numel() * tensor.element_size() * (world - 1) // world
                totals[kind + "_calls"] += 1
            return originals[name](group, output, input, *args, **kwargs)

        return call

    for name, kind in COUNTED.items():
        setattr(ProcessGroup, name, wrap(name, kind))
    try:
        yield totals
    finally:
        for name, fn in raw.items():
            setattr(ProcessGroup, name, fn)


def median_time(fn, repeats: int, clock=time.perf_counter) -> float:
    """Median of ``repeats`` timings of ``fn()``; ``clock=time.thread_time`` counts only this
    thread's CPU time, which other jobs on a shared machine disturb far less than wall time."""
    times = []
    for _ in range(repeats):
        start = clock()
        fn()
        times.append(clock() - start)
    return statistics.median(times)


def add_step_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The options every gloo step benchmark shares (ranks, batch, rounds)."""
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps-per-round", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=1)
    return parser


def _run_rank(rank: int, rank_main, *args) -> None:
    """``rank_main(rank, *args)``, then exit without finalizing the interpreter.

    gloo's worker thread may still hold the last collective's work (the harness's
    ``all_gather_object``, whose tensors own Python objects) and take the GIL to free it; during
    interpreter shutdown CPython ends that thread inside a ``noexcept`` destructor, a SIGABRT
    (docs/troubleshooting.md). An exception still reaches torch's spawn wrapper."""
    rank_main(rank, *args)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def spawn_ranks(rank_main, args) -> None:
    """Run ``rank_main(rank, world_size, port, args)`` on ``args.world_size`` spawned ranks."""
    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.start_processes(
        _run_rank, args=(rank_main, args.world_size, port, args), nprocs=args.world_size, start_method="spawn"
    )
