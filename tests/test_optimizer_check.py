"""Issue 40, item 1: an optimizer built before ``fully_shard`` fails at its first step, on every rank,
naming a parameter and the fix; without the check, two steps change nothing, in silence."""

import torch
from torch.distributed.tensor import DTensor

from fsdp_compose import optimizer_check
from tests.harness import run_on_ranks
from tests.models import TinyLM, global_batch, lm_loss, local_slice, shard_blocks_then_root


def _optimizer_first(check: bool) -> dict:
    import torch.distributed as dist

    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = TinyLM()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)  # the mistake: before fully_shard
    shard_blocks_then_root(model)
    before = {n: p.full_tensor().clone() for n, p in model.named_parameters()}
    out = {"error": None}
    if not check:  # what happens without the check (as marked already checked): the mistake passes in silence
        setattr(optimizer, optimizer_check._CHECKED_ATTR, len(optimizer.param_groups))
    try:
        for step in range(2):
            lm_loss(model, local_slice(global_batch(step, world), rank, world)).backward()
            optimizer.step()
            optimizer.zero_grad()
    except RuntimeError as error:
        out["error"] = str(error)
    out["unchanged"] = all(torch.equal(p.full_tensor(), before[n]) for n, p in model.named_parameters())
    # built after fully_shard, the same optimizer trains
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    lm_loss(model, local_slice(global_batch(0, world), rank, world)).backward()
    optimizer.step()
    out["trains_when_built_after"] = not all(
        torch.equal(p.full_tensor(), before[n]) for n, p in model.named_parameters()
    )
    out["sharded"] = all(isinstance(p, DTensor) for p in model.parameters())
    return out


def test_an_optimizer_built_before_fully_shard_fails_at_its_first_step():
    for out in run_on_ranks(2, _optimizer_first, True):  # every rank
        assert out["error"].startswith(
            "SGD.step(): the optimizer holds parameter 'embed.weight' of '<root>' (TinyLM), which fully_shard "
            "replaced by its sharded DTensor"
        ), out["error"]
        assert "Build the optimizer after fully_shard" in out["error"]
        assert out["unchanged"] and out["trains_when_built_after"] and out["sharded"], out


def test_without_the_check_the_mistake_trains_nothing():
    for out in run_on_ranks(2, _optimizer_first, False):
        assert out["error"] is None and out["unchanged"], out
