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
_CHUNK_ELEMENTS = 1 << 16  # dequantized per step into the unsharded weight: 256 KiB of fp32


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
        if out is not None:
            with torch.autograd.grad_mode._unsafe_preserve_version_counter(out):
                self._dequantize_into(out, data, scales, shape)
            return None
        ranks = scales.numel() // math.ceil(shape.numel() / self.block_size)
        full = (data.view(scales.numel(), self.block_size).float() * scales.unsqueeze(1)).view(ranks, -1)
        full = full[:, : shape.numel()].reshape(ranks * shape[0], *shape[1:]).to(param_dtype)
        return full, (full,)

    def _dequantize_into(self, out: torch.Tensor, data: torch.Tensor, scales: torch.Tensor, shape: torch.Size) -> None:
        """Dequantize into ``out`` a few blocks at a time: the fp32 products never exist for the
        whole weight at once (8 bytes per element of transients otherwise, at the peak of the
        backward's re-gather); the values are the same, rounded once from fp32 by ``copy_``."""
        per_rank, blocks_per_rank = shape.numel(), math.ceil(shape.numel() / self.block_size)
        chunk = max(1, _CHUNK_ELEMENTS // self.block_size) * self.block_size
        flat = out.view(-1)
        for rank in range(scales.numel() // blocks_per_rank):
            start = rank * per_rank
            rows = flat[start : min(start + per_rank, flat.numel())]  # the last ranks' rows may be padding
            first = rank * blocks_per_rank * self.block_size
            for i in range(0, rows.numel(), chunk):
                n = min(chunk, rows.numel() - i)
                blocks = math.ceil(n / self.block_size)
                values = data[first + i : first + i + blocks * self.block_size].view(blocks, self.block_size).float()
                block = (first + i) // self.block_size
                values.mul_(scales[block : block + blocks].unsqueeze(1))
                rows[i : i + n].copy_(values.view(-1)[:n])


def wire_format_of(param: torch.Tensor) -> BlockQuantized | None:
    """The wire format ``quantize_all_gather`` chose for ``param`` (an attribute: see ``register_owner``)."""
    return getattr(param, WIRE_ATTR, None)
