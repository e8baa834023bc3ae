"""Grad modes around a sharded model: forwards under ``torch.inference_mode`` or ``torch.no_grad``,
before, between and after training steps, in any order, train at parity."""

import pytest
import torch

from tests.harness import run_on_ranks
from tests.models import TinyLM, assert_parity, lm_loss, shard_blocks_then_root, train_against_reference

ORDERS = {
    "inference_first": (torch.inference_mode, torch.no_grad),
    "no_grad_first": (torch.no_grad, torch.inference_mode),
    "inference_only": (torch.inference_mode,),
}


def _evaluating_step(modes):
    def step(model, batch, rank, world_size):
        for mode in modes:  # the first step's first forward runs under the first mode
            with mode():
                lm_loss(model, batch)
        loss = lm_loss(model, batch)
        loss.backward()
        with torch.inference_mode():  # scored again after the backward, before the optimizer step
            lm_loss(model, batch)
        return loss.detach()

    return step


def _train(order, reshard):
    return train_against_reference(
        TinyLM,
        lambda m: shard_blocks_then_root(m, reshard_after_forward=reshard),
        step_fn=_evaluating_step(ORDERS[order]),
    )


@pytest.mark.parametrize("order", sorted(ORDERS))
@pytest.mark.parametrize("reshard", [True, False])
def test_inference_and_no_grad_forwards_around_training(order, reshard):
    assert_parity(run_on_ranks(2, _train, order, reshard))


def test_inference_mode_first_at_three_ranks():
    assert_parity(run_on_ranks(3, _train, "inference_first", True))
