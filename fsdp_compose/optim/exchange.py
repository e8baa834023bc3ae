"""Moving row-shards of whole matrices to their owner rank and the owner's result back.

A shard group is the process group over which a set of parameters is split row-wise (``Shard(0)``, rows as
``fully_shard`` splits them, ``row_layout``: the last ranks may hold fewer or none). Each matrix has one
owner in that group. Two ``all_to_all_single`` calls per group and step move every matrix: the
gradient rows to their owners, the owners' updates back to the rows' holders. Split sizes come from
shapes alone, so no rank reads a tensor value to plan a collective. Both are started asynchronously,
so a rank computes what needs no other rank's rows while they travel (or while a slower rank catches up).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from ..extras_api import row_layout


def assign_owners(costs: Sequence[int], world_size: int, load: Sequence[int] | None = None) -> list[int]:
    """Owner rank of each matrix: costliest first to the least-loaded rank (ties: lowest index, lowest rank).

    Deterministic in its inputs, so every rank computes the same owners without a collective. ``costs``: each
    matrix's work (``OwnerComputedMuon`` passes Newton-Schulz's, ``muon.newton_schulz_work``); ``load``: the
    same work each rank does already (its rows of 3-D expert batches), so matrices fill in around it.
    """
    load = list(load) if load is not None else [0] * world_size
    owners = [0] * len(costs)
    for index in sorted(range(len(costs)), key=lambda i: (-costs[i], i)):
        rank = min(range(world_size), key=lambda r: (load[r], r))
        owners[index] = rank
        load[rank] += costs[index]
    return owners


@dataclass(frozen=True)
class Matrix:
    """One matrix of a shard group: its columns, owner and the rows each rank holds (``from_shape``)."""

    cols: int
    owner: int
    row_counts: tuple[int, ...]
    row_starts: tuple[int, ...]

    def numel_on(self, rank: int) -> int:
        return self.row_counts[rank] * self.cols

    def row_start(self, rank: int) -> int:
        return self.row_starts[rank]

    @classmethod
    def from_shape(cls, shape: torch.Size, owner: int, world_size: int) -> Matrix:
        """The matrix of ``shape`` ``(rows, cols)``, every rank's ``Shard(0)`` rows as ``fully_shard`` cuts them."""
        layout = row_layout(shape, 0, world_size, 0)
        starts, counts = zip(*(layout.rows_of(rank) for rank in range(world_size)))
        return cls(shape[1], owner, counts, starts)


@dataclass(frozen=True)
class ShardGroup:
    """The process group a set of matrices is sharded over, and this rank's place in it."""

    group: dist.ProcessGroup | None  # None: not sharded, every rank holds whole matrices
    size: int
    rank: int
    device: torch.device  # where the shards live: the collectives' buffers are made there


Segment = tuple[int, int, int]  # (matrix index, rank, offset): one rank's rows of one matrix in a flat buffer


@dataclass(frozen=True)
class Pending:
    """An all-to-all under way: ``wait()`` before reading ``recv`` (``send`` is kept alive until then)."""

    work: Any
    send: torch.Tensor
    recv: torch.Tensor

    def wait(self) -> torch.Tensor:
        self.work.wait()
        return self.recv


