"""A parameter's rows, and where its unsharded form lives: one object per storage kind, behind one interface.

``RowLayout`` is the one row geometry: how a parameter is cut into rows across the shard ranks and
padded so that every rank sends the same size. The storage kinds receive it when built:

- ``Aliased``: the unsharded parameter aliases the ``(world, padded)`` copy-out target, so copy-out
  writes the parameter in place (a ``Shard(0)`` plain shard);
- ``Staged``: ``Shard(d)`` with ``d > 0``: collectives see ``d`` first, so copy-out lands in a staging
  buffer copied once into the contiguous parameter;
- ``extensions.GatherExtension``: a shard with the all-gather extension protocol (or a codec): its
  pre-all-gather chooses the inputs, its post-all-gather builds the parameter.

Every kind answers ``widths``, ``pieces``, ``targets``, ``finish``, ``rows``, ``free`` and ``nbytes``; a
``ShardedParam`` (``params.py``) holds one of them (``form``) and never asks which. Only the methods that
build or read the unsharded parameter take the ``ShardedParam`` that owns it. The group calls the form
directly, and ``gather_pieces`` and ``use`` below: a step runs no function of ``params.py``.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from functools import wraps
from typing import TypeVar

import torch

from .param_layout import ParamLayout, alias, contiguous_strides


@dataclass(frozen=True)
class RowLayout:
    """One parameter's rows: slices of ``shard_dim`` of its unsharded tensor (``shape``: global, or TP-local
    under tensor parallel), ``rows_per_rank`` per rank.

    Shards follow ``torch.chunk``, as DTensor's ``Shard`` does: rank ``r`` holds rows ``[r * rows_per_rank,
    ...)``, so tail shards may be short or empty. Collectives see the shard dim first (``comm_shape``) and
    pad every rank's rows with zeros up to ``rows_per_rank`` (``padded_numel`` elements): the padding
    sits at the end of each rank's slot, so the real rows of a gather are its first ``comm_shape``
    elements. Built by ``row_layout``; every field is plain data (a step reads them without a call)."""

    shape: torch.Size
    shard_dim: int
    world: int
    rank: int
    rows_per_rank: int
    row_start: int  # this rank's first row
    local_rows: int  # rows this rank holds (0 for an empty tail shard)
    padded_numel: int  # elements one rank sends: rows_per_rank rows
    local_numel: int
    local_shape: torch.Size  # this rank's shard, in the parameter's own layout
    comm_shape: torch.Size  # the unsharded tensor with the shard dim first: what collectives lay out
    comm_local_shape: torch.Size  # this rank's rows, the shard dim first
    comm_local_strides: tuple[int, ...]

    def to_comm(self, tensor: torch.Tensor) -> torch.Tensor:
        """``tensor`` (laid out like the parameter) with the shard dim first, as collectives see it."""
        return tensor.movedim(self.shard_dim, 0) if self.shard_dim else tensor

    def from_comm(self, tensor: torch.Tensor) -> torch.Tensor:
        """The inverse of ``to_comm``."""
        return tensor.movedim(0, self.shard_dim) if self.shard_dim else tensor

    def shard_of(self, full: torch.Tensor) -> torch.Tensor:
        """This rank's rows of the unsharded ``full`` (a view)."""
        return full.narrow(self.shard_dim, self.row_start, self.local_rows)

    def pad(self, local: torch.Tensor) -> torch.Tensor:
        """This rank's rows (shard dim first), flat and zero-padded to ``padded_numel``: what it sends."""
        flat = local.reshape(-1)
        missing = self.padded_numel - flat.numel()
        return torch.constant_pad_nd(flat, (0, missing)) if missing else flat

    def pad_rows(self, full: torch.Tensor) -> torch.Tensor:
        """The unsharded ``full`` (shard dim first) as ``(world, padded_numel)``, every rank's rows zero-padded:
        what a reduce-scatter sends (one view where nothing is missing)."""
        flat = full.reshape(-1)
        missing = self.world * self.padded_numel - flat.numel()
        if missing:  # one op: a zeros tensor and a cat wrote the padding twice
            flat = torch.constant_pad_nd(flat, (0, missing))
        return flat.view(self.world, self.padded_numel)

    def unpad(self, gathered: torch.Tensor) -> torch.Tensor:
        """Every rank's padded rows (``world * padded_numel`` elements, flat or not) without the padding,
        shaped ``comm_shape``."""
        return gathered.reshape(-1)[: self.comm_shape.numel()].view(self.comm_shape)


def row_layout(shape: torch.Size, shard_dim: int, world: int, rank: int) -> RowLayout:
    """The row geometry of a tensor of ``shape`` split on ``shard_dim`` across ``world`` ranks, seen from ``rank``."""
    size = shape[shard_dim]
    others = (*shape[:shard_dim], *shape[shard_dim + 1 :])  # the dims of one row
    row_numel = math.prod(others)
    rows_per_rank = math.ceil(size / world)
    row_start = min(rank * rows_per_rank, size)
    local_rows = min(row_start + rows_per_rank, size) - row_start
    comm_local_shape = torch.Size((local_rows, *others))
    return RowLayout(
        shape=torch.Size(shape),
        shard_dim=shard_dim,
        world=world,
        rank=rank,
        rows_per_rank=rows_per_rank,
        row_start=row_start,
        local_rows=local_rows,
        padded_numel=rows_per_rank * row_numel,
        local_numel=local_rows * row_numel,
        local_shape=torch.Size((*shape[:shard_dim], local_rows, *shape[shard_dim + 1 :])),
        comm_shape=torch.Size((size, *others)),
        comm_local_shape=comm_local_shape,
        comm_local_strides=contiguous_strides(comm_local_shape),
    )

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
    if local is not p.plain_source and (extension is None or extension.source is not local):
        p.choose_form(local)
    return p.form.pieces(local)


