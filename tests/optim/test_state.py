"""OwnerComputedMuon's state dicts: each matrix's momentum saved as row shards, loaded back to the owners.

The owner keeps a whole momentum buffer; ``state_dict()`` presents it as a ``Shard(0)`` DTensor laid out like
the parameter, so DCP saves it, and loads it at another world size, where ``load_state_dict()`` sends the
rows to that run's owners. A resumed run must equal an uninterrupted one.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from fsdp_compose.optim import OwnerComputedMuon
from tests.harness import run_on_ranks
from tests.models import full_value
from tests.optim.test_matrix import PER_RANK, MatrixNet, _batch, _count_collectives, _loss, _optimizers, _shard, _step

STEPS, SAVE_AT = 4, 2


def _setup(seed: int) -> tuple[torch.nn.Module, list[torch.optim.Optimizer]]:
    torch.manual_seed(seed)
    model = _shard(MatrixNet(), None)
    return model, _optimizers(model, OwnerComputedMuon)


def _train(model: torch.nn.Module, optimizers: list[torch.optim.Optimizer], steps: range) -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    for step in steps:
        x, y = _batch(step, world)
        mine = slice(rank * PER_RANK, (rank + 1) * PER_RANK)
        _loss(model, x[mine], y[mine]).backward()
        _step(optimizers)


def _params(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {name: full_value(p.detach()).clone() for name, p in model.named_parameters()}


def _checkpoint(model: torch.nn.Module, optimizers: list[torch.optim.Optimizer]) -> dict:
    return {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, optimizers)}


def _resume(path: str, how: str) -> float:
    """Largest parameter difference between a run interrupted at SAVE_AT (saved, reloaded fresh) and one that was not."""
    model, optimizers = _setup(0)
    _train(model, optimizers, range(STEPS))
    uninterrupted = _params(model)

    model, optimizers = _setup(0)
    _train(model, optimizers, range(SAVE_AT))
    if how == "dcp":
        dcp.save(_checkpoint(model, optimizers), checkpoint_id=path)
    else:
        saved = (model.state_dict(), [opt.state_dict() for opt in optimizers])

    model, optimizers = _setup(1)  # other initial weights: everything must come from the checkpoint
    if how == "dcp":
        checkpoint = _checkpoint(model, optimizers)
        dcp.load(checkpoint, checkpoint_id=path)
        set_model_state_dict(model, checkpoint["model"])
        set_optimizer_state_dict(model, optimizers, checkpoint["optim"])
    else:
        model.load_state_dict(saved[0])
        for opt, state in zip(optimizers, saved[1]):
            opt.load_state_dict(state)
    _train(model, optimizers, range(SAVE_AT, STEPS))
    return max((uninterrupted[k] - v).abs().max().item() for k, v in _params(model).items())


def test_resume_from_dcp_checkpoint_equals_uninterrupted_run(tmp_path) -> None:
    for diff in run_on_ranks(2, _resume, str(tmp_path / "ckpt"), "dcp"):
        assert diff <= 1e-6, diff


def test_resume_from_state_dict_methods_equals_uninterrupted_run() -> None:
    for diff in run_on_ranks(2, _resume, "", "direct"):
        assert diff <= 1e-6, diff


def _save(path: str) -> dict[str, torch.Tensor]:
    """Train and save; return each matrix's whole momentum as saved."""
    model, optimizers = _setup(0)
    _train(model, optimizers, range(SAVE_AT))
    checkpoint = _checkpoint(model, optimizers)
    dcp.save(checkpoint, checkpoint_id=path)
    return {fqn: s["momentum_buffer"].full_tensor() for fqn, s in checkpoint["optim"]["state"].items()
            if "momentum_buffer" in s}


def _load(path: str) -> dict:
    """Load into this world size; return the owners' whole buffers and what state_dict() then presents."""
    model, optimizers = _setup(1)
    checkpoint = _checkpoint(model, optimizers)
    dcp.load(checkpoint, checkpoint_id=path)
    set_optimizer_state_dict(model, optimizers, checkpoint["optim"])
    muon = optimizers[0]
    owned = {name: muon.state[p]["momentum_buffer"].clone() for name, p in model.named_parameters()
             if p.ndim == 2 and "momentum_buffer" in muon.state[p]}
    presented = {fqn: s["momentum_buffer"].full_tensor()
                 for fqn, s in get_optimizer_state_dict(model, optimizers)["state"].items() if "momentum_buffer" in s}
    return {"owned": owned, "presented": presented}


def test_a_checkpoint_saved_at_two_ranks_loads_at_three(tmp_path) -> None:
    path = str(tmp_path / "ckpt")
    saved = run_on_ranks(2, _save, path)[0]
    assert sorted(saved) == ["down.weight", "head.weight", "mid.weight", "up.weight", "wide.weight"]
    loaded = run_on_ranks(3, _load, path)
    owned = {}
    for r in loaded:
        assert not owned.keys() & r["owned"].keys()  # one owner per matrix
        owned.update(r["owned"])
        assert sorted(r["presented"]) == sorted(saved)
        assert all(torch.equal(r["presented"][k], saved[k]) for k in saved)
    assert sorted(owned) == sorted(saved)
    assert all(torch.equal(owned[k], saved[k]) for k in saved)


