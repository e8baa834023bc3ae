"""Make code that imports torch's FSDP2 names use fsdp_compose instead, reversibly.

Trainers such as Hugging Face ``accelerate`` run ``from torch.distributed.fsdp import
fully_shard, FSDPModule, MixedPrecisionPolicy`` inside their own functions. To point them at
fsdp_compose without editing them, ``use_as_torch_fsdp()`` sets our objects as attributes of
torch's FSDP2 modules (every path trainers import from), and the returned handle puts torch's
back. Patching an attribute needs the module object, so this one function imports torch's
modules, through ``importlib`` at call time only: fsdp_compose itself never uses them, and
nothing happens at ``import fsdp_compose``.

It is a package of its own, beside ``fsdp_compose``, because it is the one place that touches
torch's FSDP modules: ``fsdp_compose`` itself never names them.
"""

from __future__ import annotations

import importlib
import sys
from types import TracebackType

from fsdp_compose.api.fully_shard import fully_shard
from fsdp_compose.api.comm import AllGather, Comm, ReduceScatter
from fsdp_compose.api.forward_methods import register_fsdp_forward_method
from fsdp_compose.api.module import FSDPModule, UnshardHandle
from fsdp_compose.api.module_settings import share_comm_ctx
from fsdp_compose.api.policies import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy
from fsdp_compose.api.spmd_mesh import DataParallelMeshDims

# the public FSDP2 names (all of them: tests/api/test_surface.py checks), and the comm protocol
# classes trainers import from the private module
OUR_NAMES: dict[str, object] = {
    "fully_shard": fully_shard,
    "FSDPModule": FSDPModule,
    "UnshardHandle": UnshardHandle,
    "MixedPrecisionPolicy": MixedPrecisionPolicy,
    "OffloadPolicy": OffloadPolicy,
    "CPUOffloadPolicy": CPUOffloadPolicy,
    "register_fsdp_forward_method": register_fsdp_forward_method,
    "share_comm_ctx": share_comm_ctx,
    "DataParallelMeshDims": DataParallelMeshDims,
    "Comm": Comm,
    "AllGather": AllGather,
    "ReduceScatter": ReduceScatter,
}

# every module path trainers import FSDP2 names from (public, legacy and private)
TORCH_MODULES = (
    "torch.distributed.fsdp",
    "torch.distributed.fsdp._fully_shard",
    "torch.distributed.fsdp._fully_shard._fully_shard",
    "torch.distributed.fsdp._fully_shard._fsdp_api",
    "torch.distributed._composable.fsdp",
    "torch.distributed._composable.fsdp.fully_shard",
)

_MISSING = object()


class TorchFSDPPatch:
    """Handle returned by :func:`use_as_torch_fsdp`: ``undo()`` (or leaving its ``with``) restores torch's names."""

    def __init__(self, saved: list[tuple[object, str, object]]) -> None:
        self._saved = saved

    @property
    def active(self) -> bool:
        return bool(self._saved)

    def undo(self) -> None:
        """Put torch's original objects back; calling it again does nothing."""
        saved, self._saved = self._saved, []
        for module, name, original in reversed(saved):
            if original is _MISSING:
                delattr(module, name)
            else:
                setattr(module, name, original)
        if self in _active:
            _active.remove(self)

    def __enter__(self) -> TorchFSDPPatch:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.undo()


_active: list[TorchFSDPPatch] = []


def _torch_module(path: str):
    """torch's module at ``path``, imported now if needed; None if this torch lacks it."""
    if path in sys.modules:
        return sys.modules[path]
    try:
        return importlib.import_module(path)
    except ImportError:
        return None


def use_as_torch_fsdp() -> TorchFSDPPatch:
    """Make ``from torch.distributed.fsdp import fully_shard`` (and friends) give fsdp_compose's.

    Sets every public FSDP2 name (``fully_shard``, ``FSDPModule``, ``UnshardHandle``, the
    policies, ``DataParallelMeshDims``, ``share_comm_ctx``, ``register_fsdp_forward_method``)
    and the comm protocol classes (``Comm``, ``AllGather``, ``ReduceScatter``) on
    ``torch.distributed.fsdp``, ``torch.distributed._composable.fsdp`` and
    ``torch.distributed.fsdp._fully_shard`` (and the private modules behind them), wherever
    torch defines the name. Imports done after this call get ours; a module that already
    bound torch's function at its own import time keeps it, so call this before importing or
    constructing the trainer (``accelerate`` imports these names lazily, when it prepares the
    model). torch's FSDP1 (``FullyShardedDataParallel``) and names we do not provide are left
    alone.

    Returns a handle: ``handle.undo()`` restores torch's objects; used as a context manager
    (``with use_as_torch_fsdp(): ...``) it restores them on exit. Raises ``RuntimeError`` if
    a previous patch is still active.
    """
    if _active:
        raise RuntimeError("use_as_torch_fsdp() is already active; undo() the previous handle first")
    saved: list[tuple[object, str, object]] = []
    for path in TORCH_MODULES:
        module = _torch_module(path)
        if module is None:
            continue
        for name, ours in OUR_NAMES.items():
            original = module.__dict__.get(name, _MISSING)
            if original is _MISSING:
                continue
            saved.append((module, name, original))
            setattr(module, name, ours)
    handle = TorchFSDPPatch(saved)
    _active.append(handle)
    return handle


__all__ = ["use_as_torch_fsdp", "TorchFSDPPatch"]
