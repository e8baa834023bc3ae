"""3-D expert weights ``(E, m, n)``: a batch of E matrices, each orthogonalized on its own, as torch.optim.Muon
would update E separate matrices.

Sharded ``Shard(0)`` on the expert dim, each rank holds whole expert matrices: it computes those itself (no
collective for them), keeps their momentum, and the 2-D matrices' owners are balanced around that load.
"""

from __future__ import annotations

import copy
import functools
import tempfile

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
from torch import nn
from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict

from fsdp_compose._runtime.rows import row_layout
from fsdp_compose.optim import OwnerComputedMuon, assign_owners, newton_schulz, newton_schulz_work
from tests.harness import run_on_ranks
from tests.models import full_value, max_abs_diff
from tests.optim.test_matrix import NOISE_FACTOR, _count_collectives

EXPERTS, IN, MID, HIDDEN, PER_RANK, STEPS, LR = 3, 11, 13, 7, 6, 3, 0.02


class Experts(nn.Module):
    """Token i through expert i % E: one (E, MID, HIDDEN) weight, or E separate matrices (``separate=True``: the
    per-matrix reference torch.optim.Muon takes), the same numbers either way."""

    def __init__(self, separate: bool) -> None:
        super().__init__()
        weight = torch.randn(EXPERTS, MID, HIDDEN) / MID**0.5
        if separate:
            self.weights = nn.ParameterList(nn.Parameter(w.clone()) for w in weight)
        else:
            self.weight = nn.Parameter(weight)

    def stacked(self) -> torch.Tensor:
        return torch.stack(list(self.weights)) if hasattr(self, "weights") else self.weight

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        routed = self.stacked()[torch.arange(h.shape[0]) % EXPERTS]  # (B, MID, HIDDEN)
        return torch.einsum("bm,bmh->bh", h, routed)


class ExpertNet(nn.Module):
    """A 2-D down projection, the experts, a 2-D head."""

    def __init__(self, separate: bool = False) -> None:
        super().__init__()
        self.down = nn.Linear(IN, MID, bias=False)
        self.experts = Experts(separate)
        self.head = nn.Linear(HIDDEN, 2, bias=False)

    def expert_weight(self) -> torch.Tensor:
        return self.experts.stacked()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(F.gelu(self.experts(F.gelu(self.down(x)))))


