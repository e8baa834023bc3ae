"""Count live tensor storages (not RSS): the measurement ``explain``'s prediction is checked against.

``StorageTracker`` is a ``TorchDispatchMode``: every tensor an op reads or writes has its
storage registered once, with a weak reference whose callback subtracts the bytes when the
storage dies. ``UntypedStorage.resize_`` (how unsharded parameters are freed and re-allocated)
does not go through dispatch, so it is patched while the tracker is active. Tensors made
before entering and not touched inside are invisible unless passed to ``track``.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Iterable, Iterator

import torch
from torch._subclasses.fake_tensor import FakeTensor
from torch.utils._python_dispatch import TorchDispatchMode


class StorageTracker(TorchDispatchMode):
    """Live bytes of the storages seen, and their peak, on the devices in ``devices`` (all by default)."""

    def __init__(self, devices: Iterable[str] | None = None) -> None:
        super().__init__()
        self.devices = set(devices) if devices is not None else None
        self.current = 0
        self.peak = 0
        self._sizes: dict[int, int] = {}  # id(storage) -> bytes counted
        self._refs: dict[int, weakref.ref] = {}
        # reentrant: a storage's weakref callback (``_forget``) can run inside ``_add`` when an allocation
        # there triggers the cyclic garbage collector, on the same thread
        self._lock = threading.RLock()
        self._original_resize = None

    # ----- counting ---------------------------------------------------------------------
    def track(self, tensors: Iterable[object]) -> None:
        """Count tensors that already exist (parameters, optimizer state) from now on."""
        for t in tensors:
            self._see(t)

    def track_training_state(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None) -> None:
        """Count what a training step starts from: the model's parameters and buffers, and the optimizer's state."""
        self.track(model.parameters())
        self.track(model.buffers())
        for state in optimizer.state.values() if optimizer is not None else ():
            self.track(state.values())

    def reset_peak(self) -> None:
        self.peak = self.current

    def _see(self, t: object) -> None:
        if not isinstance(t, torch.Tensor):
            return
        if type(t) not in (torch.Tensor, torch.nn.Parameter):
            flatten = getattr(t, "__tensor_flatten__", None)
            if flatten is not None:  # DTensor and friends: count the tensors inside
                for name in flatten()[0]:
                    self._see(getattr(t, name))
                return
            if not isinstance(t, FakeTensor):  # fake tensors have storages with sizes: counted
                return
        if t.device.type == "meta" or (self.devices is not None and t.device.type not in self.devices):
            return
        storage = t.untyped_storage()
        key = id(storage)
        if key in self._refs and self._refs[key]() is storage:
            return
        self._add(key, storage)

    def _add(self, key: int, storage: torch.UntypedStorage) -> None:
        with self._lock:
            self._refs[key] = weakref.ref(storage, lambda _ref, key=key: self._forget(key))
            self._sizes[key] = storage.nbytes()
            self.current += self._sizes[key]
            self.peak = max(self.peak, self.current)

    def _forget(self, key: int) -> None:
        with self._lock:
            self.current -= self._sizes.pop(key, 0)
            self._refs.pop(key, None)

    def _resized(self, storage: torch.UntypedStorage) -> None:
        key = id(storage)
        ref = self._refs.get(key)
        if ref is None or ref() is not storage:
            self._add(key, storage)
            return
        with self._lock:
            new = storage.nbytes()
            self.current += new - self._sizes[key]
            self._sizes[key] = new
            self.peak = max(self.peak, self.current)

    # ----- dispatch ---------------------------------------------------------------------
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tensors_in((args, kwargs, out)):
            self._see(t)
        if func is torch.ops.aten.resize_.default:
            self._resized(args[0].untyped_storage())
        return out

    def __enter__(self):
        original = self._original_resize = torch.UntypedStorage.resize_
        tracker = self

        def resize_(storage, size):
            result = original(storage, size)
            tracker._resized(storage)
            return result

        torch.UntypedStorage.resize_ = resize_
        return super().__enter__()

    def __exit__(self, *exc):
        torch.UntypedStorage.resize_ = self._original_resize
        return super().__exit__(*exc)


def tensors_in(obj: object) -> Iterator[torch.Tensor]:
    """The tensors in an operator's arguments and results (nested tuples, lists, dicts): a cheaper
    ``tree_flatten``, which costs more than the operator itself under ``FakeTensorMode``."""
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, (tuple, list)):
        for item in obj:
            yield from tensors_in(item)
    elif isinstance(obj, dict):
        for item in obj.values():
            yield from tensors_in(item)
