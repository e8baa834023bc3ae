"""Opt-in shared-memory transport: CPU all-gathers and reduce-scatters between ranks on one host.

gloo moves CPU tensors through TCP loopback, tens of milliseconds of CPU for 32 MiB where a copy
costs a few. ``ShmAllGather`` / ``ShmReduceScatter`` are ``Comm``-protocol objects that
``use_shm(model)`` gives every group of a sharded model (alike on every rank); where a process
group's ranks share one host and its tensors are on the CPU they move the bytes through files under
``/dev/shm``, elsewhere they call the process group. docs/cpu-transport.md describes set-up,
segments, chunks, growth, a full ``/dev/shm`` and the errors.

It is a package of its own, beside ``fsdp_compose``, because it is CPU-only machinery a job opts
into: the core never names it, and it plugs in through the public ``set_custom_all_gather`` /
``set_custom_reduce_scatter``, using only ``fsdp_compose``'s public names and ``fsdp_compose.extras_api``.

Each rank owns one segment in two halves; collective ``n`` on a group uses half ``n % 2``. A rank
copies its contribution into its half, then a *sync* (a tiny gloo all-gather of ``[magic, kind,
bytes, generation, half size]`` per rank) proves every rank wrote and agrees; then each rank
reads the peers' halves. Reuse rule: a rank writes half ``h`` again only in collective ``n + 2``,
after the sync of collective ``n + 1`` completed, which needs every peer to have entered it,
i.e. finished reading collective ``n`` (the collective is synchronous). So one sync per
collective is enough.
"""

from __future__ import annotations

import atexit
import glob
import hashlib
import os
import secrets
import socket
import time
import warnings
import weakref
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from fsdp_compose import AllGather, ExecutionOrderError, FSDPModule, ReduceScatter, extras_api

CHUNK_ENV = "FSDP_COMPOSE_SHM_CHUNK_BYTES"
DEFAULT_CHUNK = 8 << 20
SHM_DIR = "/dev/shm"
FILE_PREFIX = "fsdp_compose_shm_"
_EXIT_GRACE_SECONDS = 0.1  # see _let_gloo_threads_finish
_ALIGN = 4096  # halves start on page boundaries, so every dtype view is aligned
_FIELDS = 5  # sync payload per rank: magic, kind, nbytes, generation, half size
_NO_ROOM = -2  # the generation a rank sends when /dev/shm had no room for its contribution
MAGIC = 0x4653_4450_5348_4D31  # first field of a sync: a rank in another all-gather of the same size is caught
ALL_GATHER, REDUCE_SCATTER = 1, 2
KINDS = {ALL_GATHER: "all-gather", REDUCE_SCATTER: "reduce-scatter"}


@dataclass
class ShmCounters:
    """Collectives this process ran through shared memory; for tests and the benchmark."""

    all_gathers: int = 0
    reduce_scatters: int = 0
    syncs: int = 0
    segments_created: int = 0
    set_ups: int = 0
    fallbacks: int = 0  # groups that use gloo after all: ranks on several hosts, or /dev/shm full


counters = ShmCounters()


