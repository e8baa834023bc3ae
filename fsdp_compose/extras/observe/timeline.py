"""A storage tracker that remembers what was live when: the peak's bytes split by category.

``StorageTimeline`` counts like ``StorageTracker`` (tensor storages, not RSS) and also keeps each
storage's lifetime as segments ``[start, end)`` of an event counter. Categories are labels put
on storages by identity, during the run (collective buffers, as the ``c10d`` operators see
them; unsharded gradients, as autograd hands them over) or afterwards (sharded parameters,
gradients, optimizer state): the peak's composition is computed at the end from the segments
live at the peak's event, so a storage labelled after it died still counts in its category.
It works under ``FakeTensorMode`` (fake tensors have storages with sizes and identities).
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Iterable

import torch

from .storage import StorageTracker, tensors_in

UNLABELLED = "activations"


class StorageTimeline(StorageTracker):
    """``StorageTracker`` plus segments, labels and a peak per phase (``phase`` names the current one)."""

    def __init__(self) -> None:
        super().__init__()
        self._lock = threading.RLock()  # a storage may die (weakref callback) while one is counted
        self.event = 0
        self.phase = "-"
        self.phase_starts: list[tuple[str, int]] = []  # (phase, its first event)
        self.phase_peaks: dict[str, tuple[int, int]] = {}  # phase -> (bytes, event)
        self.peak_event = 0
        self._serial: dict[int, int] = {}  # id(storage) -> serial
        self._opened: dict[int, tuple[int, int]] = {}  # serial -> (start event, bytes) of its live segment
        self._segments: list[tuple[int, int, int, int]] = []  # (start, end, bytes, serial), closed
        self.labels: dict[int, str] = {}  # serial -> category
        self._next_serial = 0

    def enter_phase(self, name: str) -> None:
        self.phase = name
        self.phase_starts.append((name, self.event + 1))

    # ----- labelling ------------------------------------------------------------------------
    def serial_of(self, t: torch.Tensor) -> int | None:
        """The serial of ``t``'s storage if the timeline has seen it (DTensors: their local tensor)."""
        local = getattr(t, "_local_tensor", t)
        if not isinstance(local, torch.Tensor) or local.device.type == "meta":
            return None
        storage = local.untyped_storage()
        ref = self._refs.get(id(storage))
        if ref is None or ref() is not storage:
            return None
        return self._serial[id(storage)]

    def label(self, tensors: Iterable[object], category: str, override: bool = True) -> None:
        """Put ``category`` on the storages of ``tensors`` (first seeing any not seen yet)."""
        for t in tensors:
            if not isinstance(t, torch.Tensor):
                continue
            self._see(t)
            serial = self.serial_of(t)
            if serial is not None and (override or serial not in self.labels):
                self.labels[serial] = category

    # ----- composition ----------------------------------------------------------------------
    def live_at(self, event: int) -> dict[str, int]:
        """Bytes by category of the storages live just after ``event``."""
        out: dict[str, int] = {}
        segments = self._segments + [(start, None, size, serial) for serial, (start, size) in self._opened.items()]
        for start, end, size, serial in segments:
            if start <= event and (end is None or end > event) and size:
                category = self.labels.get(serial, UNLABELLED)
                out[category] = out.get(category, 0) + size
        return out

    def peak_without(self, *categories: str) -> tuple[int, int]:
        """(bytes, event) of the largest sum of the storages in none of ``categories`` over the run."""
        changes: dict[int, int] = {}
        segments = self._segments + [(start, None, size, serial) for serial, (start, size) in self._opened.items()]
        for start, end, size, serial in segments:
            if size and self.labels.get(serial, UNLABELLED) not in categories:
                changes[start] = changes.get(start, 0) + size
                if end is not None:
                    changes[end] = changes.get(end, 0) - size
        best = (0, 0)
        total = 0
        for event in sorted(changes):
            total += changes[event]
            if total > best[0]:
                best = (total, event)
        return best

    # ----- counting (StorageTracker's, with segments) ---------------------------------------
    def _tick(self) -> None:
        self.event += 1
        if self.current > self.peak:
            self.peak, self.peak_event = self.current, self.event
        best = self.phase_peaks.get(self.phase)
        if best is None or self.current > best[0]:
            self.phase_peaks[self.phase] = (self.current, self.event)

    def _open(self, serial: int, size: int) -> None:
        self._opened[serial] = (self.event + 1, size)
        self.current += size
        self._tick()

    def _close(self, serial: int) -> None:
        start, size = self._opened.pop(serial)
        self._segments.append((start, self.event + 1, size, serial))
        self.current -= size
        self._tick()

    def _add(self, key: int, storage: torch.UntypedStorage) -> None:
        with self._lock:
            serial = self._next_serial
            self._next_serial += 1
            self._refs[key] = weakref.ref(storage, lambda _ref, key=key: self._forget(key))
            self._serial[key] = serial
            self._sizes[key] = storage.nbytes()
            self._open(serial, self._sizes[key])

    def _forget(self, key: int) -> None:
        with self._lock:
            self._sizes.pop(key, None)
            self._refs.pop(key, None)
            serial = self._serial.pop(key, None)
            if serial is not None:
                self._close(serial)

    def _resized(self, storage: torch.UntypedStorage) -> None:
        key = id(storage)
        ref = self._refs.get(key)
        if ref is None or ref() is not storage:
            self._add(key, storage)
            return
        with self._lock:  # a new segment of the same storage: same serial, same label
            serial = self._serial[key]
            self._close(serial)
            self._sizes[key] = storage.nbytes()
            self._open(serial, self._sizes[key])


