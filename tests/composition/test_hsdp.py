"""HSDP: shard within the last mesh dim, all-reduce gradients across the first."""

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh

from fsdp_compose import FSDPModule
from tests.harness import run_on_ranks
from tests.models import TinyLM, assert_parity, lm_loss, shard_blocks_then_root, train_against_reference


def _mesh():
    return init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))


def _hsdp_parity():
    mesh = _mesh()
    result = train_against_reference(TinyLM, lambda m: shard_blocks_then_root(m, mesh=mesh))
    torch.manual_seed(0)
    model = TinyLM()
    shard_blocks_then_root(model, mesh=mesh)
    weight = model.blocks[0].fc1.weight
    from torch.distributed.tensor import Replicate, Shard

    result["placements_ok"] = tuple(weight.placements) == (Replicate(), Shard(0))
    result["local_rows"] = weight.to_local().shape[0]
    return result


def test_hsdp_2x2_parity():
    results = run_on_ranks(4, _hsdp_parity)
    assert_parity(results)
    assert all(r["placements_ok"] for r in results)
    # 29 rows over the 2 ranks of each shard group (mesh rows are replicas: ranks 0,1 and 2,3)
    assert [r["local_rows"] for r in results] == [15, 14, 15, 14]


def accumulate_without_all_reduce(model, batch, rank, world_size):
    """Two micro-batches: the first skips the all-reduce across replicas."""
    total = 0.0
    micro = batch.chunk(2)
    for i, mb in enumerate(micro):
        if isinstance(model, FSDPModule):
            model.set_requires_all_reduce(i == len(micro) - 1)
        loss = lm_loss(model, mb) / len(micro)
        loss.backward()
        total = total + loss.detach()
    return total


def _hsdp_accumulation():
    mesh = _mesh()
    return train_against_reference(
        TinyLM, lambda m: shard_blocks_then_root(m, mesh=mesh), step_fn=accumulate_without_all_reduce
    )


@pytest.mark.slow  # 4 ranks
def test_hsdp_accumulation_with_all_reduce_off():
    assert_parity(run_on_ranks(4, _hsdp_accumulation))
