"""Training jobs for ``plan``'s checks: module-level build functions returning the model unsharded.

A small GPT with a real batch (activations matter), the same on real gloo ranks and in plan's fake
subprocess; and builds that do it wrong, for the errors.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from fsdp_compose import fully_shard
from tests.extras.observe.estimate_jobs import LM, VOCAB

SEQ, BATCH = 64, 4


def _optimizer(params) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=1e-3)


def _loss(model: nn.Module, generator: torch.Generator) -> torch.Tensor:
    ids = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=generator)
    return F.cross_entropy(model(ids[:, :-1]).flatten(0, 1), ids[:, 1:].flatten())


def gpt():
    """Each rank its own batches (seeded by its rank), the same initial weights everywhere."""
    torch.manual_seed(0)
    model = LM()
    generator = torch.Generator().manual_seed(1 + (dist.get_rank() if dist.is_initialized() else 0))
    return model, _optimizer, lambda: _loss(model, generator)


def reference_losses(world_size: int, steps: int) -> list[list[float]]:
    """Each rank's losses when one unsharded model trains on every rank's batches (the mean loss's gradient)."""
    torch.manual_seed(0)
    model = LM()
    optimizer = _optimizer(model.parameters())
    generators = [torch.Generator().manual_seed(1 + rank) for rank in range(world_size)]
    losses = []
    for _ in range(steps):
        per_rank = [_loss(model, g) for g in generators]
        torch.stack(per_rank).mean().backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append([loss.item() for loss in per_rank])
    return [list(column) for column in zip(*losses)]


class Flat(nn.Module):
    """No repeated block: two different layers under the root."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(16, 64)
        self.out = nn.Linear(64, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.relu(self.inp(x)))


def flat():
    model = Flat()
    return model, _optimizer, lambda: model(torch.randn(4, 16)).square().mean()


def shards_itself():
    model, make_optimizer, loss_fn = gpt()
    fully_shard(model)
    return model, make_optimizer, loss_fn


def returns_two():
    return gpt()[:2]


def returns_an_optimizer():
    model, make_optimizer, loss_fn = gpt()
    return model, make_optimizer(model.parameters()), loss_fn


def raises():
    raise KeyError("no such checkpoint")
