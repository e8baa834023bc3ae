"""Sharded and full state dicts, DCP resharding across world sizes, optimizer state dicts."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.tensor import DTensor

from fsdp_compose import full_state_dict, fully_shard, load_full_state_dict
from fsdp_compose.extras.observe.storage import StorageTracker
from tests.harness import run_on_ranks
from tests.models import TinyLM, global_batch, lm_loss, local_slice, max_abs_diff, shard_blocks_then_root

TOL = 1e-6
FULL = StateDictOptions(full_state_dict=True, cpu_offload=True)


def _max_diff(ours: dict, theirs: dict) -> float:
    assert list(ours) == list(theirs), (list(ours), list(theirs))
    return max(max_abs_diff(ours[k], theirs[k]) for k in ours)


def _full(sd: dict) -> dict:
    return {k: v.full_tensor() if isinstance(v, DTensor) else v for k, v in sd.items()}


def _sharded_pair(seed: int = 0) -> tuple[nn.Module, nn.Module]:
    torch.manual_seed(seed)
    reference = TinyLM()
    model = copy.deepcopy(reference)
    shard_blocks_then_root(model)
    return model, reference


def _step(model: nn.Module, reference: nn.Module, opt, ref_opt, step: int) -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    batch = global_batch(step, world)
    lm_loss(model, local_slice(batch, rank, world)).backward()
    lm_loss(reference, batch).backward()
    for o in (opt, ref_opt):
        o.step()
        o.zero_grad()


def _model_state_dicts() -> dict:
    rank = dist.get_rank()
    model, reference = _sharded_pair()
    other = TinyLM()  # different values (the seed moved on)
    out = {}

    # state_dict(): DTensors with the unsharded model's names and values, also between a
    # forward and its backward, when the root keeps its unsharded parameters registered
    ids = local_slice(global_batch(0, dist.get_world_size()), rank, dist.get_world_size())
    loss = lm_loss(model, ids)
    assert not isinstance(model.embed.weight, DTensor)  # the root is still unsharded
    sd = model.state_dict()
    assert all(isinstance(v, DTensor) for v in sd.values()), {k: type(v) for k, v in sd.items()}
    out["sd_vs_ref"] = _max_diff(_full(sd), reference.state_dict())
    kv = model.state_dict(keep_vars=True)
    assert all(isinstance(v, nn.Parameter) and isinstance(v, DTensor) for v in kv.values())

    # load_state_dict with plain full tensors while unsharded: the next forward must use them
    model.load_state_dict(other.state_dict())
    out["load_full_vs_other"] = _max_diff(_full(model.state_dict()), other.state_dict())
    with torch.no_grad():
        out["fwd_after_load"] = (model(ids) - other(ids)).abs().max().item()
    loss.backward()  # the pending backward still runs (it gathers again)

    # load_state_dict with DTensors (another sharded model's state dict)
    third, third_ref = _sharded_pair(seed=5)
    model.load_state_dict(third.state_dict())
    out["load_dtensor"] = _max_diff(_full(model.state_dict()), third_ref.state_dict())

    # torch's full state dict API
    full = get_model_state_dict(model, options=FULL)  # cpu_offload keeps it on rank 0 only
    if rank == 0:
        out["get_full"] = _max_diff(full, third_ref.state_dict())
        assert all(v.device.type == "cpu" and not isinstance(v, DTensor) for v in full.values())
    else:
        assert full == {}
    set_model_state_dict(model, other.state_dict(), options=StateDictOptions(full_state_dict=True))
    out["set_full"] = _max_diff(_full(model.state_dict()), other.state_dict())

    # our group-at-a-time helpers
    mine = full_state_dict(model)
    if rank == 0:
        out["ours_full"] = _max_diff(mine, other.state_dict())
    else:
        assert mine == {}
    out["ours_full_all"] = _max_diff(full_state_dict(model, rank0_only=False), other.state_dict())
    load_full_state_dict(model, third_ref.state_dict() if rank == 0 else None)
    out["ours_load"] = _max_diff(_full(model.state_dict()), third_ref.state_dict())
    broken = third_ref.state_dict()
    del broken["head.bias"]
    broken["blocks.0.fc2.weight"] = torch.zeros(2, 2)
    with pytest.raises(ValueError, match=r"'head\.bias'.*'blocks\.0\.fc2\.weight'|'blocks\.0\.fc2\.weight'.*'head\.bias'"):
        load_full_state_dict(model, broken if rank == 0 else None)
    out["unchanged_after_refusal"] = _max_diff(_full(model.state_dict()), third_ref.state_dict())

    # nn.Module names a wrong shape (and, as for any module, may have loaded other keys)
    bad = other.state_dict()
    bad["blocks.1.fc1.weight"] = torch.zeros(3, 3)
    with pytest.raises(RuntimeError, match=r"blocks\.1\.fc1\.weight"):
        model.load_state_dict(bad)
    return out


def _optimizer_state_dicts() -> dict:
    model, reference = _sharded_pair()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-2)
    for step in range(2):
        _step(model, reference, opt, ref_opt, step)
    out = {}
    names = {id(p): n for n, p in reference.named_parameters()}
    ref_state = {names[id(p)]: s for p, s in ref_opt.state.items()}
    full = get_optimizer_state_dict(model, opt, options=StateDictOptions(full_state_dict=True))
    on_cpu = get_optimizer_state_dict(model, opt, options=FULL)  # rank 0 only
    assert (dist.get_rank() == 0) == bool(on_cpu)
    out["full_keys"] = sorted(full["state"]) == sorted(ref_state)
    out["full_diff"] = max(
        (full["state"][n][k] - ref_state[n][k]).abs().max().item() for n in ref_state for k in ("exp_avg", "exp_avg_sq", "step")
    )
    sharded = get_optimizer_state_dict(model, opt)
    assert isinstance(sharded["state"]["embed.weight"]["exp_avg"], DTensor)

    # a fresh model + optimizer restored from the full and from the sharded dicts train on in lockstep
    expected = _continue(reference, ref_opt, 2).state_dict()
    rank, world = dist.get_rank(), dist.get_world_size()
    for kind, options in (("sharded", StateDictOptions()), ("full", StateDictOptions(full_state_dict=True))):
        msd = get_model_state_dict(model, options=options)
        # state dicts alias the live state (as torch's do): copy, or fresh_opt.step() edits opt
        osd = copy.deepcopy(get_optimizer_state_dict(model, opt, options=options))
        fresh, _ = _sharded_pair(seed=9)
        fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=1e-2)
        set_model_state_dict(fresh, msd, options=options)
        set_optimizer_state_dict(fresh, fresh_opt, osd, options=options)
        lm_loss(fresh, local_slice(global_batch(2, world), rank, world)).backward()
        fresh_opt.step()
        out[f"{kind}_resumed_vs_ref"] = _max_diff(_full(fresh.state_dict()), expected)
    return out


def _continue(reference: nn.Module, ref_opt, step: int) -> nn.Module:
    """The reference after one more step, computed on a copy (reference stays as it was)."""
    twin = copy.deepcopy(reference)
    twin_opt = torch.optim.AdamW(twin.parameters(), lr=1e-2)
    twin_opt.load_state_dict(ref_opt.state_dict())
    batch = global_batch(step, dist.get_world_size())
    lm_loss(twin, batch).backward()
    twin_opt.step()
    return twin


def test_model_state_dicts():
    for out in run_on_ranks(2, _model_state_dicts):
        assert all(v <= TOL for v in out.values()), out


def test_optimizer_state_dicts():
    for out in run_on_ranks(2, _optimizer_state_dicts):
        assert out.pop("full_keys"), out
        assert all(v <= TOL for v in out.values()), out


# ----- DCP: save at one world size, load at another ------------------------------------------
def _trained(seed: int = 0, steps: int = 2):
    model, reference = _sharded_pair(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-2)
    for step in range(steps):
        _step(model, reference, opt, ref_opt, step)
    return model, opt


def _full_states(model: nn.Module, opt) -> tuple[dict, dict]:
    options = StateDictOptions(full_state_dict=True)
    return get_model_state_dict(model, options=options), get_optimizer_state_dict(model, opt, options=options)["state"]


def _dcp_save(path: str) -> tuple[dict, dict]:
    model, opt = _trained()
    dcp.save({"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, opt)}, checkpoint_id=path)
    return _full_states(model, opt)


def _dcp_load(path: str) -> tuple[dict, dict]:
    model, opt = _trained(seed=7, steps=1)  # other values, and optimizer state to overwrite
    state = {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, opt)}
    dcp.load(state, checkpoint_id=path)
    set_model_state_dict(model, state["model"])
    set_optimizer_state_dict(model, opt, state["optim"])
    return _full_states(model, opt)


def _states_diff(a: tuple[dict, dict], b: tuple[dict, dict]) -> float:
    params = _max_diff(a[0], b[0])
    assert sorted(a[1]) == sorted(b[1])
    optim = max(max_abs_diff(a[1][n][k], b[1][n][k]) for n in a[1] for k in a[1][n])
    return max(params, optim)


@pytest.mark.parametrize("save_ws,load_ws", [(2, 3), pytest.param(4, 2, marks=pytest.mark.slow)])
def test_dcp_reshards_across_world_sizes(tmp_path, save_ws, load_ws):
    saved = run_on_ranks(save_ws, _dcp_save, str(tmp_path))[0]
    for loaded in run_on_ranks(load_ws, _dcp_load, str(tmp_path)):
        assert _states_diff(saved, loaded) == 0.0


# ----- memory: full_state_dict holds about one group at a time --------------------------------
class _Wide(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        from tests.models import Block

        self.blocks = nn.ModuleList(Block(256, 1024) for _ in range(8))


def _peak_extra_bytes(model: nn.Module, fn):
    """(fn(), peak live tensor bytes above the start), counted by storage (not RSS, which load and
    the allocator's caching move): the sharded parameters are tracked from the start, and every
    storage made or touched inside ``fn`` counts until it dies."""
    with StorageTracker(devices={"cpu"}) as tracker:
        tracker.track(model.parameters())
        base = tracker.current
        tracker.reset_peak()
        result = fn()
    return result, tracker.peak - base


def _nbytes(sd: dict) -> int:
    return sum(v.numel() * v.element_size() for v in sd.values())


def _full_state_dict_memory() -> dict:
    torch.manual_seed(0)
    model = _Wide()
    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)
    group = sum(p.numel() * p.element_size() for p in model.blocks[0].parameters())  # full bytes
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    ours, ours_peak = _peak_extra_bytes(model, lambda: full_state_dict(model))
    ours_extra = ours_peak - _nbytes(ours)  # rank 0 keeps the result; the rest is transient
    del ours
    naive, naive_peak = _peak_extra_bytes(
        model, lambda: get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
    )
    return {"group": group, "total": total, "ours_extra": ours_extra, "naive_peak": naive_peak}


def test_full_state_dict_peak_memory_is_one_group():
    for rank, r in enumerate(run_on_ranks(2, _full_state_dict_memory)):
        print(f"rank {rank}: {r}")
        # counted by storage, beyond the result: rank 0 the rows it receives (one group), the
        # others their half of it. gloo's worker thread drops a finished gather's tensors only after
        # wait() returns, so the previous group's may still be live: measured 1 group on rank 0 and
        # 0.5 or 1 on rank 1 in six runs, under load too; one more group allowed on rank 0 for it
        assert r["ours_extra"] <= (2 if rank == 0 else 1) * r["group"], r
        # the measurement does see a whole-model (8-group) gather, so the bound above means something
        assert r["naive_peak"] >= 0.9 * r["total"], r
