"""Handshakes on backends other than gloo: exchanged per collective, judged once a round.

On an accelerator every host read of a tensor waits for the device, so a handshake that
compared each exchange on the host would stop the CPU from running ahead before every
all-gather. Here each handshake's collective writes into the next row of a per-process-group
ledger and nothing is read; when a round ends (the end of each backward, or a full ledger) one
device-side comparison judges every row at once. Its verdict is read on the host at once on
the CPU (no device to wait for), a round later on an accelerator (a non-blocking copy, waited
for when the next round closes: by then the device has almost always finished it), and never
for a fake tensor, which has no value. On a disagreement every rank raises the same
``ExecutionOrderError`` naming the first handshake where ranks differed.

Rows: on groups of up to 8 ranks the 32-byte entries (magic, group id, kind, bytes) all-gathered
(all ranks agree when every row equals this rank's own); on larger groups one all-reduce (max) of
the four fields and their negations, each field packed with the group rank in its low bits, so the
largest and smallest of each field come back with a rank that sent it: 64 bytes at any world size,
and two ranks that disagree are named without a further collective.

What the check cannot do: a collective after a disagreement is issued before the verdict, so
ranks whose buffers differ in size may hang in it (the process group's timeout then reports it);
ranks that only run groups of equal size in another order are reported when the round ends.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
from torch._subclasses.fake_tensor import is_fake

from .c10d_direct import ASYNC_ALL_GATHER, ASYNC_MAX_ALL_REDUCE, python_free_tls
from .divergence import KINDS, MAGIC, ExecutionOrderError, diverged_message, entry_line

SLOTS = 256  # rows per ledger buffer: a round closes early when they are used up
RANK_BITS = 20  # the packed form's low bits: ranks of groups up to 2**20
SHORT_MAGIC = MAGIC >> 24  # 40 bits, so a packed field fits in int64
_FIELD_LIMIT = 1 << (63 - RANK_BITS)
FOUND_LATE = (
    "\n(on this backend the handshakes are compared on the device and judged when a step's backward ends, "
    "so the collectives after the first difference already ran)"
)


def gathers_entries(world: int) -> bool:
    """Whether a group of ``world`` ranks all-gathers its entries (else the packed all-reduce)."""
    return world <= 8


class Entry:
    """One recurring handshake's prebuilt tensor: this rank's entry, or its packed fields for the all-reduce."""

    def __init__(self, uid: int, kind: int, nbytes: int, ledger: Ledger, device: torch.device) -> None:
        self.ledger = ledger
        fields = [MAGIC, uid, kind, nbytes]
        if not ledger.gathers:
            if nbytes >= _FIELD_LIMIT:
                raise ValueError(f"a collective of {nbytes} bytes is too large for the handshake's packed entry")
            packed = [(value << RANK_BITS) | ledger.rank for value in [SHORT_MAGIC, *fields[1:]]]
            fields = packed + [-value for value in packed]
        self.mine = torch.tensor(fields, dtype=torch.int64, device=device)


class Ledger:
    """One process group's handshakes of the current round, and the verdict of the previous one.

    Two buffers alternate, so the rows a pending verdict may need to name the ranks stay
    untouched until it is read."""

    def __init__(self, group, device: torch.device) -> None:
        self.group = group
        self.world = group.size()
        self.rank = group.rank()
        self.gathers = gathers_entries(self.world)
        self.width = 4 * self.world if self.gathers else 8
        self.device = device
        self.rows: list[list[torch.Tensor] | None] = [None, None]  # each buffer's rows as views
        self.buffers: list[torch.Tensor | None] = [None, None]
        self.current = 0
        self.used = 0
        self.pending: tuple | None = None  # (verdict on the host, event, buffer index, rows used)
        self.describe: Callable[[int], str] = str

    def record(self, entry: Entry, describe: Callable[[int], str]) -> object:
        """Issue one handshake's collective into the next row and return its work; nothing is read here
        (waiting for it on an accelerator makes the compute stream wait, not the host)."""
        if self.used == SLOTS:
            self.close_round()
        rows = self.rows[self.current]
        if rows is None:
            buffer = self.buffers[self.current] = torch.empty(
                (SLOTS, self.width), dtype=torch.int64, device=self.device
            )
            rows = self.rows[self.current] = list(buffer.unbind(0))
        slot = rows[self.used]
        self.used += 1
        self.describe = describe
        with python_free_tls():
            if self.gathers:
                work = self.group.all_gather_single(slot, entry.mine, ASYNC_ALL_GATHER)
            else:
                slot.copy_(entry.mine)
                work = self.group.allreduce([slot], ASYNC_MAX_ALL_REDUCE)
        return work

    def close_round(self) -> None:
        """Judge this round's rows on the device; read the verdict now on the CPU, next round elsewhere."""
        previous, self.pending = self.pending, None
        if previous is not None:
            self._read(previous)
        if self.used == 0:
            return
        rows = self.buffers[self.current][: self.used]
        verdict = _disagreements(rows, self.gathers, self.rank, self.world).any()
        event = None
        if verdict.device.type != "cpu" and not is_fake(verdict):
            verdict = verdict.to("cpu", non_blocking=True)
            event = torch.Event(rows.device)
            event.record()
        pending = (verdict, event, self.current, self.used)
        self.current ^= 1
        self.used = 0
        if event is None:
            self._read(pending)
        else:
            self.pending = pending

    def forget(self) -> None:
        """Drop this round's rows and any pending verdict (after a failed step, which raised already)."""
        self.pending = None
        self.used = 0

    def _read(self, pending: tuple) -> None:
        verdict, event, index, used = pending
        if is_fake(verdict):  # a fake run has no values to judge
            return
        if event is not None:
            event.synchronize()
        if not verdict.item():
            return
        rows = self.buffers[index][:used].cpu()
        first = int(_disagreements(rows, self.gathers, self.rank, self.world).nonzero()[0, 0])
        row = rows[first]
        lines = self._name_entries(row) if self.gathers else self._name_extremes(row)
        if self.gathers:
            kinds = [kind for magic, _, kind, _ in row.view(-1, 4).tolist() if magic == MAGIC]
        else:  # the largest and the smallest kind
            kinds = [int(row[2]) >> RANK_BITS, -int(row[6]) >> RANK_BITS]
        raise ExecutionOrderError(diverged_message(lines, kinds) + FOUND_LATE)

    def _ranks(self) -> list[int]:
        return dist.get_process_group_ranks(self.group)

    def _name_entries(self, row: torch.Tensor) -> list[str]:
        entries = zip(self._ranks(), row.view(-1, 4).tolist())
        return [entry_line(rank, *entry, self.describe) for rank, entry in entries]

    def _name_extremes(self, row: torch.Tensor) -> list[str]:
        """Two ranks that disagree, from the largest and smallest of the first field that differs."""
        ranks = self._ranks()
        mask = (1 << RANK_BITS) - 1
        largest = row[:4].tolist()
        smallest = [-value for value in row[4:].tolist()]
        values = [[packed >> RANK_BITS for packed in side] for side in (largest, smallest)]
        agreed = [values[0][i] == values[1][i] for i in range(4)]
        field = next(i for i in (0, 1, 3, 2) if not agreed[i])
        named = {}
        for side, packed in zip(values, (largest, smallest)):
            rank = ranks[packed[field] & mask]
            magic, uid, kind, nbytes = side
            magic = MAGIC if magic == SHORT_MAGIC else magic
            size = nbytes if agreed[3] or field == 3 else None
            named[rank] = entry_line(rank, magic, uid, kind, size, self.describe)
            if magic == MAGIC and kind in KINDS and not (agreed[2] or field == 2):  # the kind is not known
                named[rank] = named[rank].replace(KINDS[kind], "a collective", 1)
        lines = [named[rank] for rank in sorted(named)]
        lines.append(f"  (the largest and smallest entries of {self.world} ranks; the others are not named)")
        return lines


