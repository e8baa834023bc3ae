"""``explain(model)``: the sharding plan of a model, its traffic and its predicted memory.

Reads only local facts (``extras_api.group_facts``), so every rank can call it at any time without
communicating; ``sample_batch`` is the exception (it runs one
forward/backward, which every rank must do together).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from ...extras_api import (
    GroupFacts,
    GroupHandle,
    group_facts,
    group_of,
    groups_in,
    recorded_order,
    reshards_after_forward,
    unsharded_bytes,
)
from . import memory, plan
from .plan import GroupPlan
from .storage import StorageTracker

# optimizer state per parameter byte, for optimizers whose state is not created yet
_STATE_FACTORS: dict[str, Callable[[dict], float]] = {
    "AdamW": lambda g: 3.0 if g.get("amsgrad") else 2.0,
    "Adam": lambda g: 3.0 if g.get("amsgrad") else 2.0,
    "SGD": lambda g: 1.0 if g.get("momentum", 0) else 0.0,
    "Adagrad": lambda g: 1.0,
    "RMSprop": lambda g: 1.0 + (1.0 if g.get("momentum", 0) else 0.0) + (1.0 if g.get("centered") else 0.0),
    "Adamax": lambda g: 2.0,
    "NAdam": lambda g: 2.0,
    "RAdam": lambda g: 2.0,
}


@dataclass
class Totals:
    """Whole-model figures for this rank."""

    world_size: int  # ranks in a shard group (N)
    replicas: int  # HSDP replicas (1 without)
    groups: int
    params: int
    param_bytes: int  # P: the unsharded parameters in their all-gather dtypes
    all_gathers: int
    reduce_scatters: int
    all_reduces: int
    bytes_per_step: int  # all-gather outputs + reduce-scatter inputs + all-reduce tensors (CommStats)
    sent_per_step: int  # bytes each rank sends (ring): (N-1)/N of each collective, 2(R-1)/R for all-reduce
    minimum_sent: int  # 3 (N-1)/N P: two all-gathers and one reduce-scatter of the bare parameters
    sharded_param_bytes: int
    buffer_bytes: int
    optimizer_bytes: int
    optimizer_source: str  # 'measured' (state exists), or the assumed optimizer
    in_flight_peak_bytes: int  # unsharded groups, collective buffers and gradients at the peak
    peak_at: str  # when the peak happens
    gradient_bytes: int  # sharded gradients after backward
    predicted_peak_bytes: int  # sharded state + in flight, forward/backward (activations excluded)
    step_bytes: int  # at optimizer.step: parameters, gradients, optimizer state, buffers
    activation_bytes: int | None = None  # measured with sample_batch
    measured_peak_bytes: int | None = None  # measured with sample_batch (storages, this rank)
    optimizer_collectives: int = 0  # issued by optimizer.step() itself (whole-matrix owners), not in the above
    optimizer_collective_bytes: int = 0  # their inputs on this rank
    in_flight_at_peak: dict[str, int] = field(default_factory=dict)  # category -> bytes in flight at the peak


@dataclass
class Explanation:
    """The result of ``explain``: ``str()`` is the table, ``to_dict()`` the same as JSON-able data."""

    groups: list[GroupPlan] = field(default_factory=list)
    totals: Totals | None = None
    notes: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def summary(self) -> str:
        """A few lines: groups, traffic, predicted memory."""
        t = self.totals
        lines = [
            f"{t.groups} groups, {t.params:,} parameters ({fmt_bytes(t.param_bytes)} gathered), "
            f"shard group {t.world_size}" + (f" x {t.replicas} replicas" if t.replicas > 1 else ""),
            f"per step: {t.all_gathers} all-gathers, {t.reduce_scatters} reduce-scatters, {t.all_reduces} all-reduces, "
            f"{fmt_bytes(t.bytes_per_step)} counted; each rank sends {fmt_bytes(t.sent_per_step)} "
            f"(3(N-1)/N*P = {fmt_bytes(t.minimum_sent)}: every parameter gathered twice, reduced once)",
            f"predicted peak per rank {fmt_bytes(t.predicted_peak_bytes)}: "
            f"parameters {fmt_bytes(t.sharded_param_bytes)}"
            f" + optimizer state {fmt_bytes(t.optimizer_bytes)} ({t.optimizer_source})"
            f" + in flight {fmt_bytes(t.in_flight_peak_bytes)} (gathered groups, buffers, gradients) at {t.peak_at}"
            "; activations not included",
        ]
        if t.optimizer_collectives:
            lines.insert(2, f"optimizer.step(): {t.optimizer_collectives} collectives more, "
                         f"{fmt_bytes(t.optimizer_collective_bytes)} in from this rank "
                         "(matrices to their owners and back)")
        if t.measured_peak_bytes is not None:
            lines.append(
                f"measured with the sample batch: peak {fmt_bytes(t.measured_peak_bytes)}, "
                f"activations {fmt_bytes(t.activation_bytes)}"
            )
        return "\n".join(lines)

    def table(self) -> str:
        header = ["group", "params", "dtype", "sharded", "unsharded", "all-gather/step", "reduce/step",
                  "reshard", "prefetch fwd / bwd", "offload"]
        rows = [header]
        for g in self.groups:
            reduce = f"{g.reduce_scatters} x RS {fmt_bytes(g.reduce_scatter_bytes)}" if g.reduce_scatters else "-"
            if g.all_reduces:
                reduce += f" + {g.all_reduces} x AR {fmt_bytes(g.all_reduce_bytes)}"
            rows.append([
                g.name + (" (root)" if g.is_root else ""),
                f"{g.params:,}",
                g.dtypes,
                fmt_bytes(g.sharded_bytes),
                fmt_bytes(g.unsharded_bytes),
                f"{g.all_gathers} x {fmt_bytes(g.all_gather_bytes)}" if g.all_gathers else "-",
                reduce,
                "no (root)" if g.is_root and not g.reshard_after_forward else str(g.reshard_after_forward),
                f"{','.join(g.forward_prefetch) or '-'} / {','.join(g.backward_prefetch) or '-'}",
                "cpu" if g.offload else "-",
            ])
        widths = [max(len(r[i]) for r in rows) for i in range(len(header))]
        lines = ["  ".join(cell.ljust(w) for cell, w in zip(r, widths)).rstrip() for r in rows]
        lines.insert(1, "  ".join("-" * w for w in widths))
        return "\n".join(lines)

    def __str__(self) -> str:
        return "\n".join([self.table(), "", self.summary(), *self.notes])


def collective_bytes(model: nn.Module) -> int:
    """Bytes counted by every group's collectives so far (all-gather outputs, reduce-scatter
    inputs, all-reduce tensors; the convention of ``explain``'s ``bytes_per_step``). Local, no
    communication: the difference across a step is that step's traffic."""
    return sum(nbytes for _, handle in groups_in(model) for _, nbytes in group_facts(handle).traffic.values())


