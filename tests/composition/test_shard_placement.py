"""shard_placement_fn: MoE expert weights sharded on dims 1 and 2, sizes that divide no world size."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard

from fsdp_compose import (
    CPUOffloadPolicy,
    MixedPrecisionPolicy,
    clip_grad_norm_,
    full_state_dict,
    fully_shard,
    init_sharded_parameters,
    load_checkpoint,
    load_full_state_dict,
    save_checkpoint,
    summon_full_params,
)
from tests.harness import run_on_ranks
from tests.models import (
    DIM,
    TinyLM,
    assert_parity,
    global_batch,
    lm_loss,
    local_slice,
    max_grad_diff,
    max_param_diff,
    train_against_reference,
    train_data_parallel_steps,
)

EXPERTS, EXPERT_HIDDEN = 3, 7


class MoE(nn.Module):
    """Soft-routed experts: weights (experts, in, out), as expert-parallel code lays them out."""

    def __init__(self) -> None:
        super().__init__()
        self.router = nn.Linear(DIM, EXPERTS)
        self.w_in = nn.Parameter(torch.empty(EXPERTS, DIM, EXPERT_HIDDEN))
        self.w_out = nn.Parameter(torch.empty(EXPERTS, EXPERT_HIDDEN, DIM))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        nn.init.normal_(self.w_in, std=0.2)
        nn.init.normal_(self.w_out, std=0.2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gates = F.softmax(self.router(x), dim=-1)
        hidden = F.gelu(torch.einsum("...d,edh->...eh", x, self.w_in))
        out = torch.einsum("...eh,ehd->...ed", hidden, self.w_out)
        return x + (gates.unsqueeze(-1) * out).sum(-2)


class MoELM(TinyLM):
    def __init__(self) -> None:
        super().__init__(n_blocks=2)
        self.blocks = nn.ModuleList(MoE() for _ in range(2))


def expert_dims(param: nn.Parameter) -> Shard | None:
    """w_in on its input dim (13), w_out on its last (13, as -1), the router on dim 1 (13)."""
    if param.dim() == 3:
        return Shard(1) if param.shape[1] == DIM else Shard(-1)
    if param.shape == (EXPERTS, DIM):
        return Shard(1)
    return None


def shard_moe(model: MoELM, placement_fn=expert_dims, **kwargs) -> None:
    for block in model.blocks:
        fully_shard(block, shard_placement_fn=placement_fn, **kwargs)
    fully_shard(model, shard_placement_fn=placement_fn, **kwargs)


def _full_params(model: nn.Module) -> dict:
    return {n: p.detach().full_tensor() for n, p in model.named_parameters()}


def _sharded_diff(a: nn.Module, b: nn.Module) -> float:
    """Largest difference between two sharded models' full parameters."""
    full_a, full_b = _full_params(a), _full_params(b)
    return max((full_a[k].float() - full_b[k].float()).abs().max().item() for k in full_a)


def _layout(model: MoELM) -> dict:
    """What the user sees: placements, torch.chunk-sized local shards, contiguous full weights in forward."""
    block = model.blocks[0]
    seen = {}

    def record(module, args):
        seen.update({name: (tuple(p.shape), p.is_contiguous()) for name, p in module.named_parameters()})

    handle = block.register_forward_pre_hook(record)
    with torch.no_grad():
        model(torch.zeros(1, 3, dtype=torch.long))
    handle.remove()
    rank, world = dist.get_rank(), dist.get_world_size()
    full = torch.empty(EXPERTS, DIM, EXPERT_HIDDEN)
    return {
        "placements": {n: str(p.placements[0]) for n, p in block.named_parameters()},
        "w_in_local": tuple(block.w_in.to_local().shape),
        "w_in_chunk": tuple(torch.chunk(full, world, dim=1)[rank].shape) if rank < len(torch.chunk(full, world, 1)) else None,
        "in_forward": seen,
    }


def _parity(config: str) -> dict:
    if config == "hsdp":
        kwargs = {"mesh": init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))}
    else:
        kwargs = {
            "plain": {},
            "offload": {"offload_policy": CPUOffloadPolicy(pin_memory=False)},
            "reshard_to_2": {"reshard_after_forward": 2},
        }[config]
    result = train_against_reference(MoELM, lambda m: shard_moe(m, **kwargs))
    torch.manual_seed(0)
    model = MoELM()
    shard_moe(model, **kwargs)
    result["layout"] = _layout(model)
    return result


def _check_layout(layout: dict, world: int) -> None:
    assert layout["placements"] == {"router.weight": "S(1)", "router.bias": "S(0)", "w_in": "S(1)", "w_out": "S(2)"}
    assert layout["in_forward"] == {
        "router.weight": ((EXPERTS, DIM), True),
        "router.bias": ((EXPERTS,), True),
        "w_in": ((EXPERTS, DIM, EXPERT_HIDDEN), True),
        "w_out": ((EXPERTS, EXPERT_HIDDEN, DIM), True),
    }


# 4 ranks with the slow tests (README.md); the default run has 4-rank Shard(1) parity below (HSDP, reshard to 2)
@pytest.mark.parametrize("world", [2, 3, pytest.param(4, marks=pytest.mark.slow)])
def test_moe_expert_dims_match_unsharded(world):
    results = run_on_ranks(world, _parity, "plain")
    assert_parity(results)
    for r in results:
        _check_layout(r["layout"], world)
    # 13 rows of w_in's dim 1: torch.chunk sizes, e.g. 5, 5, 3 at 3 ranks and 4, 4, 4, 1 at 4
    assert [r["layout"]["w_in_local"][1] for r in results] == {2: [7, 6], 3: [5, 5, 3], 4: [4, 4, 4, 1]}[world]
    assert all(r["layout"]["w_in_local"] == r["layout"]["w_in_chunk"] for r in results)


