"""The one row geometry (``_runtime/rows.py:RowLayout``), without a process group: every rank's rows
are ``torch.chunk``'s, padding is zeros at the end of each rank's slot, and ``unpad`` undoes the gather; and
the one ``_StridedShard`` split factor (``_runtime/param_layout.py:dp_shard_placement``)."""

import pytest
import torch

from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.placement_types import _StridedShard

from fsdp_compose._runtime.param_layout import dp_shard_placement
from fsdp_compose._runtime.rows import row_layout


def _gathered(shape: tuple[int, ...], dim: int, world: int) -> tuple[torch.Tensor, list]:
    """What an all-gather of every rank's padded rows gives, built from the layouts alone."""
    full = torch.arange(1, 1 + torch.Size(shape).numel(), dtype=torch.float32).view(shape)
    layouts = [row_layout(torch.Size(shape), dim, world, rank) for rank in range(world)]
    sent = [rows.pad(rows.to_comm(rows.shard_of(full))) for rows in layouts]
    return full, layouts, torch.stack(sent)


@pytest.mark.parametrize("shape, dim", [((5, 3), 0), ((2, 4), 0), ((1, 3), 0), ((3, 7), 1), ((2, 3, 5), 2), ((4,), 0)])
@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_rows_follow_torch_chunk_and_gather_back(shape, dim, world):
    full, layouts, gathered = _gathered(shape, dim, world)
    chunks = torch.chunk(full, world, dim=dim)
    for rows in layouts:
        mine = rows.shard_of(full)
        expected = chunks[rows.rank] if rows.rank < len(chunks) else full.narrow(dim, 0, 0)
        assert torch.equal(mine, expected)
        assert mine.shape == rows.local_shape
        assert rows.local_numel == mine.numel()
        assert rows.comm_local_shape == rows.to_comm(mine).shape
        assert rows.padded_numel * world >= full.numel()
    assert gathered.shape == (world, layouts[0].padded_numel)
    assert torch.equal(layouts[0].from_comm(layouts[0].unpad(gathered)), full)


def test_uneven_and_empty_shards_are_padded_with_zeros_at_the_end_of_their_slot():
    # 5 rows on 4 ranks: 2 rows each, so ranks 0-1 are full, rank 2 holds 1 row, rank 3 none
    full, layouts, gathered = _gathered((5, 2), 0, 4)
    assert [rows.local_rows for rows in layouts] == [2, 2, 1, 0]
    assert [rows.row_start for rows in layouts] == [0, 2, 4, 5]
    assert gathered.tolist() == [[1, 2, 3, 4], [5, 6, 7, 8], [9, 10, 0, 0], [0, 0, 0, 0]]


@pytest.mark.parametrize("size", [0, 1, 2, 5, 10, 13])
@pytest.mark.parametrize("world", [1, 3, 4])
def test_any_layout_names_every_ranks_rows_as_that_ranks_own_layout_does(size, world):
    # what the pretrained loader (one mesh dim at a time) and the optimizer exchange (every rank's rows) read
    layouts = [row_layout(torch.Size((size, 3)), 0, world, rank) for rank in range(world)]
    for rows in layouts:
        assert [rows.rows_of(r) for r in range(world)] == [(other.row_start, other.local_rows) for other in layouts]
    chunks = [len(c) for c in torch.arange(size).chunk(world)]
    assert [rows.local_rows for rows in layouts] == chunks + [0] * (world - len(chunks))


def test_shard_dim_one_rows_are_columns():
    full, layouts, gathered = _gathered((2, 3), 1, 2)
    assert [rows.local_shape for rows in layouts] == [torch.Size((2, 2)), torch.Size((2, 1))]
    assert layouts[0].comm_shape == torch.Size((3, 2))
    # rank 0 sends columns 0 and 1 (shard dim first), rank 1 column 2 and a zero column
    assert gathered.tolist() == [[1, 4, 2, 5], [3, 6, 0, 0]]


def test_pad_rows_pads_an_unsharded_tensor_to_every_ranks_slot():
    rows = row_layout(torch.Size((5, 2)), 0, 4, 0)
    table = rows.pad_rows(torch.arange(1.0, 11.0).view(5, 2))
    assert table.tolist() == [[1, 2, 3, 4], [5, 6, 7, 8], [9, 10, 0, 0], [0, 0, 0, 0]]
    even = row_layout(torch.Size((4, 2)), 0, 2, 1)
    grad = torch.ones(4, 2)
    assert even.pad_rows(grad).data_ptr() == grad.data_ptr()  # nothing missing: a view, no copy


def test_layouts_are_frozen_values():
    a = row_layout(torch.Size((5, 3)), 0, 2, 1)
    assert a == row_layout(torch.Size((5, 3)), 0, 2, 1)
    with pytest.raises(AttributeError):
        a.rows_per_rank = 4


def test_the_data_parallel_shard_is_strided_by_the_ways_model_parallel_dims_split_its_dim():
    # one split factor for fully_shard on a TP DTensor and on a full SPMD mesh (dp_mesh_dims)
    assert dp_shard_placement(0, [], []) == Shard(0)
    assert dp_shard_placement(0, [Shard(1)], [4]) == Shard(0)
    assert dp_shard_placement(0, [Shard(0)], [4]) == _StridedShard(0, split_factor=4)
    assert dp_shard_placement(1, [Shard(1), Replicate(), Shard(1)], [2, 3, 5]) == _StridedShard(1, split_factor=10)
    assert dp_shard_placement(0, [_StridedShard(0, split_factor=2), Shard(0)], [3, 2]) == _StridedShard(0, split_factor=6)
    with pytest.raises(ValueError):
        dp_shard_placement(0, [Shard(0)], [2, 2])  # a placement per mesh dim