def fmt_bytes(n: int | None) -> str:
    if n is None:
        return "-"
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if abs(n) >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n} B"


def explain(
    model: nn.Module,
    optimizer: torch.optim.Optimizer | Sequence[torch.optim.Optimizer] | None = None,
    sample_batch: Any = None,
    loss_fn: Callable[[nn.Module, Any], torch.Tensor] | None = None,
) -> Explanation:
    """Describe how ``model`` is sharded: one row per ``fully_shard`` group, then totals.

    Works before or after the first step, on each rank, without communication. Per group: the
    module(s), parameter count, dtypes, bytes of this rank's shards and of the gathered
    parameters, all-gathers and reduce-scatters per step (bytes as ``CommStats`` counts them),
    reshard policy, prefetch targets and offload. Totals: bytes moved per step against the
    ``3 (N-1)/N * P`` minimum, and the predicted per-rank peak of sharded parameters, optimizer
    state (``optimizer``'s if it has state, else assumed from its type; AdamW when ``None``; a list of
    optimizers, such as Muon and AdamW, sums theirs; an optimizer with ``owned_state_bytes()`` and
    ``collectives_per_step()``, such as ``OwnerComputedMuon``, reports its own state and collectives)
    and the gradients, collective buffers and unsharded groups in flight at the prefetch and
    reduce limits. Activations are not predicted; pass ``sample_batch`` (every rank must) to
    run one forward/backward (``loss_fn(model, batch)``, default ``model(batch).sum()``) and
    measure them and the real peak with a storage tracker; gradients are restored afterwards.

    ``str(result)`` is the table; ``result.to_dict()`` is JSON-able.
    """
    found = groups_in(model)
    if not found:
        raise ValueError(
            f"explain({type(model).__name__}): no fully_shard group in this module; "
            f"call fully_shard first"
        )
    states = [s for _, s in found]
    facts = {s: group_facts(s) for s in states}
    roots_of = _roots(model, facts)
    roots = set(roots_of.values())
    first = facts[states[0]]
    names_by_module = plan.module_names(model)
    names = {s: plan.group_name(g, names_by_module) for s, g in facts.items()}
    calls, param_pos = memory.forward_calls(model, list(facts.values()))
    orders: dict[GroupHandle, list[GroupHandle]] = {r: [] for r in roots}  # forward order under each root
    for c in calls:
        if c.state not in orders[roots_of[c.state]]:
            orders[roots_of[c.state]].append(c.state)
    for r in roots:
        recorded = recorded_order(r)
        if recorded:
            orders[r] = [s for s in recorded if s in names]

    sizes = {s: plan.sizes_of(g) for s, g in facts.items()}
    like = "gloo" if first.backend == "gloo" else "nccl"
    gradients = {id(p.parameter): p.had_gradient for g in facts.values() for p in g.trainable}
    gradients = {key: had for key, had in gradients.items() if had is not None}  # none before a first step
    schedules = memory.schedules_after_first_step(roots_of, orders, first.prefetch_limit)
    result = memory.replay(
        calls, param_pos, sizes, names, roots, schedules, first.reduce_limit, facts, like, gradients
    )
    groups = []
    for s, g in facts.items():
        is_root = g.call[0] in roots
        groups.append(
            plan.plan_group(
                g,
                names[s],
                reshards_after_forward(s, is_root),
                is_root,
                [names[t] for t in schedules[s].forward_targets(s)],
                [names[t] for t in schedules[s].backward_targets(s)],
            )
        )
    optimizers = list(optimizer) if isinstance(optimizer, (list, tuple)) else [optimizer]
    counted = [_optimizer_bytes(list(facts.values()), opt) for opt in optimizers]
    optimizer_bytes, source = sum(n for n, _ in counted), " + ".join(src for _, src in counted)
    totals = _totals(model, list(facts.values()), groups, optimizer_bytes, source, result)
    totals.optimizer_collectives, totals.optimizer_collective_bytes = _optimizer_collectives(optimizers)
    explanation = Explanation(groups, totals, _notes(recorded_order(states[0])))
    if sample_batch is not None:
        _measure(model, sample_batch, loss_fn, explanation)
    return explanation


