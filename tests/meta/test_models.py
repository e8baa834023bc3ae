"""The parity helpers of tests/models.py fail on NaN and inf (issue 39, item 1): ``max(x, nan) == x``
once let a run whose final parameters were all NaN pass with ``param_diff = 0.0``."""

import math

import pytest
import torch

from tests.harness import run_on_ranks
from tests.models import (
    TinyLM,
    assert_parity,
    default_step,
    max_abs_diff,
    shard_blocks_then_root,
    train_against_reference,
    worst_of,
)


def test_max_abs_diff_and_worst_of_see_nan_and_inf():
    a = torch.zeros(3)
    assert max_abs_diff(a, a + 1e-7) == pytest.approx(1e-7)
    for bad in (math.nan, math.inf, -math.inf):
        b = torch.tensor([0.0, bad, 0.0])
        assert max_abs_diff(a, b) == math.inf and max_abs_diff(b, a) == math.inf
    assert max_abs_diff(torch.zeros(0), torch.zeros(0)) == 0.0
    assert worst_of(0.0, math.nan, 1.0) == math.inf and worst_of(math.nan, 0.0) == math.inf
    assert worst_of(0.0, 2.0, 1.0) == 2.0


def _nan_gradients_in_the_last_step(steps: int = 4) -> dict:
    """The audit's probe: every sharded gradient NaN in the last of 4 steps, so every final parameter is NaN."""
    calls = []

    def step(model, batch, rank, world_size):
        loss = default_step(model, batch, rank, world_size)
        calls.append(world_size)
        if world_size > 1 and len([c for c in calls if c > 1]) == steps:  # the sharded model's last step
            for p in model.parameters():
                p.grad.to_local().fill_(math.nan)
        return loss

    return train_against_reference(TinyLM, shard_blocks_then_root, steps=steps, step_fn=step)


@pytest.mark.slow  # a failing rank: its pool is started again
def test_assert_parity_fails_when_the_sharded_run_ends_in_nan():
    results = run_on_ranks(2, _nan_gradients_in_the_last_step)
    for r in results:
        assert r["param_diff"] == math.inf and r["grad_diff"] == math.inf, r
    with pytest.raises(AssertionError):
        assert_parity(results)
