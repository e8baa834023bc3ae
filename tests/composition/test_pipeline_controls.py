"""Micro-batches as a pipeline schedule runs them: all forwards, then the backwards in reverse."""

import pytest
import torch

from fsdp_compose import FSDPModule
from fsdp_compose._runtime.state import state_of
from tests.harness import run_on_ranks
from tests.models import TinyLM, assert_parity, lm_loss, shard_blocks_then_root, train_against_reference
from tests.runtime.test_collectives import count_collectives

MICRO = 2


def gpipe_step(controls: bool):
    def step(model, batch, rank, world_size):
        sharded = isinstance(model, FSDPModule)
        micro = batch.chunk(MICRO)
        losses = [lm_loss(model, mb) / MICRO for mb in micro]  # every forward first
        for i in reversed(range(MICRO)):
            last = i == 0
            if sharded and controls:
                model.set_is_last_backward(last)
                model.set_requires_gradient_sync(last)
                model.set_reshard_after_backward(last)  # keep gathered between micro-batches
            losses[i].backward()
        return sum(loss.detach() for loss in losses)

    return step


def _pipeline(controls):
    result = train_against_reference(TinyLM, shard_blocks_then_root, step_fn=gpipe_step(controls))
    torch.manual_seed(0)
    model = TinyLM()
    shard_blocks_then_root(model)
    batch = torch.randint(0, 37, (2 * MICRO, 6))
    with count_collectives() as counts:
        gpipe_step(controls)(model, batch, 0, 1)
    result["counts"] = dict(counts)
    result["resharded"] = all(state_of(m).group.unsharded_nbytes() == 0 for m in [model, *model.blocks])
    return result


@pytest.mark.parametrize("controls", [False, True])
def test_gpipe_style_micro_batches(controls):
    results = run_on_ranks(2, _pipeline, controls)
    assert_parity(results)
    for r in results:  # every rank
        assert r["resharded"]
        # with the controls, one reduction per group for the whole step; no re-gather between backwards
        assert r["counts"]["reduce_scatter_single"] == (4 if controls else 8), r["counts"]