def _roots(model: nn.Module, facts: dict[GroupHandle, GroupFacts]) -> dict[GroupHandle, GroupHandle]:
    """Each group's root: the one lazy init chose, or before it, the outermost group above it
    (the first forward of a group with no root makes it the root of its subtree)."""
    roots: dict[GroupHandle, GroupHandle] = {}
    stack: list[tuple[nn.Module, GroupHandle | None]] = [(model, None)]
    while stack:
        module, above = stack.pop()
        handle = group_of(module)
        if handle in facts:
            above = above or handle
            chosen = facts[handle].root
            for s in facts[handle].call:  # a call's groups on other meshes share its root
                roots.setdefault(s, chosen if chosen is not None else above)
        stack.extend((child, above) for child in reversed(list(module.children())))
    return roots


def _optimizer_collectives(optimizers: list[Any]) -> tuple[int, int]:
    """Collectives an optimizer's own ``step()`` issues (``collectives_per_step()``: calls, bytes), summed."""
    calls = nbytes = 0
    for optimizer in optimizers:
        per_step = getattr(optimizer, "collectives_per_step", None)
        if callable(per_step):
            c, n = per_step()
            calls, nbytes = calls + c, nbytes + n
    return calls, nbytes


def _optimizer_bytes(groups: list[GroupFacts], optimizer: torch.optim.Optimizer | None) -> tuple[int, str]:
    owned = getattr(optimizer, "owned_state_bytes", None)
    if callable(owned):  # whole-matrix owners: the state this rank holds is not its shards' share
        return owned(), f"{type(optimizer).__name__}: {'measured' if optimizer.state else 'planned'}, owned matrices"
    params = [p for g in groups for p in g.trainable]
    local_bytes = {id(p.parameter): p.local_bytes for p in params}
    if optimizer is not None and optimizer.state:
        total = 0
        for param, param_state in optimizer.state.items():
            if id(param) not in local_bytes:
                continue
            for value in param_state.values():
                if isinstance(value, torch.Tensor):
                    local = value._local_tensor if hasattr(value, "_local_tensor") else value
                    total += local.numel() * local.element_size()
        return total, "measured"
    if optimizer is None:
        factor, name, step_bytes = 2.0, "AdamW assumed", 4
        return int(sum(local_bytes.values()) * factor) + step_bytes * len(params), name
    name = type(optimizer).__name__
    total = 0
    for group in optimizer.param_groups:
        factor = _STATE_FACTORS.get(name, lambda g: 2.0)(group)
        for param in group["params"]:
            if id(param) in local_bytes:
                total += int(local_bytes[id(param)] * factor) + (4 if name not in ("SGD",) else 0)
    known = name in _STATE_FACTORS
    return total, f"{name} assumed" if known else f"{name}: 2 states per parameter assumed"


