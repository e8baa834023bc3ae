"""Parameters on meshes of their own (``ShardPlacementResult``): experts on a 2x2 mesh, dense weights on 4.

One ``fully_shard`` call then makes one group per mesh, each with its own all-gather and reduce-scatter;
the model trains at parity with the unsharded one, and prefetch, mixed precision, state dicts, DCP
resharding, ``clip_grad_norm_`` and ``explain()`` see every group.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard

from fsdp_compose import ShardPlacementResult, fully_shard
from tests.harness import run_on_ranks
from tests.models import DIM, HIDDEN, Block, TinyLM, assert_parity, train_against_reference
from tests.runtime.test_collectives import count_collectives

EXPERTS = 3


class MoEBlock(Block):
    """A block with a soft mixture of experts: a 3-D expert weight, every expert weighted by a router."""

    def __init__(self) -> None:
        super().__init__()
        self.router = nn.Linear(DIM, EXPERTS)
        self.experts = nn.Parameter(torch.randn(EXPERTS, DIM, HIDDEN) * 0.2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(x)
        gates = self.router(h).softmax(-1)
        mixed = torch.einsum("bse,edk,bsd->bsk", gates, self.experts, h)
        return x + self.fc2(F.gelu(self.fc1(h) + mixed))


class MoELM(TinyLM):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(MoEBlock() for _ in range(3))


def _meshes():
    dense = init_device_mesh("cpu", (4,), mesh_dim_names=("dp",))
    experts = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    return dense, experts


def _experts_apart(expert_mesh, dim: int = 0, torch_info: bool = False):
    if torch_info:  # torch's own objects (torch 2.13+): an HSDPMeshInfo, read by its fields
        from torch.distributed.fsdp._fully_shard._fsdp_common import HSDPMeshInfo
        from torch.distributed.fsdp._fully_shard._fsdp_common import ShardPlacementResult as Result

        expert_mesh = HSDPMeshInfo(mesh=expert_mesh, shard_mesh_dim=1, replicate_mesh_dim=0)
    else:
        Result = ShardPlacementResult

    def placement(param: nn.Parameter):
        if param.dim() == 3:
            return Result(Shard(dim), expert_mesh)
        return None

    return placement


def _shard(model: MoELM, dense, experts, dim: int = 0, torch_info: bool = False, **kwargs) -> None:
    for block in model.blocks:
        fully_shard(block, mesh=dense, shard_placement_fn=_experts_apart(experts, dim, torch_info), **kwargs)
    fully_shard(model, mesh=dense, **kwargs)


def _train(dim: int, prefetch: bool, torch_info: bool) -> dict:
    dense, experts = _meshes()

    def shard(model: MoELM) -> None:
        _shard(model, dense, experts, dim, torch_info)
        blocks = model.blocks
        if prefetch:
            for a, b in zip(blocks, blocks[1:]):
                a.set_modules_to_forward_prefetch([b])
                b.set_modules_to_backward_prefetch([a])

    result = train_against_reference(MoELM, shard)
    model = MoELM()
    _shard(model, dense, experts, dim)
    expert = model.blocks[0].experts
    result["expert_mesh"] = expert.device_mesh.mesh_dim_names, [repr(p) for p in expert.placements]
    result["dense_mesh"] = model.blocks[0].fc1.weight.device_mesh.mesh_dim_names
    with count_collectives() as counts:
        model(torch.randint(0, 37, (2, 5))).sum().backward()
    result["counts"] = dict(counts)
    return result


def _torch_has_placement_result() -> bool:
    from torch.distributed.fsdp._fully_shard import _fsdp_common

    return hasattr(_fsdp_common, "ShardPlacementResult")


NEEDS_TORCH_RESULT = pytest.mark.skipif(
    not _torch_has_placement_result(), reason="torch's ShardPlacementResult arrived in torch 2.13"
)


@pytest.mark.parametrize(
    "dim,prefetch,torch_info",
    [
        (0, False, False),
        pytest.param(1, True, False, marks=pytest.mark.slow),
        pytest.param(0, False, True, marks=[NEEDS_TORCH_RESULT, pytest.mark.slow]),
    ],
)
def test_experts_on_a_2x2_mesh_train_at_parity(dim, prefetch, torch_info):
    results = run_on_ranks(4, _train, dim, prefetch, torch_info)
    assert_parity(results)
    for r in results:
        assert r["dense_mesh"] == ("dp",)
        assert r["expert_mesh"] == (("replicate", "shard"), ["Replicate()", f"Shard(dim={dim})"])
        # per block: one all-gather in forward and one in backward per group, one reduce-scatter per
        # group, one all-reduce across replicas for the experts' group; the root: one of each
        assert r["counts"].get("all_gather_single", 0) == 3 * 2 * 2 + 1, r["counts"]
        assert r["counts"].get("reduce_scatter_single", 0) == 3 * 2 + 1, r["counts"]
        assert r["counts"].get("all_reduce", 0) == 3, r["counts"]


def _mixed_precision() -> dict:
    from fsdp_compose import MixedPrecisionPolicy

    dense, experts = _meshes()
    policy = MixedPrecisionPolicy(param_dtype=torch.float64, reduce_dtype=torch.float64)
    seen = {}

    def shard(model: MoELM) -> None:
        _shard(model, dense, experts, mp_policy=policy)
        block = model.blocks[0]
        block.register_forward_pre_hook(lambda m, args: seen.update(experts=m.experts.dtype, fc1=m.fc1.weight.dtype))

    result = train_against_reference(MoELM, shard)
    result["seen"] = seen
    return result


@pytest.mark.slow  # 4 ranks
def test_mixed_precision_applies_to_every_mesh_group():
    results = run_on_ranks(4, _mixed_precision)
    assert_parity(results)
    for r in results:
        assert r["seen"] == {"experts": torch.float64, "fc1": torch.float64}


def _state_and_tools(tmp: str) -> dict:
    import torch.distributed.checkpoint as dcp

    from fsdp_compose import clip_grad_norm_, explain, full_state_dict

    dense, experts = _meshes()
    torch.manual_seed(0)
    reference = MoELM()
    model = copy.deepcopy(reference)
    _shard(model, dense, experts)
    rank, world = dist.get_rank(), dist.get_world_size()
    ids = torch.randint(0, 37, (world * 2, 6), generator=torch.Generator().manual_seed(5))
    model(ids[rank * 2 : rank * 2 + 2]).sum().backward()
    reference(ids).sum().div(world).backward()
    ours = clip_grad_norm_(model.parameters(), max_norm=0.5)
    theirs = torch.nn.utils.clip_grad_norm_(reference.parameters(), max_norm=0.5)
    # torch.nn.utils.clip_grad_norm_ cannot stack norms of DTensors on different meshes (torch's FSDP2 alike)
    after = clip_grad_norm_(model.parameters(), max_norm=1e9)
    out = {"norm_diff": abs(float(ours) - float(theirs)) / float(theirs), "after_clip_diff": abs(float(after) - 0.5)}
    out["clipped_grad_diff"] = max(
        (p.grad.full_tensor() - r.grad).abs().max().item()
        for p, r in zip(model.parameters(), reference.parameters())
    )
    out["table"] = str(explain(model))

    # full state dict equals the reference; DCP saves per mesh and loads into another layout
    full = full_state_dict(model)
    out["full_diff"] = max((full[k] - v).abs().max().item() for k, v in reference.state_dict().items()) if rank == 0 else 0.0
    dcp.save(model.state_dict(), checkpoint_id=tmp)
    torch.manual_seed(1)
    other = MoELM()
    for block in other.blocks:  # every parameter on the dense mesh: another layout of the same weights
        fully_shard(block, mesh=dense)
    fully_shard(other, mesh=dense)
    loaded = other.state_dict()
    dcp.load(loaded, checkpoint_id=tmp)
    other.load_state_dict(loaded)
    back = MoELM()
    _shard(back, dense, experts)
    state = back.state_dict()
    dcp.load(state, checkpoint_id=tmp)
    back.load_state_dict(state)
    out["reload_diff"] = max(
        (a.full_tensor() - r).abs().max().item()
        for m in (other, back)
        for a, r in zip(m.parameters(), reference.parameters())
    )
    return out


@pytest.mark.slow  # 4 ranks
def test_clip_state_dicts_dcp_and_explain_across_meshes(tmp_path):
    results = run_on_ranks(4, _state_and_tools, str(tmp_path / "ckpt"))
    for r in results:
        assert max(r["norm_diff"], r["after_clip_diff"], r["clipped_grad_diff"]) <= 1e-5, r
        assert max(r["full_diff"], r["reload_diff"]) <= 1e-6, r
    table = results[0]["table"]
    assert "blocks.0 on mesh (dp=4)" in table and "blocks.0 on mesh (replicate=2, shard=2)" in table, table


def _expert_parallel(torch_fsdp: bool) -> dict:
    """torchtitan's MoE layout: experts split over the ep dim (expert parallelism), their weights sharded
    over the other dim of that (efsdp, ep) mesh, dense weights over all 4 ranks; torch's mesh-info objects."""
    from torch.distributed.fsdp._fully_shard._fsdp_common import FSDPMeshInfo
    from torch.distributed.fsdp._fully_shard._fsdp_common import ShardPlacementResult as TorchResult
    from torch.testing._internal.distributed._tensor.common_dtensor import ModelArgs, Transformer

    if torch_fsdp:
        from torch.distributed.fsdp import fully_shard as shard_fn
    else:
        shard_fn = fully_shard
    dense = init_device_mesh("cpu", (4,), mesh_dim_names=("dp",))
    sparse = init_device_mesh("cpu", (2, 2), mesh_dim_names=("efsdp", "ep"))
    dense_info, expert_info = FSDPMeshInfo(mesh=dense, shard_mesh_dim=0), FSDPMeshInfo(mesh=sparse["efsdp"], shard_mesh_dim=0)
    args = ModelArgs(n_layers=2, vocab_size=37, max_seq_len=8, dim=16, n_heads=4, dropout_p=0.0,
                     weight_tying=False, num_experts=4)
    torch.manual_seed(0)
    reference = Transformer(args)
    model = copy.deepcopy(reference)
    Transformer.parallelize(model, tp_mesh=None, use_seq_parallel=False, ep_mesh=sparse["ep"])
    for block in model.layers:
        experts = set(block.expert_layer.experts.parameters())

        def placement(param, experts=experts):
            return TorchResult(Shard(0), expert_info if param in experts else dense_info)

        shard_fn(block, mesh=dense, shard_placement_fn=placement)
        block.set_gradient_divide_factor(4)  # an expert's gradient sums its ep group's tokens
    shard_fn(model, mesh=dense)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-2)
    rank = dist.get_rank()
    losses, diffs = [], []
    for step in range(3):
        ids = torch.randint(0, 37, (8, 8), generator=torch.Generator().manual_seed(step))
        ref_loss = reference(ids).float().pow(2).mean()
        ref_loss.backward()
        loss = model(ids[rank * 2 : rank * 2 + 2]).float().pow(2).mean()
        loss.backward()
        losses.append((sum(_all(loss.detach())) / 4, ref_loss.item()))
        opt.step(), ref_opt.step(), opt.zero_grad(), ref_opt.zero_grad()
    for name, p in model.named_parameters():
        diffs.append((p.full_tensor() - dict(reference.named_parameters())[name]).abs().max().item())
    expert = model.layers[0].expert_layer.experts.w1
    return {"losses": losses, "param_diff": max(diffs), "mesh": expert.device_mesh.mesh_dim_names,
            "placements": [repr(p) for p in expert.placements]}


