"""Issue 40, item 3 and issue 51, item 1: ranks that train with different weights fail at the root's first
forward, on every rank, naming the parameters and the fixes; ranks that differed only at ``fully_shard``
(an unseeded model about to be loaded) and were written since pass; without the check the model silently
trains a mix of the ranks' copies."""

import os
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, distribute_tensor

from fsdp_compose import fully_shard, sync_module_states
from fsdp_compose._checks.weights import CHECK_ENV
from fsdp_compose._runtime.process_wide import DISABLE_ENV
from tests.harness import hang_timeout, run_on_ranks
from tests.models import TinyLM, global_batch, lm_loss, local_slice, shard_blocks_then_root


def _first_forward_error(model: TinyLM) -> str | None:
    rank, world = dist.get_rank(), dist.get_world_size()
    try:
        lm_loss(model, local_slice(global_batch(0, world), rank, world)).backward()
    except ValueError as error:
        return str(error)
    return None


def _seeded_by_rank(fix: str) -> dict:
    torch.manual_seed(dist.get_rank())  # the mistake: each rank its own initialisation
    model = TinyLM()
    copy = {n: p.detach().clone() for n, p in model.named_parameters()}
    if fix == "sync":
        sync_module_states(model)
    if fix == "off":
        os.environ[CHECK_ENV] = "0"
    if fix == "disabled":  # the one opt-out variable (docs/troubleshooting.md, "Process-wide effects")
        os.environ[DISABLE_ENV] = "weights_check"
    try:
        shard_blocks_then_root(model)  # compares, records, raises nothing
        out = {"error": _first_forward_error(model)}
    finally:
        os.environ.pop(CHECK_ENV, None)
        os.environ.pop(DISABLE_ENV, None)
    out["sharded"] = all(isinstance(p, DTensor) for p in model.parameters())
    if out["error"] is None:
        # the full parameter the ranks now share: rows from each rank's own copy
        full = model.blocks[0].fc1.weight.full_tensor()
        copies = [torch.empty_like(full) for _ in range(dist.get_world_size())]
        dist.all_gather(copies, copy["blocks.0.fc1.weight"])
        out["equals_a_rank_copy"] = [torch.equal(full, c) for c in copies]
    else:  # the model is as it was: the same error again, then a load fixes it
        out["again"] = _first_forward_error(model) == out["error"]
        torch.manual_seed(0)
        model.load_state_dict(TinyLM().state_dict())
        out["after_load"] = _first_forward_error(model)
    return out


def test_ranks_with_different_weights_fail_at_the_first_forward():
    for out in run_on_ranks(2, _seeded_by_rank, "none"):  # every rank
        assert out["error"].startswith(
            "fully_shard(TinyLM) of '<root>': ranks hold different values of 'embed.weight', 'head.weight', 'head.bias'"
        ), out["error"]  # the root's group first: its pre-forward runs the check of every group under it
        assert "torch.manual_seed" in out["error"] and "sync_module_states" in out["error"]
        assert f"{DISABLE_ENV}=weights_check" in out["error"] and f"{CHECK_ENV}=0" in out["error"]
        assert out["sharded"] and out["again"] and out["after_load"] is None, out


def test_without_the_check_the_model_is_a_mix_and_sync_fixes_it():
    for fix in ("off", "disabled"):
        for out in run_on_ranks(2, _seeded_by_rank, fix):
            assert out["error"] is None and out["equals_a_rank_copy"] == [False, False], out  # neither rank's model
    for out in run_on_ranks(2, _seeded_by_rank, "sync"):
        assert out["error"] is None and out["equals_a_rank_copy"] == [True, False], out  # rank 0's, everywhere


def _reference() -> TinyLM:
    torch.manual_seed(0)
    return TinyLM()


def _unseeded_sharded() -> TinyLM:
    torch.manual_seed(100 + dist.get_rank())  # a fresh process's random seed: ranks differ
    model = TinyLM()
    shard_blocks_then_root(model)
    return model


def _loads_after_fully_shard(tmp: str) -> dict:
    """Every way of writing the shards after fully_shard and before the first forward: no error, and the model
    is the loaded one (its loss equals the unsharded reference's)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import set_model_state_dict

    from fsdp_compose import load_checkpoint, save_checkpoint

    rank, world = dist.get_rank(), dist.get_world_size()
    reference = _reference()
    batch = local_slice(global_batch(0, world), rank, world)
    expected = lm_loss(reference, batch).item()
    saved = _unseeded_sharded()
    saved.load_state_dict(reference.state_dict())
    dcp.save(saved.state_dict(), checkpoint_id=f"{tmp}/dcp")
    save_checkpoint(f"{tmp}/ours", saved)

    def dcp_then_load_state_dict(model):
        state = model.state_dict()
        dcp.load(state, checkpoint_id=f"{tmp}/dcp")
        model.load_state_dict(state)

    def in_place_init(model):
        with torch.no_grad():
            for name, p in model.named_parameters():  # e.g. an init that draws the full value, then keeps its rows
                p.copy_(distribute_tensor(reference.get_parameter(name).detach(), p.device_mesh, p.placements))

    def replaced(model):  # load_state_dict(assign=True) registers new shards
        model.load_state_dict({k: v.clone() for k, v in reference.state_dict().items()}, assign=True)

    loads = {
        "load_state_dict": lambda model: model.load_state_dict(reference.state_dict()),
        "dcp.load alone": lambda model: dcp.load(model.state_dict(), checkpoint_id=f"{tmp}/dcp"),
        "dcp.load then load_state_dict": dcp_then_load_state_dict,
        "set_model_state_dict": lambda model: set_model_state_dict(model, reference.state_dict()),
        "load_checkpoint": lambda model: load_checkpoint(f"{tmp}/ours", model),
        "in-place init under no_grad": in_place_init,
        "load_state_dict(assign=True)": replaced,
    }
    out = {}
    for name, load in loads.items():
        model = _unseeded_sharded()
        load(model)
        try:
            out[name] = abs(lm_loss(model, batch).item() - expected)
        except ValueError as error:
            out[name] = str(error)
    # reset_iter_state after a failed first step, then training goes on
    model = _unseeded_sharded()
    model.load_state_dict(reference.state_dict())
    handle = model.blocks[1].register_forward_hook(lambda *_: 1 / 0)
    try:
        lm_loss(model, batch)
    except ZeroDivisionError:
        model.reset_iter_state()
    handle.remove()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    loss = lm_loss(model, batch)
    loss.backward()
    optimizer.step()
    out["after reset_iter_state"] = abs(loss.item() - expected)
    return out


@pytest.mark.parametrize("world", [2, 3])
def test_loading_after_fully_shard_is_not_refused(world, tmp_path):
    """Issue 51: build without a seed, shard, load, train, as with torch's FSDP2 (3 ranks: uneven shards)."""
    for out in run_on_ranks(world, _loads_after_fully_shard, str(tmp_path)):
        assert all(isinstance(v, float) and v <= 1e-5 for v in out.values()), out


