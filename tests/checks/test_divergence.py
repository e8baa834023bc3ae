"""Ranks that diverge all raise an error naming what each rank was about to run (issue 12, item 2).

gloo itself aborts the process when ranks all-gather buffers of different sizes and hangs when
they run different collectives; torch's FSDP2 shows exactly that (or trains on mixed-up
shards when sizes happen to match). The order check before each collective (_checks/order.py:
on gloo a round of the collective log, an all-reduce of its count and digest and their negations, closed
before the collective) turns every case below into an ``ExecutionOrderError`` on every rank.
"""

import os
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
from expecttest import assert_expected_inline
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from fsdp_compose import fully_shard
from fsdp_compose._runtime.collectives import CollectiveError
from fsdp_compose._checks.order import CHECK_ENV, ExecutionOrderError, check_mode
from tests.harness import hang_timeout, run_on_ranks
from tests.models import (
    TinyLM,
    assert_parity,
    global_batch,
    lm_loss,
    local_slice,
    shard_blocks_then_root,
    train_against_reference,
)

# A rank left waiting would fail only at its group's timeout; a detected divergence takes well under a
# second (seconds on a loaded machine). Half the timeout tells the two apart on any machine.
GROUP_TIMEOUT_S = hang_timeout(300)
NOT_A_TIMEOUT_S = GROUP_TIMEOUT_S / 2


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


def _rank_one_skips_a_module() -> tuple[str, float]:
    model = _model()
    x = torch.randn(3, 4)
    started = time.monotonic()  # timed inside the ranks: starting them can take long under load
    return _catch(lambda: model(x, skip=dist.get_rank() == 1).sum().backward()), time.monotonic() - started


def test_rank_skipping_a_module_raises_everywhere():
    (error0, seconds0), (error1, seconds1) = run_on_ranks(2, _rank_one_skips_a_module)
    assert max(seconds0, seconds1) < NOT_A_TIMEOUT_S  # raised, not left to the 30-minute default timeout
    errors = [error0, error1]
    assert errors[0] == errors[1]
    assert_expected_inline(
        errors[0],
        """\
Ranks diverged: they were about to run different collectives of sharded modules (a rank skipped a sharded module, ran a different number of forward calls, or ran modules in another order; check data-dependent control flow):
  rank 0: all-gather of 'small' (Linear), 40 bytes
  rank 1: all-gather of 'big' (Linear), 120 bytes""",
    )


def _last_rank_skips_a_module() -> str:
    model = _model()
    return _catch(lambda: model(torch.randn(3, 4), skip=dist.get_rank() == 2).sum().backward())


