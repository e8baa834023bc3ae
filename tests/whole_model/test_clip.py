"""clip_grad_norm_: the unsharded model's total norm and clipped gradients, to 1e-6."""

from __future__ import annotations

import copy
import math

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

from fsdp_compose import clip_grad_norm_, fully_shard
from tests.harness import run_on_ranks
from tests.models import TinyLM, global_batch, lm_loss, local_slice, max_abs_diff, max_grad_diff


def _with_ignored_head() -> dict:
    """Real backward; the head is ignored (a plain parameter, its gradient averaged by hand)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    reference = TinyLM()
    model = copy.deepcopy(reference)
    for block in model.blocks:
        fully_shard(block)
    fully_shard(model, ignored_params={model.head.weight, model.head.bias})
    assert not isinstance(model.head.weight, DTensor) and isinstance(model.embed.weight, DTensor)
    batch = global_batch(0, world)
    lm_loss(model, local_slice(batch, rank, world)).backward()
    lm_loss(reference, batch).backward()
    for p in model.head.parameters():  # what DDP would do for the ignored parameters
        dist.all_reduce(p.grad)
        p.grad /= world
    out = {}
    for norm_type in (2.0, 1.0, 3.0, math.inf):
        ours = clip_grad_norm_(model, max_norm=1e9, norm_type=norm_type)
        theirs = torch.nn.utils.clip_grad_norm_(reference.parameters(), max_norm=1e9, norm_type=norm_type)
        out[f"norm_{norm_type}"] = abs(ours.item() - theirs.item()) / theirs.item()
    ours = clip_grad_norm_(model.parameters(), max_norm=0.1)  # an iterable works too
    theirs = torch.nn.utils.clip_grad_norm_(reference.parameters(), max_norm=0.1)
    out["clipping_norm"] = abs(ours.item() - theirs.item()) / theirs.item()
    out["clipped_grads"] = max_grad_diff(model, reference)
    after = torch.nn.utils.clip_grad_norm_(reference.parameters(), 1e9).item()  # 0.1 less the 1e-6 eps
    out["clipped_total"] = abs(clip_grad_norm_(model, 1e9).item() - after) / after
    return out


class _TwoDtypes(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(7, 11).to(torch.bfloat16)
        self.b = nn.Linear(11, 5).to(torch.float64)
        self.c = nn.Linear(5, 3)  # float32, left to the root group


def _mixed_dtypes() -> dict:
    """bf16, fp64 and fp32 groups plus one plain parameter; gradients set directly."""
    torch.manual_seed(0)
    model = _TwoDtypes()
    model.extra = nn.Parameter(torch.randn(4))  # ignored below
    fully_shard(model.a)
    fully_shard(model.b)
    fully_shard(model, ignored_params={model.extra})
    gen = torch.Generator().manual_seed(1)
    full_grads = {}
    for name, p in model.named_parameters():
        g = torch.randn(p.shape, generator=gen).to(p.dtype)
        full_grads[name] = g
        p.grad = distribute_tensor(g, p.device_mesh, [Shard(0)]) if isinstance(p, DTensor) else g.clone()
    assert {p.grad.dtype for p in model.parameters()} == {torch.bfloat16, torch.float64, torch.float32}
    out = {}
    for norm_type in (2.0, math.inf):
        expected = torch.linalg.vector_norm(
            torch.cat([g.double().reshape(-1) for g in full_grads.values()]), norm_type
        ).item()
        out[f"norm_{norm_type}"] = abs(clip_grad_norm_(model, 1e9, norm_type).item() - expected) / expected
    total = clip_grad_norm_(model, max_norm=1.0)
    coef = 1.0 / (total.item() + 1e-6)
    worst = 0.0
    for name, p in model.named_parameters():
        got = p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
        want = (full_grads[name].double() * coef).to(p.dtype)
        tol = 1e-2 if p.dtype == torch.bfloat16 else 1e-6  # one bf16 rounding step
        worst = max(worst, max_abs_diff(got, want) / tol)
    out["clipped_grads_in_tolerance_units"] = worst
    return out


def test_clip_grad_norm_matches_unsharded_with_ignored_params():
    for out in run_on_ranks(3, _with_ignored_head):
        assert all(v <= 1e-6 for v in out.values()), out


def test_clip_grad_norm_mixed_dtypes():
    for out in run_on_ranks(3, _mixed_dtypes):
        worst = out.pop("clipped_grads_in_tolerance_units")
        assert worst <= 1.0, worst
        assert all(v <= 1e-6 for v in out.values()), out
