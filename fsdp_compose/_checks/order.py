"""Ranks agree on the collectives they run, and every rank raises the same error when they do not.

A order check issues nothing by itself: it appends (group id, kind, bytes) to its process group's
collective log and folds it into a digest. Closing a round, one all-reduce (max) of (magic, count, digest)
and their negations, 48 bytes at any world size, tells every rank whether all logged the same; on
a mismatch ranks exchange their logs and raise ``ExecutionOrderError`` naming the first difference.

When a round closes is the one backend-specific choice. On gloo a mismatched collective aborts the
process or hangs, so a round closes before each all-gather and all-reduce and is read at once; a
reduce-scatter is only logged, and the schedule issues it once the next round on its process group
agreed (usually the next block's prefetch, else when backward ends): one synchronisation per block.
Elsewhere a host read waits for the device, so a round closes when backward ends, its verdict is
read a round later on an accelerator and never for fake tensors; collectives after a difference
have run by then, and mismatched sizes may hang there until the timeout.
``FSDP_COMPOSE_CHECK_ORDER``: ``1`` (default), ``strict`` (reduce-scatters off gloo too) or ``0``;
docs/schedule.md lists what is caught.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from functools import partial

import torch
import torch.distributed as dist
from torch._subclasses.fake_tensor import is_fake

from .._runtime.collectives import ASYNC_MAX_ALL_REDUCE, python_free_tls, wait_named
from .agreement import raise_together

CHECK_ENV = "FSDP_COMPOSE_CHECK_ORDER"
MODES = ("1", "strict", "0")
MAGIC = 0x4653_4450_4F52_4452
ALL_GATHER, REDUCE_SCATTER, ALL_REDUCE = 1, 2, 3  # ALL_REDUCE: HSDP's sum across replicas
KINDS = {ALL_GATHER: "all-gather", REDUCE_SCATTER: "reduce-scatter", ALL_REDUCE: "all-reduce"}
BACKWARD_KINDS = (REDUCE_SCATTER, ALL_REDUCE)  # issued when a module's backward is done
BACKWARD_HINT = (
    "\n(reduce-scatters, and HSDP's all-reduces across replicas, run when a module's backward is done: ranks "
    "reach different ones when a rank skipped or repeated backward(), ran a different number of micro-batches "
    "without gradient sync, or computed no gradient this step for some parameters of a module it ran, e.g. "
    "skipped computation or an unused branch or expert; such a rank reduces that module only when backward ends)"
)
FOUND_LATE = (
    "\n(on this backend the order checks are compared on the device and judged when a step's backward ends, "
    "so the collectives after the first difference already ran)"
)
SLOTS = 256  # collectives per round at most: a round closes early when its log is full
NAMED_RANKS = 8  # ranks an error names


class ExecutionOrderError(RuntimeError):
    """Ranks were about to run different collectives of sharded modules: their forward/backward differ."""

    __module__ = "fsdp_compose"  # its public home: tracebacks print fsdp_compose.<name>, pickle finds it there


def check_mode() -> str:
    """``FSDP_COMPOSE_CHECK_ORDER``: ``1`` (default), ``strict`` or ``0`` (see docs/schedule.md)."""
    mode = os.environ.get(CHECK_ENV, "1")
    if mode not in MODES:
        raise ValueError(f"{CHECK_ENV}={mode!r}: expected one of {', '.join(MODES)} (docs/schedule.md)")
    return mode


def checked_kinds() -> tuple[frozenset[int], frozenset[int]]:
    """Which collectives get a order check, from ``FSDP_COMPOSE_CHECK_ORDER``: (on every backend, on gloo),
    the second holding the first.

    On gloo all of them unless the check is off: judged before the collective, the order check keeps a
    divergence from reaching gloo's abort. HSDP's all-reduce everywhere: replicas never meet in a shard
    group's order check, and replicas that ran equally sized modules in another order would otherwise
    sum different groups' gradients without a word."""
    mode = check_mode()
    if mode == "0":
        return frozenset(), frozenset()
    everywhere = {ALL_GATHER, ALL_REDUCE} | ({REDUCE_SCATTER} if mode == "strict" else set())
    return frozenset(everywhere), frozenset((ALL_GATHER, REDUCE_SCATTER, ALL_REDUCE))


def collective_text(uid: int, kind: int, nbytes: int, name_of: Callable[[int], str]) -> str:
    """``all-gather of 'blocks.3' (Block), 1736 bytes``."""
    return f"{KINDS[kind]} of {name_of(uid)}, {nbytes} bytes"


