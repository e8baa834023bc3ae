"""Training jobs for the never-low checks (issue 58): one module-level build function per case.

Each returns ``(model, optimizer, loss_fn)`` and runs unchanged on real gloo ranks and in ``estimate``'s
fake subprocess (which imports it by name). A GPT-like model (pre-norm blocks, causal attention) with
short sequences, so that parameters, gradients and collectives dominate memory, except in ``batch`` and
``checkpointed``, where activations do.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from fsdp_compose import MixedPrecisionPolicy, fully_shard


class Block(nn.Module):
    def __init__(self, dim: int, heads: int, hidden: int, spare: bool = False) -> None:
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.fc1, self.fc2 = nn.Linear(dim, hidden), nn.Linear(hidden, dim)
        self.spare = nn.Linear(dim, dim) if spare else None  # never called: its parameters get no gradient

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, d = x.shape
        qkv = self.qkv(self.norm1(x)).view(b, s, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        q, k, v = qkv.unbind(0)
        x = x + self.proj(F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, s, d))
        return x + self.fc2(F.gelu(self.fc1(self.norm2(x))))


class LM(nn.Module):
    def __init__(
        self,
        vocab: int = 96,
        dim: int = 64,
        heads: int = 4,
        hiddens: tuple[int, ...] = (256, 256, 256),
        checkpointed: bool = False,
        tied: bool = False,
        spare: bool = False,
    ) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleList(Block(dim, heads, hidden, spare) for hidden in hiddens)
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)
        if tied:
            self.head.weight = self.embed.weight
        self.checkpointed = checkpointed

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        for block in self.blocks:
            x = checkpoint(block, x, use_reentrant=False) if self.checkpointed else block(x)
        return self.head(self.norm(x))


def _job(
    batch: int = 1,
    seq: int = 8,
    tied: bool = False,
    frozen: bool = False,
    model_kwargs: dict | None = None,
    **shard_kwargs,
):
    torch.manual_seed(0)
    model = LM(tied=tied, spare=frozen, **(model_kwargs or {}))
    if frozen:  # frozen parameters, and the blocks' spare layers, which forward never calls
        model.embed.weight.requires_grad_(False)
        model.blocks[0].qkv.requires_grad_(False)
    for block in model.blocks:
        fully_shard(block, **shard_kwargs)
    if tied:
        fully_shard([model.embed, model.head], **shard_kwargs)
    fully_shard(model, **shard_kwargs)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    vocab = model.embed.num_embeddings
    generator = torch.Generator().manual_seed(1 + dist.get_rank())

    def loss_fn() -> torch.Tensor:
        ids = torch.randint(0, vocab, (batch, seq + 1), generator=generator)
        return F.cross_entropy(model(ids[:, :-1]).flatten(0, 1), ids[:, 1:].flatten())

    return model, optimizer, loss_fn


def fp32():
    return _job()


def bf16_mixed():
    return _job(mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32))


def uneven_rows():
    """Rows indivisible by 2, 3 and 8: a 97-row vocabulary, 75 model dims (3 heads), 225 qkv rows."""
    return _job(model_kwargs=dict(vocab=97, dim=75, heads=3, hiddens=(150, 150, 150)))


def no_gradient():
    """Frozen parameters (the embedding, a qkv) and parameters forward never uses (each block's spare layer)."""
    return _job(frozen=True)


def huge_and_tiny():
    """One huge block among tiny ones: its group is most of the model."""
    return _job(model_kwargs=dict(dim=32, heads=2, hiddens=(64, 4096, 64, 64)))


def tied():
    """The embedding and the output projection share one weight, in one group of their own."""
    return _job(tied=True)


def batch():
    """A real batch: activations dominate the peak."""
    return _job(batch=4, seq=32)


def checkpointed():
    """``torch.utils.checkpoint`` per block, with a real batch."""
    return _job(batch=4, seq=32, model_kwargs=dict(checkpointed=True))


def reshard_false():
    return _job(reshard_after_forward=False)


def reshard_int():
    """``reshard_after_forward=<int>``: 2 ranks keep a slice after forward (at 2 and 3 ranks, the whole group)."""
    world = dist.get_world_size()
    return _job(reshard_after_forward=2 if world % 2 == 0 else world)


JOBS = {
    job.__name__: job
    for job in (
        fp32,
        bf16_mixed,
        uneven_rows,
        no_gradient,
        huge_and_tiny,
        tied,
        batch,
        checkpointed,
        reshard_false,
        reshard_int,
    )
}


def wide():
    """A wider model built on the meta device, for ``estimate`` at 64 and 512 ranks (no ground truth there)."""
    torch.manual_seed(0)
    with torch.device("meta"):
        model = LM(vocab=8192, dim=512, heads=8, hiddens=(2048,) * 4)
    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)

    def loss_fn() -> torch.Tensor:
        ids = torch.randint(0, 8192, (1, 65))
        return F.cross_entropy(model(ids[:, :-1]).flatten(0, 1), ids[:, 1:].flatten())

    return model, lambda params: torch.optim.AdamW(params, lr=1e-3), loss_fn
