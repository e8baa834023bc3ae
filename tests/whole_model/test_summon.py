"""summon_full_params: full parameters on the modules, edits written back to the shards."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from fsdp_compose import summon_full_params
from tests.harness import run_on_ranks
from tests.models import (
    TinyLM,
    global_batch,
    lm_loss,
    local_slice,
    max_grad_diff,
    max_param_diff,
    shard_blocks_then_root,
)


def _summon() -> dict:
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    reference = TinyLM()
    model = copy.deepcopy(reference)
    shard_blocks_then_root(model)
    batch = global_batch(0, world)
    lm_loss(model, local_slice(batch, rank, world)).backward()
    lm_loss(reference, batch).backward()
    out = {}

    # full values and gradients on the modules; names unchanged
    with summon_full_params(model, writeback=False, with_grads=True):
        params = dict(model.named_parameters())
        assert not any(isinstance(p, DTensor) for p in params.values())
        out["values"] = max_param_diff(model, reference)
        out["grads"] = max_grad_diff(model, reference)
        with torch.no_grad():
            model.head.weight.add_(1.0)  # discarded: writeback=False
    assert all(isinstance(p, DTensor) for p in model.parameters())
    out["discarded"] = max_param_diff(model, reference)
    out["grads_kept"] = max_grad_diff(model, reference)

    # writeback: edits (including through a tied/any module) persist in the shards
    with summon_full_params(model):
        with torch.no_grad():
            model.blocks[1].fc1.weight.mul_(0.5)
            model.embed.weight[3].fill_(2.0)
    with torch.no_grad():
        reference.blocks[1].fc1.weight.mul_(0.5)
        reference.embed.weight[3].fill_(2.0)
    out["written_back"] = max_param_diff(model, reference)

    # with_grads + writeback: gradient edits persist too (e.g. custom gradient surgery)
    with summon_full_params(model, with_grads=True):
        model.norm.weight.grad.mul_(3.0)
    reference.norm.weight.grad.mul_(3.0)
    out["grad_written_back"] = max_grad_diff(model, reference)

    # rank0_only: rank 0 sees full tensors, the others keep their shards
    with summon_full_params(model, writeback=False, rank0_only=True, offload_to_cpu=True):
        full = not isinstance(model.head.weight, DTensor)
        assert full == (rank == 0)
        if full:
            out["rank0_values"] = (model.head.weight - reference.head.weight).abs().max().item()
    with pytest.raises(ValueError, match="rank0_only"):
        with summon_full_params(model, rank0_only=True):
            pass

    # training after summon continues in lockstep with the reference
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-2)
    opt.step()
    ref_opt.step()
    opt.zero_grad()
    ref_opt.zero_grad()
    batch = global_batch(1, world)
    lm_loss(model, local_slice(batch, rank, world)).backward()
    lm_loss(reference, batch).backward()
    out["next_step_grads"] = max_grad_diff(model, reference)
    with summon_full_params(model.blocks[0]):  # on a subtree only
        assert not isinstance(model.blocks[0].fc1.weight, DTensor)
        assert isinstance(model.head.weight, DTensor)
    return out


def test_summon_full_params():
    for out in run_on_ranks(3, _summon):
        assert all(v <= 1e-6 for v in out.values()), out
