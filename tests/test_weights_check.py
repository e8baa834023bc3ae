"""Issue 40, item 3: ranks that built different weights fail at ``fully_shard``, on every rank, naming
the parameters and the fixes; without the check the model silently trains a mix of the ranks' copies."""

import os

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from fsdp_compose import fully_shard, sync_module_states
from fsdp_compose.weights_check import CHECK_ENV
from tests.harness import run_on_ranks
from tests.models import TinyLM, shard_blocks_then_root


def _seeded_by_rank(fix: str) -> dict:
    torch.manual_seed(dist.get_rank())  # the mistake: each rank its own initialisation
    model = TinyLM()
    copy = {n: p.detach().clone() for n, p in model.named_parameters()}
    if fix == "sync":
        sync_module_states(model)
    out = {"error": None}
    if fix == "off":
        os.environ[CHECK_ENV] = "0"
    try:
        shard_blocks_then_root(model)
    except ValueError as error:
        out["error"] = str(error)
    finally:
        os.environ.pop(CHECK_ENV, None)
    out["untouched"] = not any(isinstance(p, DTensor) for p in model.parameters())
    if out["error"] is None:
        # the full parameter the ranks now share: rows from each rank's own copy
        full = model.blocks[0].fc1.weight.full_tensor()
        copies = [torch.empty_like(full) for _ in range(dist.get_world_size())]
        dist.all_gather(copies, copy["blocks.0.fc1.weight"])
        out["equals_a_rank_copy"] = [torch.equal(full, c) for c in copies]
    return out


def test_ranks_with_different_weights_fail_at_fully_shard():
    for out in run_on_ranks(2, _seeded_by_rank, "none"):  # every rank
        assert out["error"].startswith(
            "fully_shard(Block): ranks hold different values of 'norm.weight', 'norm.bias', 'fc1.weight' and 3 more"
        ) or out["error"].startswith("fully_shard(Block): ranks hold different values of 'fc1.weight'"), out["error"]
        assert "torch.manual_seed" in out["error"] and "sync_module_states" in out["error"]
        assert f"{CHECK_ENV}=0" in out["error"]
        assert out["untouched"], out  # nothing was sharded


def test_without_the_check_the_model_is_a_mix_and_sync_fixes_it():
    for out in run_on_ranks(2, _seeded_by_rank, "off"):
        assert out["error"] is None and out["equals_a_rank_copy"] == [False, False], out  # neither rank's model
    for out in run_on_ranks(2, _seeded_by_rank, "sync"):
        assert out["error"] is None and out["equals_a_rank_copy"] == [True, False], out  # rank 0's, everywhere


def _meta_is_skipped() -> bool:
    torch.manual_seed(dist.get_rank())
    with torch.device("meta"):
        model = TinyLM()
    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)
    return all(isinstance(p, DTensor) for p in model.parameters())


def test_meta_parameters_are_not_compared():
    assert run_on_ranks(2, _meta_is_skipped) == [True, True]


def _hsdp_one_rank_differs() -> str | None:
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    torch.manual_seed(1 if dist.get_rank() == 3 else 0)  # agrees with rank 0 along no mesh dim
    try:
        fully_shard(TinyLM().blocks[0], mesh=mesh)
    except ValueError as error:
        return str(error).split(";")[0]
    return None


def test_hsdp_a_rank_differing_off_this_ranks_dims_is_still_seen():
    """Compared over the whole 2-D mesh, not each dim alone: rank 0 shares no mesh group with rank 3."""
    assert run_on_ranks(4, _hsdp_one_rank_differs) == [
        "fully_shard(Block): ranks hold different values of 'fc1.weight', 'fc1.bias', 'fc2.weight' and 1 more"
    ] * 4  # the norm's ones and zeros do not depend on the seed
