"""Predict the per-rank peak of one training step by replaying the schedule on byte counts.

A function of the model's facts (``extras_api.group_facts``) and the backend, no tensor touched: what
``explain`` reports, and what a planner can call for many configurations. It follows the runtime's rules
(hooks/forward.py, hooks/backward.py, schedule.py) and counts what ``estimate``'s fake step counts
(``timeline.py``), by the same categories:

- forward: a group waits for its all-gather (issued earlier as a prefetch, or now), copies out (the
  all-gather output and the unsharded parameters coexist), then issues its prefetch targets' all-gathers;
  non-root groups free after forward (keeping a slice under ``reshard_after_forward=<int>``);
- backward, in reverse module order: a call's pre-backward gathers again and prefetches; gradients appear
  where their parameters are used; a group's post-backward (once every trainable parameter has a gradient
  and the outputs of the calls nested in its forward got theirs, else at the end of backward) frees its
  unsharded parameters and prepares its reductions (rows cast or padded are copies, the gradients die; rows
  that are views keep them); issuing one builds the table (the rows die) and the output, and at most
  ``reduce_limit`` reductions stay in flight;
- the backend (``BACKEND_HOLDS``, as the fake step counts it): a reduce-scatter's input (gloo: its copy of
  it) and an all-gather's input apart from its output are held until the collective is waited; gloo also
  allocates an output-sized buffer while issuing an all-gather and stages its output in another until the
  transfer is over, at its wait or at the wait of a later collective of the same process group; and on
  gloo the runtime issues a reduce-scatter after the next all-gather's handshake (a synchronous all-reduce:
  a wait) or at the end of backward.

It describes a step after the first (the first records the order and prefetches no forward gathers) with
gradients set to ``None`` before it (``optimizer.zero_grad()``). Activations are not modelled.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from torch import nn

from ...extras_api import GroupFacts, GroupHandle, ScratchSchedule, reshards_after_forward
from .plan import GroupSizes, itemsize

UNSHARDED_PARAMETERS = "unsharded parameters"
COLLECTIVE_BUFFERS = "collective buffers"
UNSHARDED_GRADIENTS = "unsharded gradients"
GRADIENTS = "gradients"
_CATEGORY = {"unsharded": UNSHARDED_PARAMETERS, "grad": UNSHARDED_GRADIENTS, "rows": UNSHARDED_GRADIENTS,
             "sharded_grad": GRADIENTS}  # the rest are collective buffers


@dataclass(frozen=True)
class BackendHolds:
    """What a backend keeps around a collective beyond the tensors the runtime passes it. Every backend keeps a
    reduce-scatter's input, and an all-gather's that is not part of its output (a slice kept after forward),
    until the collective is waited: NCCL's work stashes them (``TORCH_NCCL_AVOID_RECORD_STREAMS=1``) or the
    caching allocator holds them until the transfer, which is over by then; gloo's work holds them."""

    reduce_input_copy: bool  # gloo copies a reduce-scatter's input when issued (the input itself dies then)
    gather_staging: bool  # gloo: an output-sized buffer while issuing, another while the transfer runs
    reduce_after_handshake: bool  # the runtime's gloo path: a reduce-scatter waits for the next handshake


BACKEND_HOLDS = {"nccl": BackendHolds(False, False, False), "gloo": BackendHolds(True, True, True)}


@dataclass
class Call:
    """One forward call of a group's module: its index in ``named_modules`` and its subtree's last."""

    state: GroupHandle
    start: int
    end: int


@dataclass
class Replay:
    peak: int  # bytes above the sharded parameters and optimizer state
    where: str  # the moment of the peak
    after_backward: int  # sharded gradients left for the optimizer step
    at_peak: dict[str, int] = field(default_factory=dict)  # category -> bytes at the peak


def forward_calls(model: nn.Module, groups: list[GroupFacts]) -> tuple[list[Call], dict]:
    """Calls in definition order, and each parameter's position (its module's index), by ``id`` of the parameter."""
    modules = list(model.modules())  # named_modules order, duplicates removed
    index = {m: i for i, m in enumerate(modules)}
    ends, stack = {}, []  # each module's last descendant, from the path depth
    for name, m in model.named_modules():
        d = name.count(".") + 1 if name else 0
        while stack and stack[-1][1] >= d:
            ends[stack.pop()[0]] = index[m] - 1
        stack.append((m, d))
    for m, _ in stack:
        ends[m] = len(modules) - 1
    calls = []
    for g in groups:
        for m in g.modules:
            if m in index:
                calls.append(Call(g.handle, index[m], ends[m]))
    calls.sort(key=lambda c: c.start)
    param_pos = {}
    for g in groups:
        for p in g.trainable:
            positions = [index[m] for m in p.modules if m in index]
            param_pos[id(p.parameter)] = max(positions) if positions else 0
    return calls, param_pos


