"""The harness never hangs: a failing rank whose peers wait in a collective ends the task."""

import time

import pytest
import torch
import torch.distributed as dist

from tests.harness import DEFAULT_TIMEOUT_S, RankFailure, run_on_ranks


def _one_rank_fails():
    if dist.get_rank() == 1:
        raise ValueError("rank 1 broke")
    dist.all_reduce(torch.ones(1))  # rank 0 waits here for a peer that never comes
    return "unreachable"


HANG_S = 3600.0  # longer than any deadline below: a run that waited for it failed to kill


def _hangs_everywhere():
    time.sleep(HANG_S)


def _rank():
    return dist.get_rank()


@pytest.mark.slow  # kills its pool: the next test starts new workers
def test_failure_on_one_rank_kills_the_stuck_peer():
    run_on_ranks(2, _rank)  # start the workers first: under load that alone can take seconds
    start = time.monotonic()
    with pytest.raises(RankFailure) as info:
        run_on_ranks(2, _one_rank_fails)
    assert "rank 1 raised" in str(info.value) and "ValueError: rank 1 broke" in str(info.value)
    assert "rank 0 gave no result" in str(info.value)
    # killed a few seconds after rank 1 failed, not at the run's deadline (a hang detector's bound, not a timing)
    assert time.monotonic() - start < DEFAULT_TIMEOUT_S / 2
    assert run_on_ranks(2, _rank) == [0, 1]  # a fresh pool serves the next test


@pytest.mark.slow  # kills its pool: the next test starts new workers
def test_timeout_kills_workers():
    start = time.monotonic()
    with pytest.raises(RankFailure, match="gave no result within 2s"):
        run_on_ranks(2, _hangs_everywhere, timeout=2)
    assert time.monotonic() - start < HANG_S / 2  # the workers were killed, not waited for


def _rank_one_dies():
    if dist.get_rank() == 1:
        import os

        os.abort()  # what a gloo abort or std::terminate does to a rank
    dist.all_reduce(torch.ones(1))
    return "unreachable"


@pytest.mark.slow  # kills its pool: the next test starts new workers
def test_a_dead_rank_is_reported_with_its_exit_code():
    with pytest.raises(RankFailure) as info:
        run_on_ranks(2, _rank_one_dies)
    assert "rank 1 died with exit code -6" in str(info.value), str(info.value)
    assert run_on_ranks(2, _rank) == [0, 1]


def _every_rank_exits():
    import os

    os._exit(3)  # no exception, no result, no peer left waiting: as a rank that fails to start


@pytest.mark.slow  # kills its pool: the next test starts new workers
def test_ranks_that_all_die_are_reported_at_once():
    """Nothing is left to raise or time out: the results queue is read a second at a time, so the deaths
    show within seconds (a single read for the whole time-out took the full 10 minutes)."""
    run_on_ranks(2, _rank)  # start the workers first: under load that alone can take seconds
    start = time.monotonic()
    with pytest.raises(RankFailure) as info:
        run_on_ranks(2, _every_rank_exits)
    assert time.monotonic() - start < DEFAULT_TIMEOUT_S / 10, time.monotonic() - start
    assert "rank 0 died with exit code 3" in str(info.value) and "rank 1 died with exit code 3" in str(info.value)
    assert run_on_ranks(2, _rank) == [0, 1]
