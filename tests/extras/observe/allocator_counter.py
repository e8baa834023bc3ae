"""The ground truth of the never-low checks: live CPU tensor storage, counted below torch.

``live_storage.c``, preloaded into gloo ranks (``run_counted``), counts every block c10's CPU allocator takes
from the C library until it is freed, on every thread. It shares nothing with the library under test (its
``StorageTracker`` follows the storages Python's dispatcher shows it, so it misses what an operator allocates
for itself: gloo's copy of a reduce-scatter input, its all-gather staging buffer, a kernel's scratch).
``tests/extras/observe/test_allocator_counter.py`` checks it against sizes computed by hand.

It needs a C compiler (``cc``); without one, ``library()`` is ``None`` and the checks using it skip.
"""

from __future__ import annotations

import atexit
import ctypes
import hashlib
import os
import shutil
import subprocess
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tests.harness import DEFAULT_TIMEOUT_S, RankPool

SOURCE = Path(__file__).with_name("live_storage.c")


def library() -> Path | None:
    """The shim built once per source version (in the temporary directory), or ``None`` without a compiler."""
    compiler = shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        return None
    digest = hashlib.sha256(SOURCE.read_bytes()).hexdigest()[:16]
    path = Path(tempfile.gettempdir()) / f"fsdp_compose_live_storage_{digest}.so"
    if not path.exists():
        partial = path.with_suffix(f".{os.getpid()}.tmp")
        subprocess.run(
            [compiler, "-O2", "-shared", "-fPIC", "-o", str(partial), str(SOURCE), "-ldl", "-lpthread"], check=True
        )
        os.replace(partial, path)
    return path


class LiveStorage:
    """This process's counter (it must run with the shim preloaded): bytes now, the peak, and a reset."""

    def __init__(self) -> None:
        path = os.environ.get("FSDP_COMPOSE_LIVE_STORAGE")
        if not path or path not in os.environ.get("LD_PRELOAD", ""):
            raise RuntimeError("LiveStorage: this process was not started with the shim preloaded (run_counted)")
        lib = ctypes.CDLL(path)  # the preloaded copy: dlopen returns the same one
        self._current, self._peak = lib.live_storage_current, lib.live_storage_peak
        self._reset = lib.live_storage_reset_peak
        self._current.restype = self._peak.restype = ctypes.c_int64

    def current(self) -> int:
        return self._current()

    def peak(self) -> int:
        return self._peak()

    def reset_peak(self) -> None:
        self._reset()


class _CountedPool(RankPool):
    """Gloo ranks started with the shim preloaded."""

    def __init__(self, world_size: int, path: Path) -> None:
        super().__init__(world_size)
        self.path = path

    def _start(self) -> None:
        saved = {k: os.environ.get(k) for k in ("LD_PRELOAD", "FSDP_COMPOSE_LIVE_STORAGE")}
        os.environ["LD_PRELOAD"] = " ".join(filter(None, [str(self.path), saved["LD_PRELOAD"]]))
        os.environ["FSDP_COMPOSE_LIVE_STORAGE"] = str(self.path)
        try:
            super()._start()
        finally:
            for key, value in saved.items():
                if value is None:
                    os.environ.pop(key, None)
                else:
                    os.environ[key] = value


_pools: dict[int, _CountedPool] = {}


def run_counted(world_size: int, fn: Callable, *args: Any, timeout: float = DEFAULT_TIMEOUT_S, **kwargs: Any) -> list:
    """``run_on_ranks`` on ranks that have the counter (``LiveStorage()`` works inside ``fn``)."""
    if world_size not in _pools:
        path = library()
        if path is None:
            raise RuntimeError("run_counted: no C compiler to build live_storage.c")
        _pools[world_size] = _CountedPool(world_size, path)
    return _pools[world_size].run(fn, *args, timeout=timeout, **kwargs)


@atexit.register
def _close_pools() -> None:
    for pool in _pools.values():
        pool.close()
