"""Before each collective, ranks agree on which one they are about to run.

On gloo, where mismatched buffers abort the process and different collectives hang, ranks first
all-gather a 48-byte entry (magic, group id, kind, bytes, and the reduce-scatters it covers); if any
differs every rank raises the same ``ExecutionOrderError``. A reduce-scatter waits for the next
handshake on its process group, which covers it by a count and a digest: one synchronisation point
per block. Elsewhere a handshake is logged on the host and judged once a step (``handshake_ledger.py``).
``FSDP_COMPOSE_CHECK_ORDER``: ``1`` (default), ``strict`` (reduce-scatters off gloo too) or ``0``;
docs/schedule.md lists what is caught.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from functools import partial
from typing import NamedTuple

import torch
import torch.distributed as dist

from .c10d_direct import ASYNC_ALL_GATHER, python_free_tls, wait_named
from .divergence import (
    ALL_GATHER,
    ALL_REDUCE,
    KINDS,
    MAGIC,
    ONLY_REDUCES,
    REDUCE_SCATTER,
    ExecutionOrderError,
    check_mode,
    collective_text,
    diverged_message,
    entry_line,
    fold_digest,
)
from .handshake_ledger import Entry, Ledgers

FIELDS = 6  # magic, group id, kind, bytes, then the waiting reduce-scatters: how many, and their digest
NAMED_REDUCES = 8  # waiting reduce-scatters an error names per rank


def handshake_kinds() -> tuple[frozenset[int], frozenset[int]]:
    """Which collectives get a handshake, from ``FSDP_COMPOSE_CHECK_ORDER``: (on every backend, on gloo).

    On gloo all of them unless the check is off: there the handshake, a host-side check before the
    collective, is what keeps a divergence from reaching gloo's abort. HSDP's all-reduce everywhere:
    replicas never meet in a shard group's handshake, and replicas that ran equally sized modules in
    another order would otherwise sum different groups' gradients without a word."""
    mode = check_mode()
    if mode == "0":
        return frozenset(), frozenset()
    everywhere = {ALL_GATHER, ALL_REDUCE} | ({REDUCE_SCATTER} if mode == "strict" else set())
    return frozenset(everywhere), frozenset((ALL_GATHER, REDUCE_SCATTER, ALL_REDUCE))


class _Exchange:
    """The tensors of one recurring gloo handshake, reused every step: this rank's entry, where the
    gathered rows land, what they must equal (on the CPU compared as bytes through a numpy view)."""

    def __init__(
        self, uid: int, kind: int, nbytes: int, world: int, device: torch.device, waiting: list[Waiting] | None = None
    ) -> None:
        self.waiting = waiting or []
        self.uid, self.kind = uid, kind
        self.mine = torch.tensor([MAGIC, uid, kind, nbytes, *_digest(self.waiting)], dtype=torch.int64, device=device)
        self.expected = self.mine.repeat(world)
        self.received = self.mine.new_empty(world * FIELDS)
        on_cpu = device.type == "cpu"
        self.received_array = self.received.numpy() if on_cpu else None  # shares the tensor's memory
        self.expected_bytes = self.expected.numpy().tobytes() if on_cpu else None
        self.name_of: Callable[[int], str] | None = None
        self.name: Callable[[], str] = str  # names the handshake if its wait fails; set with ``name_of``

    def agreed(self) -> bool:
        """Whether the collective gave back exactly the expected entries."""
        if self.received_array is not None:
            return self.received_array.tobytes() == self.expected_bytes
        return torch.equal(self.received, self.expected)


