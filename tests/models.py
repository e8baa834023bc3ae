"""Small models whose sizes do not divide 2, 3 or 4, and a reference training loop."""

from __future__ import annotations

import copy
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

VOCAB, DIM, HIDDEN, SEQ = 37, 13, 29, 5


class Block(nn.Module):
    def __init__(self, dim: int = DIM, hidden: int = HIDDEN) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.fc1 = nn.Linear(dim, hidden)
        self.fc2 = nn.Linear(hidden, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(F.gelu(self.fc1(self.norm(x))))


class TinyLM(nn.Module):
    def __init__(self, n_blocks: int = 3) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.blocks = nn.ModuleList(Block() for _ in range(n_blocks))
        self.norm = nn.LayerNorm(DIM)
        self.head = nn.Linear(DIM, VOCAB)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def lm_loss(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    logits = model(ids[:, :-1])
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))


def global_batch(step: int, world_size: int, per_rank: int = 2) -> torch.Tensor:
    gen = torch.Generator().manual_seed(1000 + step)
    return torch.randint(0, VOCAB, (world_size * per_rank, SEQ + 1), generator=gen)


def local_slice(batch: torch.Tensor, rank: int, world_size: int) -> torch.Tensor:
    per_rank = batch.shape[0] // world_size
    return batch[rank * per_rank : (rank + 1) * per_rank]


def shard_blocks_then_root(model: TinyLM, **kwargs) -> None:
    from fsdp_compose import fully_shard

    for block in model.blocks:
        fully_shard(block, **kwargs)
    fully_shard(model, **kwargs)


def train_data_parallel_steps(
    model: nn.Module,
    reference: nn.Module,
    optimizers: tuple[torch.optim.Optimizer, torch.optim.Optimizer],
    steps: int,
    dp_rank: int,
    dp_size: int,
    after_backward=None,
) -> list[tuple[float, float]]:
    """Train ``model`` on its data-parallel slice and ``reference`` on the whole batch, step by step.

    Returns (mean loss across ranks, reference loss) per step; ``after_backward()`` runs after both
    backwards of a step, before the optimizers, for checks on gradients."""
    losses = []
    for step in range(steps):
        batch = global_batch(step, dp_size)
        ref_loss = lm_loss(reference, batch)
        ref_loss.backward()
        loss = lm_loss(model, local_slice(batch, dp_rank, dp_size))
        loss.backward()
        losses.append((mean_across_ranks(loss), ref_loss.item()))
        if after_backward is not None:
            after_backward()
        for opt in optimizers:
            opt.step()
            opt.zero_grad()
    return losses


def mean_across_ranks(value: torch.Tensor) -> float:
    value = value.detach().clone()
    dist.all_reduce(value)
    return value.item() / dist.get_world_size()


def full_value(param: torch.Tensor) -> torch.Tensor:
    """The whole parameter; float8 travels as bytes (gloo cannot all-gather float8 itself)."""
    if not hasattr(param, "full_tensor"):
        return param
    if param.dtype.itemsize == 1 and param.dtype.is_floating_point:
        from torch.distributed.tensor import DTensor

        as_bytes = DTensor.from_local(
            param.to_local().view(torch.uint8), param.device_mesh, param.placements,
            shape=param.shape, stride=param.stride(),
        )
        return as_bytes.full_tensor().view(param.dtype)
    return param.full_tensor()


