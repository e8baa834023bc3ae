"""The order check collective log: which ranks its message names from the exchanged logs,
and a verdict kept across a device change.

Its collectives are shown on threaded ranks in ``test_fake_backend.py``; here the naming alone,
for world sizes no test runs: the first rank and those that differ from it, at most eight.
"""

import pytest
import torch
import torch.distributed as dist
from expecttest import assert_expected_inline

from fsdp_compose._checks.order import (
    ALL_GATHER,
    REDUCE_SCATTER,
    Entry,
    ExecutionOrderError,
    CollectiveLogs,
    _first_difference,
)

SMALL, BIG = (1, ALL_GATHER, 40), (2, ALL_GATHER, 120)


def _describe(uid: int) -> str:
    return f"'block{uid}' (Linear)"


def test_ranks_that_differ_from_the_first_are_named_at_the_first_difference():
    logs = [[SMALL, SMALL]] * 10 + [[SMALL, BIG]] * 2
    logs[5] = [SMALL]  # ran nothing more this round
    assert_expected_inline(
        _first_difference(logs, list(range(100, 112)), _describe),
        """\
Ranks diverged: they were about to run different collectives of sharded modules (a rank skipped a sharded module, ran a different number of forward calls, or ran modules in another order; check data-dependent control flow):
  rank 100: all-gather of 'block1' (Linear), 40 bytes
  rank 105: no further collective this round
  rank 110: all-gather of 'block2' (Linear), 120 bytes
  rank 111: all-gather of 'block2' (Linear), 120 bytes
  (the first rank and up to 7 that differ from it, of 12)""",
    )


def test_a_reduce_scatter_brings_the_backward_hint():
    logs = [[SMALL, (1, REDUCE_SCATTER, 64)], [SMALL, BIG]]
    message = _first_difference(logs, [0, 1], _describe)
    assert "rank 0: reduce-scatter of 'block1' (Linear), 64 bytes" in message
    assert "run when a module's backward is done" in message


def test_a_verdict_still_unread_when_the_model_moves_is_read_on_the_new_device(single_rank_group):
    """On an accelerator a round's verdict is read a round later; moving the model (a new device for
    the order checks) in between must not drop it."""
    collective_logs = CollectiveLogs()
    group = dist.group.WORLD
    before = collective_logs.collective_log(group, torch.device("cpu"))
    diverged = torch.tensor(True)  # as the previous round's all-reduce left it, waiting to be read
    before.pending = (diverged, None, [Entry(1, ALL_GATHER, 40, before)], _describe)
    after = collective_logs.collective_log(group, torch.device("meta"))
    assert after.device == torch.device("meta")
    with pytest.raises(ExecutionOrderError, match="all-gather of 'block1'"):
        after.close_round()