class Handshakes:
    """One group's handshakes, cached per (kind, bytes, process group): the ``kinds`` pair of
    ``handshake_kinds`` (every backend, gloo). On gloo judged on the host before the collective (``run``);
    elsewhere logged in the root's ``ledgers`` and judged once a round (``handshake_ledger.py``)."""

    def __init__(
        self, uid: int, device: torch.device, name_of: Callable[[int], str], kinds: tuple | None = None
    ) -> None:
        self.uid = uid
        everywhere, on_gloo = kinds if kinds is not None else handshake_kinds()
        self.everywhere = everywhere  # kinds checked on every backend
        self.on_gloo = everywhere | on_gloo  # kinds checked on gloo: every kind checked anywhere
        self.device = device
        self.name_of = name_of  # names any group by its uid (messages name other ranks' groups)
        self._exchanges: dict[tuple[int, int, object], _Exchange | Entry | None] = {}
        self.ledgers = Ledgers()  # this group's own until the root's replaces it (``use_ledgers``)

    def refresh(self, device: torch.device) -> None:
        if device != self.device:
            self.device = device
            self._exchanges.clear()

    def use_ledgers(self, ledgers: Ledgers) -> None:
        """Record into the root's ledgers from now on, after judging what this group recorded alone."""
        if ledgers is not self.ledgers:
            self.ledgers.close_round()
            self.ledgers = ledgers
            self._exchanges.clear()

    def _exchange(self, kind: int, nbytes: int, group) -> tuple[object, _Exchange | Entry | None]:
        """The process group (``None``: the default) and its handshake for this collective, if any."""
        group = group if group is not None else dist.group.WORLD
        key = (kind, nbytes, group)
        exchange = self._exchanges.get(key, False)
        if exchange is False:
            world = group.size()
            gloo = dist.get_backend(group) == "gloo"
            if world <= 1 or kind not in (self.on_gloo if gloo else self.everywhere):
                exchange = None
            elif gloo:
                exchange = _Exchange(self.uid, kind, nbytes, world, self.device)
            else:
                exchange = Entry(self.uid, kind, nbytes, self.ledgers.ledger(group, self.device))
            self._exchanges[key] = exchange
        return group, exchange

    def check(self, kind: int, nbytes: int, group, issue: Callable[[], None] | None = None) -> None:
        """Raise ``ExecutionOrderError`` on every rank unless all are about to run this collective, then
        run ``issue`` (which issues it), if given. On gloo a reduce-scatter's ``issue`` waits for the next
        handshake on its process group (usually the next block's prefetch, else ``flush``), which then
        covers both: the waiting reduce-scatters must agree too, and are issued first."""
        if kind in self.on_gloo:
            group, exchange = self._exchange(kind, nbytes, group)
            if type(exchange) is Entry:
                exchange.ledger.record(exchange, self.name_of)
            elif exchange is not None:
                if kind == REDUCE_SCATTER and issue is not None:
                    self.ledgers.waiting.setdefault(group, []).append(Waiting(self.uid, nbytes, issue))
                    return
                self._run_covering(kind, nbytes, group, exchange)
        if issue is not None:
            issue()

    def flush(self) -> None:
        """Agree on and issue the waiting reduce-scatters, one handshake per process group (when a group's
        backward begins and when backward ends)."""
        waiting_by_group = self.ledgers.waiting
        while waiting_by_group:
            self._run_covering(ONLY_REDUCES, 0, next(iter(waiting_by_group)))

    def _run_covering(self, kind: int, nbytes: int, group, cached: _Exchange | None = None) -> None:
        """Run the handshake (``cached`` unless reduce-scatters wait on ``group``), then issue those."""
        waiting = self.ledgers.waiting.pop(group, None) if self.ledgers.waiting else None
        if waiting or cached is None:
            cached = _Exchange(self.uid, kind, nbytes, group.size(), self.device, waiting)
        run(cached, group, self.name_of)
        for reduce in waiting or ():
            reduce.issue()


class Waiting(NamedTuple):
    """A reduce-scatter issued once the next handshake on its process group agrees on it."""

    uid: int
    nbytes: int
    issue: Callable[[], None]


def _digest(waiting: list[Waiting]) -> tuple[int, int]:
    """How many reduce-scatters wait, and a digest of their groups and sizes (order included)."""
    return len(waiting), functools.reduce(lambda d, r: fold_digest(d, r.uid, REDUCE_SCATTER, r.nbytes), waiting, 0)


def run(exchange: _Exchange, group, name_of: Callable[[int], str]) -> None:
    received = exchange.received
    if exchange.name_of is not name_of:  # the failure message's builder, made once
        exchange.name_of, exchange.name = name_of, partial(_handshake_name, exchange.uid, exchange.kind, name_of)
    with python_free_tls():
        work = group.all_gather_single(received, exchange.mine, ASYNC_ALL_GATHER)
    if work is not None:
        wait_named(work, exchange.name)
    if not exchange.agreed():
        _raise_diverged(exchange, received.view(-1, FIELDS).tolist(), group, name_of)


def _handshake_name(uid: int, kind: int, name_of: Callable[[int], str]) -> str:
    """Names a handshake whose wait failed. Takes no exchange: that would be a reference cycle."""
    if kind == ONLY_REDUCES:
        return "the handshake before the waiting reduce-scatters"
    return f"the handshake before the {KINDS[kind]} of {name_of(uid)}"


def _raise_diverged(exchange: _Exchange, rows: list[list[int]], group, name_of: Callable[[int], str]) -> None:
    """Every rank got the same ``rows``, so every rank is here: name what each was about to run."""
    waiting: list = [None] * group.size()
    if any(row[4] for row in rows):  # every rank alike: the waiting reduce-scatters, to name them
        dist.all_gather_object(waiting, [(r.uid, r.nbytes) for r in exchange.waiting[:NAMED_REDUCES]], group=group)
    lines, kinds = [], []
    for i, (rank, (magic, uid, kind, nbytes, count, _)) in enumerate(zip(dist.get_process_group_ranks(group), rows)):
        if magic != MAGIC or (kind not in KINDS and kind != ONLY_REDUCES):
            lines.append(entry_line(rank, magic, uid, kind, nbytes, name_of))
            continue
        parts = []
        if count:
            parts += [collective_text(u, REDUCE_SCATTER, b, name_of) for u, b in waiting[i]]
            if count > NAMED_REDUCES:
                parts.append(f"{count - NAMED_REDUCES} more reduce-scatters")
            kinds.append(REDUCE_SCATTER)
        if kind != ONLY_REDUCES:
            parts.append(collective_text(uid, kind, nbytes, name_of))
            kinds.append(kind)
        lines.append(f"  rank {rank}: " + ", then ".join(parts))
    raise ExecutionOrderError(diverged_message(lines, kinds))