def schedules_after_first_step(
    root_of: dict[GroupHandle, GroupHandle], orders: dict[GroupHandle, list[GroupHandle]], prefetch_limit: int
) -> dict[GroupHandle, ScratchSchedule]:
    """Each group's schedule: a scratch one per root whose first step ran ``orders[root]``.

    The runtime's own schedule functions (``extras_api.ScratchSchedule``) then record the replayed step and give
    its prefetch targets, so the replay cannot drift from what training does.
    """
    by_root = {
        root: ScratchSchedule(root, [s for s, r in root_of.items() if r is root], order, prefetch_limit)
        for root, order in orders.items()
    }
    return {s: by_root[r] for s, r in root_of.items()}


class _Live:
    def __init__(self) -> None:
        self.bytes: dict[tuple, int] = {}
        self.total = 0
        self.peak = 0
        self.where = "-"
        self.at_peak: dict[str, int] = {}

    def add(self, key: tuple, n: int, where: str) -> None:
        if n <= 0:
            return
        self.bytes[key] = self.bytes.get(key, 0) + n
        self.total += n
        if self.total > self.peak:
            self.peak, self.where = self.total, where
            self.at_peak = {}
            for k, v in self.bytes.items():
                category = _CATEGORY.get(k[0], COLLECTIVE_BUFFERS)
                self.at_peak[category] = self.at_peak.get(category, 0) + v

    def drop(self, key: tuple) -> None:
        self.total -= self.bytes.pop(key, 0)

    def spike(self, key: tuple, n: int, where: str) -> None:
        """A buffer alive only while an operator runs."""
        self.add(key, n, where)
        self.drop(key)


@dataclass
class _Collective:
    """A collective in flight: what it keeps until its transfer is over, and until its work is waited."""

    until_transfer: list[tuple] = field(default_factory=list)
    until_wait: list[tuple] = field(default_factory=list)


