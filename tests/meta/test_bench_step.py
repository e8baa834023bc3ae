"""``benchmarks/bench_step.py`` prices the divergence order checks by wrapping the collective log's rounds. The
wrapper must keep finding them: when the gloo exchange became a collective log round, the benchmark failed
with an ``AttributeError`` after every model had trained, and no test noticed."""

import torch
from torch import nn

from fsdp_compose import fully_shard
from fsdp_compose._checks.order import CollectiveLog
from tests.harness import run_on_ranks


def _rounds_counted_in_a_step() -> tuple[dict, int]:
    from benchmarks.bench_step import time_order_checks  # its MALLOC_ setdefault finds the harness's value

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 4))
    for layer in (model[0], model[2]):
        fully_shard(layer)
    fully_shard(model)
    model(torch.randn(2, 4)).sum().backward()  # lazy init and the first step's order, outside the count
    original = CollectiveLog.close_round
    rounds = 0

    def counting(collective_log: CollectiveLog) -> None:
        nonlocal rounds
        rounds += bool(collective_log.log)  # a round with nothing logged runs no collective
        original(collective_log)

    CollectiveLog.close_round = counting
    try:
        spent = time_order_checks()  # wraps ``counting``
        model(torch.randn(2, 4)).sum().backward()
    finally:
        CollectiveLog.close_round = original
    return spent, rounds


def test_the_benchmark_times_every_round_of_the_ledger():
    for spent, rounds in run_on_ranks(2, _rounds_counted_in_a_step):
        assert rounds >= 5  # gloo: one before each of the step's five all-gathers at least
        assert spent["calls"] == rounds
        assert spent["seconds"] > 0 and spent["cpu"] >= 0
