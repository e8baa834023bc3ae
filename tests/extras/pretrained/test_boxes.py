"""The rank's box of a sharded tensor: DTensor's own ``compute_local_shape_and_global_offset`` (private, detected
once) and ``our_box``, the fallback where a torch lacks it, agree on the layouts ``fully_shard`` and tensor
parallelism make (1-D and 2-D meshes, uneven rows and empty tail ranks, HSDP, FSDP on TP's ``_StridedShard``),
at every mesh coordinate, but FSDP on TP's uneven rows, where ``region_of`` keeps ours; ``tools/test_torch.sh``
runs this on torch 2.11 and 2.14.1 too. A ``_StridedShard``
after another split of its dim (rows interleaved: no box) is refused by name.
"""

from __future__ import annotations

import itertools
import math

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.placement_types import _StridedShard

from fsdp_compose.extras.pretrained import local_region
from fsdp_compose.extras.pretrained.local_region import our_box, region_of


class _MeshAt:
    """What DTensor's function reads of a mesh (torch 2.11 to 2.14.1), for one coordinate: no process group."""

    def __init__(self, shape: tuple[int, ...], coordinate: tuple[int, ...]) -> None:
        self.shape, self._coordinate = shape, coordinate

    def _is_current_rank_part_of_mesh(self) -> bool:
        return True

    def _sym_get_coordinate(self, dim: int) -> int:
        return self._coordinate[dim]


SHAPES = [(7, 5), (3, 4), (1, 6), (0, 3), (12,), (5, 2, 3)]
LAYOUTS = {  # mesh shape -> placements
    (1,): [(Shard(0),)],
    (2,): [(Shard(0),), (Shard(1),)],
    (3,): [(Shard(0),)],
    (4,): [(Shard(0),), (Shard(1),)],
    (5,): [(Shard(0),)],
    (2, 2): [(Replicate(), Shard(0)), (Shard(0), Shard(1)), (Shard(0), Shard(0)), (_StridedShard(0, split_factor=2), Shard(0))],
    (2, 3): [(Replicate(), Shard(0)), (Shard(1), Shard(0)), (_StridedShard(0, split_factor=3), Shard(0))],
    (3, 2): [(Shard(0), Shard(1)), (_StridedShard(0, split_factor=2), Shard(0)), (_StridedShard(1, split_factor=2), Shard(1))],
}


def _cases():
    for (mesh_shape, layouts), shape in itertools.product(LAYOUTS.items(), SHAPES):
        for placements in layouts:
            if all(p.is_replicate() or p.dim < len(shape) for p in placements):
                yield shape, mesh_shape, placements


def test_dtensor_box_is_found_on_this_torch() -> None:
    assert local_region.DTENSOR_BOX is not None, torch.__version__


def test_dtensor_box_and_ours_agree_at_every_coordinate() -> None:
    """Everywhere but FSDP on TP's uneven rows, where ``fully_shard`` chunks TP's rows and DTensor's function
    gives other sizes: there ``region_of`` uses ours (the local tensor's own shape)."""
    checked, differ = 0, set()
    for shape, mesh_shape, placements in _cases():
        for coordinate in itertools.product(*(range(n) for n in mesh_shape)):
            local_shape, offset = local_region.DTENSOR_BOX(shape, _MeshAt(mesh_shape, coordinate), placements)
            ours = our_box(shape, mesh_shape, coordinate, placements)
            same = tuple(size for _, size in ours) == tuple(local_shape) and (
                not math.prod(local_shape) or tuple(start for start, _ in ours) == tuple(offset)
            )  # an empty box's start means nothing (DTensor gives the dim's end)
            if not same:
                differ.add((shape, mesh_shape, placements))
            checked += 1
    assert checked > 300
    assert all(isinstance(placements[0], _StridedShard) for _, _, placements in differ), differ
    assert ((7, 5), (3, 2), (_StridedShard(0, split_factor=2), Shard(0))) in differ
    assert our_box((7, 5), (3, 2), (2, 0), (_StridedShard(0, split_factor=2), Shard(0))) == ((4, 0), (0, 5))


def test_the_boxes_tile_the_tensor() -> None:
    """Every element is in exactly one box of the ranks that write (one replica): no hole, no overlap."""
    for shape, mesh_shape, placements in _cases():
        count = torch.zeros(shape, dtype=torch.int32)
        for coordinate in itertools.product(*(range(n) for n in mesh_shape)):
            if any(p.is_replicate() and c != 0 for p, c in zip(placements, coordinate)):
                continue
            box = our_box(shape, mesh_shape, coordinate, placements)
            count[tuple(slice(start, start + size) for start, size in box)] += 1
        assert bool((count == 1).all()), (shape, mesh_shape, placements)


def test_fallback_gives_the_same_region(single_rank_group, monkeypatch) -> None:
    mesh = init_device_mesh("cpu", (1, 1))
    tensor = DTensor.from_local(torch.arange(12.0).view(3, 4), mesh, (Replicate(), Shard(0)))
    upstream = region_of(tensor, "w")
    monkeypatch.setattr(local_region, "DTENSOR_BOX", None)
    assert region_of(tensor, "w") == upstream
    assert upstream.box == ((0, 3), (0, 4)) and upstream.writer


def test_interleaved_strided_rows_are_refused(single_rank_group) -> None:
    mesh = init_device_mesh("cpu", (1, 1))
    tensor = DTensor.from_local(torch.zeros(4, 2), mesh, (Shard(0), _StridedShard(0, split_factor=2)))
    with pytest.raises(NotImplementedError, match="'w': placements .* split dim 0 by a _StridedShard after another"):
        region_of(tensor, "w")