class Route:
    """Where every rank's rows of every matrix sit in the two all-to-alls of one shard group.

    From shapes and owners alone, so a step builds it once and reuses it while the same matrices have gradients.
    Two layouts: this rank's rows of every matrix, grouped by owner (the gather's input, the scatter's output),
    and every rank's rows of the matrices this rank owns, grouped by rank (the gather's output, the scatter's
    input). Buffers are filled by one copy per segment (casting as they go): no flattened temporaries.

    The two flat buffers are kept for the next step (``release()`` drops them): freshly allocated, tens of MB
    each step cost page faults that measured as much as the copies into them. Each layout's buffer serves both
    collectives, one after the other, so the workspace is about this rank's rows and its owned matrices, once.
    """

    def __init__(self, shard_group: ShardGroup, matrices: Sequence[Matrix]) -> None:
        me, n = shard_group.rank, shard_group.size
        self.shard_group, self.matrices = shard_group, tuple(matrices)
        self.mine = [i for i, m in enumerate(matrices) if m.owner == me]
        by_owner = [[i for i, m in enumerate(matrices) if m.owner == r] for r in range(n)]
        # a rank's own rows of its own matrices stay out of both: the caller reads them where they are
        self.held = _segments([(i, me) for r in range(n) if r != me for i in by_owner[r]], self.matrices)
        self.owned = _segments([(i, r) for r in range(n) if r != me for i in self.mine], self.matrices)
        self.held_splits = [0 if r == me else sum(matrices[i].numel_on(me) for i in by_owner[r]) for r in range(n)]
        self.owned_splits = [0 if r == me else sum(matrices[i].numel_on(r) for i in self.mine) for r in range(n)]
        self._buffers: dict[str, torch.Tensor] = {}

    def rows(self, buffer: torch.Tensor, segment: Segment) -> torch.Tensor:
        """``segment``'s rows: a view into ``buffer``."""
        i, r, offset = segment
        m = self.matrices[i]
        return buffer[offset : offset + m.numel_on(r)].view(m.row_counts[r], m.cols)

    def start_gather(self, local_rows: Sequence[torch.Tensor], dtype: torch.dtype) -> Pending:
        """Send this rank's rows of every matrix to its owner (asynchronously); ``owned_rows`` reads what arrives."""
        send = self._flat("held", dtype)
        for segment in self.held:
            self.rows(send, segment).copy_(local_rows[segment[0]])
        return self._all_to_all(send, self._flat("owned", dtype), self.held_splits, self.owned_splits)

    def owned_rows(self, recv: torch.Tensor) -> dict[int, list[tuple[int, int, torch.Tensor]]]:
        """Each owned matrix's rows from the other ranks, ``(rank, first row, rows)``: views into the gather's
        output."""
        pieces: dict[int, list[tuple[int, int, torch.Tensor]]] = {i: [] for i in self.mine}
        for segment in self.owned:
            i, r, _ = segment
            pieces[i].append((r, self.matrices[i].row_start(r), self.rows(recv, segment)))
        return pieces

    def start_scatter(self, owned: dict[int, torch.Tensor], dtype: torch.dtype) -> Pending:
        """Send each rank its rows of the owned matrices' updates (asynchronously); ``held_rows`` reads them."""
        send = self._flat("owned", dtype)
        for segment in self.owned:
            i, r, _ = segment
            m = self.matrices[i]
            self.rows(send, segment).copy_(owned[i].narrow(0, m.row_start(r), m.row_counts[r]))
        return self._all_to_all(send, self._flat("held", dtype), self.owned_splits, self.held_splits)

    def held_rows(self, recv: torch.Tensor) -> list[torch.Tensor]:
        """This rank's rows of every matrix owned by another rank, by index (None for its own): views into the
        scatter's output."""
        rows: list[torch.Tensor | None] = [None] * len(self.matrices)
        for segment in self.held:
            rows[segment[0]] = self.rows(recv, segment)
        return rows  # type: ignore[return-value]

    def release(self) -> None:
        """Drop the kept buffers (the next collective allocates them again)."""
        self._buffers.clear()

    def _flat(self, layout: str, dtype: torch.dtype) -> torch.Tensor:
        """The flat buffer of ``layout`` ("held": this rank's rows; "owned": rows of its matrices) as ``dtype``."""
        numel = sum(self.held_splits if layout == "held" else self.owned_splits)
        nbytes = numel * dtype.itemsize
        buffer = self._buffers.get(layout)
        if buffer is None or buffer.numel() < nbytes:
            buffer = self._buffers[layout] = torch.empty(nbytes, dtype=torch.uint8, device=self.shard_group.device)
        return buffer[:nbytes].view(dtype)

    def _all_to_all(
        self, send: torch.Tensor, recv: torch.Tensor, send_splits: list[int], recv_splits: list[int]
    ) -> Pending:
        work = dist.all_to_all_single(recv, send, recv_splits, send_splits, group=self.shard_group.group, async_op=True)
        return Pending(work, send, recv)


def _segments(pairs: list[tuple[int, int]], matrices: Sequence[Matrix]) -> list[Segment]:
    """``(matrix, rank)`` pairs laid end to end: each with the offset of its rows."""
    segments, offset = [], 0
    for i, r in pairs:
        segments.append((i, r, offset))
        offset += matrices[i].numel_on(r)
    return segments


def gather_to_owners(
    shard_group: ShardGroup, matrices: Sequence[Matrix], local_rows: Sequence[torch.Tensor], dtype: torch.dtype
) -> dict[int, torch.Tensor]:
    """Whole matrices, by index, of those this rank owns, assembled from every rank's rows in one collective."""
    route = Route(shard_group, matrices)
    pieces = route.owned_rows(route.start_gather(local_rows, dtype).wait())
    for i in route.mine:
        pieces[i].append((shard_group.rank, matrices[i].row_start(shard_group.rank), local_rows[i].to(dtype)))
    return {i: torch.cat([rows for _, _, rows in sorted(p, key=lambda piece: piece[0])]) for i, p in pieces.items()}


def scatter_from_owners(
    shard_group: ShardGroup, matrices: Sequence[Matrix], owned: dict[int, torch.Tensor], dtype: torch.dtype
) -> list[torch.Tensor]:
    """This rank's rows of every matrix, sent by the owners in one collective."""
    route = Route(shard_group, matrices)
    rows = route.held_rows(route.start_scatter(owned, dtype).wait())
    me = shard_group.rank
    for i in route.mine:
        rows[i] = owned[i].narrow(0, matrices[i].row_start(me), matrices[i].row_counts[me]).to(dtype)
    return rows