def use(p, unsharded: bool) -> None:
    """Register the sharded or the unsharded parameter everywhere it lives."""
    param = p.unsharded_param if unsharded else p.sharded_param
    for place in p.places:
        place.module._parameters[place.name] = param


class Aliased:
    """The unsharded parameter is a view of the gathered rows: no copy after copy-out. See [Note: the
    aliasing copy-out target] in ``param_layout.py``."""

    extension = None

    def __init__(self, row_layout: RowLayout, layout: ParamLayout) -> None:
        self.row_layout = row_layout
        self.layout = layout  # the gather dtype and the compute device: where the unsharded parameter lives
        self.target: torch.Tensor | None = None  # (world, padded bytes) uint8 view of the unsharded storage
        self._source: torch.Tensor | None = None  # the local shard ``_pieces`` were made of
        self._pieces: list[torch.Tensor] = []
        # what pads this rank's rows to the padded count (``RowLayout``), sent as a piece of its own: no copy
        self._padding = self._zeros(row_layout.padded_numel - row_layout.local_numel)

    def _zeros(self, numel: int) -> torch.Tensor:
        """Zeros where and as the unsharded parameter lives: the compute device, the gather dtype."""
        return torch.zeros(numel, dtype=self.layout.gather_dtype, device=self.layout.compute_device)

    def widths(self) -> list[int]:
        return [self.row_layout.padded_numel * self.layout.gather_dtype.itemsize]

    def pieces(self, local: torch.Tensor) -> list[torch.Tensor]:
        """The shard's bytes and its padding, cast to the gather dtype where needed (uncast views cached)."""
        if local is self._source:
            return self._pieces
        layout = self.layout
        if local.device != layout.compute_device or local.dtype != layout.gather_dtype:
            return self._padded(local.to(layout.compute_device, layout.gather_dtype, non_blocking=True))
        self._source, self._pieces = local, self._padded(local)
        return self._pieces

    def _padded(self, rows: torch.Tensor) -> list[torch.Tensor]:
        """This rank's rows (shard dim first) as bytes, then the padding's."""
        pieces = [rows.reshape(-1).view(torch.uint8)]
        if self._padding.numel():
            pieces.append(self._padding.view(torch.uint8))
        return pieces

    def _create(self, p) -> None:
        rows = self.row_layout
        storage_owner = self._zeros(rows.world * rows.padded_numel)
        p.new_unsharded(alias(storage_owner, rows.shape, contiguous_strides(rows.shape)))
        self.target = alias(storage_owner, (rows.world, rows.padded_numel), (rows.padded_numel, 1)).view(torch.uint8)

    def targets(self, p) -> list[torch.Tensor]:
        """Give the unsharded storage back (``p``'s unsharded parameter is built the first time); the
        copy-out target."""
        if p.unsharded_param is None:
            self._create(p)
        give_storage(self.target.untyped_storage(), self.target.numel())
        return [self.target]

    def finish(self, p, slice_follows: bool) -> None:
        """After copy-out: the parameter already holds the values."""

    def rows(self, p) -> list[torch.Tensor]:
        """The gathered ``(world, bytes)`` rows while unsharded (what a post-forward slice keeps)."""
        return self.targets(p)

    def free(self) -> None:
        if self.target is not None:
            self.target.untyped_storage().resize_(0)

    def nbytes(self) -> int:
        return 0 if self.target is None else self.target.untyped_storage().nbytes()


class Staged(Aliased):
    """``Shard(d)``, ``d > 0``: copy-out fills a ``(world, padded)`` staging buffer with ``d`` first, copied
    once into the parameter's own contiguous storage and freed; gradients go and come back the same way."""

    def __init__(self, row_layout: RowLayout, layout: ParamLayout) -> None:
        super().__init__(row_layout, layout)
        self.data: torch.Tensor | None = None  # the parameter's own storage

    def pieces(self, local: torch.Tensor) -> list[torch.Tensor]:
        """The shard with its dim first (a copy each time: the optimizer updates it in place)."""
        local = local.to(self.layout.compute_device, self.layout.gather_dtype, non_blocking=True)
        return self._padded(self.row_layout.to_comm(local).contiguous())

    def _create(self, p) -> None:
        super()._create(p)  # the parameter aliases that storage; the staging buffer is another
        rows = self.row_layout
        self.data = alias(self.target.view(self.layout.gather_dtype), rows.shape, contiguous_strides(rows.shape))
        staging = self._zeros(rows.world * rows.padded_numel)
        self.target = staging.view(rows.world, rows.padded_numel).view(torch.uint8)

    def targets(self, p) -> list[torch.Tensor]:
        targets = super().targets(p)  # (re)allocates the staging buffer
        give_storage(self.data.untyped_storage(), self.target.numel())
        return targets

    def _staged(self) -> torch.Tensor:
        """The gathered tensor inside the staging buffer, the shard dim first, padding dropped."""
        return self.row_layout.unpad(self.target.view(self.layout.gather_dtype))

    def finish(self, p, slice_follows: bool) -> None:
        self.data.copy_(self.row_layout.from_comm(self._staged()))
        self.target.untyped_storage().resize_(0)  # staging is only needed during copy-out

    def rows(self, p) -> list[torch.Tensor]:
        targets = self.targets(p)
        self._staged().copy_(self.row_layout.to_comm(self.data))
        return targets

    def free(self) -> None:
        super().free()
        if self.data is not None:
            self.data.untyped_storage().resize_(0)

    def nbytes(self) -> int:
        return super().nbytes() + (0 if self.data is None else self.data.untyped_storage().nbytes())
