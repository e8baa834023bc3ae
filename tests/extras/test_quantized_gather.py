"""The codec's dequantize and requantize walk every rank's blocks with a number of kernels that does
not grow with the world size, and give exactly what a rank-by-rank reference gives.

Cases: shards small enough to go many ranks at once, a shard larger than one chunk (walked in
chunks), uneven shards whose last rank the weight cuts short, ranks past the weight's end, and
blocks that straddle a shard's end.
"""

import math

import pytest
import torch

from fsdp_compose.extras import quantized_gather
from fsdp_compose.extras.quantized_gather import BlockQuantized


def _wire(codec: BlockQuantized, world: int, per_rank_shape: torch.Size, seed: int):
    """Every rank's (1-byte values, scales) as the all-gather leaves them: ranks' padded blocks in turn."""
    generator = torch.Generator().manual_seed(seed)
    blocks = math.ceil(per_rank_shape.numel() / codec.block_size)
    values = torch.randint(-127, 128, (world * blocks * codec.block_size,), generator=generator)
    scales = torch.rand(world * blocks, generator=generator) + 0.01
    return values.to(codec.dtype), scales


def _reference(codec: BlockQuantized, data, scales, per_rank_shape: torch.Size, numel: int) -> torch.Tensor:
    per_rank = per_rank_shape.numel()
    blocks = math.ceil(per_rank / codec.block_size)
    world = scales.numel() // blocks
    rows = data.view(world, blocks, codec.block_size).float() * scales.view(world, blocks, 1)
    return rows.view(world, -1)[:, :per_rank].reshape(-1)[:numel]


CASES = [  # (world, one rank's padded shard, elements of the weight)
    (1024, torch.Size((1, 16)), 64 * 16),  # 64 rows over 1024 ranks: most ranks past the end
    (8, torch.Size((3, 50)), 22 * 50),  # uneven: the last rank cut short; blocks straddle shard ends
    (3, torch.Size((700, 200)), 2000 * 200),  # a shard of 140,000 elements: several chunks each
    (5, torch.Size((7,)), 33),
]


@pytest.mark.parametrize(("world", "shape", "numel"), CASES)
@pytest.mark.parametrize("block_size", [128, 32])
def test_dequantize_matches_a_rank_by_rank_reference(world, shape, numel, block_size):
    codec = BlockQuantized(torch.int8, block_size)
    data, scales = _wire(codec, world, shape, seed=world)
    out = torch.full((numel,), float("nan"))
    codec._dequantize_into(out, data, scales, shape)
    assert torch.equal(out, _reference(codec, data, scales, shape, numel))


@pytest.mark.parametrize(("world", "shape", "numel"), CASES)
def test_requantize_gives_back_the_bytes_of_the_weight(world, shape, numel):
    """What ``requantize_into`` writes dequantizes to the weight it read, and padding stays zero."""
    codec = BlockQuantized(torch.int8, 32)
    data, scales = _wire(codec, world, shape, seed=1)
    weight = _reference(codec, data, scales, shape, numel)
    again = torch.full_like(data, 99)
    codec.requantize_into(again, scales, weight, shape)
    assert torch.equal(_reference(codec, again, scales, shape, numel), weight)
    per_rank, blocks = shape.numel(), math.ceil(shape.numel() / 32)
    written = torch.zeros(world, blocks * 32, dtype=torch.bool)
    written[:, :per_rank] = True
    written = written.view(-1) & (torch.arange(world * blocks * 32) < _padded_index(numel, per_rank, blocks * 32))
    assert not again[~written].any()


def _padded_index(numel: int, per_rank: int, padded: int) -> int:
    """Where in the wire data the weight's last element ends (elements after it are padding)."""
    rank, within = divmod(numel, per_rank)
    return rank * padded + within


def test_kernels_do_not_grow_with_the_world_size(monkeypatch):
    """The walk yields one span per group of ranks that fits a chunk, not one per rank."""
    codec = BlockQuantized(torch.int8, 128)
    shape = torch.Size((1, 16))
    counts = {}
    for world in (8, 1024):
        data, scales = _wire(codec, world, shape, seed=0)
        counts[world] = len(list(codec._spans(torch.zeros(world * 16), shape, data, scales)))
    assert counts == {8: 1, 1024: 2}, counts
    assert quantized_gather._CHUNK_ELEMENTS == 1 << 16  # 512 ranks of 128-element blocks per span