def test_moe_expert_dims_with_offload_post_forward_slices_and_hsdp():
    assert_parity(run_on_ranks(3, _parity, "offload"))
    assert_parity(run_on_ranks(4, _parity, "reshard_to_2"))
    assert_parity(run_on_ranks(4, _parity, "hsdp"))


def _mixed_precision_like_dim0() -> float:
    """bf16 compute cannot match fp32 to 1e-5, but Shard(1) must train exactly like Shard(0)."""
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    models = []
    for placement_fn in (expert_dims, None):
        torch.manual_seed(0)
        model = MoELM()
        shard_moe(model, placement_fn=placement_fn, mp_policy=mp)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        rank, world = dist.get_rank(), dist.get_world_size()
        for step in range(3):
            lm_loss(model, local_slice(global_batch(step, world), rank, world)).backward()
            opt.step()
            opt.zero_grad()
        models.append(model)
    return _sharded_diff(*models)


def test_moe_expert_dims_mixed_precision_trains_like_dim0():
    assert run_on_ranks(3, _mixed_precision_like_dim0) == [0.0] * 3


# ----- whole-model operations on Shard(1)/Shard(2) parameters ------------------------------------
def _trained_pair():
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    reference = MoELM()
    model = copy.deepcopy(reference)
    shard_moe(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-2)
    train_data_parallel_steps(model, reference, (opt, ref_opt), 2, rank, world)
    return model, opt, reference


def _whole_model(path: str) -> dict:
    rank, world = dist.get_rank(), dist.get_world_size()
    model, opt, reference = _trained_pair()
    out = {}
    sharded = model.state_dict()
    out["state_dict_placements"] = {k: str(v.placements[0]) for k, v in sharded.items() if k.startswith("blocks.0.")}
    out["state_dict_diff"] = max(
        (sharded[k].full_tensor() - v).abs().max().item() for k, v in reference.state_dict().items()
    )
    full = full_state_dict(model, rank0_only=False)
    out["full_state_dict_diff"] = max((full[k] - v).abs().max().item() for k, v in reference.state_dict().items())
    out["full_contiguous"] = all(v.is_contiguous() for v in full.values())
    torch.manual_seed(1)
    fresh = MoELM()
    shard_moe(fresh)
    load_full_state_dict(fresh, full if rank == 0 else None)
    out["load_full_diff"] = max_param_diff(fresh, reference)

    batch = global_batch(5, world)
    lm_loss(model, local_slice(batch, rank, world)).backward()
    lm_loss(reference, batch).backward()
    ours = clip_grad_norm_(model, max_norm=0.05)
    theirs = torch.nn.utils.clip_grad_norm_(reference.parameters(), max_norm=0.05)
    out["clip_norm"] = abs(ours.item() - theirs.item()) / theirs.item()
    out["clipped_grads"] = max_grad_diff(model, reference)

    with summon_full_params(model, with_grads=True):
        w_in = model.blocks[1].w_in
        out["summoned"] = (type(w_in).__name__, (w_in - reference.blocks[1].w_in).abs().max().item())
        out["summoned_grad"] = (w_in.grad - reference.blocks[1].w_in.grad).abs().max().item()
        with torch.no_grad():
            w_in.add_(1.0)
    with torch.no_grad():
        reference.blocks[1].w_in.add_(1.0)
    out["writeback_diff"] = max_param_diff(model, reference)
    opt.zero_grad()
    save_checkpoint(path, model, opt, step=3)
    out["saved"] = _full_params(model)
    return out


def _resume(path: str) -> dict:
    torch.manual_seed(1)
    model = MoELM()
    shard_moe(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    step, _ = load_checkpoint(path, model, opt)
    return {"step": step, "loaded": _full_params(model), "placement": str(model.blocks[0].w_in.placements[0])}


def test_state_dicts_clip_summon_and_checkpoint_reshard_with_shard_dim_1(tmp_path):
    path = str(tmp_path / "ckpt")
    results = run_on_ranks(3, _whole_model, path)
    for r in results:
        assert r["state_dict_placements"] == {
            "blocks.0.router.weight": "S(1)",
            "blocks.0.router.bias": "S(0)",
            "blocks.0.w_in": "S(1)",
            "blocks.0.w_out": "S(2)",
        }
        assert r["state_dict_diff"] <= 1e-5 and r["full_state_dict_diff"] <= 1e-5, r
        assert r["full_contiguous"] and r["load_full_diff"] <= 1e-5, r
        assert r["clip_norm"] <= 1e-6 and r["clipped_grads"] <= 1e-6, r
        assert r["summoned"][0] == "Parameter" and r["summoned"][1] <= 1e-5 and r["summoned_grad"] <= 1e-6, r
        assert r["writeback_diff"] <= 1e-5, r
    saved = results[0]["saved"]
    for world in (2, 4):
        for r in run_on_ranks(world, _resume, path):
            assert r["step"] == 3 and r["placement"] == "S(1)"
            assert max((r["loaded"][k] - v).abs().max().item() for k, v in saved.items()) == 0.0


def _meta_init() -> float:
    """Deferred init fills Shard(1) shards with the values a Shard(0) model gets from the same seed."""
    models = []
    for placement_fn in (expert_dims, None):
        with torch.device("meta"):
            model = MoELM()
        shard_moe(model, placement_fn=placement_fn)
        model.to_empty(device="cpu")
        torch.manual_seed(0)
        init_sharded_parameters(model)
        models.append(model)
    return _sharded_diff(*models)


def test_meta_init_with_shard_dim_1():
    assert run_on_ranks(3, _meta_init) == [0.0] * 3
