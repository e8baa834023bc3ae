"""Ranks that diverge all raise an error naming what each rank was about to run (issue 12, item 2).

gloo itself aborts the process when ranks all-gather buffers of different sizes and hangs when
they run different collectives; torch's FSDP2 shows exactly that (or trains on mixed-up
shards when sizes happen to match). The 32-byte handshake before each collective
(runtime/handshake.py) turns every case below into an ``ExecutionOrderError`` on every rank.
"""

import time
from datetime import timedelta

import torch
import torch.distributed as dist
from expecttest import assert_expected_inline
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from fsdp_compose import fully_shard
from fsdp_compose.runtime.handshake import CollectiveError
from fsdp_compose.runtime.order_check import ExecutionOrderError
from tests.harness import run_on_ranks


class TwoSizes(nn.Module):
    """Two sharded children of different sizes; ``skip`` leaves one out (data-dependent flow)."""

    def __init__(self) -> None:
        super().__init__()
        self.small = nn.Linear(4, 4)
        self.big = nn.Linear(4, 12)
        self.head = nn.Linear(12, 2)

    def forward(self, x: torch.Tensor, skip: bool = False) -> torch.Tensor:
        if not skip:
            x = self.small(x)
        return self.head(self.big(x))


def _model(mesh=None) -> TwoSizes:
    torch.manual_seed(0)
    model = TwoSizes()
    fully_shard(model.small, mesh=mesh)
    fully_shard(model.big, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def _catch(step) -> str:
    try:
        step()
    except ExecutionOrderError as error:
        return str(error)
    return "no error"


def _rank_one_skips_a_module() -> str:
    model = _model()
    x = torch.randn(3, 4)
    return _catch(lambda: model(x, skip=dist.get_rank() == 1).sum().backward())


def test_rank_skipping_a_module_raises_everywhere():
    started = time.monotonic()
    errors = run_on_ranks(2, _rank_one_skips_a_module, timeout=60)
    assert time.monotonic() - started < 30
    assert errors[0] == errors[1]
    assert_expected_inline(
        errors[0],
        """\
Ranks diverged: they were about to run different collectives of sharded modules (a rank skipped a sharded module, ran a different number of forward calls, or ran modules in another order; check data-dependent control flow):
  rank 0: all-gather of 'small' (Linear), 40 bytes
  rank 1: all-gather of 'big' (Linear), 120 bytes""",
    )


def _different_forward_counts() -> str:
    model = _model()
    x = torch.randn(3, 4)

    def step():
        loss = model(x).sum()
        if dist.get_rank() == 0:
            loss = loss + model(x).sum()
        loss.backward()

    return _catch(step)


def test_different_numbers_of_forward_calls_raise_everywhere():
    errors = run_on_ranks(2, _different_forward_counts, timeout=60)
    assert all(e.startswith("Ranks diverged") for e in errors), errors
    assert "rank 0: all-gather of 'small' (Linear)" in errors[0]
    assert "rank 1: all-gather of 'big' (Linear)" in errors[0]  # rank 1 is already in backward


def _rank_one_stops() -> str:
    group = dist.new_group(timeout=timedelta(seconds=3))
    mesh = DeviceMesh.from_group(group, "cpu")
    model = _model(mesh)
    if dist.get_rank() == 1:
        time.sleep(6)  # "stops": never runs the forward
        message = "slept"
    else:
        started = time.monotonic()
        try:
            model(torch.randn(3, 4))
            message = "no error"
        except CollectiveError as error:
            message = f"{error} after {time.monotonic() - started:.0f}s"
    return message


def test_stopped_rank_fails_peers_within_group_timeout():
    rank0, rank1 = run_on_ranks(2, _rank_one_stops, timeout=60)
    assert rank1 == "slept"
    assert rank0.startswith("rank 0: the handshake before the all-gather of '<root>' (TwoSizes) failed"), rank0
    assert "init_process_group(timeout=...)" in rank0
    assert float(rank0.rsplit(" after ", 1)[1][:-1]) < 6
