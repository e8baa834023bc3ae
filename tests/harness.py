"""Run a function on N gloo ranks in fresh processes over loopback, with a hard deadline.

Workers are spawned once per world size and reused (importing torch costs seconds per
process). Any failure or time-out kills every worker of that pool, so the next test starts
from clean processes and no test can hang the suite.

Every deadline in the tests is a hang detector, never a performance bound: ``hang_timeout()``
gives it (10 minutes by default, far beyond what any case needs on a loaded 2-core machine),
times ``FSDP_COMPOSE_TIMEOUT_SCALE`` (e.g. 0.2 to find a hang sooner, 3 on a very slow machine).
A failing rank still ends its peers within seconds (below), so only a real hang waits that long.
"""

from __future__ import annotations

import atexit
import datetime
import faulthandler
import os
import queue
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

TIMEOUT_SCALE = float(os.environ.get("FSDP_COMPOSE_TIMEOUT_SCALE", "1"))


def hang_timeout(seconds: float = 600.0) -> float:
    """A deadline that only a hang reaches: ``seconds`` times ``FSDP_COMPOSE_TIMEOUT_SCALE``."""
    return seconds * TIMEOUT_SCALE


DEFAULT_TIMEOUT_S = hang_timeout()
# Workers return freed tensors' memory to the OS at once, so RSS-based memory tests measure
# live bytes rather than allocator caching (read by glibc when each worker starts).
os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", "65536")


class RankFailure(AssertionError):
    """One or more ranks raised or timed out."""


def _worker(rank: int, world_size: int, port: int, tasks, results) -> None:
    faulthandler.enable(all_threads=True)  # a crash (e.g. SIGSEGV) prints every thread's Python stack to stderr
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=datetime.timedelta(seconds=hang_timeout()))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size)
    parent = os.getppid()
    while True:
        try:
            task = tasks.get(timeout=2.0)
        except queue.Empty:
            if os.getppid() != parent:  # the test process is gone without closing the pool (killed, or an
                os._exit(0)  # xdist worker ending with os._exit): no orphan waits here for ever
            continue
        if task is None:
            break
        fn, args, kwargs = task
        try:
            results.put((rank, True, fn(*args, **kwargs)))
        except BaseException:  # noqa: BLE001 - report everything to the parent
            results.put((rank, False, traceback.format_exc()))
    dist.destroy_process_group()


class RankPool:
    """``world_size`` worker processes that each run ``fn(*args)`` with a process group set up."""

    def __init__(self, world_size: int) -> None:
        self.world_size = world_size
        self._procs: list = []

    def _start(self) -> None:
        ctx = mp.get_context("spawn")
        self._store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
        self._results = ctx.Queue()
        self._tasks = [ctx.Queue() for _ in range(self.world_size)]
        self._procs = [
            ctx.Process(
                target=_worker,
                args=(rank, self.world_size, self._store.port, self._tasks[rank], self._results),
                daemon=True,
            )
            for rank in range(self.world_size)
        ]
        for proc in self._procs:
            proc.start()

    def kill(self) -> None:
        for proc in self._procs:
            if proc.is_alive():
                proc.kill()
        for proc in self._procs:
            proc.join(timeout=5)
        self._procs = []

    def close(self) -> None:
        if self._procs:
            for q in self._tasks:
                q.put(None)
            deadline = time.monotonic() + 5
            for proc in self._procs:
                proc.join(timeout=max(0.0, deadline - time.monotonic()))
            self.kill()

    def run(self, fn: Callable, *args: Any, timeout: float = DEFAULT_TIMEOUT_S, **kwargs: Any) -> list[Any]:
        """Run ``fn`` on every rank; return the per-rank results in rank order."""
        if not self._procs or not all(p.is_alive() for p in self._procs):
            self.kill()
            self._start()
        for q in self._tasks:
            q.put((fn, args, kwargs))
        outcomes: dict[int, tuple[bool, Any]] = {}
        deadline = time.monotonic() + timeout
        while len(outcomes) < self.world_size:
            remaining = deadline - time.monotonic()
            try:  # a second at a time: a rank that died (at start too: a bad import) is seen at once
                rank, ok, value = self._results.get(timeout=max(0.05, min(remaining, 1.0)))
                outcomes[rank] = (ok, value)
                if not ok:  # its peers may be stuck in a collective: 5 s more for them
                    deadline = min(deadline, time.monotonic() + 5.0)
            except queue.Empty:
                if time.monotonic() >= deadline or not all(p.is_alive() for p in self._procs):
                    break
        failed = {r: v for r, (ok, v) in outcomes.items() if not ok}
        missing = [r for r in range(self.world_size) if r not in outcomes]
        if failed or missing:
            exit_codes = {r: self._procs[r].exitcode for r in missing}  # before kill(): None = still running
            self.kill()
            lines = [f"{fn.__name__} on {self.world_size} ranks failed"]
            for rank, tb in sorted(failed.items()):
                lines.append(f"--- rank {rank} raised:\n{tb}")
            for rank in missing:
                code = exit_codes[rank]
                if code is None:
                    lines.append(f"--- rank {rank} gave no result within {timeout:.0f}s (killed)")
                else:  # e.g. -6: SIGABRT (a gloo abort or std::terminate; its message is on stderr)
                    lines.append(f"--- rank {rank} died with exit code {code} and gave no result")
            raise RankFailure("\n".join(lines))
        return [outcomes[r][1] for r in range(self.world_size)]


_pools: dict[int, RankPool] = {}


def pool(world_size: int) -> RankPool:
    if world_size not in _pools:
        _pools[world_size] = RankPool(world_size)
    return _pools[world_size]


def run_on_ranks(world_size: int, fn: Callable, *args: Any, timeout: float = DEFAULT_TIMEOUT_S, **kwargs: Any) -> list[Any]:
    return pool(world_size).run(fn, *args, timeout=timeout, **kwargs)


@atexit.register
def close_pools() -> None:
    """Stop every pool's workers (at exit, and at the end of a pytest session: conftest.py)."""
    for p in _pools.values():
        p.close()
    _pools.clear()