def _all(value: torch.Tensor) -> list[float]:
    out = [torch.zeros_like(value) for _ in range(dist.get_world_size())]
    dist.all_gather(out, value)
    return [v.item() for v in out]


@NEEDS_TORCH_RESULT
def test_expert_parallel_experts_on_their_own_mesh_with_torchs_mesh_info():
    results = run_on_ranks(4, _expert_parallel, False)
    for r in results:
        assert all(abs(a - b) <= 1e-5 for a, b in r["losses"]), r["losses"]
        assert r["param_diff"] <= 1e-5, r
        assert r["mesh"] == ("efsdp", "ep"), r


def _options(options: str) -> dict:
    from fsdp_compose import CPUOffloadPolicy
    from tests.models import lm_loss

    dense, experts = _meshes()
    kwargs = {"reshard_2": {"reshard_after_forward": 2}, "offload": {"offload_policy": CPUOffloadPolicy()},
              "no_reshard": {"reshard_after_forward": False}, "no_sync": {}}[options]

    def accumulate(model, batch, rank, world_size):
        """Two micro-batches, the first without gradient sync (every group of a call follows the setter)."""
        if world_size == 1:  # the reference: the global batch at once
            loss = lm_loss(model, batch)
            loss.backward()
            return loss
        model.set_requires_gradient_sync(False)
        first = lm_loss(model, batch[:1]) / 2
        with count_collectives() as counts:
            first.backward()
        reduced.append(counts.get("reduce_scatter_single", 0) + counts.get("all_reduce", 0))
        model.set_requires_gradient_sync(True)
        second = lm_loss(model, batch[1:]) / 2
        second.backward()
        return first.detach() + second.detach()

    reduced: list[int] = []
    step = accumulate if options == "no_sync" else None
    result = train_against_reference(MoELM, lambda model: _shard(model, dense, experts, **kwargs), step_fn=step)
    result["reduced_without_sync"] = reduced
    return result


@pytest.mark.slow  # 4 ranks
@pytest.mark.parametrize("options", ["reshard_2", "offload", "no_reshard", "no_sync"])
def test_options_and_accumulation_apply_to_every_mesh_group(options):
    results = run_on_ranks(4, _options, options)
    assert_parity(results)
    for r in results:  # no reduction at all in a no-sync backward, the experts' groups included
        assert r["reduced_without_sync"] == ([0] * 4 if options == "no_sync" else []), r["reduced_without_sync"]
