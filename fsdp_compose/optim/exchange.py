"""Moving row-shards of whole matrices to their owner rank and the owner's result back.

A shard group is the process group over which a set of parameters is split row-wise (``Shard(0)``,
rows as ``torch.chunk`` splits them: the last ranks may hold fewer or none). Each matrix has one
owner in that group. Two ``all_to_all_single`` calls per group and step move every matrix: the
gradient rows to their owners, the owners' updates back to the rows' holders. Split sizes come from
shapes alone, so no rank reads a tensor value to plan a collective.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist


def assign_owners(numels: Sequence[int], world_size: int, load: Sequence[int] | None = None) -> list[int]:
    """Owner rank of each matrix: largest first to the least-loaded rank (ties: lowest index, lowest rank).

    Deterministic in its inputs, so every rank computes the same owners without a collective. ``load``:
    elements each rank computes already (its rows of 3-D expert batches), so matrices fill in around them.
    """
    load = list(load) if load is not None else [0] * world_size
    owners = [0] * len(numels)
    for index in sorted(range(len(numels)), key=lambda i: (-numels[i], i)):
        rank = min(range(world_size), key=lambda r: (load[r], r))
        owners[index] = rank
        load[rank] += numels[index]
    return owners


def chunk_rows(total: int, world_size: int) -> list[int]:
    """Rows each rank holds under ``Shard(0)`` (``torch.chunk``: ceil-sized chunks, the last may be short or empty)."""
    size = -(-total // world_size) if total else 0
    return [max(0, min(size, total - r * size)) for r in range(world_size)]


@dataclass(frozen=True)
class Matrix:
    """One matrix of a shard group: its global shape, owner and the rows each rank holds."""

    rows: int
    cols: int
    owner: int
    row_counts: tuple[int, ...]

    def numel_on(self, rank: int) -> int:
        return self.row_counts[rank] * self.cols

    def row_start(self, rank: int) -> int:
        return sum(self.row_counts[:rank])


@dataclass(frozen=True)
class ShardGroup:
    """The process group a set of matrices is sharded over, and this rank's place in it."""

    group: dist.ProcessGroup | None  # None: not sharded, every rank holds whole matrices
    size: int
    rank: int


def _all_to_all(
    send: torch.Tensor, send_splits: list[int], recv_splits: list[int], shard_group: ShardGroup
) -> torch.Tensor:
    recv = send.new_empty(sum(recv_splits))
    dist.all_to_all_single(recv, send, recv_splits, send_splits, group=shard_group.group)
    return recv


def _flat(pieces: list[torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
    if not pieces:
        return torch.empty(0, dtype=dtype)
    return torch.cat([p.reshape(-1).to(dtype) for p in pieces])


def gather_to_owners(
    shard_group: ShardGroup, matrices: Sequence[Matrix], local_rows: Sequence[torch.Tensor], dtype: torch.dtype
) -> dict[int, torch.Tensor]:
    """Whole matrices, by index, of those this rank owns, assembled from every rank's rows in one collective."""
    me, n = shard_group.rank, shard_group.size
    order = [i for r in range(n) for i, m in enumerate(matrices) if m.owner == r]
    send = _flat([local_rows[i] for i in order], dtype)
    send_splits = [sum(m.numel_on(me) for m in matrices if m.owner == r) for r in range(n)]
    mine = [i for i, m in enumerate(matrices) if m.owner == me]
    recv_splits = [sum(matrices[i].numel_on(r) for i in mine) for r in range(n)]
    recv = _all_to_all(send, send_splits, recv_splits, shard_group)
    pieces: dict[int, list[torch.Tensor]] = {i: [] for i in mine}
    offset = 0
    for r in range(n):
        for i in mine:
            m = matrices[i]
            pieces[i].append(recv[offset : offset + m.numel_on(r)].view(m.row_counts[r], m.cols))
            offset += m.numel_on(r)
    return {i: torch.cat(p) for i, p in pieces.items()}


def scatter_from_owners(
    shard_group: ShardGroup, matrices: Sequence[Matrix], owned: dict[int, torch.Tensor], dtype: torch.dtype
) -> list[torch.Tensor]:
    """This rank's rows of every matrix's update, sent by the owners in one collective."""
    me, n = shard_group.rank, shard_group.size
    mine = [i for i, m in enumerate(matrices) if m.owner == me]
    send_pieces = []
    for r in range(n):
        for i in mine:
            m = matrices[i]
            send_pieces.append(owned[i].narrow(0, m.row_start(r), m.row_counts[r]))
    send = _flat(send_pieces, dtype)
    send_splits = [sum(matrices[i].numel_on(r) for i in mine) for r in range(n)]
    recv_splits = [sum(m.numel_on(me) for m in matrices if m.owner == r) for r in range(n)]
    recv = _all_to_all(send, send_splits, recv_splits, shard_group)
    rows: list[torch.Tensor | None] = [None] * len(matrices)
    offset = 0
    for r in range(n):
        for i, m in enumerate(matrices):
            if m.owner == r:
                rows[i] = recv[offset : offset + m.numel_on(me)].view(m.row_counts[me], m.cols)
                offset += m.numel_on(me)
    return rows  # type: ignore[return-value]