class Entry:
    """One recurring order check: the collective it names, and the collective log it is logged in."""

    __slots__ = ("uid", "kind", "nbytes", "collective_log")

    def __init__(self, uid: int, kind: int, nbytes: int, collective_log: CollectiveLog) -> None:
        self.uid, self.kind, self.nbytes, self.collective_log = uid, kind, nbytes, collective_log


class CollectiveLog:
    """One process group's log of the current round, and the verdict of the previous one. ``before_each``
    (gloo): rounds close before each collective, on the CPU, except that reduce-scatters wait for the next."""

    def __init__(self, group, device: torch.device, before_each: bool = False) -> None:
        self.group = group
        self.device = device
        self.before_each = before_each
        self.log: list[Entry] = []
        self.digest = 0
        self.pending: tuple | None = None  # (verdict, event, log, name_of) of a closed round
        self.name_of: Callable[[int], str] = str

    def record(self, entry: Entry, name_of: Callable[[int], str]) -> None:
        """Log one collective about to be issued: host arithmetic only, no collective and no read."""
        if len(self.log) == SLOTS:
            self.close_round()
        self.log.append(entry)
        # one more collective (group, kind, bytes) folded in: equal digests mean equal sequences
        self.digest = (self.digest * 1_000_003 + (entry.uid * 8 + entry.kind) * 65_537 + entry.nbytes) % ((1 << 61) - 1)
        self.name_of = name_of

    def close_round(self) -> None:
        """Agree on this round's log on the device; read the verdict now on the CPU, next round elsewhere."""
        previous, self.pending = self.pending, None
        if previous is not None:
            self._read(previous)
        if not self.log:
            return
        log, name_of = self.log, self.name_of
        fields = [MAGIC, len(log), self.digest]
        self.log, self.digest = [], 0
        # built on the host and copied without a stream sync (a blocking copy to a GPU would wait for it)
        mine = torch.tensor(fields + [-value for value in fields], dtype=torch.int64).to(self.device, non_blocking=True)
        verdict = disagreement(mine, (self.group,), partial(_round_name, log[-1], self.before_each, name_of)).any()
        if verdict.device.type != "cpu" and not is_fake(verdict):
            verdict = verdict.to("cpu", non_blocking=True)
            event = torch.Event(mine.device)
            event.record()
            self.pending = (verdict, event, log, name_of)
        else:
            self._read((verdict, None, log, name_of))

    def forget(self) -> None:
        """Drop this round's log and any pending verdict (after a failed step)."""
        self.pending = None
        self.log, self.digest = [], 0

    def _read(self, pending: tuple) -> None:
        verdict, event, log, name_of = pending
        if is_fake(verdict):  # a fake run has no values to judge
            return
        if event is not None:
            event.synchronize()
        if verdict.item():  # every rank read the same verdict: each sends its log, all raise naming the difference
            ranks, late = dist.get_process_group_ranks(self.group), "" if self.before_each else FOUND_LATE
            raise_together(
                [(e.uid, e.kind, e.nbytes) for e in log],
                group=self.group,
                cls=ExecutionOrderError,
                message=lambda logs: _first_difference(logs, ranks, name_of) + late,
            )


def disagreement(mine: torch.Tensor, groups: tuple, name: str | Callable[[], str]) -> torch.Tensor:
    """Where the ranks of ``groups`` (a mesh's dims) hold different values, elementwise, on the device: ``mine``
    is the values then their negations, so an all-reduce (max) per group gives each one's largest and minus
    its smallest over all ranks, and any element unlike ``mine`` differs somewhere. ``name`` names a failed wait."""
    extremes = mine.clone()
    for group in groups:
        with python_free_tls():
            work = group.allreduce([extremes], ASYNC_MAX_ALL_REDUCE)
        wait_named(work, name)
    return extremes != mine


def _round_name(last: Entry, before_each: bool, name_of: Callable[[int], str]) -> str:
    """Names a round whose all-reduce failed (built only then; on gloo a reduce-scatter last in the log waits)."""
    if not before_each:
        return "the order check when backward ends"
    if last.kind == REDUCE_SCATTER:
        return "the order check before the waiting reduce-scatters"
    return f"the order check before the {KINDS[last.kind]} of {name_of(last.uid)}"


