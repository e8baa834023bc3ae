"""Parameters with fewer rows than ranks: the rows of later ranks are padding only, gathered,
copied out and reduced like any other row (zeros, and every parameter's has-gradient flag), and
training matches the unsharded model."""


import pytest
import torch
from torch import nn
from torch.distributed import ProcessGroup
from torch.distributed.tensor import Shard

from fsdp_compose import fully_shard
from fsdp_compose._runtime.collectives import SCATTER_METHOD
from fsdp_compose_shm import counters, use_shm
from tests.harness import run_on_ranks
from tests.api.test_edge_inputs import _parity


class Narrow(nn.Module):
    """At 4 ranks: ``a`` holds rows on 2 ranks, ``c`` on 1 (Shard(0)) or 4 (Shard(1)), ``b`` on all."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 2)
        self.b = nn.Linear(2, 8)
        self.c = nn.Linear(8, 1)

    def forward(self, x):
        return self.c(torch.relu(self.b(self.a(x))))


def _shard(model: Narrow) -> None:
    fully_shard(model.a, reshard_after_forward=2)  # gathered again within pairs for backward
    fully_shard(model.c, shard_placement_fn=lambda p: Shard(1) if p.ndim == 2 else None)
    fully_shard(model)  # b, whose rows reach every rank, with a at two ranks' rows


def _step(model, batch):
    loss = model(batch).pow(2).mean()
    loss.backward()
    return loss


def _parity_and_tables() -> tuple[float, dict]:
    sent = {}  # width -> the last reduce-scatter input of that width, as (world, width)
    original = getattr(ProcessGroup, SCATTER_METHOD)
    raw = vars(ProcessGroup)[SCATTER_METHOD]

    def watch(group, output, input, *args):
        table = input.view(group.size(), -1)
        sent[table.shape[1]] = table.tolist()
        return original(group, output, input, *args)

    setattr(ProcessGroup, SCATTER_METHOD, watch)
    try:
        worst = _parity(Narrow, _step, shard=_shard)
    finally:
        setattr(ProcessGroup, SCATTER_METHOD, raw)
    return worst, sent


@pytest.mark.slow  # 4 ranks
def test_rows_of_later_ranks_are_padding_and_training_matches():
    for worst, sent in run_on_ranks(4, _parity_and_tables):
        assert worst <= 1e-5
        # a: weight (2, 4) and bias (2,), one row per rank, then 2 flags: ranks 2 and 3 hold no data
        assert sorted(sent) == [5, 7, 8] and all(len(table) == 4 for table in sent.values())
        assert sent[7][2] == sent[7][3] == [0, 0, 0, 0, 0, 1, 1]
        # c: weight (1, 8) split on dim 1 (2 columns per rank), bias (1,) on rank 0 alone
        assert [row[2] for row in sent[5][1:]] == [0, 0, 0] and all(row[3:] == [1, 1] for row in sent[5])


class Tiny(nn.Module):
    """At 4 ranks both groups are short: ``a`` has rows on 2 ranks, the root's ``b`` on 3."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 2)
        self.b = nn.Linear(2, 3)

    def forward(self, x):
        return self.b(torch.relu(self.a(x)))


def _tiny_parity(transport: str) -> float:
    def shard(model):
        fully_shard(model.a)
        fully_shard(model)
        if transport == "shm":
            use_shm(model)

    reduced = counters.reduce_scatters
    worst = _parity(Tiny, _step, shard=shard)
    assert (counters.reduce_scatters > reduced) == (transport == "shm")  # the short tables went through it
    return worst


@pytest.mark.parametrize("world", [3, pytest.param(4, marks=pytest.mark.slow)])
@pytest.mark.parametrize("transport", ["gloo", "shm"])
def test_every_group_short_trains_at_parity(transport, world):
    assert run_on_ranks(world, _tiny_parity, transport) == [pytest.approx(0, abs=1e-5)] * world
