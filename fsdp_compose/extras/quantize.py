"""``quantize_all_gather``: chosen weights travel as block-quantized bytes (ZeRO++'s qwZ), opt-in."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from ..extras_api import owner_of, set_gather_codec
from .quantized_gather import BlockQuantized

_WIRE_DTYPES = (
    torch.int8,
    *(getattr(torch, name) for name in ("float8_e4m3fn", "float8_e5m2") if hasattr(torch, name)),
)


def _default_choice(module: nn.Module, name: str, param: nn.Parameter, min_numel: int) -> bool:
    return isinstance(module, (nn.Linear, nn.Embedding)) and name == "weight" and param.numel() >= min_numel


def quantize_all_gather(
    module: nn.Module,
    dtype: torch.dtype = torch.int8,
    *,
    block_size: int = 128,
    min_numel: int = 4096,
    filter_fn: Callable[[str, nn.Parameter], bool] | None = None,
) -> list[str]:
    """Send chosen weights through ``fully_shard``'s all-gather as 1-byte blocks with a scale each.

    Each rank quantizes its shard in blocks of ``block_size`` elements (``dtype``: ``torch.int8``,
    or ``torch.float8_e4m3fn``) with one fp32 scale per block, and every rank dequantizes what
    arrives into the compute dtype (``MixedPrecisionPolicy.param_dtype``, else the parameter's). So
    a bf16 all-gather's bytes drop to about half (int8 + scales), an fp32 one's to about a
    quarter. The shards themselves, the optimizer's state, gradients and state dicts stay in full
    precision: only what travels is rounded, once per gather.

    Call it before ``fully_shard``. By default it chooses ``nn.Linear`` and ``nn.Embedding``
    weights of at least ``min_numel`` elements (norms and biases travel as before); pass
    ``filter_fn(name, param)`` to choose yourself (``name`` relative to ``module``). Returns the
    names chosen, a tied weight once (its first name chosen). Not for parameters sharded on a dim
    other than 0 or tensor-parallel ones.
    """
    if dtype not in _WIRE_DTYPES:
        raise ValueError(f"quantize_all_gather(dtype={dtype}): pick one of {', '.join(map(str, _WIRE_DTYPES))}")
    if block_size < 1:
        raise ValueError(f"quantize_all_gather(block_size={block_size}): pass a positive number of elements")
    wire = BlockQuantized(dtype, block_size)
    chosen, seen = [], set()
    for module_name, owner in module.named_modules():
        for name, param in owner.named_parameters(recurse=False):
            fqn = f"{module_name}.{name}" if module_name else name
            pick = filter_fn(fqn, param) if filter_fn is not None else _default_choice(owner, name, param, min_numel)
            if not pick or id(param) in seen:
                continue
            seen.add(id(param))
            if owner_of(param) is not None:
                raise ValueError(
                    f"quantize_all_gather: parameter '{fqn}' is already sharded by fully_shard; call "
                    "quantize_all_gather before fully_shard"
                )
            set_gather_codec(param, wire)
            chosen.append(fqn)
    return chosen
