"""``raise_together``: every rank raises the same error, or none does, and none is left waiting.

The primitive behind the order check, ``load_full_state_dict``, ``save_checkpoint``/``load_checkpoint`` and
``load_pretrained``: on 2 and 3 gloo ranks, one rank failing makes every rank raise the same message at once
(each rank's call returns in well under a second, where a rank left in a collective would wait for the harness's
deadline), no rank failing raises nothing, and ``source=r`` takes rank ``r``'s finding alone.
"""

from __future__ import annotations

import time

import pytest
import torch.distributed as dist

from fsdp_compose.extras_api import raise_together
from tests.harness import run_on_ranks


class Refused(ValueError):
    pass


def _outcome(error, **kwargs) -> tuple[str, str, float]:
    """(the exception's type, its message, seconds the call took); ("", "", s) when none was raised."""
    start = time.monotonic()
    try:
        raise_together(error, **kwargs)
    except Exception as raised:  # noqa: BLE001 - compared across ranks below
        return type(raised).__name__, str(raised), time.monotonic() - start
    return "", "", time.monotonic() - start


def _cases() -> dict:
    rank, world = dist.get_rank(), dist.get_world_size()
    last = world - 1
    out = {
        "none fails": _outcome(None),
        "the last fails": _outcome(f"bad file on rank {rank}" if rank == last else None, cls=Refused),
        "all fail": _outcome(f"bad file on rank {rank}"),
        "combined": _outcome(rank or None, message=lambda found: f"found {found}"),
        "source 0 fails": _outcome("rank 0's check failed" if rank == 0 else None, source=0, cls=Refused),
        # only the source's finding counts: another rank's is not read
        "source 0 passes": _outcome(None if rank == 0 else f"ignored on rank {rank}", source=0),
        "source last fails": _outcome(f"rank {rank}'s check failed" if rank == last else None, source=last),
    }
    sub = dist.new_group([0, last])  # a group without rank 1 on 3 ranks: source is a rank of the group
    if rank in (0, last):
        out["in a group"] = _outcome("bad" if rank == last else None, group=sub, source=1)
    return out


@pytest.mark.parametrize("world", [2, 3])
def test_every_rank_raises_the_same_error_or_none_does(world: int) -> None:
    results = run_on_ranks(world, _cases)
    last = world - 1
    for name in results[0]:
        outcomes = [r[name][:2] for r in results if name in r]
        assert all(o == outcomes[0] for o in outcomes), (name, outcomes)  # the same type and message everywhere
        assert all(r[name][2] < 10 for r in results if name in r), (name, [r[name][2] for r in results])
    first = results[0]
    others = f" and {world - 1} other rank(s)"
    assert {name: outcome[:2] for name, outcome in first.items()} == {
        "none fails": ("", ""),
        "the last fails": ("Refused", f"bad file on rank {last} (rank {last})"),
        "all fail": ("ValueError", f"bad file on rank 0 (rank 0{others})"),
        "combined": ("ValueError", f"found {[None, *range(1, world)]}"),
        "source 0 fails": ("Refused", "rank 0's check failed"),
        "source 0 passes": ("", ""),
        "source last fails": ("ValueError", f"rank {last}'s check failed"),
        "in a group": ("ValueError", "bad"),
    }


def test_without_a_process_group_the_own_error_is_raised() -> None:
    if dist.is_initialized():
        pytest.skip("this process holds a process group")
    assert _outcome(None)[:2] == ("", "")
    assert _outcome("bad", cls=Refused)[:2] == ("Refused", "bad")
    assert _outcome("bad", source=0)[:2] == ("ValueError", "bad")