def max_abs_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a - b|, and inf where either holds a NaN or inf: parity must fail on them (Python's ``max``
    drops a NaN, ``max(x, nan) == x``, and ``nan <= tol`` is merely False)."""
    if a.numel() == 0:  # an empty tensor differs nowhere
        return 0.0
    a, b = a.detach(), b.detach()
    if a.dtype != b.dtype or a.dtype not in (torch.float32, torch.float64):  # widened first: exact
        a, b = a.double(), b.double()  # (not for fp32 subclasses: torchao's float8 weight casts on copy)
    diff = (a - b).abs()
    return diff.max().item() if bool(torch.isfinite(diff).all()) else float("inf")


def worst_of(*values: float) -> float:
    """The largest of ``values``, inf if any is NaN (``max`` would drop it)."""
    return float("inf") if any(v != v for v in values) else max(values)


def max_param_diff(model: nn.Module, reference: nn.Module) -> float:
    """Largest |sharded - reference| over parameters; names must match exactly."""
    ours = dict(model.named_parameters())
    theirs = dict(reference.named_parameters())
    assert list(ours) == list(theirs), (list(ours), list(theirs))
    return worst_of(0.0, *(max_abs_diff(full_value(p.detach()), theirs[name]) for name, p in ours.items()))


def max_grad_diff(model: nn.Module, reference: nn.Module) -> float:
    worst = 0.0
    theirs = dict(reference.named_parameters())
    for name, param in model.named_parameters():
        ref_grad = theirs[name].grad
        if param.grad is None or ref_grad is None:
            assert param.grad is None and ref_grad is None, f"{name}: grad presence differs"
            continue
        full = param.grad.full_tensor() if hasattr(param.grad, "full_tensor") else param.grad
        worst = max(worst, max_abs_diff(full, ref_grad))
    return worst


def train_against_reference(
    build: Callable[[], nn.Module],
    shard: Callable[[nn.Module], None],
    *,
    steps: int = 4,
    step_fn: Callable | None = None,
    lr: float = 1e-2,
    sharded: Callable[[], nn.Module] | None = None,
) -> dict:
    """Train a sharded copy on each rank's slice and a full copy on the global batch.

    ``step_fn(model, batch, rank, world_size)`` returns the loss after calling backward; the
    default is one forward/backward on the batch. ``sharded()``, if given, builds the sharded
    model itself (for example by deferred init) instead of copying and sharding the reference.
    """
    rank, world_size = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    reference = build()
    if sharded is None:
        model = copy.deepcopy(reference)
        shard(model)
    else:
        model = sharded()
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=lr)
    step_fn = step_fn or default_step
    losses, ref_losses, grad_diffs = [], [], []
    for step in range(steps):
        batch = global_batch(step, world_size)
        ref_losses.append(step_fn(reference, batch, 0, 1).item())
        losses.append(mean_across_ranks(step_fn(model, local_slice(batch, rank, world_size), rank, world_size)))
        grad_diffs.append(max_grad_diff(model, reference))
        opt.step()
        ref_opt.step()
        opt.zero_grad()
        ref_opt.zero_grad()
    return {
        "losses": losses,
        "ref_losses": ref_losses,
        "param_diff": max_param_diff(model, reference),
        "param_diffs": {  # by name, with the parameter's dtype: for per-dtype tolerances
            name: (str(p.dtype), max_abs_diff(full_value(p.detach()), r))
            for (name, p), r in zip(model.named_parameters(), reference.parameters())
        },
        "grad_diff": max(grad_diffs),
        "names": [n for n, _ in model.named_parameters()],
        "sharding": {  # by name: what this rank holds of each parameter and of its optimizer state
            name: {
                "placements": [str(pl) for pl in getattr(p, "placements", ())],
                "shape": list(p.shape),
                "local_shape": list(p.to_local().shape) if hasattr(p, "to_local") else list(p.shape),
                "state_shapes": sorted({tuple(getattr(s, "to_local", lambda s=s: s)().shape)
                                        for s in opt.state[p].values() if s.dim() > 0}),
            }
            for name, p in model.named_parameters()
        },
    }


def shard_rows(total: int, world_size: int, rank: int) -> int:
    """Rows ``Shard(0)`` gives ``rank`` of ``total`` (``torch.chunk``'s split: the last ranks may hold none)."""
    size = -(-total // world_size)
    return max(0, min(size, total - rank * size))


def assert_sharded(results: list[dict]) -> None:
    """Every parameter a ``Shard(0)`` DTensor holding its 1/N of the rows on every rank, and its
    optimizer state shaped like that shard (parameters, gradients and state at 1/N)."""
    for rank, r in enumerate(results):
        for name, s in r["sharding"].items():
            rows = shard_rows(s["shape"][0], len(results), rank)
            assert s["placements"] == ["S(0)"], (rank, name, s)
            assert s["local_shape"] == [rows, *s["shape"][1:]], (rank, name, s)
            assert s["state_shapes"] == [tuple(s["local_shape"])], (rank, name, s)


def default_step(model: nn.Module, batch: torch.Tensor, rank: int, world_size: int) -> torch.Tensor:
    loss = lm_loss(model, batch)
    loss.backward()
    return loss


def assert_parity(results: list[dict], tol: float = 1e-5) -> None:
    for rank, r in enumerate(results):
        for ours, ref in zip(r["losses"], r["ref_losses"]):
            assert abs(ours - ref) <= tol, (rank, r["losses"], r["ref_losses"])
        assert r["param_diff"] <= tol, (rank, r["param_diff"])
        assert r["grad_diff"] <= tol, (rank, r["grad_diff"])
    assert len({tuple(r["names"]) for r in results}) == 1


class BranchyLM(TinyLM):
    """A TinyLM whose blocks carry a branch that forward never uses."""

    def __init__(self) -> None:
        super().__init__()
        for block in self.blocks:
            block.unused = nn.Linear(DIM, 3)


class SharedBlockLM(TinyLM):
    """Runs ``blocks[0]`` twice per forward: shared weights inside one step."""

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        x = self.blocks[0](x)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def assert_parity_by_dtype(results: list[dict], tolerances: dict[str, float]) -> None:
    """Every parameter within its dtype's tolerance (``tolerances`` names each dtype present), on every rank."""
    for rank, r in enumerate(results):
        for name, (dtype, diff) in r["param_diffs"].items():
            assert diff <= tolerances[dtype], (rank, name, dtype, diff)


def freeze(model: nn.Module, names: set[str]) -> nn.Module:
    for name, param in model.named_parameters():
        if name in names:
            param.requires_grad_(False)
    return model
