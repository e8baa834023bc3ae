"""Where a parameter's unsharded form lives: one object per storage kind, behind one interface.

- ``Aliased``: the unsharded parameter aliases the ``(world, padded)`` copy-out target, so copy-out
  writes the parameter in place (a ``Shard(0)`` plain shard);
- ``Staged``: ``Shard(d)`` with ``d > 0``: collectives see ``d`` first, so copy-out lands in a staging
  buffer copied once into the contiguous parameter;
- ``extensions.GatherExtension``: a shard with the all-gather extension protocol (or a codec): its
  pre-all-gather chooses the inputs, its post-all-gather builds the parameter.

Every kind answers ``widths``, ``pieces``, ``targets``, ``finish``, ``rows``, ``free`` and ``nbytes`` for a
``ShardedParam`` (``params.py``), which holds one of them (``form``) and never asks which. The group calls
the form directly, and ``gather_pieces`` and ``use`` below: a step runs no function of ``params.py``.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import wraps
from typing import TypeVar

import torch

from .param_layout import alias, contiguous_strides

F = TypeVar("F", bound=Callable)
# torch's private switches for function transforms (torch.func.jvp, vmap, grad); absent: nothing is disabled
_transforms_active = getattr(torch._C, "_are_functorch_transforms_active", None)
_DisableTransforms = getattr(torch._C, "_DisableFuncTorch", None)


def outside_transforms(fn: F) -> F:
    """``fn`` run below any active function transform: a first all-gather inside ``torch.func.jvp`` would
    otherwise make its buffers and the unsharded parameter the transform's wrappers, which have no storage
    to alias. The values are plain either way; the transform still sees the module use them."""
    if _transforms_active is None or _DisableTransforms is None:
        return fn

    @wraps(fn)
    def plain(*args, **kwargs):
        if not _transforms_active():
            return fn(*args, **kwargs)
        with _DisableTransforms():
            return fn(*args, **kwargs)

    return plain


def give_storage(storage: torch.UntypedStorage, nbytes: int) -> None:
    """Give a storage freed with ``resize_(0)`` its ``nbytes`` back (a no-op where it has them). Every unshard
    runs it, so it lives in this file of a step's path."""
    if storage.nbytes() != nbytes:
        storage.resize_(nbytes)


def gather_pieces(p) -> list[torch.Tensor]:
    """This rank's all-gather contribution as byte pieces, moved and cast to the gather dtype before the
    collective (bf16 halves the bytes moved); a shard object not seen before picks its form first."""
    local = p.sharded_param._local_tensor
    extension = p.form.extension
    if local is not p._plain_source and (extension is None or extension.source is not local):
        p.choose_form(local)
    return p.form.pieces(p, local)


def use(p, unsharded: bool) -> None:
    """Register the sharded or the unsharded parameter everywhere it lives."""
    param = p.unsharded_param if unsharded else p.sharded_param
    for place in p.places:
        place.module._parameters[place.name] = param


class Aliased:
    """The unsharded parameter is a view of the gathered rows: no copy after copy-out."""

    extension = None

    def __init__(self) -> None:
        self.target: torch.Tensor | None = None  # (world, padded bytes) uint8 view of the unsharded storage
        self._source: torch.Tensor | None = None  # the local shard ``_pieces`` were made of
        self._pieces: list[torch.Tensor] = []

    @staticmethod
    def to_comm(tensor: torch.Tensor) -> torch.Tensor:
        """The layout collectives see: the shard dim first (already, for dim 0)."""
        return tensor

    from_comm = to_comm

    def widths(self, p) -> list[int]:
        return [p.padded_numel * p.gather_element_size]

    def pieces(self, p, local: torch.Tensor) -> list[torch.Tensor]:
        """The shard's bytes and its padding, cast to the gather dtype where needed (uncast views cached)."""
        if local is self._source:
            return self._pieces
        if local.device != p.layout.compute_device or local.dtype != p.layout.gather_dtype:
            return p.as_pieces(local.to(p.layout.compute_device, p.layout.gather_dtype, non_blocking=True))
        self._source, self._pieces = local, p.as_pieces(local)
        return self._pieces

    def _create(self, p) -> None:
        storage_owner = p.zeros(p.world_size * p.padded_numel)
        p.new_unsharded(alias(storage_owner, p.unsharded_shape, contiguous_strides(p.unsharded_shape)))
        self.target = alias(storage_owner, (p.world_size, p.padded_numel), (p.padded_numel, 1)).view(torch.uint8)

    def targets(self, p) -> list[torch.Tensor]:
        """Give the unsharded storage back; the copy-out target."""
        if p.unsharded_param is None:
            self._create(p)
        give_storage(self.target.untyped_storage(), self.target.numel())
        return [self.target]

    def finish(self, p, slice_follows: bool) -> None:
        """After copy-out: the parameter already holds the values."""

    def rows(self, p) -> list[torch.Tensor]:
        """The gathered ``(world, bytes)`` rows while unsharded (what a post-forward slice keeps)."""
        return self.targets(p)

    def free(self, p) -> None:
        if self.target is not None:
            self.target.untyped_storage().resize_(0)

    def nbytes(self, p) -> int:
        return 0 if self.target is None else self.target.untyped_storage().nbytes()


class Staged(Aliased):
    """``Shard(d)``, ``d > 0``: copy-out fills a ``(world, padded)`` staging buffer with ``d`` first, copied
    once into the parameter's own contiguous storage and freed; gradients go and come back the same way."""

    def __init__(self, shard_dim: int) -> None:
        super().__init__()
        self.data: torch.Tensor | None = None  # the parameter's own storage
        self._shard_dim = shard_dim

    def to_comm(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor.movedim(self._shard_dim, 0)

    def from_comm(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor.movedim(0, self._shard_dim)

    def pieces(self, p, local: torch.Tensor) -> list[torch.Tensor]:
        """The shard with its dim first (a copy each time: the optimizer updates it in place)."""
        local = local.to(p.layout.compute_device, p.layout.gather_dtype, non_blocking=True)
        return p.as_pieces(self.to_comm(local).contiguous())

    def _create(self, p) -> None:
        super()._create(p)  # the parameter aliases that storage; the staging buffer is another
        storage = self.target.view(p.layout.gather_dtype)
        self.data = alias(storage, p.unsharded_shape, contiguous_strides(p.unsharded_shape))
        staging = p.zeros(p.world_size * p.padded_numel)
        self.target = staging.view(p.world_size, p.padded_numel).view(torch.uint8)

    def targets(self, p) -> list[torch.Tensor]:
        targets = super().targets(p)  # (re)allocates the staging buffer
        give_storage(self.data.untyped_storage(), p.world_size * p.padded_numel * p.gather_element_size)
        return targets

    def _staged(self, p) -> torch.Tensor:
        """The gathered tensor inside the staging buffer, the shard dim first, padding dropped."""
        flat = self.target.view(p.layout.gather_dtype).reshape(-1)
        return flat[: p.comm_shape.numel()].view(p.comm_shape)

    def finish(self, p, slice_follows: bool) -> None:
        self.data.copy_(self.from_comm(self._staged(p)))
        self.target.untyped_storage().resize_(0)  # staging is only needed during copy-out

    def rows(self, p) -> list[torch.Tensor]:
        targets = self.targets(p)
        self._staged(p).copy_(self.to_comm(self.data))
        return targets

    def free(self, p) -> None:
        super().free(p)
        if self.data is not None:
            self.data.untyped_storage().resize_(0)

    def nbytes(self, p) -> int:
        return super().nbytes(p) + (0 if self.data is None else self.data.untyped_storage().nbytes())
