"""dp_mesh_dims: parameters already DTensors on a full SPMD mesh, sharded over the named dims."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_module, distribute_tensor

from fsdp_compose import (
    DataParallelMeshDims,
    clip_grad_norm_,
    full_state_dict,
    fully_shard,
    load_checkpoint,
    save_checkpoint,
)
from tests.harness import run_on_ranks
from tests.models import (
    TinyLM,
    global_batch,
    lm_loss,
    local_slice,
    max_grad_diff,
    max_param_diff,
    train_data_parallel_steps,
)

# tensor-parallel layout of each block's MLP on the "tp" dim; everything else is replicated
TP_PLAN = {"fc1.weight": Shard(0), "fc1.bias": Shard(0), "fc2.weight": Shard(1)}


def _to_dtensor(module, inputs, mesh):
    return tuple(
        DTensor.from_local(x, mesh, [Replicate()] * mesh.ndim, run_check=False) if isinstance(x, torch.Tensor) else x
        for x in inputs
    )


def _to_local(module, output, mesh):
    return output.full_tensor()


def spmd_parallelize(model: nn.Module, mesh) -> None:
    """Every parameter a DTensor on the full mesh: TP_PLAN on "tp", Replicate() elsewhere.

    Leaf modules take plain inputs as replicated DTensors and return plain tensors, so
    DTensor computes each layer (gathering the TP-sharded outputs) and the rest stays plain.
    """
    names = mesh.mesh_dim_names
    for module_name, module in model.named_modules():
        if list(module.children()) or not list(module.parameters(recurse=False)):
            continue
        short = module_name.split(".")[-1]

        def partition(_name, mod, device_mesh, short=short):
            for pname, param in list(mod.named_parameters(recurse=False)):
                tp = TP_PLAN.get(f"{short}.{pname}", Replicate())
                placements = [tp if n == "tp" else Replicate() for n in names]
                mod.register_parameter(pname, nn.Parameter(distribute_tensor(param.detach(), device_mesh, placements)))

        distribute_module(module, mesh, partition, input_fn=_to_dtensor, output_fn=_to_local)


CASES = {
    # name: (mesh shape, dim names, DataParallelMeshDims, data-parallel dims)
    "fsdp_tp": ((2, 2), ("dp_shard", "tp"), DataParallelMeshDims(shard="dp_shard")),
    "fsdp_tp_dim1": ((2, 2), ("dp_shard", "tp"), DataParallelMeshDims(shard="dp_shard")),
    "hsdp": ((2, 2, 1), ("dp_replicate", "dp_shard", "tp"), DataParallelMeshDims(shard="dp_shard", replicate="dp_replicate")),
    "flattened": ((2, 2, 1), ("dp_replicate", "dp_shard", "tp"), DataParallelMeshDims(shard=("dp_replicate", "dp_shard"))),
}


def _parity(case: str, path: str | None = None) -> dict:
    warnings.simplefilter("ignore")
    shape, names, dims = CASES[case]
    mesh = init_device_mesh("cpu", shape, mesh_dim_names=names)
    dp_names = [n for n in names if n != "tp"]
    dp_size = mesh[tuple(dp_names)].size() if len(dp_names) > 1 else mesh[dp_names[0]].size()
    coords = {n: mesh.get_local_rank(n) for n in names}
    dp_rank = 0
    for n in dp_names:
        dp_rank = dp_rank * mesh.size(names.index(n)) + coords[n]
    # "fsdp_tp_dim1": FSDP splits dim 1 of every matrix, under TP's dim-0 or dim-1 split
    placement_fn = (lambda p: Shard(1) if p.dim() == 2 else None) if case == "fsdp_tp_dim1" else None

    def sharded_copy(reference: nn.Module) -> nn.Module:
        model = copy.deepcopy(reference)
        spmd_parallelize(model, mesh)
        for block in model.blocks:
            fully_shard(block, mesh=mesh, dp_mesh_dims=dims, shard_placement_fn=placement_fn)
        fully_shard(model, mesh=mesh, dp_mesh_dims=dims, shard_placement_fn=placement_fn)
        return model

    torch.manual_seed(0)
    reference = TinyLM(n_blocks=2)
    model = sharded_copy(reference)
    fc1, fc2 = model.blocks[0].fc1.weight, model.blocks[0].fc2.weight
    out = {
        "fc1": (fc1.device_mesh.mesh_dim_names, [str(p) for p in fc1.placements]),
        "fc1_local": tuple(fc1.to_local().shape),
        "fc2": [str(p) for p in fc2.placements],
        "fc2_local": tuple(fc2.to_local().shape),
    }
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-2)
    grad_diffs = []
    losses = train_data_parallel_steps(
        model, reference, (opt, ref_opt), 3, dp_rank, dp_size,
        after_backward=lambda: grad_diffs.append(max_grad_diff(model, reference)),
    )
    batch = global_batch(9, dp_size)
    lm_loss(reference, batch).backward()
    lm_loss(model, local_slice(batch, dp_rank, dp_size)).backward()
    ours = clip_grad_norm_(model, max_norm=0.05)
    theirs = torch.nn.utils.clip_grad_norm_(reference.parameters(), max_norm=0.05)
    out["clip"] = (abs(ours.item() - theirs.item()) / theirs.item(), max_grad_diff(model, reference))
    opt.zero_grad()
    ref_opt.zero_grad()
    out["loss_diff"] = max(abs(a - b) for a, b in losses)
    out["grad_diff"] = max(grad_diffs)
    out["param_diff"] = max_param_diff(model, reference)
    full = full_state_dict(model, rank0_only=False)
    out["full_state_dict_diff"] = max((full[k] - v).abs().max().item() for k, v in reference.state_dict().items())
    if path is not None:  # DCP round trip into a model with other values
        save_checkpoint(path, model, opt, step=3)
        torch.manual_seed(1)
        fresh = sharded_copy(TinyLM(n_blocks=2))
        load_checkpoint(path, fresh, torch.optim.AdamW(fresh.parameters(), lr=1e-2))
        saved = dict(model.named_parameters())
        out["checkpoint_diff"] = max(
            (p.detach().full_tensor() - saved[n].detach().full_tensor()).abs().max().item()
            for n, p in fresh.named_parameters()
        )
    return out


def _check(results: list[dict]) -> None:
    for r in results:
        assert r["loss_diff"] <= 1e-5 and r["grad_diff"] <= 1e-5 and r["param_diff"] <= 1e-5, r
        assert r["full_state_dict_diff"] <= 1e-5, r
        assert r["clip"][0] <= 1e-6 and r["clip"][1] <= 1e-6, r


def test_fsdp_over_dp_shard_of_a_dp_tp_mesh():
    results = run_on_ranks(4, _parity, "fsdp_tp")
    _check(results)
    # 29 hidden rows: TP splits 15 / 14, then dp splits each again (_StridedShard: TP chunked first)
    assert results[0]["fc1"] == (("dp_shard", "tp"), ["_S(0, 2)", "S(0)"])
    assert [r["fc1_local"][0] for r in results] == [8, 7, 7, 7]


@pytest.mark.slow  # 4 ranks
def test_hsdp_over_dp_replicate_and_dp_shard():
    results = run_on_ranks(4, _parity, "hsdp")
    _check(results)
    assert results[0]["fc1"] == (("dp_replicate", "dp_shard", "tp"), ["R", "S(0)", "S(0)"])  # tp has size 1 here
    assert [r["fc1_local"][0] for r in results] == [15, 14, 15, 14]


@pytest.mark.slow  # 4 ranks
def test_flattened_shard_dims(tmp_path):
    results = run_on_ranks(4, _parity, "flattened", str(tmp_path / "ckpt"))
    _check(results)
    assert all(r["checkpoint_diff"] == 0.0 for r in results)
    assert results[0]["fc1"] == (("dp_replicate_dp_shard", "tp"), ["S(0)", "S(0)"])
    assert [r["fc1_local"][0] for r in results] == [8, 8, 8, 5]


@pytest.mark.slow  # 4 ranks
def test_shard_dim_1_under_tensor_parallel(tmp_path):
    results = run_on_ranks(4, _parity, "fsdp_tp_dim1", str(tmp_path / "ckpt"))
    _check(results)
    assert all(r["checkpoint_diff"] == 0.0 for r in results)
    # fc1 (29, 13): TP rows, FSDP columns 7 / 6; fc2 (13, 29): TP columns 15 / 14, then FSDP (strided)
    assert results[0]["fc1"] == (("dp_shard", "tp"), ["S(1)", "S(0)"])
    assert [r["fc1_local"] for r in results] == [(15, 7), (14, 7), (15, 6), (14, 6)]
    assert results[0]["fc2"] == ["_S(1, 2)", "S(1)"]
    assert [r["fc2_local"] for r in results] == [(13, 8), (13, 7), (13, 7), (13, 7)]
