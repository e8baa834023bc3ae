"""Block-quantized weight all-gather (ZeRO++'s qwZ): int8 or float8 bytes plus a scale per block.

A codec for the all-gather extension protocol (the core's ``set_gather_codec``), no tensor subclass needed: each
rank sends its padded shard as blocks of ``block_size`` 1-byte values scaled by the block's absolute
maximum (one fp32 scale each); every rank dequantizes all blocks into the compute dtype. The shard
(the master weight) is never quantized, only what travels; gradients pass straight through.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from ..extras_api import row_layout

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
        rows = row_layout(outer_size, 0, mesh.size(), 0)  # the core's rows: every rank pads to the same count
        blocks = math.ceil(rows.padded_numel / self.block_size)
        flat = torch.zeros(blocks * self.block_size, dtype=torch.float32, device=shard.device)
        flat[: shard.numel()].copy_(shard.reshape(-1))
        flat = flat.view(blocks, self.block_size)
        scales = flat.abs().amax(dim=1).clamp(min=1e-12).div_(self.largest)
        scaled = flat.div_(scales.unsqueeze(1))
        if self.dtype == torch.int8:
            scaled = scaled.round_()
        return (scaled.to(self.dtype).view(-1), scales), torch.Size((rows.rows_per_rank, *outer_size[1:]))

    def wire_nbytes(self, padded_numel: int) -> int:
        """Bytes one rank sends for a shard of ``padded_numel`` elements (what ``pre`` returns): a byte per
        element of whole blocks, and an fp32 scale per block."""
        blocks = math.ceil(padded_numel / self.block_size)
        return blocks * self.block_size * self.dtype.itemsize + blocks * 4

    def post(self, outputs, shape: torch.Size, param_dtype: torch.dtype, *, out: torch.Tensor | None = None):
        """Every rank's blocks dequantized into one (world x padded rows, ...) tensor of ``param_dtype``
        (``shape``, the metadata, is one rank's padded shard)."""
        data, scales = outputs
        if out is not None:
            with torch.autograd.grad_mode._unsafe_preserve_version_counter(out):
                self._dequantize_into(out, data, scales, shape)
            return None
        ranks = scales.numel() // math.ceil(shape.numel() / self.block_size)
        full = torch.empty((ranks * shape[0], *shape[1:]), dtype=param_dtype, device=data.device)
        self._dequantize_into(full, data, scales, shape)
        return full, (full,)

    def rebuilds(self, param_dtype: torch.dtype) -> bool:
        """Whether ``requantize_into`` gets the wire bytes back exactly from a ``param_dtype`` weight: where
        it keeps fp32's exponent range (rounding at most 2**-9 relative, far inside half a quantization
        step); fp16 may flush small weights, so there the bytes are kept."""
        return param_dtype in (torch.bfloat16, torch.float32, torch.float64)

    def requantize_into(
        self, data: torch.Tensor, scales: torch.Tensor, weight: torch.Tensor, shape: torch.Size
    ) -> None:
        """Write into ``data`` the 1-byte values every rank sent, from ``weight`` and the gathered ``scales``
        (``shape``: one rank's padded shard), a few blocks at a time."""
        data.zero_()
        buffer = torch.empty(self._chunk_elements(), dtype=torch.float32, device=data.device)
        for part, wire, scale in self._spans(weight.detach().reshape(-1), shape, data, scales):
            values = buffer[: wire.numel()].view(part.shape[0], -1)
            values[:, : part.shape[1]].copy_(part)
            scaled = values.view(wire.shape).div_(scale)
            if self.dtype == torch.int8:
                scaled.round_()
            wire.view(part.shape[0], -1)[:, : part.shape[1]].copy_(values[:, : part.shape[1]])

    def _dequantize_into(self, out: torch.Tensor, data: torch.Tensor, scales: torch.Tensor, shape: torch.Size) -> None:
        """Dequantize into ``out`` a few blocks at a time through one fp32 buffer, so fp32 products never
        exist for the whole weight at once (the backward re-gather's peak)."""
        buffer = torch.empty(self._chunk_elements(), dtype=torch.float32, device=out.device)
        for part, wire, scale in self._spans(out.view(-1), shape, data, scales):
            values = buffer[: wire.numel()].view(wire.shape)
            values.copy_(wire).mul_(scale)
            part.copy_(values.view(part.shape[0], -1)[:, : part.shape[1]])

    def _chunk_elements(self) -> int:
        return max(1, _CHUNK_ELEMENTS // self.block_size) * self.block_size

    def _spans(self, flat: torch.Tensor, shape: torch.Size, data: torch.Tensor, scales: torch.Tensor) -> Iterator:
        """Walk the weight ``flat`` (each rank's padded shard of ``shape`` in turn) a chunk at a time, as (its
        part, a row per rank; those ranks' (ranks, blocks, block) wire values; their scales): small shards
        go several ranks at once, so the kernels per weight do not grow with the world size."""
        per_rank, size, chunk = shape.numel(), self.block_size, self._chunk_elements()
        wires = data.view(-1, math.ceil(per_rank / size) * size)  # a row per rank: its padded blocks
        scale_rows = scales.view(wires.shape[0], -1)
        whole = min(wires.shape[0], flat.numel() // per_rank)  # ranks whose whole shard is in the weight
        together = max(1, chunk // wires.shape[1])
        spans = [(rank, min(together, whole - rank)) for rank in range(0, whole, together)]
        spans += [(whole, 1)] if flat.numel() > whole * per_rank else []
        for rank, ranks in spans:
            rows = flat[rank * per_rank : (rank + ranks) * per_rank].view(ranks, -1)
            for at in range(0, rows.shape[1], chunk):
                end = at + math.ceil(min(chunk, rows.shape[1] - at) / size) * size
                wire = wires[rank : rank + ranks, at:end].view(ranks, -1, size)
                scale = scale_rows[rank : rank + ranks, at // size : end // size, None]
                yield rows[:, at : at + chunk], wire, scale