def _disagreements(rows: torch.Tensor, gathers: bool, rank: int, world: int) -> torch.Tensor:
    """Per row, whether the ranks disagreed (a bool vector, computed where the rows are)."""
    if gathers:
        entries = rows.view(rows.shape[0], world, 4)
        differs = (entries != entries[:, rank : rank + 1]).flatten(1).any(1)
        return differs | (entries[:, rank, 0] != MAGIC)
    largest = rows[:, :4] >> RANK_BITS
    smallest = rows[:, 4:].neg() >> RANK_BITS
    return (largest != smallest).any(1) | (largest[:, 0] != SHORT_MAGIC)


class Ledgers:
    """Every process group's ledger of one root (one model): closed together when a step ends."""

    def __init__(self) -> None:
        self.by_group: dict[object, Ledger] = {}
        # gloo: per process group, reduce-scatters waiting for its next handshake (``handshake.Handshakes.submit``)
        self.waiting: dict[object, list] = {}

    def ledger(self, group, device: torch.device) -> Ledger:
        ledger = self.by_group.get(group)
        if ledger is None or ledger.device != device:
            ledger = self.by_group[group] = Ledger(group, device)
        return ledger

    def close_round(self) -> None:
        for ledger in list(self.by_group.values()):
            ledger.close_round()

    def forget(self) -> None:
        self.waiting.clear()
        for ledger in self.by_group.values():
            ledger.forget()