def _totals(model, facts: list[GroupFacts], groups, optimizer_bytes, source, result) -> Totals:
    world, replicas = facts[0].world, facts[0].replicas
    param_bytes = sum(p.shape.numel() * p.gather_dtype.itemsize for f in facts for p in f.params)
    sharded = sum(g.sharded_bytes for g in groups)
    managed = {id(p.parameter) for f in facts for p in f.params}
    buffers = sum(b.numel() * b.element_size() for b in model.buffers())
    unmanaged = sum(p.numel() * p.element_size() for p in model.parameters() if id(p) not in managed)
    static = sharded + unmanaged + buffers + optimizer_bytes
    return Totals(
        world_size=world,
        replicas=replicas,
        groups=len(groups),
        params=sum(g.params for g in groups),
        param_bytes=param_bytes,
        all_gathers=sum(g.all_gathers for g in groups),
        reduce_scatters=sum(g.reduce_scatters for g in groups),
        all_reduces=sum(g.all_reduces for g in groups),
        bytes_per_step=sum(g.all_gather_bytes + g.reduce_scatter_bytes + g.all_reduce_bytes for g in groups),
        sent_per_step=sum(g.sent_bytes for g in groups),
        minimum_sent=round(3 * (world - 1) / world * param_bytes),
        sharded_param_bytes=sharded + unmanaged,
        buffer_bytes=buffers,
        optimizer_bytes=optimizer_bytes,
        optimizer_source=source,
        in_flight_peak_bytes=result.peak,
        peak_at=result.where,
        gradient_bytes=result.after_backward,
        predicted_peak_bytes=static + result.peak,
        step_bytes=static + result.after_backward,
        in_flight_at_peak=result.at_peak,
    )


def _notes(recorded: list) -> list[str]:
    if not recorded:
        return ["(before the first step: order and prefetch follow module definition order; "
                "the first step records the real order)"]
    return []


def _measure(model: nn.Module, batch: Any, loss_fn, explanation: Explanation) -> None:
    """One forward/backward under a storage tracker; gradients are put back as they were."""
    loss_fn = loss_fn or (lambda m, b: m(b).sum())
    params = list(model.parameters())
    saved = [p.grad for p in params]
    for p in params:
        p.grad = None
    handles = [s for _, s in groups_in(model)]
    tracker = StorageTracker()
    tracker.track(params)
    tracker.track(b for b in model.buffers())
    try:
        with tracker:
            unsharded_before = unsharded_bytes(handles)
            before = tracker.current
            loss = loss_fn(model, batch)
            unsharded = unsharded_bytes(handles) - unsharded_before
            activations = max(0, tracker.current - before - unsharded)
            loss.backward()
            del loss
    finally:
        for p, g in zip(params, saved):
            p.grad = g
    t = explanation.totals
    t.activation_bytes = activations
    t.measured_peak_bytes = tracker.peak + t.optimizer_bytes