class _Step:
    """One step's events on byte counts (see the module docstring)."""

    def __init__(self, sizes, names, roots, schedules, reduce_limit, facts, holds: BackendHolds) -> None:
        self.sizes, self.names, self.roots, self.schedules = sizes, names, roots, schedules
        self.reduce_limit, self.facts, self.holds = reduce_limit, facts, holds
        self.live = _Live()
        self.unsharded: set[GroupHandle] = set()
        self.pending: set[GroupHandle] = set()
        self.kept: set[GroupHandle] = set()
        self.in_flight: list[tuple[tuple, _Collective]] = []  # issue order (one process group is assumed)
        self.reducing: list[GroupHandle] = []
        self.queued: list[GroupHandle] = []  # prepared reductions waiting for a handshake (gloo)

    # ----- collectives in flight ----------------------------------------------------------
    def issued(self, key: tuple, collective: _Collective) -> None:
        self.in_flight.append((key, collective))

    def waited(self, key: tuple | None) -> None:
        """``key``'s collective is done (``None``: a handshake's all-reduce, issued after every one in flight),
        and so is the transfer of every one issued before it."""
        keys = [each for each, _ in self.in_flight]
        upto = keys.index(key) + 1 if key in keys else (len(keys) if key is None else 0)
        keep = []
        for at, (each, collective) in enumerate(self.in_flight):
            if at < upto:
                for held in collective.until_transfer:
                    self.live.drop(held)
                collective.until_transfer = []
            if each == key:
                for held in collective.until_wait:
                    self.live.drop(held)
                collective.until_wait = []
            if collective.until_transfer or collective.until_wait:
                keep.append((each, collective))
        self.in_flight = keep

    # ----- unshard / reshard --------------------------------------------------------------
    def start(self, s: GroupHandle) -> None:
        if s in self.unsharded or s in self.pending or not self.facts[s].params:
            return
        size, name = self.sizes[s], self.names[s]
        if self.holds.reduce_after_handshake:  # gloo's order check: a synchronous all-reduce first
            self.waited(None)
        # re-gathered from the slice kept after forward (held until the wait), or from the shards (the input
        # is the output's own row)
        collective = _Collective()
        gathered = size.kept_gathered if s in self.kept else size.gathered
        if s in self.kept:
            self.kept.discard(s)
            collective.until_wait.append(("kept", s))
        self.live.add(("gathered", s), gathered, f"all-gather {name}")
        if self.holds.gather_staging:
            self.live.spike(("issuing", s), gathered, f"all-gather {name}")
            self.live.add(("staging", s), gathered, f"all-gather {name}")
            collective.until_transfer.append(("staging", s))
        self.issued(("gather", s), collective)
        self.pending.add(s)

    def wait(self, s: GroupHandle, where: str) -> None:
        if s not in self.pending:
            return
        self.pending.discard(s)
        self.waited(("gather", s))
        self.live.add(("unsharded", s), self.sizes[s].unsharded, where)  # copy-out: buffer and target coexist
        self.live.drop(("gathered", s))
        self.unsharded.add(s)

    def reshard(self, s: GroupHandle, after_forward: bool) -> None:
        if s not in self.unsharded:
            return
        if after_forward and self.sizes[s].kept:
            self.kept.add(s)
            self.live.add(("kept", s), self.sizes[s].kept, "")
        self.live.drop(("unsharded", s))
        self.unsharded.discard(s)

    def unshard_with_prefetch(self, s: GroupHandle, targets: list[GroupHandle], where: str) -> None:
        self.start(s)
        self.wait(s, where)
        for t in targets:
            self.start(t)

    # ----- gradients ----------------------------------------------------------------------
    def prepare_reduce(self, s: GroupHandle, gradients: dict[int, bool]) -> None:
        """``start_reduce``: each parameter's rows; a copy (cast, padded, or zeros for no gradient) lets its
        gradient die now, a view keeps it until the table is built."""
        g, where = self.facts[s], f"reduce-scatter {self.names[s]}"
        for i, reduction in enumerate(g.reductions if g.requires_gradient_sync else ()):
            for p in reduction.params:
                got = gradients.get(id(p.parameter), True)
                padded = p.unsharded_shape.numel() != g.world * p.padded_numel
                if not got or p.gather_dtype != reduction.dtype or padded:
                    self.live.add(("rows", s, i), g.world * p.padded_numel * itemsize(reduction.dtype), where)
                    self.live.drop(("grad", id(p.parameter)))

    def issue_reduce(self, s: GroupHandle) -> None:
        size, where = self.sizes[s], f"reduce-scatter {self.names[s]}"
        for i, (table, output) in enumerate(zip(size.reduce_tables, size.reduce_outputs)):
            self.live.add(("table", s, i), table, where)  # the rows copied in, then dropped
            self.live.drop(("rows", s, i))
            for p in self.facts[s].reductions[i].params:
                self.live.drop(("grad", id(p.parameter)))
            self.live.add(("output", s, i), output, where)
            collective = _Collective()
            if self.holds.reduce_input_copy:  # gloo's copy is held; the table dies when issued
                self.live.add(("copy", s, i), table, where)
                collective.until_wait.append(("copy", s, i))
                self.live.drop(("table", s, i))
            else:
                collective.until_wait.append(("table", s, i))
            self.issued(("reduce", s, i), collective)
        self.reducing.append(s)
        while len(self.reducing) > self.reduce_limit:
            self.finish_reduce(self.reducing.pop(0))

    def finish_reduce(self, s: GroupHandle) -> None:
        for i, copy in enumerate(self.sizes[s].sharded_grad_copies):
            self.waited(("reduce", s, i))
            output = self.live.bytes.get(("output", s, i), 0)
            self.live.drop(("output", s, i))
            # the sharded gradient: a view of the output, or a copy of it
            self.live.add(("sharded_grad", s, i), copy or output, "")

    def issue_queued(self) -> None:
        queued, self.queued = self.queued, []
        for s in queued:
            self.issue_reduce(s)

    def post_backward(self, s: GroupHandle, gradients: dict[int, bool]) -> None:
        if self.facts[s].reshard_after_backward:
            self.reshard(s, after_forward=False)
        if not self.sizes[s].reduce_tables:
            return
        self.prepare_reduce(s, gradients)
        self.queued.append(s)
        if not self.holds.reduce_after_handshake:
            self.issue_queued()


