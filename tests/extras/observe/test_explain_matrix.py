"""explain() and estimate() with OwnerComputedMuon: the state each owner really holds and the step's own collectives.

Each matrix's momentum lives whole on its owner, not as 1/N of every matrix, so the optimizer state differs by
rank; ``step()`` adds two all-to-alls per shard group that no sharded group counts. ``explain`` asks the
optimizer (``owned_state_bytes()``, ``collectives_per_step()``) and must agree with what a step then holds
and hands to ``all_to_all_single``.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from expecttest import assert_expected_inline
from torch import nn

from fsdp_compose import estimate, explain, fully_shard
from fsdp_compose.extras.observe.explain import fmt_bytes
from fsdp_compose.optim import OwnerComputedMuon
from tests.harness import run_on_ranks


class Net(nn.Module):
    """Matrices 48x32, 16x48 and 8x16 (owners at 2 ranks: the first on rank 0, the others on rank 1), a LayerNorm."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(32, 48, bias=False)
        self.norm = nn.LayerNorm(48)
        self.b = nn.Linear(48, 16, bias=False)
        self.c = nn.Linear(16, 8, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c(F.gelu(self.b(self.norm(self.a(x)))))


def _sharded() -> Net:
    torch.manual_seed(0)
    model = Net()
    for layer in (model.a, model.b, model.c):
        fully_shard(layer)
    fully_shard(model)
    return model


def _optimizer_lines(explanation) -> str:
    """The summary's optimizer line, and its optimizer-state figure (the rest of the peak line left out)."""
    t = explanation.totals
    step = [line for line in explanation.summary().splitlines() if line.startswith("optimizer.step()")]
    return "\n".join([*step, f"optimizer state {fmt_bytes(t.optimizer_bytes)} ({t.optimizer_source})"])


def _explain_with_owner_computed_muon() -> dict:
    model = _sharded()
    muon = OwnerComputedMuon([p for p in model.parameters() if p.ndim == 2], lr=0.02)
    adamw = torch.optim.AdamW([p for p in model.parameters() if p.ndim != 2], lr=1e-3)
    before = explain(model, [muon, adamw]).totals
    muon_planned = explain(model, muon).totals.optimizer_bytes
    sent = []
    original = dist.all_to_all_single

    def counting(output, input, *args, **kwargs):
        sent.append(input.numel() * input.element_size())
        return original(output, input, *args, **kwargs)

    torch.manual_seed(dist.get_rank())
    for step in range(2):
        model(torch.randn(4, 32)).square().mean().backward()
        dist.all_to_all_single = counting if step == 1 else original
        try:
            muon.step()
        finally:
            dist.all_to_all_single = original
        adamw.step()
        muon.zero_grad()
        adamw.zero_grad()
    after = explain(model, [muon, adamw])
    held = sum(t.numel() * t.element_size() for s in muon.state.values() for t in s.values())
    adamw_local = [getattr(t, "_local_tensor", t) for s in adamw.state.values() for t in s.values()]  # its shards
    adamw_held = sum(t.numel() * t.element_size() for t in adamw_local)
    return {
        "before": (before.optimizer_bytes, before.optimizer_collectives, before.optimizer_collective_bytes),
        "after": (after.totals.optimizer_bytes, after.totals.optimizer_collectives,
                  after.totals.optimizer_collective_bytes),
        "held": (held, adamw_held),
        "sent": sent,
        "muon_planned": muon_planned,
        "muon_alone": explain(model, muon).totals.optimizer_bytes,
        "text": _optimizer_lines(after),
        "planned_text": _optimizer_lines(explain(model, OwnerComputedMuon(model.a.parameters()))),
    }


def test_explain_counts_the_owners_state_and_the_steps_all_to_alls() -> None:
    ranks = run_on_ranks(2, _explain_with_owner_computed_muon)
    assert_expected_inline(
        "\n---\n".join(r["text"] for r in ranks),
        """\
optimizer.step(): 2 collectives more, 3.2 KiB in from this rank (matrices to their owners and back)
optimizer state 6.4 KiB (OwnerComputedMuon: measured, owned matrices + measured)
---
optimizer.step(): 2 collectives more, 3.9 KiB in from this rank (matrices to their owners and back)
optimizer state 3.9 KiB (OwnerComputedMuon: measured, owned matrices + measured)""",
    )
    for rank, r in enumerate(ranks):
        owned = [48 * 32 * 4] if rank == 0 else [16 * 48 * 4, 8 * 16 * 4]  # fp32 momentum of whole matrices
        muon_held, adamw_held = r["held"]
        assert muon_held == sum(owned) == r["muon_alone"]
        assert r["muon_planned"] == sum(owned)  # planned before the first step: the momentum it then holds
        assert r["after"][0] == muon_held + adamw_held  # measured, both optimizers
        assert r["before"][1:] == r["after"][1:]  # planned from shapes: the same before and after
        assert r["after"][1] == len(r["sent"]) == 2
        assert r["after"][2] == sum(r["sent"])  # the bytes the step handed to all_to_all_single
    # a plan before any step: one matrix, owned by rank 0; rank 1 holds nothing and only sends its rows
    assert_expected_inline(
        "\n---\n".join(r["planned_text"] for r in ranks),
        """\
optimizer.step(): 2 collectives more, 1.5 KiB in from this rank (matrices to their owners and back)
optimizer state 6.0 KiB (OwnerComputedMuon: planned, owned matrices)
---
optimizer.step(): 2 collectives more, 3.0 KiB in from this rank (matrices to their owners and back)
optimizer state 0 B (OwnerComputedMuon: planned, owned matrices)""",
    )


def build_for_estimate():
    """For estimate(): the same model, every parameter a matrix (estimate steps one optimizer)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 48, bias=False), nn.GELU(), nn.Linear(48, 16, bias=False),
                          nn.Linear(16, 8, bias=False))
    for layer in (model[0], model[2], model[3]):
        fully_shard(layer)
    fully_shard(model)

    def loss_fn() -> torch.Tensor:
        return model(torch.randn(4, 32)).square().mean()

    return model, lambda params: OwnerComputedMuon(params, lr=0.02), loss_fn


@pytest.mark.slow  # an estimate subprocess per rank
def test_estimate_counts_the_owners_momentum_by_rank() -> None:
    rank0, rank1 = (estimate(build_for_estimate, 2, rank=r) for r in (0, 1))
    assert rank0.at_peak.get("optimizer state", 0) == 48 * 32 * 4  # the whole 48x32 matrix it owns
    assert rank1.at_peak.get("optimizer state", 0) == (16 * 48 + 8 * 16) * 4
    for result in (rank0, rank1):
        assert "optimizer.step(): 2 collectives more" in result.plan
        assert "OwnerComputedMuon: measured, owned matrices" in result.plan
