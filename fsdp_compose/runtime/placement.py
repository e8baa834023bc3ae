"""``shard_placement_fn``: parameters sharded on a dim other than 0, uneven sizes included.

Each rank holds its ``torch.chunk`` of dim ``d``; collectives move ``d`` to the front (copy-in sends
the shard transposed, copy-out lands in a staging buffer copied once into the contiguous parameter,
gradients go and come back the same way), so unevenness is plain dim-0 padding.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn
from torch.distributed.tensor import Shard

from .param_layout import alias, contiguous_strides
from .params import ShardedParam


def resolve_shard_dim(
    placement_fn: Callable[[nn.Parameter], Shard | None] | None, param: nn.Parameter, fqn: str, module: str
) -> int:
    """The (non-negative) dim ``placement_fn`` shards ``param`` on; ``None`` means dim 0."""
    if placement_fn is None:
        return 0
    placement = placement_fn(param)
    if placement is None:
        return 0
    if type(placement) is not Shard:  # _StridedShard and friends are not a choice a user makes here
        raise ValueError(
            f"fully_shard({module}, shard_placement_fn=...): returned {placement!r} for parameter "
            f"'{fqn}'; return Shard(dim) or None (for Shard(0))"
        )
    ndim = param.dim()
    if not -ndim <= placement.dim < ndim:
        raise ValueError(
            f"fully_shard({module}, shard_placement_fn=...): Shard({placement.dim}) for parameter "
            f"'{fqn}' of shape {tuple(param.shape)} is out of range; pick a dim in [{-ndim}, {ndim - 1}]"
        )
    return placement.dim % ndim


class DimShardedParam(ShardedParam):
    """A ``ShardedParam`` split on ``shard_dim > 0``; only the layout conversions differ."""

    def to_comm(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor.movedim(self.shard_dim, 0)

    def from_comm(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor.movedim(0, self.shard_dim)

    def gather_pieces(self) -> list[torch.Tensor]:
        """The shard with ``shard_dim`` first (a copy each time: the optimizer updates it in place)."""
        local = self.local_tensor().to(self.layout.compute_device, self.layout.gather_dtype, non_blocking=True)
        return self._as_pieces(self.to_comm(local).contiguous())

    # ----- unsharded side: the parameter's own storage plus a (world, padded) staging buffer ----
    def _create_unsharded(self) -> None:
        super()._create_unsharded()
        # the base made the parameter alias the gather target; give the gather its own buffer
        param_storage = self._gather_target.view(self.layout.gather_dtype)
        self._param_nbytes = param_storage.untyped_storage().nbytes()
        self._unsharded_data = alias(param_storage, self.unsharded_shape, contiguous_strides(self.unsharded_shape))
        staging = self._zeros(self.world_size * self.padded_numel, self.layout.compute_device)
        self._gather_target = staging.view(self.world_size, self.padded_numel).view(torch.uint8)

    def alloc_unsharded(self) -> torch.Tensor:
        target = super().alloc_unsharded()  # (re)allocates the staging buffer
        storage = self._unsharded_data.untyped_storage()
        if storage.nbytes() != self._param_nbytes:
            storage.resize_(self._param_nbytes)
        return target

    def _staged(self) -> torch.Tensor:
        """The gathered tensor inside the staging buffer, ``shard_dim`` first, padding dropped."""
        flat = self._gather_target.view(self.layout.gather_dtype).reshape(-1)
        return flat[: self.comm_shape.numel()].view(self.comm_shape)

    def finish_copy_out(self, slice_follows: bool = True) -> None:
        self._unsharded_data.copy_(self.from_comm(self._staged()))
        self._gather_target.untyped_storage().resize_(0)  # staging is only needed during copy-out

    def gathered_rows(self) -> list[torch.Tensor]:
        target = self.alloc_unsharded()
        self._staged().copy_(self.to_comm(self._unsharded_data))
        return [target]

    def free_unsharded(self) -> None:
        super().free_unsharded()
        if self.unsharded_param is not None:
            self._unsharded_data.untyped_storage().resize_(0)

    def unsharded_nbytes(self) -> int:
        if self.unsharded_param is None:
            return 0
        return super().unsharded_nbytes() + self._unsharded_data.untyped_storage().nbytes()
