"""Predict the per-rank peak of one training step by replaying the schedule on byte counts.

The replay follows the runtime's rules (hooks/forward.py, hooks/backward.py, schedule.py):
the all-gather input is this rank's row of the output (no separate send buffer); a group's
all-gather output and its unsharded parameters coexist during copy-out, and its prefetch
targets are issued only after that copy-out; prefetched gathers are in flight while a group
computes; non-root groups free after forward (keeping a slice under
``reshard_after_forward=<int>``); backward re-gathers in reverse post-forward order; a finished
group (its trainable parameters' gradients and the outputs of the calls nested in its forward done)
frees its unsharded parameters, then builds the reduce-scatter input (the unsharded gradients die
once it is built), then allocates the output;
at most ``reduce_limit`` reductions stay in flight (their inputs too, unless the backend copies
them, as gloo does). Activations are not modelled.
It describes a step after the first (the first records the order and prefetches no forward
gathers) with gradients set to ``None`` before it (``optimizer.zero_grad()``).
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from ...extras_api import GroupFacts, GroupHandle, ScratchSchedule, reshards_after_forward
from .plan import GroupSizes


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

    def add(self, key: tuple, n: int, where: str) -> None:
        if n <= 0:
            return
        self.bytes[key] = self.bytes.get(key, 0) + n
        self.total += n
        if self.total > self.peak:
            self.peak, self.where = self.total, where

    def drop(self, key: tuple) -> None:
        self.total -= self.bytes.pop(key, 0)


def replay(
    calls: list[Call],
    param_pos: dict[int, int],
    sizes: dict[GroupHandle, GroupSizes],
    names: dict[GroupHandle, str],
    roots: set[GroupHandle],
    schedules: dict[GroupHandle, ScratchSchedule],
    reduce_limit: int,
    facts: dict[GroupHandle, GroupFacts],
    reduce_input_held: bool = True,
) -> Replay:
    """Replay a step on byte counts; ``schedules`` (``schedules_after_first_step``) records it.

    ``reduce_input_held``: the backend keeps the reduce-scatter input until the wait (NCCL);
    gloo copies it when the collective is issued, so the input dies at once."""
    live = _Live()
    unsharded: set[GroupHandle] = set()
    pending: set[GroupHandle] = set()
    kept: set[GroupHandle] = set()

    def start(s: GroupHandle) -> None:
        if s in unsharded or s in pending or not facts[s].params:
            return
        size = sizes[s]
        if s in kept:  # re-gather from the slice kept after forward
            kept.discard(s)
            live.add(("gathered", s), size.kept_gathered, "")
        else:  # the send buffer is the output's own row
            live.add(("gathered", s), size.gathered, "")
        pending.add(s)

    def wait(s: GroupHandle, where: str) -> None:
        if s not in pending:
            return
        pending.discard(s)
        live.add(("unsharded", s), sizes[s].unsharded, where)  # copy-out: buffer and target coexist
        for kind in ("gathered", "kept"):
            live.drop((kind, s))
        unsharded.add(s)

    def reshard(s: GroupHandle, after_forward: bool) -> None:
        if s not in unsharded:
            return
        if after_forward and sizes[s].kept:
            kept.add(s)
            live.add(("kept", s), sizes[s].kept, "")
        live.drop(("unsharded", s))
        unsharded.discard(s)

    def unshard_with_prefetch(s: GroupHandle, targets: list[GroupHandle], where: str) -> None:
        start(s)
        wait(s, where)
        for t in targets:
            start(t)

    # ----- forward ------------------------------------------------------------------------
    open_calls: list[Call] = []
    nested_ends: dict[GroupHandle, list[int]] = {}  # where backward has consumed the outputs of calls nested in a group's

    def post_forward(call: Call) -> None:
        s = call.state
        schedules[s].after_forward(s)
        if reshards_after_forward(s, facts[s].call[0] in roots):
            reshard(s, after_forward=True)

    for call in calls:
        while open_calls and open_calls[-1].end < call.start:
            post_forward(open_calls.pop())
        s = call.state
        if open_calls and open_calls[-1].state is not s:
            nested_ends.setdefault(open_calls[-1].state, []).append(call.end)
        unshard_with_prefetch(s, schedules[s].before_forward(s), f"forward {names[s]}")
        open_calls.append(call)
    while open_calls:
        post_forward(open_calls.pop())

    # ----- backward -----------------------------------------------------------------------
    reducing: list[GroupHandle] = []
    pre_done: set[GroupHandle] = set()
    post_done: set[GroupHandle] = set()
    done_at: dict[GroupHandle, int] = {}
    for s in sizes:
        positions = [param_pos[id(p.parameter)] for p in facts[s].trainable]
        starts = [c.start for c in calls if c.state is s]
        # a group with trainable parameters also waits for the outputs of the calls nested in its forward
        done_at[s] = min(positions + nested_ends.get(s, [])) if positions else min(starts, default=0)

    def pre_backward(s: GroupHandle) -> None:
        if s in pre_done:
            return
        pre_done.add(s)
        unshard_with_prefetch(s, schedules[s].backward_targets(s), f"backward {names[s]}")

    def finish_reduce(s: GroupHandle, i: int) -> None:
        live.drop(("table", s, i))
        copy = sizes[s].sharded_grad_copies[i]
        if copy:
            live.add(("sharded_grad", s, i), copy, "")
            live.drop(("output", s, i))

    def post_backward(s: GroupHandle) -> None:
        if s in post_done:
            return
        post_done.add(s)
        size = sizes[s]
        if facts[s].reshard_after_backward:
            reshard(s, after_forward=False)
        if size.reduce_tables:
            where = f"reduce-scatter {names[s]}"
            for i, (table, output) in enumerate(zip(size.reduce_tables, size.reduce_outputs)):
                live.add(("rows", s, i), size.row_copies[i], where)
                live.add(("table", s, i), table, where)
                live.drop(("rows", s, i))
                if i == len(size.reduce_tables) - 1:
                    live.drop(("grads", s))
                live.add(("output", s, i), output, where)
                if not reduce_input_held:
                    live.drop(("table", s, i))
            reducing.append(s)
            while len(reducing) > reduce_limit:
                oldest = reducing.pop(0)
                for i in range(len(sizes[oldest].reduce_tables)):
                    finish_reduce(oldest, i)
        else:
            live.drop(("grads", s))

    last = max((c.end for c in calls), default=-1)
    by_end: dict[int, list[Call]] = {}
    for c in calls:
        by_end.setdefault(c.end, []).append(c)
    grads_at: dict[int, list[GroupHandle]] = {}
    for s in sizes:
        for p in facts[s].trainable:
            at = grads_at.setdefault(param_pos[id(p.parameter)], [])
            if s not in at:
                at.append(s)
    for k in range(last, -1, -1):
        for c in sorted(by_end.get(k, []), key=lambda c: c.start):
            pre_backward(c.state)
        for s in grads_at.get(k, []):
            grad_bytes = sum(
                p.unsharded_shape.numel() * p.gather_dtype.itemsize
                for p in facts[s].trainable
                if param_pos[id(p.parameter)] == k
            )
            live.add(("grads", s), grad_bytes, f"backward {names[s]}")
        for s in [s for s in sizes if done_at[s] == k]:
            if s in pre_done:
                post_backward(s)
    for s in sizes:
        if s in pre_done:
            post_backward(s)
    for s in reducing:
        for i in range(len(sizes[s].reduce_tables)):
            finish_reduce(s, i)
    return Replay(live.peak, live.where, live.total)
