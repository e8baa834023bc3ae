"""Where a parameter's unsharded form lives: one object per storage kind, behind one interface.

- ``Aliased``: the unsharded parameter aliases the ``(world, padded)`` copy-out target, so copy-out
  writes the parameter in place (a ``Shard(0)`` plain shard);
- ``Staged``: ``Shard(d)`` with ``d > 0``: collectives see ``d`` first, so copy-out lands in a staging
  buffer copied once into the contiguous parameter;
- ``extensions.GatherExtension``: a shard with the all-gather extension protocol (or a codec): its
  pre-all-gather chooses the inputs, its post-all-gather builds the parameter.

Every kind receives the parameter's ``RowLayout`` (``rows.py``) when built and answers ``widths``, ``pieces``,
``targets``, ``finish``, ``rows``, ``free`` and ``nbytes``; a ``ShardedParam`` (``params.py``) holds one of them
(``form``) and never asks which. Only the methods that build or read the unsharded parameter take the
``ShardedParam`` that owns it.
"""

from __future__ import annotations

import torch

from .param_layout import ParamLayout, alias, contiguous_strides
from .rows import RowLayout


def give_storage(storage: torch.UntypedStorage, nbytes: int) -> None:
    """Give a storage freed with ``resize_(0)`` its ``nbytes`` back (a no-op where it has them). Every unshard
    runs it, so it lives in this file of a step's path."""
    if storage.nbytes() != nbytes:
        storage.resize_(nbytes)


class Aliased:
    """The unsharded parameter is a view of the gathered rows: no copy after copy-out. See [Note: the
    aliasing copy-out target] in ``param_layout.py``."""

    extension = None

    def __init__(self, row_layout: RowLayout, layout: ParamLayout) -> None:
        self.row_layout = row_layout
        self.layout = layout  # the gather dtype and the compute device: where the unsharded parameter lives
        self.target: torch.Tensor | None = None  # (world, padded bytes) uint8 view of the unsharded storage
        self._source: torch.Tensor | None = None  # the local shard ``_pieces`` were made of
        self._pieces: list[torch.Tensor] = []
        # what pads this rank's rows to the padded count (``RowLayout``), sent as a piece of its own: no copy
        self._padding = self._zeros(row_layout.padded_numel - row_layout.local_numel)

    def _zeros(self, numel: int) -> torch.Tensor:
        """Zeros where and as the unsharded parameter lives: the compute device, the gather dtype."""
        return torch.zeros(numel, dtype=self.layout.gather_dtype, device=self.layout.compute_device)

    def widths(self) -> list[int]:
        return [self.row_layout.padded_numel * self.layout.gather_dtype.itemsize]

    def pieces(self, local: torch.Tensor) -> list[torch.Tensor]:
        """The shard's bytes and its padding, cast to the gather dtype where needed (uncast views cached)."""
        if local is self._source:
            return self._pieces
        layout = self.layout
        if local.device != layout.compute_device or local.dtype != layout.gather_dtype:
            return self._padded(local.to(layout.compute_device, layout.gather_dtype, non_blocking=True))
        self._source, self._pieces = local, self._padded(local)
        return self._pieces

    def _padded(self, rows: torch.Tensor) -> list[torch.Tensor]:
        """This rank's rows (shard dim first) as bytes, then the padding's."""
        pieces = [rows.reshape(-1).view(torch.uint8)]
        if self._padding.numel():
            pieces.append(self._padding.view(torch.uint8))
        return pieces

    def _create(self, p) -> None:
        rows = self.row_layout
        storage_owner = self._zeros(rows.world * rows.padded_numel)
        p.new_unsharded(alias(storage_owner, rows.shape, contiguous_strides(rows.shape)))
        self.target = alias(storage_owner, (rows.world, rows.padded_numel), (rows.padded_numel, 1)).view(torch.uint8)

    def targets(self, p) -> list[torch.Tensor]:
        """Give the unsharded storage back (``p``'s unsharded parameter is built the first time); the
        copy-out target."""
        if p.unsharded_param is None:
            self._create(p)
        give_storage(self.target.untyped_storage(), self.target.numel())
        return [self.target]

    def finish(self, p, slice_follows: bool) -> None:
        """After copy-out: the parameter already holds the values."""

    def rows(self, p) -> list[torch.Tensor]:
        """The gathered ``(world, bytes)`` rows while unsharded (what a post-forward slice keeps)."""
        return self.targets(p)

    def free(self) -> None:
        if self.target is not None:
            self.target.untyped_storage().resize_(0)

    def nbytes(self) -> int:
        return 0 if self.target is None else self.target.untyped_storage().nbytes()


class Staged(Aliased):
    """``Shard(d)``, ``d > 0``: copy-out fills a ``(world, padded)`` staging buffer with ``d`` first, copied
    once into the parameter's own contiguous storage and freed; gradients go and come back the same way."""

    def __init__(self, row_layout: RowLayout, layout: ParamLayout) -> None:
        super().__init__(row_layout, layout)
        self.data: torch.Tensor | None = None  # the parameter's own storage

    def pieces(self, local: torch.Tensor) -> list[torch.Tensor]:
        """The shard with its dim first (a copy each time: the optimizer updates it in place)."""
        local = local.to(self.layout.compute_device, self.layout.gather_dtype, non_blocking=True)
        return self._padded(self.row_layout.to_comm(local).contiguous())

    def _create(self, p) -> None:
        super()._create(p)  # the parameter aliases that storage; the staging buffer is another
        rows = self.row_layout
        self.data = alias(self.target.view(self.layout.gather_dtype), rows.shape, contiguous_strides(rows.shape))
        staging = self._zeros(rows.world * rows.padded_numel)
        self.target = staging.view(rows.world, rows.padded_numel).view(torch.uint8)

    def targets(self, p) -> list[torch.Tensor]:
        targets = super().targets(p)  # (re)allocates the staging buffer
        give_storage(self.data.untyped_storage(), self.target.numel())
        return targets

    def _staged(self) -> torch.Tensor:
        """The gathered tensor inside the staging buffer, the shard dim first, padding dropped."""
        return self.row_layout.unpad(self.target.view(self.layout.gather_dtype))

    def finish(self, p, slice_follows: bool) -> None:
        self.data.copy_(self.row_layout.from_comm(self._staged()))
        self.target.untyped_storage().resize_(0)  # staging is only needed during copy-out

    def rows(self, p) -> list[torch.Tensor]:
        targets = self.targets(p)
        self._staged().copy_(self.row_layout.to_comm(self.data))
        return targets

    def free(self) -> None:
        super().free()
        if self.data is not None:
            self.data.untyped_storage().resize_(0)

    def nbytes(self) -> int:
        return super().nbytes() + (0 if self.data is None else self.data.untyped_storage().nbytes())
