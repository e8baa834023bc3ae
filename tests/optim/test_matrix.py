"""OwnerComputedMuon: torch.optim.Muon's answer on sharded matrices, two collectives per shard group.

The reference is the unsharded model trained with ``torch.optim.Muon`` on the global batch. Newton-Schulz
runs in bf16, so gradients that differ in the last fp32 bit (a reduce-scatter sums in another order) give
updates that differ by bf16 noise. The tolerance is twice that noise, measured on each run as the largest
distance from the reference of two equivalent runs of torch.optim.Muon: one fed the same batch summed slice
by slice, one computing the model in fp64 (its gradients round to bf16 from other bits). A wrong answer
(Newton-Schulz on each rank's rows) must land over 10x outside it, and also beyond twice the whole bf16
error (the reference against Newton-Schulz in fp32).

Under mixed precision (bf16 compute, fp32 reduction) the reference is the same unsharded torch.optim.Muon fed
what that policy computes: each rank's slice through a bf16 copy of the fp32 weights, the bf16 gradients
averaged in fp32 (the tolerance stays twice the measured bf16 noise of the iteration).
"""

from __future__ import annotations

import copy
import functools

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from fsdp_compose.optim import OwnerComputedMuon, assign_owners, newton_schulz, newton_schulz_work
from tests.harness import run_on_ranks
from tests.models import full_value, max_abs_diff

STEPS, LR, WEIGHT_DECAY, PER_RANK = 4, 0.02, 0.1, 3
IN, MID, OUT = 29, 13, 37
NOISE_FACTOR = 2.0  # tolerance: twice the measured bf16 noise (each bf16 run off the exact one by about the noise)
COUNTED = ("all_to_all_single", "all_to_all", "all_gather", "all_gather_into_tensor", "all_reduce",
           "reduce_scatter_tensor", "broadcast", "send", "recv", "isend", "irecv")


