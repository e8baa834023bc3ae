"""Which part of a parameter's full value this rank holds, and where those elements lie in a row-major file.

A parameter sharded by ``fully_shard`` is a DTensor: on each mesh dim a ``Shard(d)`` splits tensor dim ``d``
into the runtime's rows (``row_layout``: ``torch.chunk``'s, as DTensor cuts them, tail ranks short or empty).
A ``_StridedShard(d)`` (FSDP on top of a tensor-parallel split of the same dim) splits the rows the other mesh
dims left this rank, so it is applied after them. The result is a box, ``(start, size)`` per tensor dim, as
DTensor's own ``compute_local_shape_and_global_offset`` gives it (``our_box`` where a torch lacks that private
function); in the row-major bytes of a safetensors file it is a few contiguous runs (one for ``Shard(0)``).
"""

from __future__ import annotations

import dataclasses
import inspect
import itertools
import math
from collections.abc import Callable, Sequence

import torch
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.placement_types import Placement

from ...extras_api import row_layout


@dataclasses.dataclass(frozen=True)
class Region:
    """This rank's box of a tensor of global ``shape``, and whether it is the one replica that writes it."""

    shape: tuple[int, ...]
    box: tuple[tuple[int, int], ...]  # (start, size) per dim
    writer: bool

    @property
    def local_shape(self) -> tuple[int, ...]:
        return tuple(size for _, size in self.box)

    def runs(self, itemsize: int) -> list[tuple[int, int, int]]:
        """``(byte offset in the full tensor, byte offset in the box, bytes)`` of each contiguous run of the box."""
        if math.prod(self.local_shape) == 0:
            return []
        restricted = [d for d, (start, size) in enumerate(self.box) if (start, size) != (0, self.shape[d])]
        if not restricted:
            return [(0, 0, math.prod(self.shape) * itemsize)]
        last = restricted[-1]  # dims after it are whole: each run spans them
        strides = [math.prod(self.shape[d + 1 :]) for d in range(len(self.shape))]
        start_last, size_last = self.box[last]
        run = size_last * strides[last] * itemsize
        leading = [range(start, start + size) for start, size in self.box[:last]]
        runs = []
        for n, index in enumerate(itertools.product(*leading)):
            element = sum(i * s for i, s in zip(index, strides)) + start_last * strides[last]
            runs.append((element * itemsize, n * run, run))
        return runs


def _detect_dtensor_box() -> Callable | None:
    """DTensor's own ``compute_local_shape_and_global_offset(global_shape, mesh, placements)`` (private: torch 2.11 to
    2.14.1 have it with these parameters), or None where this torch lacks it or calls it otherwise."""
    try:
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
    except ImportError:
        return None
    try:
        parameters = list(inspect.signature(compute_local_shape_and_global_offset).parameters)
    except (TypeError, ValueError):
        return None
    return compute_local_shape_and_global_offset if parameters[:3] == ["global_shape", "mesh", "placements"] else None


# detected once, at import; the box falls back to ``our_box`` without it (tests/extras/pretrained/test_boxes.py
# checks the two agree, on every supported torch). Not for a _StridedShard (FSDP on TP's split of the same dim):
# there ``fully_shard`` cuts TP's uneven rows as ``torch.chunk`` does (7 rows, TP 2, FSDP 3: 2, 2, 0 of TP's 4),
# and DTensor's function gives other sizes (1 row to the third FSDP rank), which the local tensor does not have
DTENSOR_BOX: Callable | None = _detect_dtensor_box()


def region_of(tensor: torch.Tensor, name: str) -> Region:
    """This rank's region of ``tensor`` (a DTensor's local part, or all of a plain tensor)."""
    shape = tuple(tensor.shape)
    if not isinstance(tensor, DTensor):
        return Region(shape, tuple((0, s) for s in shape), writer=True)
    mesh, placements = tensor.device_mesh, tensor.placements
    coordinate = mesh.get_coordinate()
    if coordinate is None:  # this rank holds none of it
        return Region(shape, tuple((0, 0) for _ in shape), writer=False)
    writer = True
    sharded: set[int] = set()
    for mesh_dim, placement in enumerate(placements):
        if placement.is_replicate():
            writer = writer and coordinate[mesh_dim] == 0
        elif placement.is_partial():
            raise ValueError(f"'{name}' is a Partial DTensor: it has no values to load into or save; redistribute it first")
        elif hasattr(placement, "split_factor") and placement.dim in sharded:
            raise NotImplementedError(  # its rows interleave: no box holds them
                f"'{name}': placements {placements} split dim {placement.dim} by a _StridedShard after another mesh dim "
                "did; a layout load_pretrained/save_pretrained do not know"
            )
        else:
            sharded.add(placement.dim)
    if DTENSOR_BOX is not None and not any(hasattr(p, "split_factor") for p in placements):
        local_shape, offset = DTENSOR_BOX(shape, mesh, placements)
        box = tuple(zip(offset, local_shape))
    else:
        box = our_box(shape, tuple(mesh.shape), tuple(coordinate), placements)
    region = Region(shape, box, writer)
    local = tuple(tensor.to_local().shape)
    if region.local_shape != local:
        raise NotImplementedError(
            f"'{name}': its local tensor has shape {local}, but placements {placements} on mesh {tuple(mesh.shape)} "
            f"give {region.local_shape}; a layout load_pretrained/save_pretrained do not know"
        )
    return region


def our_box(
    shape: tuple[int, ...], mesh_shape: tuple[int, ...], coordinate: tuple[int, ...], placements: Sequence[Placement]
) -> tuple[tuple[int, int], ...]:
    """The box of the rank at ``coordinate``: each ``Shard(d)`` cuts dim ``d`` into ``fully_shard``'s rows, left to
    right; a ``_StridedShard(d)`` (FSDP on top of TP's split of the same dim) cuts the rows the other mesh dims
    left, so it is applied after them. Where ``DTENSOR_BOX`` is missing, and the reference it is tested against."""
    box = [(0, s) for s in shape]
    strided = []
    for mesh_dim, placement in enumerate(placements):
        if hasattr(placement, "split_factor"):
            strided.append(mesh_dim)
        elif not placement.is_replicate() and not placement.is_partial():
            box[placement.dim] = _rows(box[placement.dim], mesh_shape[mesh_dim], coordinate[mesh_dim])
    for mesh_dim in reversed(strided):
        dim = placements[mesh_dim].dim
        box[dim] = _rows(box[dim], mesh_shape[mesh_dim], coordinate[mesh_dim])
    return tuple(box)


def _rows(span: tuple[int, int], ways: int, index: int) -> tuple[int, int]:
    """Rank ``index``'s rows of ``span`` split ``ways`` ways, as ``fully_shard`` splits them (``row_layout``)."""
    start, size = span
    rows = row_layout(torch.Size((size,)), 0, ways, index)
    return start + rows.row_start, rows.local_rows
