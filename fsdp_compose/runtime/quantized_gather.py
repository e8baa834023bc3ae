"""Block-quantized weight all-gather (ZeRO++'s qwZ): int8 or float8 bytes plus a scale per block.

A codec for the all-gather extension protocol (``extensions.py``) that needs no tensor subclass:
each rank pads its shard to the padded row count, flattens it into blocks of ``block_size``
elements, and sends every block as 1-byte values scaled by the block's absolute maximum (one
fp32 scale per block). After the gather every rank dequantizes all blocks into the compute
dtype. The shard itself (the master weight the optimizer steps, what state dicts hold) is never
quantized; only what travels is. Gradients are unchanged: straight through.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

WIRE_ATTR = "_fsdp_compose_wire"


@dataclass(frozen=True)
class BlockQuantized:
    """The wire format: ``dtype`` (``torch.int8`` or a float8 dtype) and elements per scale."""

    dtype: torch.dtype = torch.int8
    block_size: int = 128

    @property
    def largest(self) -> float:
        if self.dtype == torch.int8:
            return 127.0
        return float(torch.finfo(self.dtype).max)

    def pre(self, shard: torch.Tensor, mesh, outer_size: torch.Size, outer_stride, module, mp_policy):
        """This rank's shard, padded to the padded rows, as (quantized blocks, fp32 block scales)."""
        rows = math.ceil(outer_size[0] / mesh.size())
        numel = rows * math.prod(outer_size[1:])
        blocks = math.ceil(numel / self.block_size)
        flat = torch.zeros(blocks * self.block_size, dtype=torch.float32, device=shard.device)
        flat[: shard.numel()].copy_(shard.reshape(-1))
        flat = flat.view(blocks, self.block_size)
        scales = flat.abs().amax(dim=1).clamp(min=1e-12).div_(self.largest)
        scaled = flat.div_(scales.unsqueeze(1))
        if self.dtype == torch.int8:
            scaled = scaled.round_()
        return (scaled.to(self.dtype).view(-1), scales), torch.Size((rows, *outer_size[1:]))

    def post(self, outputs, shape: torch.Size, param_dtype: torch.dtype, *, out: torch.Tensor | None = None):
        """Every rank's blocks dequantized into one (world x padded rows, ...) tensor of ``param_dtype``
        (``shape``, the metadata, is one rank's padded shard)."""
        data, scales = outputs
        ranks = scales.numel() // math.ceil(shape.numel() / self.block_size)
        full = (data.view(scales.numel(), self.block_size).float() * scales.unsqueeze(1)).view(ranks, -1)
        full = full[:, : shape.numel()].reshape(ranks * shape[0], *shape[1:]).to(param_dtype)
        if out is None:
            return full, (full,)
        with torch.autograd.grad_mode._unsafe_preserve_version_counter(out):
            out.copy_(full[: out.shape[0]])
        return None


def wire_format_of(param: torch.Tensor) -> BlockQuantized | None:
    """The wire format ``quantize_all_gather`` chose for ``param`` (an attribute: see ``register_owner``)."""
    return getattr(param, WIRE_ATTR, None)
