"""Will Llama 3 8B fit on 64 GPUs, and 70B on 512? ``fsdp_compose.estimate`` answers on this CPU machine.

Llama-3-shaped models (grouped-query attention, rotary embeddings, SwiGLU) built on the meta
device, fp32 parameters gathered in bf16 (``MixedPrecisionPolicy``), one ``fully_shard`` per layer
and one on the root, AdamW, batch 1 x 2048 tokens per rank; 70B also checkpoints each layer's
activations. Prints each estimate and its wall time:

    python -m benchmarks.estimate_llama            # both
    python -m benchmarks.estimate_llama 8b         # one
"""

from __future__ import annotations

import resource
import sys
import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from fsdp_compose import MixedPrecisionPolicy, estimate, fully_shard


@dataclass
class LlamaConfig:
    layers: int
    dim: int
    heads: int
    kv_heads: int
    ffn: int
    vocab: int = 128256
    seq: int = 2048
    batch: int = 1
    checkpointed: bool = False


LLAMA3_8B = LlamaConfig(layers=32, dim=4096, heads=32, kv_heads=8, ffn=14336)
LLAMA3_70B = LlamaConfig(layers=80, dim=8192, heads=64, kv_heads=8, ffn=28672, checkpointed=True)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


class Attention(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = cfg.heads, cfg.kv_heads, cfg.dim // cfg.heads
        self.wq = nn.Linear(cfg.dim, cfg.dim, bias=False)
        self.wk = nn.Linear(cfg.dim, cfg.kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(cfg.dim, cfg.kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(cfg.dim, cfg.dim, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q = self.wq(x).view(b, s, self.heads, self.head_dim).transpose(1, 2)
        k = self.wk(x).view(b, s, self.kv_heads, self.head_dim).transpose(1, 2)
        v = self.wv(x).view(b, s, self.kv_heads, self.head_dim).transpose(1, 2)
        q, k = rotate(q, cos, sin), rotate(k, cos, sin)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        return self.wo(out.transpose(1, 2).reshape(b, s, -1))


class Layer(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.attention_norm, self.ffn_norm = nn.RMSNorm(cfg.dim), nn.RMSNorm(cfg.dim)
        self.attention = Attention(cfg)
        self.w1 = nn.Linear(cfg.dim, cfg.ffn, bias=False)
        self.w3 = nn.Linear(cfg.dim, cfg.ffn, bias=False)
        self.w2 = nn.Linear(cfg.ffn, cfg.dim, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x), cos, sin)
        h = self.ffn_norm(x)
        return x + self.w2(F.silu(self.w1(h)) * self.w3(h))


class Llama(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab, cfg.dim)
        self.layers = nn.ModuleList(Layer(cfg) for _ in range(cfg.layers))
        self.norm = nn.RMSNorm(cfg.dim)
        self.output = nn.Linear(cfg.dim, cfg.vocab, bias=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        head_dim = self.cfg.dim // self.cfg.heads
        freqs = torch.outer(torch.arange(ids.shape[1]), 500000.0 ** -(torch.arange(0, head_dim, 2) / head_dim))
        cos, sin = freqs.cos().to(torch.bfloat16), freqs.sin().to(torch.bfloat16)
        x = self.embed(ids)
        for layer in self.layers:
            x = checkpoint(layer, x, cos, sin, use_reentrant=False) if self.cfg.checkpointed else layer(x, cos, sin)
        return self.output(self.norm(x))


def unsharded_job(cfg: LlamaConfig):
    """The model on meta, unsharded, a function making the optimizer, the loss of a batch (what plan needs)."""
    with torch.device("meta"):
        model = Llama(cfg)

    def loss_fn() -> torch.Tensor:
        ids = torch.randint(0, cfg.vocab, (cfg.batch, cfg.seq + 1))
        logits = model(ids[:, :-1])
        return F.cross_entropy(logits.flatten(0, 1).float(), ids[:, 1:].flatten())

    return model, lambda params: torch.optim.AdamW(params, lr=3e-4), loss_fn


def train_job(cfg: LlamaConfig):
    """What a training script does before its loop, unchanged, ending in what estimate needs."""
    model, make_optimizer, loss_fn = unsharded_job(cfg)
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for layer in model.layers:
        fully_shard(layer, mp_policy=mp)
    fully_shard(model, mp_policy=mp)
    return model, make_optimizer, loss_fn


def llama3_8b():
    return train_job(LLAMA3_8B)


def llama3_70b():
    return train_job(LLAMA3_70B)


def children_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def main(which: list[str]) -> None:
    for name, build, world in (("8b", llama3_8b, 64), ("70b", llama3_70b, 512)):
        if which and name not in which:
            continue
        began, cpu = time.perf_counter(), children_cpu()
        result = estimate(build, world_size=world)
        print(
            f"=== Llama 3 {name.upper()} at world size {world}: estimated in {time.perf_counter() - began:.1f} s "
            f"({children_cpu() - cpu:.1f} s of CPU in the subprocess)"
        )
        print(result)
        print()


if __name__ == "__main__":
    main(sys.argv[1:])
