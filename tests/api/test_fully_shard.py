import pytest

from tests.harness import run_on_ranks
from tests.models import TinyLM, assert_parity, assert_sharded, shard_blocks_then_root, train_against_reference


def _parity_nested(reshard_after_forward):
    return train_against_reference(
        TinyLM, lambda m: shard_blocks_then_root(m, reshard_after_forward=reshard_after_forward)
    )


@pytest.mark.parametrize("world_size", [1, 2, 3, pytest.param(4, marks=pytest.mark.slow)])  # 4 ranks: in the slow run (README.md)
@pytest.mark.parametrize("reshard_after_forward", [True, False])
def test_nested_parity(world_size, reshard_after_forward):
    results = run_on_ranks(world_size, _parity_nested, reshard_after_forward)
    assert_parity(results)
    assert_sharded(results)



def _params_after_forward(reshard_after_forward, set_later):
    """Whether the root's and a block's parameters are sharded DTensors right after a forward with grad."""
    import torch
    from torch.distributed.tensor import DTensor

    from tests.models import lm_loss

    torch.manual_seed(0)
    model = TinyLM()
    shard_blocks_then_root(model, reshard_after_forward=reshard_after_forward)
    if set_later is not None:
        model.set_reshard_after_forward(set_later, recurse=False)
    loss = lm_loss(model, torch.randint(0, 37, (2, 6)))
    kinds = [{type(p) is DTensor for p in m.parameters(recurse=False)} for m in (model.embed, model.blocks[0].fc1)]
    loss.backward()
    return kinds



# (fully_shard's value, set_reshard_after_forward on the root later, root resharded, block resharded)
ROOT_RESHARD_CASES = [
    (None, None, False, True),
    (True, None, True, True),
    (False, None, False, False),
    (None, True, True, True),
    (True, False, False, True),
    (2, None, True, True),  # an int as in torch: the shard group size (2 here) means True ...
    (1, None, False, False),  # ... and 1 means False
]


def _all_root_reshard_cases():
    return [_params_after_forward(value, later) for value, later, _, _ in ROOT_RESHARD_CASES]


def test_root_reshards_after_forward_only_when_asked():
    """As in torch's FSDP2: by default the root keeps its parameters after forward (backward
    needs them at once); a value the user passed, to fully_shard or set_reshard_after_forward,
    applies to the root too (torch's test_param_registration_after_forward)."""
    expected = [[{root}, {block}] for _, _, root, block in ROOT_RESHARD_CASES]
    assert run_on_ranks(2, _all_root_reshard_cases) == [expected] * 2
