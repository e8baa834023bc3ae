"""Auto-wrap policies: which modules become groups (the plan text), errors, and training parity."""

from __future__ import annotations

import expecttest
import pytest
import torch
from torch import nn

from fsdp_compose import CustomPolicy, ModuleWrapPolicy, SizeBasedPolicy, apply_fully_shard
from fsdp_compose._runtime.state import state_of
from tests.harness import run_on_ranks
from tests.models import Block, TinyLM, assert_parity, train_against_reference


def _embedding_kept_unsharded(module: nn.Module):
    if isinstance(module, nn.Embedding):
        return {"reshard_after_forward": False}
    return isinstance(module, Block)


def make_policy(name: str):
    """Policies are built in the rank process: a CustomPolicy's function need not pickle."""
    return {
        "module": ModuleWrapPolicy({Block}),
        # 300 elements: the Linear layers (390-518) qualify, the LayerNorms (26) do not, and a
        # Block (822) does not either once its two Linear layers claimed their share.
        "size": SizeBasedPolicy(min_num_params=300),
        "custom": CustomPolicy(_embedding_kept_unsharded),
        "none": None,
    }[name]


def _plan_text(name: str) -> str:
    torch.manual_seed(0)
    return str(apply_fully_shard(TinyLM(), make_policy(name)))


class TestPlanText(expecttest.TestCase):
    def test_module_policy(self):
        self.assertExpectedInline(
            run_on_ranks(1, _plan_text, "module")[0],
            """\
ShardPlan(ModuleWrapPolicy({Block})): 4 groups
  blocks.0  Block   6 params   822 elements
  blocks.1  Block   6 params   822 elements
  blocks.2  Block   6 params   822 elements
  <root>    TinyLM  5 params  1025 elements""",
        )

    def test_size_policy(self):
        self.assertExpectedInline(
            run_on_ranks(1, _plan_text, "size")[0],
            """\
ShardPlan(SizeBasedPolicy(min_num_params=300)): 9 groups
  embed         Embedding  1 params  481 elements
  blocks.0.fc1  Linear     2 params  406 elements
  blocks.0.fc2  Linear     2 params  390 elements
  blocks.1.fc1  Linear     2 params  406 elements
  blocks.1.fc2  Linear     2 params  390 elements
  blocks.2.fc1  Linear     2 params  406 elements
  blocks.2.fc2  Linear     2 params  390 elements
  head          Linear     2 params  518 elements
  <root>        TinyLM     8 params  104 elements""",
        )

    def test_custom_policy(self):
        self.assertExpectedInline(
            run_on_ranks(1, _plan_text, "custom")[0],
            """\
ShardPlan(CustomPolicy('_embedding_kept_unsharded')): 5 groups
  embed     Embedding  1 params  481 elements  reshard_after_forward=False
  blocks.0  Block      6 params  822 elements
  blocks.1  Block      6 params  822 elements
  blocks.2  Block      6 params  822 elements
  <root>    TinyLM     4 params  544 elements""",
        )

    def test_no_policy_shards_root_only(self):
        self.assertExpectedInline(
            run_on_ranks(1, _plan_text, "none")[0],
            """\
ShardPlan(None): 1 groups
  <root>  TinyLM  23 params  3491 elements""",
        )


def test_custom_policy_rejects_other_answers():
    # The policy runs before any fully_shard call, so no process group is needed here.
    policy = CustomPolicy(lambda m: "yes" if m is model.blocks[1] else False)
    model = TinyLM()
    with pytest.raises(TypeError, match=r"module 'blocks\.1' \(Block\) it returned 'yes'"):
        apply_fully_shard(model, policy)
    assert state_of(model) is None and state_of(model.blocks[0]) is None


def test_custom_policy_rejects_unknown_override():
    model = TinyLM()
    policy = CustomPolicy(lambda m: {"reshard_after_fwd": True} if isinstance(m, Block) else False)
    with pytest.raises(TypeError, match=r"'blocks\.0' \(Block\).*\['reshard_after_fwd'\]"):
        apply_fully_shard(model, policy)


def test_size_policy_skips_containers_and_small_subtrees():
    model = TinyLM()
    selected = SizeBasedPolicy(min_num_params=800).select(model, set())
    # every Block (822) qualifies; the ModuleList holding them never does (no forward); the
    # root qualifies with what the blocks left over (embed + norm + head = 1025).
    assert list(selected) == [*model.blocks, model]
    # ignored parameters do not count towards a module's size
    ignored = set(model.blocks[0].fc1.parameters())
    assert list(SizeBasedPolicy(min_num_params=800).select(model, ignored)) == [*model.blocks[1:], model]


def _parity_with_policies() -> list[dict]:
    def shard_with(name: str):
        return lambda model: apply_fully_shard(model, make_policy(name))

    return [train_against_reference(TinyLM, shard_with(name), steps=3) for name in ("module", "size", "custom")]


def test_apply_fully_shard_parity_two_ranks():
    for results in zip(*run_on_ranks(2, _parity_with_policies)):
        assert_parity(list(results))
