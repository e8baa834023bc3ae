"""FSDPModule semantics that torch's own FSDP2 tests check (test_fully_shard_state.py), re-created
for fsdp_compose on one rank: state objects, class swap, container slicing, refusals."""

import copy

import pytest
from expecttest import assert_expected_inline
from torch import nn

from fsdp_compose import FSDPModule, fully_shard
from tests.messages import message
from tests.models import Block


@pytest.fixture(autouse=True)
def _group(single_rank_group):
    yield


def test_each_call_has_its_own_state():
    model = nn.Sequential(Block(), Block(), Block())
    for block in model:
        fully_shard(block)
    fully_shard(model)
    states = [fully_shard.state(model)] + [fully_shard.state(block) for block in model]
    assert None not in states
    assert len(set(map(id, states))) == 4
    assert fully_shard.state(nn.Linear(2, 2)) is None


def test_second_call_is_both_value_and_assertion_error():
    block = Block()
    fully_shard(block)
    for error in (ValueError, AssertionError):
        with pytest.raises(error, match="Each distinct composable distributed API can only be applied to a module once."):
            fully_shard(block)


def test_only_the_sharded_module_changes_class():
    block = Block()
    fully_shard(block)
    assert isinstance(block, Block) and isinstance(block, FSDPModule)
    assert type(block).__name__ == "FSDPBlock"
    assert not any(isinstance(m, FSDPModule) for m in block.modules() if m is not block)


def test_slice_of_sharded_sequential_is_not_fsdp_module():
    model = nn.Sequential(Block(), Block(), Block())
    fully_shard(model)
    assert type(model).__name__ == "FSDPSequential" and isinstance(model, FSDPModule)
    sliced = model[:2]
    assert type(sliced) is nn.Sequential and not isinstance(sliced, FSDPModule)
    assert len(sliced) == 2 and sliced[0] is model[0]


@pytest.mark.parametrize("container", [nn.ModuleList([Block(), Block()]), nn.ModuleDict({"a": Block()})])
def test_containers_without_forward_are_refused(container):
    with pytest.raises(ValueError, match="fully_shard does not support containers that do not implement forward"):
        fully_shard(container)
    assert not isinstance(container, FSDPModule)


def test_container_subclass_with_forward_is_accepted():
    class Stack(nn.ModuleList):
        def forward(self, x):
            for m in self:
                x = m(x)
            return x

    stack = Stack([Block()])
    fully_shard(stack)
    assert isinstance(stack, FSDPModule)


def test_deepcopy_is_refused_clearly():
    block = Block()
    fully_shard(block)
    assert_expected_inline(
        message(lambda: copy.deepcopy(block)),
        """DeepcopyUnsupportedError: copy.deepcopy(Block): FSDP does not support deepcopy of a sharded module (its parameters are shards tied to process groups and hooks); deepcopy the model before fully_shard, or copy its weights with state_dict()/full_state_dict() into a fresh model""",
    )
    with pytest.raises(AssertionError, match="FSDP does not support deepcopy"):
        copy.deepcopy(block)