def _first_difference(logs: list[list[tuple[int, int, int]]], ranks: list[int], name_of: Callable[[int], str]) -> str:
    """The message naming each rank's collective at the first position where the logs differ."""
    at = next((i for i in range(max(map(len, logs))) if len({tuple(log[i : i + 1]) for log in logs}) > 1), 0)
    named = [(rank, log[at] if at < len(log) else None) for rank, log in zip(ranks, logs)]
    if len(named) > NAMED_RANKS:  # the first rank, then those that differ from it
        named = [named[0]] + [item for item in named[1:] if item[1] != named[0][1]][: NAMED_RANKS - 1]
    lines = [
        f"  rank {rank}: " + (collective_text(*entry, name_of) if entry else "no further collective this round")
        for rank, entry in named
    ]
    if len(named) < len(ranks):
        lines.append(f"  (the first rank and up to {NAMED_RANKS - 1} that differ from it, of {len(ranks)})")
    hint = BACKWARD_HINT if any(entry and entry[1] in BACKWARD_KINDS for _, entry in named) else ""
    return (
        "Ranks diverged: they were about to run different collectives of sharded modules (a rank skipped "
        "a sharded module, ran a different number of forward calls, or ran modules in another order; "
        "check data-dependent control flow):\n" + "\n".join(lines) + hint
    )


class CollectiveLogs:
    """Every process group's collective log of one root (one model): closed together when a step ends."""

    def __init__(self) -> None:
        self.by_group: dict[object, CollectiveLog] = {}

    def collective_log(self, group, device: torch.device, before_each: bool = False) -> CollectiveLog:
        """``group``'s collective log, agreeing on ``device`` from its next round (a moved model keeps its log
        and its previous round's unread verdict)."""
        collective_log = self.by_group.setdefault(group, CollectiveLog(group, device, before_each))
        collective_log.device = device
        return collective_log

    def awaiting(self) -> bool:
        """Whether a gloo round holds logged reduce-scatters: they are issued once it closes (``flush``)."""
        return any(collective_log.before_each and collective_log.log for collective_log in self.by_group.values())

    def flush(self) -> None:
        """Close the gloo rounds that hold logged reduce-scatters, so that they may be issued."""
        for collective_log in self.by_group.values():
            if collective_log.before_each and collective_log.log:
                collective_log.close_round()

    def close_round(self) -> None:
        for collective_log in list(self.by_group.values()):
            collective_log.close_round()

    def forget(self) -> None:
        for collective_log in self.by_group.values():
            collective_log.forget()


def _unknown_group(uid: int) -> str:
    return f"<group {uid}, before its first forward>"


class OrderCheck:
    """One group's order checks, cached per (kind, bytes, process group): the ``kinds`` pair of
    ``checked_kinds`` (every backend, gloo), logged in the root's ``collective logs``."""

    def __init__(self, uid: int, device: torch.device) -> None:
        self.uid = uid
        self.everywhere, self.on_gloo = checked_kinds()  # kinds checked on every backend, and on gloo
        self.device = device
        self.name_of: Callable[[int], str] = _unknown_group  # names any group by its uid (messages name other ranks')
        self._entries: dict[tuple[int, int, object], Entry | None] = {}
        self.collective_logs = CollectiveLogs()  # this group's own until the root's replaces it (``use_ledgers``)

    def refresh(self, device: torch.device) -> None:
        if device != self.device:
            self.device = device
            self._entries.clear()

    def use_logs(self, collective_logs: CollectiveLogs, name_of: Callable[[int], str]) -> None:
        """Record into the root's collective logs from now on, naming groups through the root, after judging what
        this group recorded alone."""
        self.name_of = name_of
        if collective_logs is not self.collective_logs:
            self.collective_logs.close_round()
            self.collective_logs = collective_logs
            self._entries.clear()

    def check(self, kind: int, nbytes: int, group) -> None:
        """Log this collective before it is issued. On gloo the round closes at once (``ExecutionOrderError``
        on every rank unless all agree), except after a reduce-scatter: the schedule issues it once the next
        round on its process group closed (``CollectiveLogs.flush``), which then covers both. See [Note: gloo
        reduce-scatter deferral] in ``schedule.py``."""
        if kind not in self.on_gloo:  # checked on no backend
            return
        key = (kind, nbytes, group)
        entry = self._entries.get(key, False)
        if entry is False:  # first seen: whether it has a order check here, and in which collective log
            gloo = dist.get_backend(group) == "gloo"
            entry = None
            if group.size() > 1 and kind in (self.on_gloo if gloo else self.everywhere):
                device = torch.device("cpu") if gloo else self.device  # gloo: judged on the host
                entry = Entry(self.uid, kind, nbytes, self.collective_logs.collective_log(group, device, before_each=gloo))
            self._entries[key] = entry
        if entry is not None:
            collective_log = entry.collective_log
            collective_log.record(entry, self.name_of)
            if collective_log.before_each and kind != REDUCE_SCATTER:
                collective_log.close_round()
