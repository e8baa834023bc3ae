"""The owner's step done in row blocks, async, with kept buffers: the same bits as torch.optim.Muon on whole tensors.

Fed identical gradients (no reduce-scatter in between), the sharded owner-computed step must equal unsharded
``torch.optim.Muon`` exactly: momentum and the Nesterov look-ahead are elementwise (so block by block equals
whole), and the owner runs Newton-Schulz on the same whole matrix with the same kernels.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn

from fsdp_compose._runtime.rows import row_layout
from fsdp_compose.optim import OwnerComputedMuon
from fsdp_compose.optim.exchange import Matrix
from fsdp_compose.optim.muon import muon_momentum, muon_momentum_rows
from tests.harness import run_on_ranks

# odd shapes: uneven row splits at 2 and 3 ranks, tall and wide, and 2 rows (the third rank holds none)
SHAPES = [(13, 29), (37, 13), (2, 37), (48, 64), (130, 7)]
OPTIONS = [{}, {"nesterov": False}, {"momentum": 0.0, "adjust_lr_fn": "match_rms_adamw"}]


def _grad(shape: tuple[int, ...], step: int, index: int) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(100 * step + index))


def _sharded_against_torch(options: dict, keep_buffers: bool, default_device: str = "cpu") -> dict:
    """``default_device``: the default device while our step runs (the shards stay on CPU)."""
    from torch.distributed.tensor import distribute_tensor

    from fsdp_compose import fully_shard

    torch.manual_seed(0)
    holder = nn.Module()
    holder.weights = nn.ParameterList([nn.Parameter(torch.randn(shape)) for shape in SHAPES])
    reference = [p.detach().clone().requires_grad_() for p in holder.weights]
    fully_shard(holder)
    ours = OwnerComputedMuon(list(holder.weights), lr=0.02, keep_buffers=keep_buffers, **options)
    theirs = torch.optim.Muon(reference, lr=0.02, **options)
    kept = []
    for step in range(3):
        for i, (p, q) in enumerate(zip(holder.weights, reference)):
            q.grad = _grad(q.shape, step, i)
            p.grad = distribute_tensor(q.grad, p.device_mesh, p.placements)
        with torch.device(default_device):
            ours.step()
        theirs.step()
        kept.append({key: b.data_ptr() for key, b in ours._buckets[0]._route[1]._buffers.items()})
    momentum = ours.state_dict()["state"]
    return {
        "params": all(torch.equal(p.full_tensor(), q) for p, q in zip(holder.weights, reference)),
        "momentum": options.get("momentum") == 0.0 or all(  # torch keeps the gradient as a buffer even then
            torch.equal(momentum[i]["momentum_buffer"].full_tensor(), theirs.state[q]["momentum_buffer"])
            for i, q in enumerate(reference)
        ),
        "kept": kept,
        "rank": dist.get_rank(),
    }


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("options", OPTIONS, ids=["default", "plain-momentum", "no-momentum-rms"])
def test_same_gradients_give_torch_muons_bits(world: int, options: dict) -> None:
    for r in run_on_ranks(world, _sharded_against_torch, options, True):
        assert r["params"] and r["momentum"], r
        assert len(r["kept"][0]) == 2 and r["kept"][0] == r["kept"][-1]  # two buffers, the same memory each step


def test_buffers_released_after_each_step_on_request() -> None:
    for r in run_on_ranks(2, _sharded_against_torch, {}, False):
        assert r["params"] and r["momentum"], r
        assert r["kept"] == [{}, {}, {}]


def test_step_makes_its_tensors_where_the_shards_are() -> None:
    """On a GPU the default device stays CPU while the shards are on the GPU: every buffer the step makes (the
    collectives' flat buffers, the owner's momentum) must follow the shards. Here the default is meta, so a tensor
    made on the default device fails the step or its answer."""
    for r in run_on_ranks(2, _sharded_against_torch, {}, True, "meta"):
        assert r["params"] and r["momentum"], r


def test_momentum_in_row_blocks_equals_whole() -> None:
    for nesterov in (True, False):
        whole_state, blocks_state = {}, {"momentum_buffer": torch.zeros(37, 13)}
        for step in range(3):
            grad = _grad((37, 13), step, 0)
            expected = muon_momentum(grad, whole_state, 0.95, nesterov)
            buf = blocks_state["momentum_buffer"]
            out = torch.empty(37, 13, dtype=torch.bfloat16) if nesterov else None
            for rows in (slice(0, 19), slice(19, 37)):
                muon_momentum_rows(grad[rows], buf[rows], None if out is None else out[rows], 0.95)
            assert torch.equal(buf, whole_state["momentum_buffer"])
            assert torch.equal(buf if out is None else out, expected if out is None else expected.bfloat16())


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_a_matrix_has_every_ranks_rows_as_fully_shard_cuts_them(shape: tuple[int, int], world: int) -> None:
    m = Matrix.from_shape(torch.Size(shape), 0, world)
    layouts = [row_layout(torch.Size(shape), 0, world, rank) for rank in range(world)]
    assert m.row_counts == tuple(rows.local_rows for rows in layouts)
    assert [m.row_start(r) for r in range(world)] == [rows.row_start for rows in layouts]
    assert [m.numel_on(r) for r in range(world)] == [rows.local_numel for rows in layouts]
