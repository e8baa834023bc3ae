"""The benchmark GPT and how the benchmarks shard it, shared by bench_step.py and quantized_convergence.py.

Kept apart from bench_step.py so importing it does not pin glibc's mmap threshold (bench_step.py
does that at import for its peak-RSS figures)."""

from __future__ import annotations

import os
import sys

import torch
from torch import nn

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [p for p in (ROOT, os.path.join(ROOT, "examples")) if p not in sys.path]

from gpt import GPT, GPTConfig  # noqa: E402

CONFIG = GPTConfig(vocab_size=8192, seq_len=128, dim=512, n_heads=8, n_layers=8)  # ~34M parameters


def shard(model: GPT, fully_shard, **kwargs) -> GPT:
    """One group per transformer block, then the root (embeddings, final norm, head)."""
    for block in model.blocks:
        fully_shard(block, **kwargs)
    fully_shard(model, **kwargs)
    return model


def bf16_policy(policy_class):
    """bf16 compute with fp32 gradient reduction, the usual recipe (for ours or torch's policy class)."""
    return policy_class(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)


def bf16_compute(model: nn.Module):
    """``model``'s forward with every floating parameter cast to bf16 inside autograd, as a bf16
    mixed-precision policy computes, without any sharding: the compute-only baseline for it."""
    from torch.func import functional_call

    def forward(ids: torch.Tensor) -> torch.Tensor:
        params = {name: p.to(torch.bfloat16) for name, p in model.named_parameters()}
        return functional_call(model, params, (ids,))

    return forward
