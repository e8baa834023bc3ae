"""Count live tensor storage bytes created while a ``StorageTracker`` is active.

A ``TorchDispatchMode`` records every output tensor's storage through a C-level weak
reference (``StorageWeakRef``), so a storage is counted exactly as long as something (a
Python object, the autograd graph, a hook's closure, a C++ cache) keeps it alive. DTensor
outputs are followed to their local tensor. Shared by tests that assert memory is flat.
"""

from __future__ import annotations

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves


class StorageTracker(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self._live: dict[int, tuple[StorageWeakRef, int]] = {}

    def _track(self, tensor: torch.Tensor) -> None:
        local = getattr(tensor, "_local_tensor", None)
        if local is not None:
            tensor = local
        try:
            storage = tensor.untyped_storage()
        except (RuntimeError, NotImplementedError):
            return  # a wrapper subclass or sparse tensor without a plain storage
        key = storage._cdata
        if key not in self._live or self._live[key][0].expired():
            self._live[key] = (StorageWeakRef(storage), storage.nbytes())

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for leaf in tree_leaves(out):
            if isinstance(leaf, torch.Tensor):
                self._track(leaf)
        return out

    def live_bytes(self) -> int:
        """Bytes of tracked storages still alive (expired entries are dropped)."""
        self._live = {k: v for k, v in self._live.items() if not v[0].expired()}
        return sum(nbytes for _, nbytes in self._live.values())