def replay(
    calls: list[Call],
    param_pos: dict[int, int],
    sizes: dict[GroupHandle, GroupSizes],
    names: dict[GroupHandle, str],
    roots: set[GroupHandle],
    schedules: dict[GroupHandle, ScratchSchedule],
    reduce_limit: int,
    facts: dict[GroupHandle, GroupFacts],
    like: str = "nccl",
    gradients: dict[int, bool] | None = None,
) -> Replay:
    """Replay a step on byte counts; ``schedules`` (``schedules_after_first_step``) records it. ``like``: the
    backend (``BACKEND_HOLDS``); ``gradients``: whether each trainable parameter (by ``id``) gets a gradient
    (all do when not known)."""
    gradients = gradients or {}
    step = _Step(sizes, names, roots, schedules, reduce_limit, facts, BACKEND_HOLDS[like])
    live = step.live

    # ----- forward ------------------------------------------------------------------------
    open_calls: list[Call] = []
    nested_ends: dict[GroupHandle, list[int]] = {}  # where backward has consumed the outputs of calls nested in a group's

    def post_forward(call: Call) -> None:
        s = call.state
        schedules[s].after_forward(s)
        if reshards_after_forward(s, facts[s].call[0] in roots):
            step.reshard(s, after_forward=True)

    for call in calls:
        while open_calls and open_calls[-1].end < call.start:
            post_forward(open_calls.pop())
        s = call.state
        if open_calls and open_calls[-1].state is not s:
            nested_ends.setdefault(open_calls[-1].state, []).append(call.end)
        step.unshard_with_prefetch(s, schedules[s].before_forward(s), f"forward {names[s]}")
        open_calls.append(call)
    while open_calls:
        post_forward(open_calls.pop())

    # ----- backward -----------------------------------------------------------------------
    pre_done: set[GroupHandle] = set()
    post_done: set[GroupHandle] = set()
    done_at: dict[GroupHandle, int] = {}
    for s in sizes:
        trainable = [p for p in facts[s].trainable if gradients.get(id(p.parameter), True)]
        if len(trainable) < len(facts[s].trainable):  # a parameter without a gradient: at the end of backward
            continue
        positions = [param_pos[id(p.parameter)] for p in trainable]
        starts = [c.start for c in calls if c.state is s]
        # a group with trainable parameters also waits for the outputs of the calls nested in its forward
        done_at[s] = min(positions + nested_ends.get(s, [])) if positions else min(starts, default=0)

    def pre_backward(s: GroupHandle) -> None:
        if s in pre_done:
            return
        pre_done.add(s)
        step.unshard_with_prefetch(s, schedules[s].backward_targets(s), f"backward {names[s]}")
        step.issue_queued()  # after the handshake of the all-gathers above (gloo)

    def post_backward(s: GroupHandle) -> None:
        if s not in post_done:
            post_done.add(s)
            step.post_backward(s, gradients)

    last = max((c.end for c in calls), default=-1)
    by_end: dict[int, list[Call]] = {}
    for c in calls:
        by_end.setdefault(c.end, []).append(c)
    grads_at: dict[int, list] = {}
    for s in sizes:
        for p in facts[s].trainable:
            if gradients.get(id(p.parameter), True):
                grads_at.setdefault(param_pos[id(p.parameter)], []).append((s, p))
    for k in range(last, -1, -1):
        for c in sorted(by_end.get(k, []), key=lambda c: c.start):
            pre_backward(c.state)
        for s, p in grads_at.get(k, []):
            grad_bytes = p.unsharded_shape.numel() * p.gather_dtype.itemsize
            live.add(("grad", id(p.parameter)), grad_bytes, f"backward {names[s]}")
        for s in [s for s in sizes if done_at.get(s) == k]:
            if s in pre_done:
                post_backward(s)
    for s in sizes:  # the end of backward: the groups left, then every reduction
        if s in pre_done:
            post_backward(s)
    if step.holds.reduce_after_handshake and step.queued:
        step.waited(None)  # the handshake that lets them go
    step.issue_queued()
    for s in step.reducing:
        step.finish_reduce(s)
    step.reducing.clear()
    return Replay(live.peak, live.where, live.total, live.at_peak)
