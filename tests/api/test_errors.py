"""Bad input gets an error that names the module or parameter at fault."""

import pytest
import torch
from expecttest import assert_expected_inline
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

from fsdp_compose import fully_shard
from tests.messages import message
from tests.models import Block


@pytest.fixture(autouse=True)
def _group(single_rank_group):
    yield


def test_double_apply():
    block = Block()
    fully_shard(block)
    assert_expected_inline(
        message(lambda: fully_shard(block)),
        """AlreadyShardedError: fully_shard was already called on this Block module; call it once per module (Each distinct composable distributed API can only be applied to a module once.)""",
    )


def test_child_after_ancestor():
    model = nn.Sequential(Block(), Block())
    fully_shard(model)
    assert_expected_inline(
        message(lambda: fully_shard(model[1])),
        """ValueError: fully_shard(Block): parameter 'norm.weight' is already sharded by fully_shard on an ancestor module (Sequential); call fully_shard on submodules before their parents""",
    )


def test_parameter_shared_across_groups():
    embed, head = nn.Embedding(7, 4), nn.Linear(4, 7, bias=False)
    head.weight = embed.weight
    model = nn.Sequential(embed, head)
    fully_shard(model[0])
    assert_expected_inline(
        message(lambda: fully_shard(model)),
        """ValueError: fully_shard(Sequential): parameter '1.weight' of Linear '1' is already in the group of fully_shard(Embedding); a parameter may belong to one group only: shard its users together first, fully_shard([the Embedding, the Linear '1']), or shard one module that contains all of them, or ignore it (ignored_params)""",
    )


def test_mixed_devices():
    model = nn.Sequential(nn.Linear(3, 4))
    with torch.device("meta"):
        model.append(nn.Linear(4, 2))
    assert_expected_inline(
        message(lambda: fully_shard(model)),
        """ValueError: fully_shard(Sequential): parameters are on different devices ('0.weight' on cpu, '1.weight' on meta); move the module to one device first""",
    )


def test_three_dimensional_mesh():
    mesh = init_device_mesh("cpu", (1, 1, 1), mesh_dim_names=("a", "b", "c"))
    assert_expected_inline(
        message(lambda: fully_shard(Block(), mesh=mesh)),
        """ValueError: fully_shard(Block, mesh=<3-D mesh>): pass a 1-D mesh (shard) or a 2-D mesh (replicate, shard) for HSDP; for tensor parallelism pass the data-parallel sub-mesh""",
    )


def test_meta_parameter_reaching_forward_then_retry():
    with torch.device("meta"):
        model = nn.Sequential(Block(), nn.Linear(13, 3))
    fully_shard(model[0])
    fully_shard(model)
    x = torch.randn(2, 13)
    assert_expected_inline(
        message(lambda: model(x)),
        """RuntimeError: Parameter '1.weight' of module '<root>' (Sequential) is still on the meta device at the first forward; materialize it first: model.to_empty(device=...) then fsdp_compose.init_sharded_parameters(model)""",
    )
    # the failed lazy init changed nothing: materialize and the same model runs
    model.to_empty(device="cpu")
    for module in model.modules():
        if hasattr(module, "reset_parameters"):
            module.reset_parameters()
    assert model(x).shape == (2, 3)
    assert all(p.device.type == "cpu" for p in model.parameters())


def test_zero_dim_parameter():
    module = nn.Module()
    module.scale = nn.Parameter(torch.tensor(1.0))
    assert_expected_inline(
        message(lambda: fully_shard(module)),
        """ValueError: fully_shard cannot shard the 0-dim parameter 'scale' on dim 0; give it shape (1,) or pass it in ignored_params""",
    )


def test_reshard_after_forward_must_divide_the_group():
    assert_expected_inline(
        message(lambda: fully_shard(Block(), reshard_after_forward=2)),
        """ValueError: fully_shard(Block, reshard_after_forward=2): pass True, False or a number of ranks that divides the shard group size 1 (e.g. the ranks of one node)""",
    )


def _overlapping_meshes_message() -> str:
    from torch.distributed.tensor import Shard, distribute_tensor

    data_parallel = init_device_mesh("cpu", (2,), mesh_dim_names=("dp",))
    other = init_device_mesh("cpu", (1, 2), mesh_dim_names=("pp", "tp"))  # the same two ranks again
    layer = nn.Linear(4, 4)
    layer.weight = nn.Parameter(distribute_tensor(layer.weight.detach(), other["tp"], [Shard(0)]))
    return message(lambda: fully_shard(layer, mesh=data_parallel))


def test_tensor_parallel_parameter_on_an_overlapping_mesh():
    """TP over the ranks data parallelism already spans: no mesh holds both (torch refuses it too)."""
    from tests.harness import run_on_ranks

    first, second = run_on_ranks(2, _overlapping_meshes_message)
    assert first == second  # every rank
    assert_expected_inline(
        first,
        """ValueError: parameter 'weight' is a DTensor on a cpu mesh of shape (2,) with dims ('tp',); fully_shard can shard it further only when that mesh and the data-parallel mesh ('dp',) are disjoint dims of one mesh, e.g. mesh = init_device_mesh(..., mesh_dim_names=('dp_replicate', 'dp_shard', 'tp')); fully_shard(m, mesh=mesh['dp_replicate', 'dp_shard'])""",
    )


def test_two_dimensional_mesh_needs_named_roles():
    unnamed = init_device_mesh("cpu", (1, 1))
    assert_expected_inline(
        message(lambda: fully_shard(Block(), mesh=unnamed)),
        """MeshRoleError: fully_shard(Block, mesh=<2-D mesh without dim names>): a 2-D mesh is HSDP, read as (replicate, shard) by position; name its dims so the order is explicit: init_device_mesh(..., (replicas, shards), mesh_dim_names=('replicate', 'shard'))""",
    )
    backwards = init_device_mesh("cpu", (1, 1), mesh_dim_names=("dp_shard", "dp_replicate"))
    assert_expected_inline(
        message(lambda: fully_shard(Block(), mesh=backwards)),
        """MeshRoleError: fully_shard(Block, mesh=<2-D mesh with dims ('dp_shard', 'dp_replicate')>): a 2-D mesh is HSDP, read as (replicate, shard) by position, but the names say otherwise; build it in that order: init_device_mesh(..., (replicas, shards), mesh_dim_names=('replicate', 'shard'))""",
    )
    tensor_parallel = init_device_mesh("cpu", (1, 1), mesh_dim_names=("dp", "tp"))
    assert_expected_inline(
        message(lambda: fully_shard(Block(), mesh=tensor_parallel)),
        """MeshRoleError: fully_shard(Block, mesh=<2-D mesh with dims ('dp', 'tp')>): a 2-D mesh is HSDP, read as (replicate, shard) by position, but the names say otherwise; for tensor (or other) parallelism pass the data-parallel sub-mesh, e.g. mesh['dp']""",
    )
