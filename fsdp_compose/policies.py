"""Option objects accepted by ``fully_shard``, with torch FSDP2's field names.

They are frozen so one instance can be shared by many ``fully_shard`` calls.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class MixedPrecisionPolicy:
    """Dtypes for the all-gather, the gradient reduction and the forward output.

    ``None`` means "keep the parameter's own dtype".
    """

    param_dtype: torch.dtype | None = None
    reduce_dtype: torch.dtype | None = None
    output_dtype: torch.dtype | None = None
    cast_forward_inputs: bool = True


@dataclass(frozen=True)
class OffloadPolicy:
    """No offloading: sharded parameters live on the compute device."""


@dataclass(frozen=True)
class CPUOffloadPolicy(OffloadPolicy):
    """Keep sharded parameters, gradients and optimizer state on CPU."""

    pin_memory: bool = True
