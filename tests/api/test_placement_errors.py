"""Bad shard_placement_fn results and dp_mesh_dims get errors naming the module and parameter."""

import pytest
import torch
from expecttest import assert_expected_inline
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard, distribute_tensor

from fsdp_compose import DataParallelMeshDims, fully_shard
from tests.models import Block
from tests.api.test_errors import message


@pytest.fixture(autouse=True)
def _group(single_rank_group):
    yield


def test_placement_fn_returns_something_else():
    assert_expected_inline(
        message(lambda: fully_shard(Block(), shard_placement_fn=lambda p: Replicate())),
        """ValueError: fully_shard(Block, shard_placement_fn=...): returned Replicate() for parameter 'norm.weight'; return Shard(dim), None (for Shard(0)) or ShardPlacementResult(placement, mesh_info)""",
    )


def test_placement_dim_out_of_range():
    fn = lambda p: Shard(2) if p.dim() == 2 else None  # noqa: E731
    assert_expected_inline(message(lambda: fully_shard(Block(), shard_placement_fn=fn)), """ValueError: fully_shard(Block, shard_placement_fn=...): Shard(2) for parameter 'fc1.weight' of shape (29, 13) is out of range; pick a dim in [-2, 1]""")


def test_negative_placement_dim_counts_from_the_end():
    block = fully_shard(Block(), shard_placement_fn=lambda p: Shard(-1))
    assert block.fc1.weight.placements == (Shard(1),) and block.fc1.bias.placements == (Shard(0),)


def _spmd_block(mesh) -> Block:
    block = Block()
    for module in block.modules():
        for name, param in list(module.named_parameters(recurse=False)):
            placements = [Replicate()] * mesh.ndim
            module.register_parameter(name, nn.Parameter(distribute_tensor(param.detach(), mesh, placements)))
    return block


def test_dp_mesh_dims_name_not_in_mesh():
    mesh = init_device_mesh("cpu", (1, 1), mesh_dim_names=("dp", "tp"))
    dims = DataParallelMeshDims(shard="dp_shard")
    assert_expected_inline(message(lambda: fully_shard(_spmd_block(mesh), mesh=mesh, dp_mesh_dims=dims)), """ValueError: fully_shard(Block, dp_mesh_dims=DataParallelMeshDims(shard='dp_shard', replicate=None)): mesh dim 'dp_shard' is not one of the mesh's dims ('dp', 'tp')""")


def test_dp_mesh_dims_on_a_mesh_without_names():
    mesh = init_device_mesh("cpu", (1,))
    dims = DataParallelMeshDims(shard="dp")
    assert_expected_inline(message(lambda: fully_shard(Block(), mesh=mesh, dp_mesh_dims=dims)), """ValueError: fully_shard(Block, dp_mesh_dims=DataParallelMeshDims(shard='dp', replicate=None)): the mesh has no dim names; create it with init_device_mesh(..., mesh_dim_names=...)""")


def test_dp_mesh_dims_with_a_plain_parameter():
    mesh = init_device_mesh("cpu", (1, 1), mesh_dim_names=("dp", "tp"))
    block = _spmd_block(mesh)
    block.norm.weight = nn.Parameter(torch.ones(13))
    dims = DataParallelMeshDims(shard="dp")
    assert_expected_inline(message(lambda: fully_shard(block, mesh=mesh, dp_mesh_dims=dims)), """ValueError: fully_shard(Block, dp_mesh_dims=...): parameter 'norm.weight' is a plain tensor; with dp_mesh_dims every parameter must be a DTensor on the full mesh (e.g. from parallelize_module or distribute_tensor with Replicate() on the data-parallel dims)""")


def test_dp_mesh_dims_parameter_not_replicated_on_a_dp_dim():
    mesh = init_device_mesh("cpu", (1, 1), mesh_dim_names=("dp", "tp"))
    block = _spmd_block(mesh)
    weight = block.fc1.weight.detach().full_tensor()
    block.fc1.weight = nn.Parameter(distribute_tensor(weight, mesh, [Shard(0), Replicate()]))
    dims = DataParallelMeshDims(shard="dp")
    assert_expected_inline(message(lambda: fully_shard(block, mesh=mesh, dp_mesh_dims=dims)), """ValueError: fully_shard(Block, dp_mesh_dims=...): parameter 'fc1.weight' has placement S(0) on data-parallel mesh dim 'dp'; expected Replicate()""")


def test_dp_mesh_dims_shard_and_replicate_the_same_dim():
    mesh = init_device_mesh("cpu", (1, 1), mesh_dim_names=("dp", "tp"))
    dims = DataParallelMeshDims(shard="dp", replicate=("dp",))
    assert_expected_inline(message(lambda: fully_shard(_spmd_block(mesh), mesh=mesh, dp_mesh_dims=dims)), """ValueError: fully_shard(Block, dp_mesh_dims=DataParallelMeshDims(shard='dp', replicate=('dp',))): a mesh dim is named twice; each dim shards or replicates, not both""")


def test_dp_mesh_dims_needs_a_name():
    assert_expected_inline(message(lambda: DataParallelMeshDims()), """ValueError: DataParallelMeshDims: set shard, replicate or both (mesh dim names)""")


def test_placement_result_with_something_that_is_no_mesh():
    from fsdp_compose import ShardPlacementResult

    fn = lambda p: ShardPlacementResult(Shard(0), "dp") if p.dim() == 2 else None  # noqa: E731
    assert_expected_inline(message(lambda: fully_shard(Block(), shard_placement_fn=fn)), """TypeError: fully_shard(Block, shard_placement_fn=...): the mesh_info for parameter 'fc1.weight' is 'dp'; pass a DeviceMesh or torch's FSDPMeshInfo/HSDPMeshInfo""")


def test_placement_result_with_a_replicate_only_mesh_info():
    from types import SimpleNamespace

    from fsdp_compose import ShardPlacementResult

    info = SimpleNamespace(mesh=init_device_mesh("cpu", (1,)), shard_mesh_dim=None, replicate_mesh_dim=0)
    fn = lambda p: ShardPlacementResult(None, info)  # noqa: E731
    assert_expected_inline(message(lambda: fully_shard(Block(), shard_placement_fn=fn)), """ValueError: fully_shard(Block, shard_placement_fn=...): the mesh_info for parameter 'norm.weight' has no shard dim (replicate only); fully_shard shards every parameter it manages""")


def test_placement_result_with_dp_mesh_dims():
    from fsdp_compose import ShardPlacementResult

    mesh = init_device_mesh("cpu", (1, 1), mesh_dim_names=("dp", "tp"))
    other = init_device_mesh("cpu", (1,), mesh_dim_names=("ep",))
    fn = lambda p: ShardPlacementResult(None, other)  # noqa: E731
    dims = DataParallelMeshDims(shard="dp")
    assert_expected_inline(
        message(lambda: fully_shard(_spmd_block(mesh), mesh=mesh, dp_mesh_dims=dims, shard_placement_fn=fn)), """NotImplementedError: fully_shard(Block, dp_mesh_dims=...): shard_placement_fn put parameter 'norm.weight' on a mesh of its own; a per-parameter mesh takes a data-parallel mesh, not dp_mesh_dims"""
    )
