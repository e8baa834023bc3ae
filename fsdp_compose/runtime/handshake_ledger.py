"""Handshakes off gloo: logged on the host per collective, agreed on once a round.

On an accelerator a host read waits for the device, so a handshake here issues nothing: it appends
(group id, kind, bytes) to its process group's log and folds it into a digest. When a round ends
(each backward's end, or a full log) one all-reduce (max) of (magic, count, digest) and their
negations, 48 bytes at any world size, tells every rank whether all logged the same. The verdict is
read at once on the CPU, a round later on an accelerator, never for fake tensors. On a mismatch the
ranks exchange their logs and raise ``ExecutionOrderError`` naming the first difference. Collectives
after a difference run before the verdict: mismatched sizes may hang there until the timeout.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
from torch._subclasses.fake_tensor import is_fake

from .c10d_direct import ASYNC_MAX_ALL_REDUCE, python_free_tls, wait_named
from .divergence import MAGIC, ExecutionOrderError, diverged_message, entry_line, fold_digest

SLOTS = 256  # collectives per round at most: a round closes early when its log is full
NAMED_RANKS = 8  # ranks an error names
FOUND_LATE = (
    "\n(on this backend the handshakes are compared on the device and judged when a step's backward ends, "
    "so the collectives after the first difference already ran)"
)


class Entry:
    """One recurring handshake: the collective it names, and the ledger it is logged in."""

    __slots__ = ("uid", "kind", "nbytes", "ledger")

    def __init__(self, uid: int, kind: int, nbytes: int, ledger: Ledger) -> None:
        self.uid, self.kind, self.nbytes, self.ledger = uid, kind, nbytes, ledger


class Ledger:
    """One process group's log of the current round, and the verdict of the previous one."""

    def __init__(self, group, device: torch.device) -> None:
        self.group = group
        self.device = device
        self.log: list[Entry] = []
        self.digest = 0
        self.pending: tuple | None = None  # (verdict, event, log, name_of) of a closed round
        self.name_of: Callable[[int], str] = str

    def record(self, entry: Entry, name_of: Callable[[int], str]) -> None:
        """Log one collective about to be issued: host arithmetic only, no collective and no read."""
        if len(self.log) == SLOTS:
            self.close_round()
        self.log.append(entry)
        self.digest = fold_digest(self.digest, entry.uid, entry.kind, entry.nbytes)
        self.name_of = name_of

    def close_round(self) -> None:
        """Agree on this round's log on the device; read the verdict now on the CPU, next round elsewhere."""
        previous, self.pending = self.pending, None
        if previous is not None:
            self._read(previous)
        if not self.log:
            return
        fields = [MAGIC, len(self.log), self.digest]
        mine = torch.tensor(fields + [-value for value in fields], dtype=torch.int64, device=self.device)
        extremes = mine.clone()
        with python_free_tls():
            work = self.group.allreduce([extremes], ASYNC_MAX_ALL_REDUCE)
        wait_named(work, "the handshake when backward ends")
        verdict = (extremes != mine).any()
        event = None
        if verdict.device.type != "cpu" and not is_fake(verdict):
            verdict = verdict.to("cpu", non_blocking=True)
            event = torch.Event(mine.device)
            event.record()
        pending = (verdict, event, self.log, self.name_of)
        self.log, self.digest = [], 0
        if event is None:
            self._read(pending)
        else:
            self.pending = pending

    def forget(self) -> None:
        """Drop this round's log and any pending verdict (after a failed step, which raised already)."""
        self.pending = None
        self.log, self.digest = [], 0

    def _read(self, pending: tuple) -> None:
        verdict, event, log, name_of = pending
        if is_fake(verdict):  # a fake run has no values to judge
            return
        if event is not None:
            event.synchronize()
        if verdict.item():
            logs: list = [None] * self.group.size()
            dist.all_gather_object(logs, [(e.uid, e.kind, e.nbytes) for e in log], group=self.group)
            raise ExecutionOrderError(_first_difference(logs, dist.get_process_group_ranks(self.group), name_of))


def _first_difference(logs: list[list[tuple[int, int, int]]], ranks: list[int], name_of: Callable[[int], str]) -> str:
    """The message naming each rank's collective at the first position where the logs differ."""
    at = next((i for i in range(max(map(len, logs))) if len({tuple(log[i : i + 1]) for log in logs}) > 1), 0)
    named = [(rank, log[at] if at < len(log) else None) for rank, log in zip(ranks, logs)]
    if len(named) > NAMED_RANKS:  # the first rank, then those that differ from it
        named = [named[0]] + [item for item in named[1:] if item[1] != named[0][1]][: NAMED_RANKS - 1]
    lines = [
        entry_line(rank, MAGIC, *entry, name_of) if entry else f"  rank {rank}: no further collective this round"
        for rank, entry in named
    ]
    if len(named) < len(ranks):
        lines.append(f"  (the first rank and up to {NAMED_RANKS - 1} that differ from it, of {len(ranks)})")
    return diverged_message(lines, [entry[1] for _, entry in named if entry]) + FOUND_LATE


class Ledgers:
    """Every process group's ledger of one root (one model): closed together when a step ends."""

    def __init__(self) -> None:
        self.by_group: dict[object, Ledger] = {}
        # gloo: per process group, reduce-scatters waiting for its next handshake (``handshake.Handshakes.check``)
        self.waiting: dict[object, list] = {}

    def ledger(self, group, device: torch.device) -> Ledger:
        """``group``'s ledger, agreeing on ``device`` from its next round (a moved model keeps its log
        and its previous round's unread verdict)."""
        ledger = self.by_group.get(group)
        if ledger is None:
            ledger = self.by_group[group] = Ledger(group, device)
        ledger.device = device
        return ledger

    def close_round(self) -> None:
        for ledger in list(self.by_group.values()):
            ledger.close_round()

    def forget(self) -> None:
        self.waiting.clear()
        for ledger in self.by_group.values():
            ledger.forget()