COLLECTIVE_BUFFERS = "collective buffers"
_DEVICE = torch.ops.prim.device.default


class CollectiveTimeline(StorageTimeline):
    """Also labels the tensors of ``c10d`` operators as collective buffers (without replacing a
    label already put, e.g. on a shard sent as it is, except an ``inherited`` one), and counts what
    the backend ``like`` holds while a collective is in flight (the fake process group holds nothing and
    is done at once).

    Every backend keeps a reduce-scatter's input, and an all-gather's that is not part of its output (a slice
    kept after forward), until the collective is waited (``waited``; failing that, until its output is next
    read): NCCL's work stashes them (``TORCH_NCCL_AVOID_RECORD_STREAMS=1``) or the caching allocator holds
    them until the transfer is over, which it is by then; gloo's work holds them, and it copies a
    reduce-scatter's input when issued (the copy is held, the input dies). ``like="gloo"`` also counts what
    gloo allocates for an all-gather: an output-sized buffer while it is issued, and a staging buffer while
    the transfer runs, which is over at the wait or at the wait of a later collective of its process group
    (the ranks run a group's collectives in one order; the order check's handshake before each all-gather
    is one): when exactly depends on gloo's threads, so it counts to the latest end, and ``settled_peak``
    leaves both out. These are counted as collective buffers no Python tensor holds, as the C allocator's
    own count of a real gloo run shows them (``tests/extras/observe/test_never_low.py``). ``like=None``:
    nothing more.
    ``inherited``: labels that pass from an operator's inputs to its new outputs (an unsharded
    gradient's copy in the reduce dtype is still that gradient)."""

    def __init__(self, like: str | None, inherited: frozenset[str] = frozenset()) -> None:
        super().__init__()
        self.like = like
        self.inherited = inherited
        # serial of a collective's output -> what the backend holds for it: tensors, and buffers of its own
        # (``_backend_buffer``'s serials) with whether they live until the work is waited or only the transfer
        self._held: dict[int, list[tuple[torch.Tensor | int, bool]]] = {}
        self._in_flight: dict[object, list[int]] = {}  # process group -> its collectives' outputs, in issue order
        self._timed: dict[int, int] = {}  # gloo's all-gather buffers: serial -> bytes (see ``settled_peak``)
        self._timed_bytes = 0
        self.settled_peak = 0  # the peak were every transfer over as soon as issued: without those buffers

    def issued(self, group: object, output: torch.Tensor) -> None:
        """A collective on ``group`` writing ``output`` was issued (after its operator ran)."""
        serial = self.serial_of(output)
        if serial is not None:
            self._in_flight.setdefault(group, []).append(serial)

    def waited(self, output: torch.Tensor, group: object = None) -> None:
        """The collective writing ``output`` is done, and so is the transfer of every one issued before it on
        ``group`` (ranks run a group's collectives in one order): the backend lets go of what they held, but
        for what it frees with a work not waited yet."""
        serial = self.serial_of(output)
        if serial is None:
            return
        order = self._in_flight.get(group, [])
        earlier = []
        if serial in order:
            at = order.index(serial)
            earlier, self._in_flight[group] = order[:at], order[at + 1 :]
        for each in [*earlier, serial]:
            kept = []
            for held, with_work in self._held.pop(each, ()):
                if with_work and each != serial:
                    kept.append((held, with_work))
                elif isinstance(held, int):
                    self._close(held)  # else a tensor, let go
            if kept:
                self._held[each] = kept

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is _DEVICE:  # asked for every fake tensor's device by autograd: no storage to count
            return func(*args)
        tensors = list(tensors_in(args))
        if self._held and func.namespace != "c10d" and not func.is_view:  # read before the wait was seen
            for t in tensors:
                self.waited(t)
        out = super().__torch_dispatch__(func, types, args, kwargs)
        if func.namespace == "c10d":
            for t in tensors:
                serial = self.serial_of(t)
                if serial is not None and (serial not in self.labels or self.labels[serial] in self.inherited):
                    self.labels[serial] = COLLECTIVE_BUFFERS
            if len(tensors) >= 2:
                self._hold(str(func), tensors[0], tensors[1])
        elif self.inherited and self.labels:
            serials = [self.serial_of(t) for t in tensors]
            found = next((self.labels[s] for s in serials if self.labels.get(s) in self.inherited), None)
            if found is not None:
                self.label(tensors_in(out), found, override=False)
        return out

    def _hold(self, name: str, output: torch.Tensor, input: torch.Tensor) -> None:
        """What the backend keeps while the collective ``name`` (output, input) is in flight."""
        serial = self.serial_of(output)
        if serial is None or self.like not in ("nccl", "gloo"):
            return
        held = self._held.setdefault(serial, [])
        if "reduce_scatter" in name:
            if self.like == "nccl":  # the input, until the wait
                held.append((input, True))
            else:  # gloo's copy, freed with the work
                held.append((self._backend_buffer(input.untyped_storage().nbytes()), True))
        elif "allgather" in name:
            if input.untyped_storage() is not output.untyped_storage():  # e.g. a slice kept after forward
                held.append((input, True))
            if self.like == "gloo":
                nbytes = output.untyped_storage().nbytes()
                self._close(self._backend_buffer(nbytes, timed=True))  # while the operator runs
                held.append((self._backend_buffer(nbytes, timed=True), False))  # staging, while the transfer runs

    def _backend_buffer(self, nbytes: int, timed: bool = False) -> int:
        """Count a buffer the backend allocates for itself, as a storage of its own; its serial. ``timed``: its
        life depends on when gloo's threads run the transfer (counted to the latest end)."""
        with self._lock:
            serial = self._next_serial
            self._next_serial += 1
            self.labels[serial] = COLLECTIVE_BUFFERS
            if timed:
                self._timed[serial] = nbytes
                self._timed_bytes += nbytes
            self._open(serial, nbytes)
        return serial

    def _close(self, serial: int) -> None:
        self._timed_bytes -= self._timed.pop(serial, 0)
        super()._close(serial)

    def _tick(self) -> None:
        super()._tick()
        self.settled_peak = max(self.settled_peak, self.current - self._timed_bytes)

