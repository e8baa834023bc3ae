"""The one row geometry: how a tensor is cut into rows across the shard ranks and padded so that every rank
sends the same size. A pure function of plain arguments (``row_layout``), tested without a process group; the
runtime, the pretrained loader (a DTensor's box, one mesh dim at a time) and the owner-computed optimizer (every
rank's rows of a matrix) all read it, the extras through ``extras_api.row_layout``."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from .param_layout import contiguous_strides


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

    def rows_of(self, rank: int) -> tuple[int, int]:
        """``(first row, rows)`` that ``rank`` holds: ``(row_start, local_rows)`` of its own layout."""
        return _rows_of(self.shape[self.shard_dim], self.rows_per_rank, rank)

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
    row_start, local_rows = _rows_of(size, rows_per_rank, rank)
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


def _rows_of(size: int, rows_per_rank: int, rank: int) -> tuple[int, int]:
    """``torch.chunk``'s part ``rank`` of ``size`` rows in parts of ``rows_per_rank``: ``(first row, rows)``."""
    start = min(rank * rows_per_rank, size)
    return start, min(start + rows_per_rank, size) - start