def _batch(step: int, world: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(700 + step)
    return torch.randn(world * PER_RANK, IN, generator=gen), torch.randint(0, 2, (world * PER_RANK,), generator=gen)


def _loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(model(x), y)


def _shard(model: ExpertNet) -> ExpertNet:
    from fsdp_compose import fully_shard

    fully_shard(model.experts)  # Shard(0) on the expert dim: each rank holds whole expert matrices
    fully_shard(model.down)
    fully_shard(model)
    return model


def _whole(model: ExpertNet) -> list[torch.Tensor]:
    return [full_value(model.down.weight.detach()), full_value(model.expert_weight().detach()),
            full_value(model.head.weight.detach())]


def _diff(a: ExpertNet, b: ExpertNet) -> float:
    return max(max_abs_diff(x, y) for x, y in zip(_whole(a), _whole(b)))


def _train_experts() -> dict:
    """Ours (one 3-D weight, sharded) against torch.optim.Muon on E separate matrices, unsharded."""
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    reference = ExpertNet(separate=True)
    torch.manual_seed(0)
    ours = _shard(ExpertNet())
    resliced, wide = copy.deepcopy(reference), copy.deepcopy(reference).double()
    muon = OwnerComputedMuon(ours.parameters(), lr=LR)
    runs = [(reference, torch.optim.Muon(reference.parameters(), lr=LR)),
            (resliced, torch.optim.Muon(resliced.parameters(), lr=LR)),
            (wide, torch.optim.Muon(wide.parameters(), lr=LR)), (ours, muon)]
    mine = slice(rank * PER_RANK, (rank + 1) * PER_RANK)
    counts = None
    for step in range(STEPS):
        x, y = _batch(step, world)
        _loss(reference, x, y).backward()
        _loss(wide, x.double(), y).backward()
        for xs, ys in zip(x.chunk(world), y.chunk(world)):
            (_loss(resliced, xs, ys) / world).backward()
        _loss(ours, x[mine], y[mine]).backward()
        for _, opt in runs:
            if opt is muon and step == 1:
                counts = _count_collectives(opt.step)
            else:
                opt.step()
            opt.zero_grad()
    expert = ours.experts.weight
    return {
        "diff": _diff(ours, reference),
        "noise": max(_diff(resliced, reference), _diff(wide, reference)),
        "counts": counts,
        "expert_momentum": tuple(muon.state[expert]["momentum_buffer"].shape),
        "expert_rows": tuple(expert.to_local().shape),
        "matrix_momentum": [p.shape for p in (ours.down.weight, ours.head.weight) if muon.state[p]],
    }


@functools.cache
def _results(world: int) -> list[dict]:
    return run_on_ranks(world, _train_experts)


@pytest.mark.parametrize("world", [2, 3, pytest.param(4, marks=pytest.mark.slow)])  # 3 experts: 2 + 1 at 2 ranks; at 4 the last holds none
def test_expert_weights_match_torch_muon_per_expert_matrix(world: int) -> None:
    results = _results(world)
    tol = NOISE_FACTOR * max(r["noise"] for r in results)
    for rank, r in enumerate(results):
        assert 0 < tol and r["diff"] <= tol, (rank, r["diff"], tol)


@pytest.mark.parametrize("world", [2, 3, pytest.param(4, marks=pytest.mark.slow)])
def test_each_rank_keeps_the_momentum_of_the_experts_it_holds(world: int) -> None:
    work = newton_schulz_work
    owners = assign_owners([work(MID, IN), work(2, HIDDEN)], world, [c * work(MID, HIDDEN) for c in _expert_counts(world)])
    for rank, r in enumerate(_results(world)):
        assert r["expert_momentum"] == r["expert_rows"] == (_expert_counts(world)[rank], MID, HIDDEN)
        assert r["matrix_momentum"] == [s for s, o in zip([(MID, IN), (2, HIDDEN)], owners) if o == rank]
        assert r["counts"][0] == {"all_to_all_single": 2}, r["counts"]  # the 2-D matrices' two; none for experts


def _expert_counts(world: int) -> list[int]:
    return [row_layout(torch.Size((EXPERTS,)), 0, world, rank).local_rows for rank in range(world)]


@pytest.mark.parametrize("adjust_lr_fn", ["original", "match_rms_adamw"])
def test_a_plain_3d_weight_is_torch_muon_on_each_matrix_bit_for_bit(adjust_lr_fn: str) -> None:
    torch.manual_seed(0)
    batch = torch.randn(4, 13, 29, requires_grad=True)  # wide matrices
    tall = torch.randn(2, 37, 13, requires_grad=True)
    separate = [w.detach().clone().requires_grad_() for w in (*batch, *tall)]
    ours = OwnerComputedMuon([batch, tall], lr=0.03, adjust_lr_fn=adjust_lr_fn)
    reference = torch.optim.Muon(separate, lr=0.03, adjust_lr_fn=adjust_lr_fn)
    for step in range(3):
        gen = torch.Generator().manual_seed(step)
        batch.grad, tall.grad = torch.randn(batch.shape, generator=gen), torch.randn(tall.shape, generator=gen)
        for w, g in zip(separate, (*batch.grad, *tall.grad)):
            w.grad = g.clone()
        ours.step()
        reference.step()
    assert all(torch.equal(a, b) for a, b in zip((*batch.detach(), *tall.detach()), separate))


def test_batched_newton_schulz_is_each_matrix_on_its_own() -> None:
    torch.manual_seed(1)
    for shape in [(5, 8, 24), (3, 24, 8)]:
        batch = torch.randn(shape)
        assert torch.equal(newton_schulz(batch), torch.stack([newton_schulz(m) for m in batch]))


def _expert_checkpoint_round_trip(path: str, save: bool) -> dict:
    """Train 2 steps and save at one world size; load at another and compare the momentum to the saved one."""
    torch.manual_seed(0)
    model = _shard(ExpertNet())
    muon = OwnerComputedMuon(model.parameters(), lr=LR)
    if save:
        rank, world = dist.get_rank(), dist.get_world_size()
        for step in range(2):
            x, y = _batch(step, world)
            _loss(model, x[rank * PER_RANK:(rank + 1) * PER_RANK], y[rank * PER_RANK:(rank + 1) * PER_RANK]).backward()
            muon.step()
            muon.zero_grad()
        state = get_optimizer_state_dict(model, muon)
        dcp.save({"optim": state}, checkpoint_id=path)
    else:
        state = {"optim": get_optimizer_state_dict(model, muon)}
        dcp.load(state, checkpoint_id=path)
        set_optimizer_state_dict(model, muon, state["optim"])
        state = get_optimizer_state_dict(model, muon)
    expert = state["state"]["experts.weight"]["momentum_buffer"]
    return {"expert": full_value(expert).clone(), "local": tuple(muon.state[model.experts.weight]["momentum_buffer"].shape)}


def test_expert_momentum_saved_at_two_ranks_loads_at_three() -> None:
    with tempfile.TemporaryDirectory() as path:
        saved = run_on_ranks(2, _expert_checkpoint_round_trip, path, True)
        loaded = run_on_ranks(3, _expert_checkpoint_round_trip, path, False)
    assert saved[0]["expert"].abs().sum() > 0
    for r in loaded:
        assert torch.equal(r["expert"], saved[0]["expert"])
    assert [r["local"] for r in loaded] == [(1, MID, HIDDEN)] * 3