class MatrixNet(nn.Module):
    """Linear(bias=False) weights 13x29, 29x13, 37x13 and 2x37 (2 rows: the third of 3 ranks holds none), a LayerNorm."""

    def __init__(self) -> None:
        super().__init__()
        self.down = nn.Linear(IN, MID, bias=False)
        self.up = nn.Linear(MID, IN, bias=False)
        self.norm = nn.LayerNorm(IN)
        self.mid = nn.Linear(IN, MID, bias=False)
        self.wide = nn.Linear(MID, OUT, bias=False)
        self.head = nn.Linear(OUT, 2, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.norm(x + self.up(F.gelu(self.down(x))))
        return self.head(F.gelu(self.wide(F.gelu(self.mid(x)))))


def _batch(step: int, n_slices: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(500 + step)
    return torch.randn(n_slices * PER_RANK, IN, generator=gen), torch.randint(0, 2, (n_slices * PER_RANK,), generator=gen)


def _loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(model(x), y)


def _matrices(model: nn.Module) -> list[torch.Tensor]:
    return [p for p in model.parameters() if p.ndim == 2]


def _others(model: nn.Module) -> list[torch.Tensor]:
    return [p for p in model.parameters() if p.ndim != 2]


def _optimizers(model: nn.Module, muon_cls) -> list[torch.optim.Optimizer]:
    return [muon_cls(_matrices(model), lr=LR, weight_decay=WEIGHT_DECAY), torch.optim.AdamW(_others(model), lr=1e-2)]


def _step(optimizers: list[torch.optim.Optimizer]) -> None:
    for opt in optimizers:
        opt.step()
        opt.zero_grad()


class PerShardMuon(torch.optim.Optimizer):
    """The wrong answer: Muon's math on each rank's rows alone (Newton-Schulz of a shard, not of the matrix)."""

    def __init__(self, params, lr: float, weight_decay: float) -> None:
        super().__init__(params, dict(lr=lr, weight_decay=weight_decay))

    @torch.no_grad()
    def step(self) -> None:
        for group in self.param_groups:
            for p in group["params"]:
                grad, local = p.grad.to_local(), p.to_local()
                buf = self.state[p].setdefault("momentum_buffer", torch.zeros_like(grad))
                buf.lerp_(grad, 0.05)
                update = newton_schulz(grad.lerp(buf, 0.95)) if grad.shape[0] else grad
                local.mul_(1 - group["lr"] * group["weight_decay"])
                local.add_(update, alpha=-group["lr"] * max(1, p.shape[0] / p.shape[1]) ** 0.5)


def newton_schulz_fp32(matrix: torch.Tensor, state: dict) -> torch.Tensor:
    """Muon's iteration without bf16 rounding: the exact answer bf16 runs scatter around."""
    a, b, c = 3.4445, -4.775, 2.0315
    x = matrix.T if matrix.shape[0] > matrix.shape[1] else matrix
    x = x / x.norm().clamp(min=1e-7)
    for _ in range(5):
        gram = x @ x.T
        x = a * x + (b * gram + c * gram @ gram) @ x
    return x.T if matrix.shape[0] > matrix.shape[1] else x


def _fp32_muon(params, lr: float, weight_decay: float) -> OwnerComputedMuon:
    return OwnerComputedMuon(params, lr=lr, weight_decay=weight_decay, update_fn=newton_schulz_fp32)


def _shard(model: nn.Module, mesh, mixed_precision: bool = False) -> nn.Module:
    from fsdp_compose import MixedPrecisionPolicy, fully_shard

    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if mixed_precision else None
    kwargs = {"mp_policy": policy} if policy else {}
    for layer in (model.down, model.up, model.mid, model.wide, model.head):
        fully_shard(layer, mesh=mesh, **kwargs)
    fully_shard(model, mesh=mesh, **kwargs)
    return model


def _bf16_compute_grads(model: nn.Module, x: torch.Tensor, y: torch.Tensor, world: int) -> None:
    """What bf16 compute with fp32 reduction gives ``model`` (fp32 masters): each rank's slice through a bf16
    copy, the bf16 gradients averaged in fp32."""
    grads = [torch.zeros_like(p) for p in model.parameters()]
    for xs, ys in zip(x.chunk(world), y.chunk(world)):
        low = copy.deepcopy(model).bfloat16()
        _loss(low, xs.bfloat16(), ys).backward()
        for g, q in zip(grads, low.parameters()):
            g += q.grad.float()
    for p, g in zip(model.parameters(), grads):
        p.grad = g / world


def _count_collectives(fn) -> tuple[dict[str, int], int]:
    """Calls of each torch.distributed collective during ``fn()``, and the c10d ops CommDebugMode saw."""
    from torch.distributed.tensor.debug import CommDebugMode

    counts = dict.fromkeys(COUNTED, 0)
    originals = {name: getattr(dist, name) for name in COUNTED}
    inside = [False]  # the outermost call only: a wrapper left by another tool may call back into dist

    def counting(name):
        def call(*args, **kwargs):
            if inside[0]:
                return originals[name](*args, **kwargs)
            counts[name] += 1
            inside[0] = True
            try:
                return originals[name](*args, **kwargs)
            finally:
                inside[0] = False

        return call

    for name in COUNTED:
        setattr(dist, name, counting(name))
    try:
        with CommDebugMode() as mode:
            fn()
    finally:
        for name, original in originals.items():
            setattr(dist, name, original)
    return {k: v for k, v in counts.items() if v}, mode.get_total_counts()


def _train(hsdp: bool, mixed_precision: bool = False) -> dict:
    """Sharded (owner-computed and per-shard) against unsharded torch.optim.Muon references."""
    from torch.distributed.device_mesh import init_device_mesh

    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard")) if hsdp else None
    torch.manual_seed(0)
    reference = MatrixNet()
    resliced, exact, ours, wrong, wide, low = (copy.deepcopy(reference) for _ in range(6))
    wide.double()
    _shard(ours, mesh, mixed_precision)
    _shard(wrong, mesh, mixed_precision)
    runs = {
        "reference": (reference, _optimizers(reference, torch.optim.Muon)),
        "resliced": (resliced, _optimizers(resliced, torch.optim.Muon)),
        "exact": (exact, _optimizers(exact, _fp32_muon)),
        "wide": (wide, _optimizers(wide, torch.optim.Muon)),
        "ours": (ours, _optimizers(ours, OwnerComputedMuon)),
        "wrong": (wrong, _optimizers(wrong, PerShardMuon)),
    }
    if mixed_precision:  # ours and wrong compute in bf16: compared with the reference fed bf16 gradients
        runs["bf16 reference"] = (low, _optimizers(low, torch.optim.Muon))
    target = low if mixed_precision else reference
    counts = None
    for step in range(STEPS):
        x, y = _batch(step, world)
        _loss(reference, x, y).backward()
        _loss(exact, x, y).backward()
        _loss(wide, x.double(), y).backward()
        for xs, ys in zip(x.chunk(world), y.chunk(world)):  # the same mean, summed slice by slice
            (_loss(resliced, xs, ys) / world).backward()
        mine = slice(rank * PER_RANK, (rank + 1) * PER_RANK)
        for name in ("ours", "wrong"):
            _loss(runs[name][0], x[mine], y[mine]).backward()
        if mixed_precision:
            _bf16_compute_grads(low, x, y, world)
        for name, (_, optimizers) in runs.items():
            if name == "ours" and step == 1:
                counts = _count_collectives(lambda opts=optimizers: opts[0].step())
                optimizers[0].zero_grad()
                _step(optimizers[1:])
            else:
                _step(optimizers)
    muon = runs["ours"][1][0]
    return {
        "diff": _param_diff(ours, target),
        "noise": max(_param_diff(resliced, reference), _param_diff(wide, reference)),
        "bf16_error": _param_diff(exact, reference),
        "wrong": _param_diff(wrong, target),
        "policy_effect": _param_diff(low, reference) if mixed_precision else None,  # bf16 compute vs fp32
        "counts": counts,
        "momentum_held": [bool(muon.state[p].get("momentum_buffer") is not None) for p in _matrices(ours)],
        "momentum_shapes": [tuple(muon.state[p]["momentum_buffer"].shape) for p in _matrices(ours) if muon.state[p]],
        "shard_rank": mesh.get_local_rank("shard") if hsdp else rank,
    }


def _param_diff(model: nn.Module, reference: nn.Module) -> float:
    return max(max_abs_diff(full_value(p.detach()), r.detach()) for p, r in zip(model.parameters(), reference.parameters()))


@functools.cache
def _results(world: int, hsdp: bool = False, mixed_precision: bool = False) -> list[dict]:
    return run_on_ranks(world, _train, hsdp, mixed_precision)


def _tolerance(results: list[dict]) -> float:
    return NOISE_FACTOR * max(r["noise"] for r in results)


# every shape is odd (uneven shards at any world size); the 2-row head leaves ranks 2 and 3 without rows
CASES = [pytest.param(2, False, False, id="2-ranks"), pytest.param(3, False, False, id="3-ranks-uneven"),
         pytest.param(4, False, False, id="4-ranks-uneven", marks=pytest.mark.slow), pytest.param(4, True, False, id="hsdp-2x2", marks=pytest.mark.slow),
         pytest.param(2, False, True, id="2-ranks-bf16-mixed-precision"),
         pytest.param(3, False, True, id="3-ranks-bf16-mixed-precision")]


@pytest.mark.parametrize(("world", "hsdp", "mixed_precision"), CASES)
def test_matches_unsharded_torch_muon_within_bf16_noise(world: int, hsdp: bool, mixed_precision: bool) -> None:
    results = _results(world, hsdp, mixed_precision)
    tol = _tolerance(results)
    for rank, r in enumerate(results):
        assert r["diff"] <= tol, (rank, r["diff"], tol, r["noise"])
        if mixed_precision:  # the policy changes the numbers: matching the fp32 reference instead would fail
            assert r["policy_effect"] > 10 * tol, (rank, r["policy_effect"], tol)


@pytest.mark.parametrize(("world", "hsdp", "mixed_precision"), CASES)
def test_newton_schulz_per_shard_falls_outside_the_tolerance(world: int, hsdp: bool, mixed_precision: bool) -> None:
    results = _results(world, hsdp, mixed_precision)
    tol = _tolerance(results)
    assert all(r["wrong"] > 10 * tol for r in results), ([r["wrong"] for r in results], tol)
    assert all(r["wrong"] > 2 * r["bf16_error"] for r in results), [(r["wrong"], r["bf16_error"]) for r in results]


@pytest.mark.parametrize(("world", "hsdp", "mixed_precision"), CASES)
def test_one_step_is_two_all_to_alls_per_shard_group(world: int, hsdp: bool, mixed_precision: bool) -> None:
    for calls, c10d_ops in (r["counts"] for r in _results(world, hsdp, mixed_precision)):
        assert calls == {"all_to_all_single": 2}, calls
        assert c10d_ops == 2, c10d_ops  # nothing else (no DTensor redistribution) reached c10d


@pytest.mark.parametrize(("world", "hsdp", "mixed_precision"), CASES)
def test_only_the_owner_holds_a_matrix_momentum(world: int, hsdp: bool, mixed_precision: bool) -> None:
    results = _results(world, hsdp, mixed_precision)
    shapes = [(MID, IN), (IN, MID), (MID, IN), (OUT, MID), (2, OUT)]
    size = 2 if hsdp else world
    owners = assign_owners([newton_schulz_work(r, c) for r, c in shapes], size)
    for r in results:
        assert r["momentum_held"] == [o == r["shard_rank"] for o in owners], (r["shard_rank"], r["momentum_held"])
        assert r["momentum_shapes"] == [s for s, o in zip(shapes, owners) if o == r["shard_rank"]]


def test_owners_balance_cost_largest_first() -> None:
    assert assign_owners([10, 50, 30, 30, 5], 2) == [0, 0, 1, 1, 0]  # 50 | 30+30 | then 10 and 5 to the lighter
    assert assign_owners([4, 4, 4], 3) == [0, 1, 2]
    assert assign_owners([7], 4) == [0]


def test_owners_balance_newton_schulz_work_not_elements() -> None:
    # three matrices of 262144 elements each; the square one is 12x the Newton-Schulz work of either thin one
    shapes = [(4096, 64), (512, 512), (64, 4096)]
    assert assign_owners([r * c for r, c in shapes], 2) == [0, 1, 0]  # by elements: 2 matrices' work vs 1
    assert assign_owners([newton_schulz_work(r, c) for r, c in shapes], 2) == [1, 0, 1]


@pytest.mark.parametrize(
    "options",
    [{}, {"nesterov": False, "adjust_lr_fn": "match_rms_adamw"}, {"momentum": 0.0, "adjust_lr_fn": "original"}],
    ids=["default", "plain-momentum-rms", "no-momentum"],
)
def test_plain_tensors_match_torch_muon_bit_for_bit(options: dict) -> None:
    torch.manual_seed(0)
    ours, reference = [torch.randn(13, 29), torch.randn(37, 13)], [None, None]
    reference = [p.clone().requires_grad_() for p in ours]
    ours = [p.requires_grad_() for p in ours]
    opt, ref_opt = OwnerComputedMuon(ours, lr=0.03, **options), torch.optim.Muon(reference, lr=0.03, **options)
    for step in range(3):
        for p, q in zip(ours, reference):
            p.grad = torch.randn(p.shape, generator=torch.Generator().manual_seed(step))
            q.grad = p.grad.clone()
        opt.step()
        ref_opt.step()
    assert all(torch.equal(p, q) for p, q in zip(ours, reference))


def test_update_fn_replaces_newton_schulz() -> None:
    seen = []

    def sign_update(matrix: torch.Tensor, state: dict) -> torch.Tensor:
        state["calls"] = state.get("calls", 0) + 1
        seen.append(matrix.clone())
        return matrix.sign()

    p = torch.zeros(3, 5, requires_grad=True)
    opt = OwnerComputedMuon([p], lr=0.1, weight_decay=0.0, momentum=0.0, update_fn=sign_update)
    p.grad = torch.arange(15.0).reshape(3, 5) - 7
    opt.step()
    assert torch.equal(seen[0], p.grad) and opt.state[p]["calls"] == 1
    assert torch.equal(p.detach(), -0.1 * p.grad.sign())


def test_non_matrix_parameters_raise_naming_them() -> None:
    model = nn.Sequential(nn.Linear(4, 3), nn.LayerNorm(3))
    with pytest.raises(ValueError, match=r"another optimizer such as torch\.optim\.AdamW: 0\.bias \(1-D, shape \(3,\)\), "
                       r"1\.weight \(1-D, shape \(3,\)\), 1\.bias \(1-D, shape \(3,\)\)$"):
        OwnerComputedMuon(model.named_parameters())
    with pytest.raises(ValueError, match=r"param_groups\[0\]\['params'\]\[1\] \(1-D"):
        OwnerComputedMuon(model.parameters())




def test_other_placements_raise(single_rank_group) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    mesh = init_device_mesh("cpu", (1,))
    by_columns = nn.Parameter(DTensor.from_local(torch.zeros(3, 5), mesh, [Shard(1)]))
    with pytest.raises(ValueError, match=r"placements \(Shard\(dim=1\),\); supported: Shard\(0\) on the last mesh dim"):
        OwnerComputedMuon([by_columns])


def test_a_matrix_without_gradient_is_left_alone() -> None:
    frozen, trained = torch.ones(4, 6, requires_grad=True), torch.ones(6, 4, requires_grad=True)
    opt = OwnerComputedMuon([frozen, trained], lr=0.1)
    trained.grad = torch.randn(6, 4)
    opt.step()
    assert torch.equal(frozen, torch.ones(4, 6)) and frozen not in opt.state
    assert not torch.equal(trained, torch.ones(6, 4)) and "momentum_buffer" in opt.state[trained]


MAX_NORM = 0.1  # below the runs' gradient norms, so clipping scales every step


def _train_accumulate_clip_freeze() -> dict:
    """Two micro-batches per step (no gradient sync on the first), clip_grad_norm_, and a frozen matrix."""
    from fsdp_compose import clip_grad_norm_

    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    reference = MatrixNet()
    reference.down.weight.requires_grad_(False)
    frozen = reference.down.weight.detach().clone()
    resliced, wide, ours = (copy.deepcopy(reference) for _ in range(3))
    wide.double()
    _shard(ours, None)
    runs = {name: (model, _optimizers(model, muon)) for name, model, muon in (
        ("reference", reference, torch.optim.Muon), ("resliced", resliced, torch.optim.Muon),
        ("wide", wide, torch.optim.Muon), ("ours", ours, OwnerComputedMuon))}
    mine = slice(rank * PER_RANK, (rank + 1) * PER_RANK)
    clipped = []
    for step in range(STEPS):
        micro = [_batch(10 * step + m, world) for m in range(2)]
        for m, (x, y) in enumerate(micro):
            (_loss(reference, x, y) / 2).backward()
            (_loss(wide, x.double(), y) / 2).backward()
            for xs, ys in zip(x.chunk(world), y.chunk(world)):
                (_loss(resliced, xs, ys) / (2 * world)).backward()
            ours.set_requires_gradient_sync(m == 1)
            (_loss(ours, x[mine], y[mine]) / 2).backward()
        for name, (model, optimizers) in runs.items():
            if name == "ours":
                norm = clip_grad_norm_(model.parameters(), MAX_NORM)
            else:
                norm = torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
            clipped.append(round(float(full_value(norm)), 4))
            _step(optimizers)
    return {
        "diff": _param_diff(ours, reference),
        "noise": max(_param_diff(resliced, reference), _param_diff(wide, reference)),
        "clipped": clipped,
        "frozen_kept": torch.equal(full_value(ours.down.weight.detach()), frozen),
        "frozen_stateless": ours.down.weight not in runs["ours"][1][0].state,
    }


@pytest.mark.parametrize("world", [2, 3, pytest.param(4, marks=pytest.mark.slow)])
def test_accumulation_clipping_and_frozen_matrices_match_torch_muon(world: int) -> None:
    results = run_on_ranks(world, _train_accumulate_clip_freeze)
    tol = _tolerance(results)
    for rank, r in enumerate(results):
        assert min(r["clipped"]) > MAX_NORM, (rank, r["clipped"])  # the clip scaled every step, on every run
        assert r["diff"] <= tol, (rank, r["diff"], tol, r["noise"])
        assert r["frozen_kept"] and r["frozen_stateless"], (rank, r)
