"""Behaviour every user hits, each trained against an unsharded reference."""

import pytest
import torch

from fsdp_compose import FSDPModule
from tests.harness import run_on_ranks
from tests.models import (
    BranchyLM,
    SharedBlockLM,
    TinyLM,
    assert_parity,
    freeze,
    lm_loss,
    shard_blocks_then_root,
    train_against_reference,
)


def accumulate_step(sync_each: bool):
    """Two micro-batches per step; with ``sync_each=False`` only the last one reduces."""

    def step(model, batch, rank, world_size):
        total = 0.0
        micro = batch.chunk(2)
        for i, mb in enumerate(micro):
            if isinstance(model, FSDPModule) and not sync_each:
                model.set_requires_gradient_sync(i == len(micro) - 1)
            loss = lm_loss(model, mb) / len(micro)
            loss.backward()
            total = total + loss.detach()
        return total

    return step


def _accumulation(sync_each):
    return train_against_reference(TinyLM, shard_blocks_then_root, step_fn=accumulate_step(sync_each))


def _frozen():
    frozen = {"blocks.0.fc1.weight", "blocks.0.norm.weight", "blocks.1.fc2.bias", "embed.weight"}
    return train_against_reference(lambda: freeze(TinyLM(), frozen), shard_blocks_then_root)


def _frozen_block_adapter():
    """LoRA-like: a block whose own weights are all frozen (its inputs still need grad)."""
    names = {f"blocks.1.{n}" for n in ("norm.weight", "norm.bias", "fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias")}
    return train_against_reference(lambda: freeze(TinyLM(), names), shard_blocks_then_root)


def _unused_branch():
    return train_against_reference(BranchyLM, shard_blocks_then_root)


def _shared_block(reshard_after_forward):
    return train_against_reference(
        SharedBlockLM, lambda m: shard_blocks_then_root(m, reshard_after_forward=reshard_after_forward)
    )


@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("sync_each", [True, False])
def test_gradient_accumulation(world_size, sync_each):
    assert_parity(run_on_ranks(world_size, _accumulation, sync_each))


@pytest.mark.parametrize("world_size", [2, 3])
def test_frozen_and_trainable_in_one_group(world_size):
    results = run_on_ranks(world_size, _frozen)
    assert_parity(results)


@pytest.mark.parametrize("world_size", [2, pytest.param(4, marks=pytest.mark.slow)])
def test_fully_frozen_block(world_size):
    assert_parity(run_on_ranks(world_size, _frozen_block_adapter))


@pytest.mark.parametrize("world_size", [2, 3])
def test_unused_branch(world_size):
    assert_parity(run_on_ranks(world_size, _unused_branch))


@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("reshard_after_forward", [True, False])
def test_module_called_twice_per_step(world_size, reshard_after_forward):
    assert_parity(run_on_ranks(world_size, _shared_block, reshard_after_forward))


def _eval_and_storage():
    """Storage really is freed: measured on the unsharded parameters' storages."""
    import torch.distributed as dist

    from fsdp_compose._runtime.state import state_of

    torch.manual_seed(0)
    reference = TinyLM()
    model = TinyLM()
    model.load_state_dict(reference.state_dict())
    shard_blocks_then_root(model)
    root, blocks = state_of(model), [state_of(b) for b in model.blocks]
    ids = torch.randint(0, 37, (2, 6))
    report = {}
    # a no_grad forward reshards everything, the root included, and matches the reference
    with torch.no_grad():
        out = model(ids)
        report["eval_diff"] = (out - reference(ids)).abs().max().item()
    report["after_no_grad"] = [s.group.unsharded_nbytes() for s in [root, *blocks]]
    model.eval()
    loss = lm_loss(model, ids)
    report["after_train_forward"] = [s.group.unsharded_nbytes() for s in [root, *blocks]]
    loss.backward()
    report["after_backward"] = [s.group.unsharded_nbytes() for s in [root, *blocks]]
    report["local_rows"] = [p.to_local().shape[0] for p in model.blocks[0].parameters()]
    report["rank"] = dist.get_rank()
    return report


def test_eval_forward_and_freed_storage():
    reports = run_on_ranks(3, _eval_and_storage)
    for r in reports:
        assert r["eval_diff"] <= 1e-5
        assert r["after_no_grad"] == [0, 0, 0, 0]
        root_bytes, *block_bytes = r["after_train_forward"]
        assert root_bytes > 0 and block_bytes == [0, 0, 0]  # root keeps params for backward
        assert r["after_backward"] == [0, 0, 0, 0]
    # norm(13), norm(13), fc1(29), fc1 bias(29), fc2(13), fc2 bias(13) on 3 ranks: chunk sizes 5,5,3 / 10,10,9
    assert [r["local_rows"] for r in reports] == [[5, 5, 10, 10, 5, 5], [5, 5, 10, 10, 5, 5], [3, 3, 9, 9, 3, 3]]
