"""reshard_after_forward=<int>: after forward keep an N-way slice; backward gathers within N ranks."""

import pytest
import torch

from fsdp_compose._runtime.state import state_of
from tests.harness import run_on_ranks
from tests.models import TinyLM, assert_parity, lm_loss, shard_blocks_then_root, train_against_reference
from tests.runtime.test_collectives import record_gathers


def _parity(ranks):
    result = train_against_reference(TinyLM, lambda m: shard_blocks_then_root(m, reshard_after_forward=ranks))
    torch.manual_seed(0)
    model = TinyLM()
    shard_blocks_then_root(model, reshard_after_forward=ranks)
    group = state_of(model.blocks[0]).group
    full_bytes = sum(p.row_layout.world * p.row_layout.padded_numel * 4 for p in group.params)
    ids = torch.randint(0, 37, (2, 6))
    loss = lm_loss(model, ids)
    result["kept_after_forward"] = group.unsharded_nbytes() / full_bytes
    with record_gathers() as gathers:
        loss.backward()
    result["backward_gather_group_sizes"] = [size for size, _, _ in gathers]
    result["after_backward"] = group.unsharded_nbytes()
    return result


def test_reshard_to_two_of_four_ranks():
    results = run_on_ranks(4, _parity, 2)
    assert_parity(results)
    for r in results:
        assert 0.5 <= r["kept_after_forward"] < 0.52  # half of the full group
        # the 3 blocks and the root (an explicit value applies to the root too), within pairs of ranks
        assert r["backward_gather_group_sizes"] == [2, 2, 2, 2]
        assert r["after_backward"] == 0


def _load_between_forward_and_backward():
    """A load after a forward (post-forward slices kept) must be what the next forward uses."""
    torch.manual_seed(0)
    model = TinyLM()
    shard_blocks_then_root(model, reshard_after_forward=2)
    ids = torch.randint(0, 37, (2, 6))
    lm_loss(model, ids)  # forward with grad, no backward: each block keeps its N-way slice
    torch.manual_seed(1)
    fresh = TinyLM()
    model.load_state_dict(fresh.state_dict())
    with torch.no_grad():
        return (model(ids) - fresh(ids)).abs().max().item()


@pytest.mark.slow  # 4 ranks
def test_load_after_forward_replaces_the_post_forward_slice():
    assert run_on_ranks(4, _load_between_forward_and_backward) == [0.0] * 4
