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


def validate_policies(
    module_name: str,
    mesh_device_type: str,
    compute_device_type: str,
    mp_policy: MixedPrecisionPolicy,
    offload_policy: OffloadPolicy,
) -> None:
    """Reject policies that cannot work, naming the module and the field at fault."""
    for field_name in ("param_dtype", "reduce_dtype", "output_dtype"):
        dtype = getattr(mp_policy, field_name)
        if dtype is not None and not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
            raise ValueError(
                f"fully_shard({module_name}, mp_policy=...): {field_name}={dtype} is not a floating-point dtype"
            )
    if isinstance(offload_policy, CPUOffloadPolicy) and mesh_device_type not in ("cpu", compute_device_type):
        raise ValueError(
            f"fully_shard({module_name}, offload_policy=CPUOffloadPolicy()): the mesh is on '{mesh_device_type}' "
            f"but this process computes on '{compute_device_type}'; offloading moves shards between CPU and "
            "the mesh's device, so build the mesh on the compute device"
        )


def collective_dtypes(dtype: torch.dtype, mp_policy: MixedPrecisionPolicy) -> tuple[torch.dtype, torch.dtype]:
    """The all-gather and reduce-scatter dtypes of a parameter whose own dtype is ``dtype``."""
    if not dtype.is_floating_point:  # integer and bool parameters keep their dtype
        return dtype, dtype
    gather_dtype = mp_policy.param_dtype if mp_policy.param_dtype is not None else dtype
    return gather_dtype, mp_policy.reduce_dtype if mp_policy.reduce_dtype is not None else gather_dtype