def _loaded_on_rank_0_only() -> str | None:
    torch.manual_seed(100 + dist.get_rank())
    model = TinyLM()
    if dist.get_rank() == 0:  # the mistake: pretrained weights on rank 0 only, before fully_shard
        model.load_state_dict(_reference().state_dict())
    shard_blocks_then_root(model)
    return _first_forward_error(model)


def test_weights_loaded_on_rank_0_only_are_caught():
    errors = run_on_ranks(3, _loaded_on_rank_0_only)
    assert len(set(errors)) == 1, errors  # every rank
    assert errors[0].startswith("fully_shard(TinyLM) of '<root>': ranks hold different values"), errors


def _all_meta() -> bool:
    torch.manual_seed(dist.get_rank())
    with torch.device("meta"):
        model = TinyLM()
    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)
    return all(isinstance(p, DTensor) for p in model.parameters())


def test_ranks_all_on_meta_agree():
    assert run_on_ranks(2, _all_meta) == [True, True]


def _rank_0_real_others_meta() -> float:
    """torch's "rank 0 loads, the others build on meta" recipe: ``fully_shard`` on every rank (rank 0 compares
    values with ranks that have none: it must not wait alone), then rank 0's full state dict broadcast."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    rank, world = dist.get_rank(), dist.get_world_size()
    reference = _reference()
    if rank == 0:
        model = _reference()
    else:
        with torch.device("meta"):
            model = TinyLM()
    shard_blocks_then_root(model)
    if rank != 0:
        model.to_empty(device="cpu")
    full = reference.state_dict() if rank == 0 else {}
    set_model_state_dict(model, full, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))
    batch = local_slice(global_batch(0, world), rank, world)
    return abs(lm_loss(model, batch).item() - lm_loss(reference, batch).item())


@pytest.mark.parametrize("world", [2, 3])
def test_rank_0_values_and_meta_elsewhere_then_a_broadcast_trains(world):
    """It hung: the meta ranks skipped the comparison's all-reduce that rank 0 entered."""
    assert all(diff <= 1e-5 for diff in run_on_ranks(world, _rank_0_real_others_meta))


def _hsdp_one_rank_differs(load_on_replica_0: bool) -> str | None:
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    torch.manual_seed(1 if dist.get_rank() == 3 else 0)  # agrees with rank 0 along no mesh dim
    block = TinyLM().blocks[0]
    fully_shard(block, mesh=mesh)
    if load_on_replica_0:  # HSDP's resume: replica 0 loads, then broadcasts each shard to the other replicas
        torch.manual_seed(0)
        if mesh.get_local_rank(0) == 0:
            block.load_state_dict(TinyLM().blocks[0].state_dict())
        for p in block.parameters():
            dist.broadcast(p.to_local(), src=mesh.mesh[0, mesh.get_local_rank(1)].item(), group=mesh.get_group(0))
    try:
        block(torch.randn(2, block.fc1.in_features))
    except ValueError as error:
        return str(error).split(";")[0]
    return None


@pytest.mark.slow  # 4 ranks
def test_hsdp_a_rank_differing_off_this_ranks_dims_is_still_seen():
    """Compared over the whole 2-D mesh, not each dim alone: rank 0 shares no mesh group with rank 3; a load on
    replica 0 then a broadcast across replicas (no write seen on the others) passes."""
    assert run_on_ranks(4, _hsdp_one_rank_differs, False) == [
        "fully_shard(Block) of '<root>': ranks hold different values of 'fc1.weight', 'fc1.bias', 'fc2.weight' "
        "and 1 more"
    ] * 4  # the norm's ones and zeros do not depend on the seed
    assert run_on_ranks(4, _hsdp_one_rank_differs, True) == [None] * 4


def test_unseeded_thread_ranks_train_in_a_process_of_their_own():
    """torch's own FSDP2 tests run ranks as threads of one process (``threaded_weights_case.py``); run there, in
    a fresh interpreter: the threaded world it tears down left torch 2.11 crashing the next test of this process
    that shards on one rank (``nn.Parameter`` of a DTensor): its threaded backend's teardown fails there
    ('ThreadLocalWorld' object has no attribute 'comms')."""
    case = os.path.join(os.path.dirname(__file__), "threaded_weights_case.py")
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", case],
        capture_output=True, text=True, timeout=hang_timeout(),
    )
    assert done.returncode == 0 and "1 passed" in done.stdout, done.stdout[-3000:] + done.stderr[-3000:]
