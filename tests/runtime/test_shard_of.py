"""``ShardedParam.shard_of``, the one way a full value becomes this rank's shard (fully_shard, replaced
parameters, loading, deferred init, summon's write-back), cuts exactly what the shard's DTensor layout
says it holds: the same bytes as DTensor slicing the full tensor on the shard's mesh, for 1-D, HSDP,
``Shard(1)``, tensor-parallel (given the global value or the TP-local DTensor) and full SPMD meshes."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor

from fsdp_compose._runtime.state import states_in
from tests.harness import run_on_ranks
from tests.models import TinyLM, shard_blocks_then_root


def _dim1(p):
    return Shard(1) if p.dim() == 2 else None


def _shard(model: TinyLM, case: str) -> None:
    if case == "uneven_dim1":
        shard_blocks_then_root(model, shard_placement_fn=_dim1)
    elif case == "hsdp":
        shard_blocks_then_root(model, mesh=init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard")))
    elif case == "tp_dim1":
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        for block in model.blocks:
            parallelize_module(block, mesh["tp"], {"fc1": ColwiseParallel(), "fc2": RowwiseParallel()})
        shard_blocks_then_root(model, mesh=mesh["dp"], shard_placement_fn=_dim1)
    else:
        from tests.composition.test_spmd_mesh import CASES, spmd_parallelize

        shape, names, dims = CASES["fsdp_tp"]
        mesh = init_device_mesh("cpu", shape, mesh_dim_names=names)
        spmd_parallelize(model, mesh)
        shard_blocks_then_root(model, mesh=mesh, dp_mesh_dims=dims)


def _compare(case: str) -> dict:
    warnings.simplefilter("ignore")
    torch.manual_seed(0)
    reference = TinyLM(n_blocks=1)
    model = copy.deepcopy(reference)
    _shard(model, case)
    full = {id(param): reference.get_parameter(name) for name, param in model.named_parameters()}
    out = {"params": 0, "differ": []}
    for _, state in states_in(model):
        for p in state.group.params:
            value = full[id(p.sharded_param)].detach()
            ours = p.shard_of(value)
            by_layout = distribute_tensor(
                value, p.sharded_param.device_mesh, p.sharded_param.placements, src_data_rank=None
            )
            same = torch.equal(ours, by_layout._local_tensor) and torch.equal(ours, p.local_tensor())
            if p.tp_spec is not None:  # the unsharded parameter's form: a DTensor in the TP layout
                tp_local = distribute_tensor(value, p.tp_spec.mesh, p.tp_spec.placements, src_data_rank=None)
                same = same and torch.equal(p.shard_of(tp_local), ours)
            out["params"] += 1
            if not same or ours.shape != p.row_layout.local_shape:
                out["differ"].append(p.fqn)
    return out


@pytest.mark.parametrize(
    ("case", "world_size"),
    [("uneven_dim1", 3), *(pytest.param(case, 4, marks=pytest.mark.slow) for case in ("hsdp", "tp_dim1", "spmd"))],
)
def test_shard_of_cuts_what_the_shard_layout_holds(case, world_size):
    for r in run_on_ranks(world_size, _compare, case):
        assert r == {"params": 11, "differ": []}, r
