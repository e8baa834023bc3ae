"""clip_grad_norm_, state dicts and summon_full_params on every layout the core supports: HSDP, CPU offload, TP, tied groups."""

import copy
import math
import warnings

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

from fsdp_compose import (
    CPUOffloadPolicy,
    clip_grad_norm_,
    full_state_dict,
    fully_shard,
    load_full_state_dict,
    summon_full_params,
)
from tests.composition.test_tensor_parallel import TPLM
from tests.harness import run_on_ranks
from tests.models import TinyLM, global_batch, lm_loss, local_slice, max_abs_diff, shard_blocks_then_root


def _layout(kind):
    warnings.simplefilter("ignore")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    reference = TPLM() if kind == "tp" else TinyLM()
    model = copy.deepcopy(reference)
    data_rank, data_world = rank, world
    if kind == "tp":
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        for block in model.blocks:
            parallelize_module(block, mesh["tp"], {"fc1": ColwiseParallel(), "fc2": RowwiseParallel()})
            fully_shard(block, mesh=mesh["dp"])
        fully_shard(model, mesh=mesh["dp"])
        data_rank, data_world = mesh["dp"].get_local_rank(), 2
    elif kind == "hsdp":
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
        shard_blocks_then_root(model, mesh=mesh)
    elif kind == "offload":
        shard_blocks_then_root(model, offload_policy=CPUOffloadPolicy())
    elif kind == "tied":
        model.head.weight = model.embed.weight = torch.nn.Parameter(model.embed.weight.detach().clone()[:, :])
        reference.head.weight = reference.embed.weight = torch.nn.Parameter(model.embed.weight.detach().clone())
        for block in model.blocks:
            fully_shard(block)
        fully_shard([model.embed, model.head])
        fully_shard(model)
    batch = global_batch(0, data_world)
    lm_loss(model, local_slice(batch, data_rank, data_world)).backward()
    lm_loss(reference, batch).backward()
    out = {}
    for norm_type in (2.0, math.inf):
        ours = clip_grad_norm_(model, max_norm=1e9, norm_type=norm_type).item()
        theirs = torch.nn.utils.clip_grad_norm_(reference.parameters(), max_norm=1e9, norm_type=norm_type).item()
        out[f"norm_{norm_type}"] = abs(ours - theirs) / theirs
    # state dicts: sharded round trip, and the full one equals the unsharded model's
    sharded = {k: v.full_tensor() for k, v in model.state_dict().items()}
    expected = reference.state_dict()
    out["sharded_keys_equal"] = list(sharded) == list(expected)
    out["sharded_values"] = max(max_abs_diff(sharded[k], expected[k]) for k in expected)
    full = full_state_dict(model, rank0_only=False)
    out["full_values"] = max(max_abs_diff(full[k], expected[k]) for k in expected)
    on_rank0 = full_state_dict(model)  # the default, rank0_only=True: TP must not hang the others
    out["rank0_only"] = (
        max(max_abs_diff(on_rank0[k], expected[k]) for k in expected) == 0.0 if rank == 0 else not on_rank0
    )
    with torch.no_grad():
        for p in model.parameters():
            p.to_local().zero_()
    load_full_state_dict(model, full if rank == 0 else None)
    out["reloaded"] = max(max_abs_diff(model.state_dict()[k].full_tensor(), expected[k]) for k in expected)
    # summon: the module's own view (a TP DTensor under TP), gathered like full_state_dict; edits written back
    with summon_full_params(model):
        inside = dict(model.named_parameters())
        out["summoned_types"] = {type(p.data).__name__ for p in inside.values()}
        whole = {k: p.full_tensor() if isinstance(p, DTensor) else p for k, p in inside.items()}
        out["summoned"] = max(max_abs_diff(whole[k], expected[k]) for k in inside)
        with torch.no_grad():
            for p in inside.values():
                p.mul_(0.5)
    after = {k: v.full_tensor() for k, v in model.state_dict().items()}
    out["written_back"] = max(max_abs_diff(after[k], expected[k] * 0.5) for k in expected)
    return out


@pytest.mark.parametrize("kind", [pytest.param("hsdp", marks=pytest.mark.slow), pytest.param("tp", marks=pytest.mark.slow), "offload", "tied"])
def test_clip_and_state_dicts_on_layout(kind):
    for r in run_on_ranks(4 if kind in ("hsdp", "tp") else 2, _layout, kind):
        assert r["norm_2.0"] <= 1e-6 and r["norm_inf"] <= 1e-6, r
        assert r["sharded_keys_equal"] and r["rank0_only"], r
        assert r["sharded_values"] == 0.0 and r["full_values"] == 0.0 and r["reloaded"] == 0.0, r
        assert r["summoned_types"] == ({"DTensor", "Tensor"} if kind == "tp" else {"Tensor"}), r
        assert r["summoned"] == 0.0 and r["written_back"] == 0.0, r
