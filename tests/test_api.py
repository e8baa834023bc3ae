import pytest

from tests.harness import run_on_ranks
from tests.models import TinyLM, assert_parity, shard_blocks_then_root, train_against_reference


def _parity_nested(reshard_after_forward):
    return train_against_reference(
        TinyLM, lambda m: shard_blocks_then_root(m, reshard_after_forward=reshard_after_forward)
    )


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
@pytest.mark.parametrize("reshard_after_forward", [True, False])
def test_nested_parity(world_size, reshard_after_forward):
    assert_parity(run_on_ranks(world_size, _parity_nested, reshard_after_forward))
