"""Training jobs for ``estimate``'s checks: module-level build functions (estimate imports them by name).

Each returns ``(model, optimizer, loss_fn)`` and runs unchanged on real gloo ranks and in
estimate's fake subprocess. The sequences are long enough that activations matter.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.distributed.device_mesh import init_device_mesh
from torch.utils.checkpoint import checkpoint

from fsdp_compose import MixedPrecisionPolicy, fully_shard

VOCAB, DIM, HEADS, SEQ, BATCH, LAYERS = 96, 64, 4, 32, 4, 3


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(DIM), nn.LayerNorm(DIM)
        self.qkv = nn.Linear(DIM, 3 * DIM)
        self.proj = nn.Linear(DIM, DIM)
        self.fc1, self.fc2 = nn.Linear(DIM, 4 * DIM), nn.Linear(4 * DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, s, 3, HEADS, DIM // HEADS).permute(2, 0, 3, 1, 4).unbind(0)
        x = x + self.proj(F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, s, DIM))
        return x + self.fc2(F.gelu(self.fc1(self.norm2(x))))


class LM(nn.Module):
    def __init__(self, checkpointed: bool = False) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.blocks = nn.ModuleList(Block() for _ in range(LAYERS))
        self.norm = nn.LayerNorm(DIM)
        self.head = nn.Linear(DIM, VOCAB)
        self.checkpointed = checkpointed

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        for block in self.blocks:
            x = checkpoint(block, x, use_reentrant=False) if self.checkpointed else block(x)
        return self.head(self.norm(x))


def _job(checkpointed: bool = False, fake_built: bool = False, **shard_kwargs):
    torch.manual_seed(0)
    if fake_built:  # as torchtitan's memory estimator builds: the mesh outside, the model in a FakeTensorMode
        shard_kwargs["mesh"] = init_device_mesh("cpu", (dist.get_world_size(),))
        with FakeTensorMode():
            model = LM(checkpointed)
    else:
        model = LM(checkpointed)
    for block in model.blocks:
        fully_shard(block, **shard_kwargs)
    fully_shard(model, **shard_kwargs)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    torch.manual_seed(1 + dist.get_rank())

    def loss_fn() -> torch.Tensor:
        ids = torch.randint(0, VOCAB, (BATCH, SEQ + 1))
        return F.cross_entropy(model(ids[:, :-1]).flatten(0, 1), ids[:, 1:].flatten())

    return model, optimizer, loss_fn


def fp32():
    return _job()


def bf16_mixed():
    return _job(mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32))


def checkpointed_no_reshard():
    return _job(checkpointed=True, reshard_after_forward=False)


def fake_built():
    """``fp32``'s job with FakeTensor parameters: only estimate can run it."""
    return _job(fake_built=True)


JOBS = {"fp32": fp32, "bf16_mixed": bf16_mixed, "checkpointed_no_reshard": checkpointed_no_reshard}