def host_identity() -> str:
    """What must be equal on every rank for them to share ``/dev/shm``: hostname and boot id."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = "?"
    return f"{socket.gethostname()}/{boot}"


def segment_bytes() -> int:
    """Bytes of shared memory this process's own segments hold now (peers' are theirs)."""
    return sum(t.own.tensor.numel() for t in list(_transports.values()) if t is not None and t.own is not None)


@dataclass
class _Segment:
    """One mapped file: two halves of ``half`` bytes."""

    path: str
    generation: int
    half: int
    tensor: torch.Tensor

    def region(self, index: int, nbytes: int) -> torch.Tensor:
        start = index * self.half
        return self.tensor[start : start + nbytes]


class ShmTransport:
    """The segments of one process group (this rank's own, and its mappings of the peers')."""

    def __init__(self, group, prefix: str, chunk: int = DEFAULT_CHUNK) -> None:
        self._group = weakref.ref(group)  # not a strong reference: see ``group``
        self.chunk = -(-chunk // 64) * 64  # the most one exchange moves: whole elements of any dtype
        self.rank = group.rank()
        self.world = group.size()
        self.prefix = prefix
        self.own: _Segment | None = None
        self.peers: list[_Segment | None] = [None] * self.world
        self.calls = 0  # collectives run so far: picks the half
        self._known = torch.full((self.world, 2), -1, dtype=torch.int64)  # (generation, half) mapped per rank
        self._mine = torch.zeros(_FIELDS, dtype=torch.int64)
        self._rows = torch.zeros(self.world * _FIELDS, dtype=torch.int64)
        self._confirmed = torch.zeros_like(self._rows)  # the second sync's rows (no temporary per growth)
        self._unlink_after_sync: str | None = None
        self.no_room = ""  # why this rank could not grow its segment, if it could not

    @property
    def group(self):
        """The process group, held weakly: ``_transports`` is keyed weakly by it, and a strong
        reference kept it alive past ``destroy_process_group`` into interpreter teardown (SIGABRT)."""
        return self._group()

    # ----- segments ---------------------------------------------------------------------------
    def _own_region(self, nbytes: int) -> torch.Tensor | None:
        """This rank's half for the coming collective, growing the segment if it is too small;
        ``None`` if ``/dev/shm`` has no room for the larger segment."""
        if self.own is None or nbytes > self.own.half:
            generation = 0 if self.own is None else self.own.generation + 1
            half = max(_ALIGN, -(-nbytes // _ALIGN) * _ALIGN)
            path = os.path.join(SHM_DIR, f"{self.prefix}_{self.rank}_{generation}")
            try:
                fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
                _linked.add(path)
                try:  # reserve the pages now: a full /dev/shm fails here, not with SIGBUS at a write
                    _fallocate(fd, 2 * half)
                finally:
                    os.close(fd)
            except OSError as error:  # reported in the sync, so every rank falls back alike
                _unlink(path)
                self.no_room = f"rank {self.rank} could not reserve {2 * half} bytes in {SHM_DIR}: {error}"
                return None
            tensor = torch.from_file(path, shared=True, size=2 * half, dtype=torch.uint8)  # extends the file
            self.own = self.peers[self.rank] = _Segment(path, generation, half, tensor)
            self._unlink_after_sync = path
            counters.segments_created += 1
        return self.own.region(self.calls % 2, nbytes)

    def _attach(self, rank: int, generation: int, half: int) -> None:
        path = os.path.join(SHM_DIR, f"{self.prefix}_{rank}_{generation}")
        tensor = torch.from_file(path, shared=True, size=2 * half, dtype=torch.uint8)
        self.peers[rank] = _Segment(path, generation, half, tensor)

    # ----- sync -------------------------------------------------------------------------------
    def _sync(self, kind: int, nbytes: int, has_room: bool) -> bool:
        """All ranks have written their contribution; check they agree, map new segments.
        False (on every rank) if a rank had no room for its contribution: the group then
        stops using shared memory, and this collective runs over gloo."""
        mine = self._mine
        generation, half = (self.own.generation, self.own.half) if has_room else (_NO_ROOM, 0)
        mine[0], mine[1], mine[2], mine[3], mine[4] = MAGIC, kind, nbytes, generation, half
        self._gather(self._rows, mine, kind)
        rows = self._rows.view(self.world, _FIELDS)
        if not torch.equal(rows[:, :3], mine[:3].expand(self.world, 3)):
            self._diverged(rows)
        if torch.equal(rows[:, 3:], self._known):
            return True
        if (rows[:, 3] == _NO_ROOM).any():
            self._stop(rows)
            return False
        for rank, (generation, half) in enumerate(rows[:, 3:].tolist()):
            if rank != self.rank and (generation, half) != tuple(self._known[rank].tolist()):
                self._attach(rank, generation, half)
        self._known.copy_(rows[:, 3:])
        # everyone mapped the new segments once everyone is past this second sync: unlink them
        self._gather(self._confirmed, mine, kind)
        path, self._unlink_after_sync = self._unlink_after_sync, None
        if path is not None:
            _unlink(path)
        return True

    def _stop(self, rows: torch.Tensor) -> None:
        """A rank's ``/dev/shm`` is full: this group uses gloo from now on, on every rank."""
        full = [rank for rank, row in zip(self._ranks(), rows.tolist()) if row[3] == _NO_ROOM]
        self._abandon()
        _transports[self.group] = None
        counters.fallbacks += 1
        warnings.warn(
            f"fsdp_compose_shm: {SHM_DIR} has no room for the segment of rank(s) {full} of process group "
            f"{self._ranks()} ({self.no_room or 'see that rank'}); the group uses gloo from now on. Enlarge "
            f"{SHM_DIR} (e.g. docker run --shm-size) to keep the transport",
            stacklevel=4,
        )

    def _gather(self, rows: torch.Tensor, mine: torch.Tensor, kind: int) -> None:
        """The sync; like every collective of ours, issued inside the runtime's ``python_free_tls``."""
        counters.syncs += 1
        try:
            work = getattr(self.group, extras_api.GATHER_METHOD)(rows, mine, extras_api.ASYNC_ALL_GATHER)
            if work is not None:
                extras_api.wait_named(work, lambda: f"the shared-memory sync of a {KINDS[kind]} over ranks {self._ranks()}")
        except BaseException:
            self._abandon()
            raise

    def _ranks(self) -> list[int]:
        return dist.get_process_group_ranks(self.group)

    def _diverged(self, rows: torch.Tensor) -> None:
        """Ranks contributed different kinds or sizes. On gloo the core's order check names the modules
        before this with ``FSDP_COMPOSE_CHECK_ORDER`` on; off, reading a peer's half would give garbage."""
        ranks = self._ranks()
        lines = [
            f"  rank {rank}: " + (f"{KINDS.get(kind, '?')}, {nbytes} bytes" if magic == MAGIC else "another collective")
            for rank, (magic, kind, nbytes, _, _) in zip(ranks, rows.tolist())
        ]
        self._abandon()
        raise ExecutionOrderError(
            f"Ranks {ranks} diverged in a shared-memory collective (fsdp_compose_shm): a rank skipped a sharded "
            "module or a backward(), or ran them in another order; FSDP_COMPOSE_CHECK_ORDER=1 (the default) names "
            "the modules:\n" + "\n".join(lines)
        )

    def _abandon(self) -> None:
        """After a failed or diverged sync: unlink every file of this job, forget the group (a
        later collective, if any, sets up afresh on every rank)."""
        for path in glob.glob(os.path.join(SHM_DIR, glob.escape(self.prefix) + "_*")):
            _unlink(path)
        self.own = None
        self.peers = [None] * self.world
        if _transports.get(self.group) is self:
            del _transports[self.group]

    # ----- collectives ------------------------------------------------------------------------
    def all_gather(self, output: torch.Tensor, input: torch.Tensor, async_op: bool):
        """Copy this rank's row of ``output`` into its half, sync, copy the peers' rows into
        ``output``; a row larger than a chunk goes chunk by chunk, one sync each."""
        rows = output.view(self.world, -1)
        mine = rows[self.rank]
        if input.data_ptr() != mine.data_ptr():  # the runtime concatenates several pieces into it
            mine.copy_(input.view(-1))
        by_byte = rows.view(torch.uint8)
        nbytes = by_byte.shape[1]
        for start in range(0, nbytes, self.chunk):
            size = min(self.chunk, nbytes - start)
            region = self._own_region(size)  # grows at the first chunk only: later ones fit
            if region is not None:
                region.copy_(by_byte[self.rank, start : start + size])
            if not self._sync(ALL_GATHER, nbytes, region is not None):  # a rank had no room: over gloo
                return extras_api.DIRECT_ALL_GATHER(output, mine, self.group, async_op)
            for rank, peer in enumerate(self.peers):
                if rank != self.rank:
                    by_byte[rank, start : start + size].copy_(peer.region(self.calls % 2, size))
            self.calls += 1
        counters.all_gathers += 1
        return _completed(async_op)

    def reduce_scatter(self, output: torch.Tensor, input: torch.Tensor, async_op: bool):
        """Copy the (world, width) table into this rank's half, sync, sum row ``rank`` of every
        rank's table into ``output``; a table larger than a chunk goes by column blocks."""
        dtype, width = input.dtype, output.numel()
        table = input.view(self.world, width)
        nbytes = input.numel() * dtype.itemsize
        columns = width if nbytes <= self.chunk else max(1, self.chunk // (self.world * dtype.itemsize))
        for start in range(0, width, columns):
            end = min(start + columns, width)
            size = self.world * (end - start) * dtype.itemsize
            region = self._own_region(size)  # grows at the first block only
            if region is not None:
                region.view(dtype).view(self.world, end - start).copy_(table[:, start:end])
            if not self._sync(REDUCE_SCATTER, nbytes, region is not None):  # only at the first block
                return extras_api.DIRECT_REDUCE_SCATTER(output, input, self.group, async_op=async_op)
            index = self.calls % 2
            parts = [p.region(index, size).view(dtype).view(self.world, end - start)[self.rank] for p in self.peers]
            torch.add(parts[0], parts[1], out=output[start:end])
            for part in parts[2:]:
                output[start:end].add_(part)
            self.calls += 1
        counters.reduce_scatters += 1
        return _completed(async_op)


def _completed(async_op: bool):
    """The protocol's return value for a collective that is done: a completed work, or ``None``."""
    return extras_api.COMPLETED if async_op else None


def _empty(size, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    return torch.empty(size, dtype=dtype, device=device)


class ShmAllGather(AllGather):
    """All-gather through ``/dev/shm`` where the process group allows it, else the process group's own."""

    allocate = staticmethod(_empty)

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group, async_op: bool = False):
        transport = transport_for(group, output_tensor.device)
        if transport is None:
            return extras_api.DIRECT_ALL_GATHER(output_tensor, input_tensor, group, async_op)
        return transport.all_gather(output_tensor, input_tensor, async_op)


class ShmReduceScatter(ReduceScatter):
    """Sum reduce-scatter through ``/dev/shm`` where the process group allows it, else the process group's own."""

    allocate = staticmethod(_empty)

    def __call__(
        self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group, op: object = None, async_op: bool = False
    ):
        transport = transport_for(group, output_tensor.device)
        if transport is None:
            return extras_api.DIRECT_REDUCE_SCATTER(output_tensor, input_tensor, group, op, async_op)
        return transport.reduce_scatter(output_tensor, input_tensor, async_op)


SHM_ALL_GATHER = ShmAllGather()
SHM_REDUCE_SCATTER = ShmReduceScatter()


def comms() -> tuple[AllGather, ReduceScatter]:
    """The transport's collectives, for ``set_custom_all_gather`` / ``set_custom_reduce_scatter`` by hand."""
    return SHM_ALL_GATHER, SHM_REDUCE_SCATTER


def use_shm(model: nn.Module) -> None:
    """Run every group that ``fully_shard`` made in ``model`` through this transport.

    Call it on every rank alike (a rank left on gloo would meet the others' syncs with its data),
    after the last ``fully_shard`` on the model: a module sharded later keeps the process group's
    collectives. Before or after the first forward is the same (lazy init keeps a group's
    collectives, and a group reads them at each collective), so between steps works too. It is
    each sharded module's ``set_custom_all_gather`` / ``set_custom_reduce_scatter``, which cover the
    groups of per-parameter meshes and a separate reduce-scatter group, and replace a custom
    collective set before.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"use_shm expects the sharded nn.Module, got {type(model).__name__}")
    sharded = [m for m in model.modules() if isinstance(m, FSDPModule)]
    if not sharded:
        raise ValueError(
            f"use_shm({type(model).__name__}): no module in it is sharded; call fully_shard on it "
            "(and its blocks) first, then use_shm"
        )
    for module in sharded:
        module.set_custom_all_gather(SHM_ALL_GATHER)
        module.set_custom_reduce_scatter(SHM_REDUCE_SCATTER)


# process group -> its transport, or None where set-up fell back to gloo
_transports: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_linked: set[str] = set()  # files this process created and has not unlinked yet
_prefixes: set[str] = set()  # every job prefix this process used: cleaned at exit
_warned = False


def transport_for(group, device: torch.device) -> ShmTransport | None:
    """The process group's shm transport, if its collectives on ``device`` can go through ``/dev/shm``."""
    if device.type != "cpu" or group.size() == 1:
        return None
    transport = _transports.get(group, False)
    if transport is False:
        transport = _transports[group] = _set_up(group)
    return transport


def _set_up(group) -> ShmTransport | None:
    """One exchange of (magic, host hash, random prefix, has /dev/shm, chunk bytes) per rank;
    rank 0's prefix and chunk size are used (the chunking must be the same on every rank)."""
    global _warned
    digest = hashlib.blake2b(host_identity().encode(), digest_size=7).digest()
    mine = torch.tensor(
        [MAGIC, int.from_bytes(digest, "little"), secrets.randbits(62), int(os.path.isdir(SHM_DIR)), _chunk_bytes()],
        dtype=torch.int64,
    )
    rows = mine.new_empty(group.size() * 5)
    work = getattr(group, extras_api.GATHER_METHOD)(rows, mine, extras_api.ASYNC_ALL_GATHER)
    if work is not None:
        extras_api.wait_named(work, f"the shm transport's set-up over ranks {dist.get_process_group_ranks(group)}")
    table = rows.view(-1, 5).tolist()
    counters.set_ups += 1
    if all(row[1] == table[0][1] and row[3] == 1 for row in table):
        prefix = f"{FILE_PREFIX}{table[0][2]:016x}"
        _prefixes.add(prefix)
        return ShmTransport(group, prefix, table[0][4])
    counters.fallbacks += 1
    if not _warned:
        _warned = True
        warnings.warn(
            f"fsdp_compose_shm: the ranks of process group {dist.get_process_group_ranks(group)} are not all "
            f"on one host with {SHM_DIR} (hostname and boot id differ); using gloo for its collectives",
            stacklevel=2,
        )
    return None


def _chunk_bytes() -> int:
    value = os.environ.get(CHUNK_ENV, "")
    try:
        chunk = int(value) if value else DEFAULT_CHUNK
    except ValueError:
        chunk = 0
    if chunk <= 0:
        raise ValueError(f"{CHUNK_ENV}={value!r}: expected a positive number of bytes (default {DEFAULT_CHUNK})")
    return chunk


def _fallocate(fd: int, nbytes: int) -> None:
    os.posix_fallocate(fd, 0, nbytes)


def _unlink(path: str) -> None:
    _linked.discard(path)
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


@atexit.register
def _unlink_at_exit() -> None:
    for path in list(_linked):
        _unlink(path)
    for prefix in _prefixes:  # a peer killed while growing its segment leaves its file to us
        for path in glob.glob(os.path.join(SHM_DIR, glob.escape(prefix) + "_*")):
            _unlink(path)
    if _prefixes:
        _let_gloo_threads_finish()


def _let_gloo_threads_finish() -> None:
    """Release the GIL for a moment before the interpreter finalizes: with the transport on, a
    gloo worker thread finishing its last ``Work`` sometimes needed the GIL of a finalizing
    interpreter and aborted the process at exit (docs/cpu-transport.md gives the runs)."""
    time.sleep(_EXIT_GRACE_SECONDS)
