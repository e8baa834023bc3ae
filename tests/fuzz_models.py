"""A seeded generator of random module trees for parity fuzzing (tests/api/test_fuzz.py).

Every node maps a ``(batch, width)`` float tensor to ``(batch, width')``. Leaves are Linear,
LayerNorm, Embedding (indices derived from the input) and Conv1d layers with odd sizes;
containers nest 1-3 deep, may hold a branch forward never calls and may call one shared
leaf twice. A sharding plan is drawn alongside: which modules get ``fully_shard`` (children
first, the root always), with random ``reshard_after_forward`` and a mixed-precision policy
that keeps fp32 parity (compute or reduce in float64, output in float32).
"""

from __future__ import annotations

import random

import torch
from torch import nn

from fsdp_compose import MixedPrecisionPolicy, fully_shard


class EmbedLeaf(nn.Module):
    """Looks up ``k`` indices derived from the input and appends their embeddings."""

    def __init__(self, width: int, vocab: int, dim: int, k: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.vocab, self.k = vocab, k

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        idx = (x[:, : self.k].detach().abs() * 10).long() % self.vocab
        return torch.cat([x, self.embed(idx).flatten(1).to(x.dtype)], dim=1)


class ConvLeaf(nn.Module):
    """Views the features as ``(channels, length)`` and applies an odd-sized Conv1d."""

    def __init__(self, channels: int, out_channels: int, kernel: int) -> None:
        super().__init__()
        self.channels = channels
        self.conv = nn.Conv1d(channels, out_channels, kernel, padding=kernel // 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.conv(x.view(x.shape[0], self.channels, -1)).flatten(1)


class Node(nn.Module):
    """Runs ``steps`` in order (a shared leaf may appear twice); ``unused`` is never called."""

    def __init__(self, steps: list[nn.Module]) -> None:
        super().__init__()
        self.steps = nn.ModuleList(steps)
        self.order = list(range(len(steps)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for i in self.order:
            x = self.steps[i](x)
        return x


def _leaf(rng: random.Random, width: int) -> tuple[nn.Module, int]:
    kind = rng.choice(["linear", "linear", "norm", "embed", "conv"])
    if kind == "norm":
        return nn.LayerNorm(width, elementwise_affine=rng.random() < 0.8), width
    if kind == "embed":
        dim, k = rng.choice([1, 3, 5]), rng.choice([1, 2])
        return EmbedLeaf(width, rng.choice([2, 7, 11]), dim, k), width + dim * k
    if kind == "conv":
        channels = next(c for c in (3, 2, 1) if width % c == 0)
        out = rng.choice([1, 2, 5])
        return ConvLeaf(channels, out, rng.choice([1, 3])), out * (width // channels)
    out = rng.choice([1, 3, 5, 7, 9])
    return nn.Linear(width, out, bias=rng.random() < 0.7), out


def _node(rng: random.Random, width: int, depth: int) -> tuple[nn.Module, int]:
    steps = []
    for _ in range(rng.randint(1, 3)):
        if depth > 1 and rng.random() < 0.5:
            child, width = _node(rng, width, depth - 1)
        else:
            child, width = _leaf(rng, width)
        steps.append(child)
    node = Node(steps)
    if rng.random() < 0.3:  # a shared square leaf, called twice in a row
        shared = nn.Linear(width, width)
        node.steps.append(shared)
        node.order += [len(node.steps) - 1, len(node.steps) - 1]
    if rng.random() < 0.3:
        node.unused = nn.Linear(width, 2)
    return node, width


def build_model(seed: int, in_width: int = 4) -> nn.Module:
    """The random model of ``seed`` (identical on every rank); some parameters are frozen."""
    rng = random.Random(seed)
    torch.manual_seed(seed)
    model, _ = _node(rng, in_width, rng.randint(1, 3))
    for p in model.parameters():
        if rng.random() < 0.15:
            p.requires_grad_(False)
    return model


def shard_model(model: nn.Module, seed: int, world_size: int) -> list[str]:
    """Apply the seed's sharding plan; return it as readable lines (for failure messages)."""
    rng = random.Random(seed * 7919 + world_size)
    plan = []
    names = [(n, m) for n, m in model.named_modules() if n and not isinstance(m, nn.ModuleList)]
    sharded: set[nn.Module] = set()
    for name, module in reversed(names):  # children before parents
        if rng.random() < 0.4:
            # a float64 compute policy would feed float64 into an already sharded fp32 child
            kwargs = _options(rng, world_size, allow_param64=not any(m in sharded for m in module.modules()))
            fully_shard(module, **kwargs)
            sharded.add(module)
            plan.append(f"{name}: {kwargs}")
    kwargs = _options(rng, world_size, allow_param64=not sharded)
    fully_shard(model, **kwargs)
    plan.append(f"<root>: {kwargs}")
    return plan


def _options(rng: random.Random, world_size: int, allow_param64: bool) -> dict:
    kwargs: dict = {"reshard_after_forward": rng.choice([True, False, 1, world_size])}
    policy = rng.choice([None, None, "param64" if allow_param64 else None, "reduce64"])
    if policy == "param64":
        kwargs["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.float64, output_dtype=torch.float32)
    elif policy == "reduce64":
        kwargs["mp_policy"] = MixedPrecisionPolicy(reduce_dtype=torch.float64)
    return kwargs
