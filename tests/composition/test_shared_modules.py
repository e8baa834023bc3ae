"""Several modules as one group: a tied embedding and output projection."""

import pytest
import torch
from torch import nn

from fsdp_compose import fully_shard
from fsdp_compose._runtime.state import state_of
from tests.harness import run_on_ranks
from tests.models import DIM, VOCAB, TinyLM, assert_parity, lm_loss, train_against_reference
from tests.runtime.test_collectives import count_collectives


class TiedLM(TinyLM):
    def __init__(self, head_first: bool = False):
        super().__init__()
        self.head = nn.Linear(DIM, VOCAB, bias=False)
        self.head.weight = self.embed.weight
        self.head_first = head_first
        self.prior = nn.Parameter(torch.randn(1, DIM))

    def forward(self, ids):
        prior = self.head(self.prior) if self.head_first else 0.0  # the head runs before the embedding
        x = self.embed(ids)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x)) + prior


def shard_tied(model, **kwargs):
    for block in model.blocks:
        fully_shard(block, **kwargs)
    fully_shard([model.embed, model.head], **kwargs)
    fully_shard(model, **kwargs)


def _tied(head_first, reshard_after_forward):
    result = train_against_reference(
        lambda: TiedLM(head_first), lambda m: shard_tied(m, reshard_after_forward=reshard_after_forward)
    )
    torch.manual_seed(0)
    model = TiedLM(head_first)
    shard_tied(model, reshard_after_forward=reshard_after_forward)
    result["tied"] = model.head.weight is model.embed.weight
    result["one_state"] = state_of(model.head) is state_of(model.embed)
    with count_collectives() as counts:
        lm_loss(model, torch.randint(0, VOCAB, (2, 6))).backward()
    result["counts"] = dict(counts)
    result["resharded"] = state_of(model.embed).group.unsharded_nbytes() == 0
    return result


@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("head_first", [False, True])
def test_tied_embedding_and_head(world_size, head_first):
    results = run_on_ranks(world_size, _tied, head_first, True)
    assert_parity(results)
    # forward: 5 groups, the tied group again for its second (third) use; backward: 3 blocks + tied
    # + the root (reshard_after_forward=True passed to the root applies to it too, as in torch)
    gathers = (6 + (1 if head_first else 0)) + 5
    for r in results:  # every rank
        assert r["tied"] and r["one_state"] and r["resharded"]
        assert r["counts"] == {"all_gather_single": gathers, "reduce_scatter_single": 5}, r["counts"]


def test_tied_without_reshard_after_forward():
    results = run_on_ranks(2, _tied, True, False)
    assert_parity(results)
    for r in results:
        assert r["counts"] == {"all_gather_single": 5, "reduce_scatter_single": 5}, r["counts"]