def _collectives_of_state_dict_round_trip() -> tuple:
    model, optimizers = _setup(0)
    _train(model, optimizers, range(1))
    muon = optimizers[0]
    saved = {}
    save_counts = _count_collectives(lambda: saved.update(muon.state_dict()))
    fresh = _setup(0)[1][0]
    load_counts = _count_collectives(lambda: fresh.load_state_dict(saved))
    same = all(torch.equal(fresh.state[q]["momentum_buffer"], muon.state[p]["momentum_buffer"])
               for p, q in zip(muon.param_groups[0]["params"], fresh.param_groups[0]["params"]) if muon.state[p])
    return save_counts, load_counts, same


def test_state_dict_and_load_are_one_all_to_all_per_shard_group() -> None:
    for save_counts, load_counts, same in run_on_ranks(2, _collectives_of_state_dict_round_trip):
        assert save_counts[0] == {"all_to_all_single": 1}, save_counts
        assert load_counts[0] == {"all_to_all_single": 1}, load_counts
        assert same


def _a_rank_owning_nothing() -> tuple[bool, list[str]]:
    """Two matrices on three ranks: the third owns neither, yet torch's helper must not step it alone."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 5, bias=False), torch.nn.Linear(5, 4, bias=False))
    for layer in model:
        _shard_layer(layer)
    _shard_layer(model)
    muon = OwnerComputedMuon(model.parameters(), lr=0.02)
    model(torch.randn(3, 6)).square().mean().backward()
    muon.step()
    muon.zero_grad()
    owns = any("momentum_buffer" in s for s in muon.state.values())
    state = get_optimizer_state_dict(model, muon)["state"]
    return owns, sorted(fqn for fqn, s in state.items() if "momentum_buffer" in s)


def _shard_layer(module: torch.nn.Module) -> None:
    from fsdp_compose import fully_shard

    fully_shard(module)


def test_a_rank_owning_no_matrix_checkpoints_with_the_others() -> None:
    results = run_on_ranks(3, _a_rank_owning_nothing)
    assert [owns for owns, _ in results] == [True, True, False]
    assert all(fqns == ["0.weight", "1.weight"] for _, fqns in results)


def _hsdp_round_trip() -> tuple[bool, float]:
    """HSDP (replicate, shard): each replica's owners save their buffers as the parameter's layout and get them back."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    torch.manual_seed(0)
    model = _shard(MatrixNet(), mesh)
    optimizers = _optimizers(model, OwnerComputedMuon)
    _train(model, optimizers, range(SAVE_AT))
    muon = optimizers[0]
    state = muon.state_dict()
    placements_ok = all(s["momentum_buffer"].placements == p.placements
                        for s, p in zip(state["state"].values(), muon.param_groups[0]["params"]) if s)
    torch.manual_seed(1)
    fresh = _optimizers(_shard(MatrixNet(), mesh), OwnerComputedMuon)[0]
    fresh.load_state_dict(state)
    diffs = [(fresh.state[q]["momentum_buffer"] - muon.state[p]["momentum_buffer"]).abs().max().item()
             for p, q in zip(muon.param_groups[0]["params"], fresh.param_groups[0]["params"])
             if "momentum_buffer" in muon.state[p]]
    return placements_ok and len(diffs) > 0, max(diffs)


@pytest.mark.slow  # 4 ranks
def test_hsdp_state_dict_round_trip() -> None:
    for ok, diff in run_on_ranks(4, _hsdp_round_trip):
        assert ok and diff == 0.0, (ok, diff)


def _full_state_dict_round_trip() -> tuple[bool, bool]:
    """``full_state_dict=True``: every matrix's momentum whole on every rank, and back to this run's owners."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    model, optimizers = _setup(0)
    _train(model, optimizers, range(SAVE_AT))
    options = StateDictOptions(full_state_dict=True)
    full = get_optimizer_state_dict(model, optimizers, options=options)
    momenta = [s["momentum_buffer"] for s in full["state"].values() if "momentum_buffer" in s]
    whole = len(momenta) == 5 and not any(isinstance(m, torch.distributed.tensor.DTensor) for m in momenta)
    fresh_model, fresh = _setup(1)
    set_optimizer_state_dict(fresh_model, fresh, full, options=options)
    muon, loaded = optimizers[0], fresh[0]
    same = all(torch.equal(loaded.state[q]["momentum_buffer"], muon.state[p]["momentum_buffer"])
               for p, q in zip(muon.param_groups[0]["params"], loaded.param_groups[0]["params"])
               if "momentum_buffer" in muon.state[p])
    return whole, same


def test_full_state_dict_round_trip() -> None:
    assert run_on_ranks(2, _full_state_dict_round_trip) == [(True, True)] * 2