def test_one_rank_of_three_diverging_is_named_everywhere():
    """Two ranks agree and one does not: all three raise the same error (a check that compared only
    against a majority would miss it)."""
    errors = run_on_ranks(3, _last_rank_skips_a_module)
    assert errors[0] == errors[1] == errors[2]
    assert_expected_inline(
        errors[0],
        """\
Ranks diverged: they were about to run different collectives of sharded modules (a rank skipped a sharded module, ran a different number of forward calls, or ran modules in another order; check data-dependent control flow):
  rank 0: all-gather of 'small' (Linear), 40 bytes
  rank 1: all-gather of 'small' (Linear), 40 bytes
  rank 2: all-gather of 'big' (Linear), 80 bytes""",
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
    errors = run_on_ranks(2, _different_forward_counts)
    assert all(e.startswith("Ranks diverged") for e in errors), errors
    assert "rank 0: all-gather of 'small' (Linear)" in errors[0]
    assert "rank 1: all-gather of 'big' (Linear)" in errors[0]  # rank 1 is already in backward


def _rank_one_stops() -> str:
    group = dist.new_group(timeout=timedelta(seconds=3))
    mesh = DeviceMesh.from_group(group, "cpu")
    model = _model(mesh)
    if dist.get_rank() == 1:
        dist.barrier()  # "stops": never runs the forward, and waits (on the default group) until rank 0 is done
        return "stopped"
    started = time.monotonic()
    try:
        model(torch.randn(3, 4))
        message = "no error"
    except CollectiveError as error:
        message = f"{error} after {time.monotonic() - started:.0f}s"
    dist.barrier()
    return message


def test_stopped_rank_fails_peers_within_group_timeout():
    """Rank 1 stays stopped until rank 0 has returned, so rank 0's error came while its peer never
    joined: from the group's 3 s timeout (a longer one, e.g. the 30-minute default, would leave both
    ranks to the harness's deadline). Ordered by the barrier, not by sleeps: nothing here is timed."""
    rank0, rank1 = run_on_ranks(2, _rank_one_stops)
    assert rank1 == "stopped"
    assert rank0.startswith("rank 0: the order check before the all-gather of '<root>' (TwoSizes) failed"), rank0
    assert "init_process_group(timeout=...)" in rank0
    assert float(rank0.rsplit(" after ", 1)[1][:-1]) >= 2, rank0  # waited for the group's timeout (3 s)


class LastKeptWhole(TwoSizes):
    """``small`` is resharded after forward and ``big`` is not, so a backward's first collective is a reduce-scatter."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.big(self.small(x)))


def _skip_backward_on_rank_one(mode: str, timeout_s: float) -> tuple[str, float]:
    os.environ[CHECK_ENV] = mode
    try:
        group = dist.new_group(timeout=timedelta(seconds=timeout_s))
        mesh = DeviceMesh.from_group(group, "cpu")
        torch.manual_seed(0)
        model = LastKeptWhole()
        fully_shard(model.small, mesh=mesh, reshard_after_forward=True)
        fully_shard(model.big, mesh=mesh, reshard_after_forward=False)
        fully_shard(model, mesh=mesh)
    finally:
        del os.environ[CHECK_ENV]
    x = torch.randn(3, 4)
    started = time.monotonic()
    try:
        for step in range(2):
            loss = model(x).sum()
            if not (step == 0 and dist.get_rank() == 1):  # e.g. a skipped batch (NaN loss) on one rank
                loss.backward()
        message = "no error"
    except (ExecutionOrderError, CollectiveError) as error:
        message = f"{type(error).__name__}: {error}"
    return message, time.monotonic() - started


@pytest.mark.parametrize("mode", ["1", "strict"])
def test_a_rank_that_skipped_backward_is_named_at_once(mode):
    """Rank 1 skips ``backward()`` once; on gloo both the default and ``strict`` check reduce-scatters too,
    so both ranks raise at once.

    Rank 0's backward starts with the reduce-scatter of ``big`` (the root's waits for the outputs of the
    modules its forward called: [Note: nested outputs]) while rank 1, already in
    the next forward, all-gathers ``small``. When the default mode checked all-gathers only,
    that reduce-scatter met rank 1's order check unchecked, the ranks' collectives stayed
    misaligned, and both failed only when the process group's timeout expired: in each of 8 runs
    of ``_skip_backward_on_rank_one("1", 5.0)`` each rank raised ``CollectiveError: ... the
    order check before the all-gather of 'small' (Linear) failed; another rank stopped ...`` after
    5 s (with ``init_process_group``'s default timeout that is 30 minutes). More backward cases:
    test_backward_divergence.py.
    """
    results = run_on_ranks(2, _skip_backward_on_rank_one, mode, GROUP_TIMEOUT_S)
    (error0, seconds0), (error1, seconds1) = results
    assert error0 == error1
    assert max(seconds0, seconds1) < NOT_A_TIMEOUT_S  # not the group timeout (it takes well under a second)
    assert_expected_inline(
        error0,
        """\
ExecutionOrderError: Ranks diverged: they were about to run different collectives of sharded modules (a rank skipped a sharded module, ran a different number of forward calls, or ran modules in another order; check data-dependent control flow):
  rank 0: reduce-scatter of 'big' (Linear), 128 bytes
  rank 1: all-gather of 'small' (Linear), 40 bytes
(reduce-scatters, and HSDP's all-reduces across replicas, run when a module's backward is done: ranks reach different ones when a rank skipped or repeated backward(), ran a different number of micro-batches without gradient sync, or computed no gradient this step for some parameters of a module it ran, e.g. skipped computation or an unused branch or expert; such a rank reduces that module only when backward ends)""",
    )


def _train_in_modes() -> dict:
    """The same model and batches trained with checks off, in the default and in the strict mode, then
    against a reference."""
    outcomes = {}
    for mode in ("0", "1", "strict"):
        os.environ[CHECK_ENV] = mode
        try:
            torch.manual_seed(0)
            model = TinyLM(n_blocks=2)
            shard_blocks_then_root(model)
        finally:
            del os.environ[CHECK_ENV]
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        losses = []
        for step in range(3):
            batch = local_slice(global_batch(step, dist.get_world_size()), dist.get_rank(), dist.get_world_size())
            loss = lm_loss(model, batch)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            losses.append(loss.item())
        outcomes[mode] = (losses, [p.full_tensor() for p in model.parameters()])
    (losses, params) = outcomes["0"]
    os.environ[CHECK_ENV] = "strict"
    try:
        parity = train_against_reference(lambda: TinyLM(n_blocks=2), shard_blocks_then_root, steps=3)
    finally:
        del os.environ[CHECK_ENV]
    return {
        **parity,
        "same_losses": all(outcomes[mode][0] == losses for mode in ("1", "strict")),
        "same_params": all(torch.equal(a, b) for mode in ("1", "strict") for a, b in zip(params, outcomes[mode][1])),
    }


def test_checked_modes_train_exactly_like_checks_off():
    results = run_on_ranks(3, _train_in_modes)  # 3 ranks: uneven shards
    assert all(r["same_losses"] and r["same_params"] for r in results)
    assert_parity(results)


def test_an_unknown_check_mode_is_refused(monkeypatch):
    """Mode ``tag`` (an in-data tag without a order check) is gone: a passed order check proves what it checked."""
    monkeypatch.setenv(CHECK_ENV, "tag")
    with pytest.raises(ValueError) as caught:
        check_mode()
    assert_expected_inline(
        str(caught.value), """FSDP_COMPOSE_CHECK_ORDER='tag': expected one of 1, strict, 0 (docs/schedule.md)"""
    )
