"""The harness never hangs: a failing rank whose peers wait in a collective ends the task."""

import time

import pytest
import torch
import torch.distributed as dist

from tests.harness import RankFailure, run_on_ranks


def _one_rank_fails():
    if dist.get_rank() == 1:
        raise ValueError("rank 1 broke")
    dist.all_reduce(torch.ones(1))  # rank 0 waits here for a peer that never comes
    return "unreachable"


def _hangs_everywhere():
    time.sleep(60)


def _rank():
    return dist.get_rank()


def test_failure_on_one_rank_kills_the_stuck_peer():
    run_on_ranks(2, _rank)  # start the workers first: under load that alone can take seconds
    start = time.monotonic()
    with pytest.raises(RankFailure) as info:
        run_on_ranks(2, _one_rank_fails)
    assert "rank 1 raised" in str(info.value) and "ValueError: rank 1 broke" in str(info.value)
    assert "rank 0 gave no result" in str(info.value)
    assert time.monotonic() - start < 30
    assert run_on_ranks(2, _rank) == [0, 1]  # a fresh pool serves the next test


def test_timeout_kills_workers():
    start = time.monotonic()
    with pytest.raises(RankFailure, match="gave no result within 2s"):
        run_on_ranks(2, _hangs_everywhere, timeout=2)
    assert time.monotonic() - start < 20


def _rank_one_dies():
    if dist.get_rank() == 1:
        import os

        os.abort()  # what a gloo abort or std::terminate does to a rank
    dist.all_reduce(torch.ones(1))
    return "unreachable"


def test_a_dead_rank_is_reported_with_its_exit_code():
    with pytest.raises(RankFailure) as info:
        run_on_ranks(2, _rank_one_dies)
    assert "rank 1 died with exit code -6" in str(info.value), str(info.value)
    assert run_on_ranks(2, _rank) == [0, 1]
