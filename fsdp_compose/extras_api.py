"""What the extras (``fsdp_compose/extras/``, ``fsdp_compose_shm``) may use of the core besides its public names.

Facts, not runtime objects: ``group_facts`` describes a group as frozen data (``GroupFacts``, ``ParamFacts``,
``ReductionFacts``), read without side effects, so the runtime's classes can change behind it. A group is named
by a ``GroupHandle``: an opaque key (identity-hashed, one per group) that the functions here accept and that
shows nothing of the group. Besides the facts, a few verbs: ``write_full`` (deferred init writes a parameter's
full value into its shard), ``ScratchSchedule`` (``explain`` replays a step on the runtime's own schedule
functions, on scratch state, never a model's), ``unsharded_bytes`` and ``unsharded_parameters`` (what a measured
step holds unsharded), and, exported as the core names them: ``raise_together`` (every rank raises the same
error, or none does), putting idle groups back in sharded form (``reshard_idle``), a parameter's gather codec
(``set_gather_codec``), the row geometry (``row_layout``), the user's class behind ``fully_shard``'s subclass (``user_class``), and
for a transport (``fsdp_compose_shm``) the default
collectives it falls back to and how a collective is issued and waited. Names with a leading underscore are the
port's own; the extras use none (``tests/meta/test_architecture.py`` checks). Whatever an extra needs of the
core is added here.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field

import torch
from torch import nn

from ._checks.agreement import raise_together
from ._runtime import schedule as _schedule
from ._runtime.collectives import (
    ASYNC_ALL_GATHER,
    COMPLETED,
    DIRECT_ALL_GATHER,
    DIRECT_REDUCE_SCATTER,
    GATHER_METHOD,
    wait_named,
)
from ._runtime.extensions import has_protocol as _has_protocol, set_gather_codec
from ._runtime.group import divide_factors as _divide_factors
from ._runtime.params import ShardedParam as _ShardedParam
from ._runtime.rows import row_layout
from ._runtime.state import (
    GroupState as _GroupState,
    RootState as _RootState,
    owner_of as _owner_of,
    state_of as _state_of,
    states_in as _states_in,
    user_class,
)
from .whole_model.model_groups import reshard_idle


@dataclass(frozen=True, eq=False, repr=False)
class GroupHandle:
    """A group as the extras name it: a key the functions here accept, compared and hashed by identity (one per
    group while any is held). It shows nothing of the group: ``group_facts(handle)`` says what the group is."""

    _state: _GroupState

    def __repr__(self) -> str:
        return f"GroupHandle({self._state.group.label})"


# a group's handle while one is held, by the group's id: the handle keeps its group alive, so no id is reused
_handles: weakref.WeakValueDictionary[int, GroupHandle] = weakref.WeakValueDictionary()


def _handle(state: _GroupState) -> GroupHandle:
    handle = _handles.get(id(state))
    if handle is None or handle._state is not state:
        handle = _handles[id(state)] = GroupHandle(state)
    return handle


@dataclass(frozen=True)
class ParamFacts:
    """One managed parameter as this rank holds it."""

    fqn: str
    parameter: nn.Parameter  # the sharded parameter the module and the optimizer hold
    modules: tuple[nn.Module, ...]  # where it is registered
    shape: torch.Size  # global
    unsharded_shape: torch.Size  # what the module sees unsharded: global, or TP-local under tensor parallel
    dtype: torch.dtype  # the shard's
    gather_dtype: torch.dtype
    reduce_dtype: torch.dtype
    requires_grad: bool
    tensor_parallel: bool  # also split by tensor parallelism (a DTensor on a TP mesh)
    padded_numel: int  # elements one rank sends per all-gather of a plain shard (``RowLayout``)
    local_numel: int
    local_bytes: int  # this rank's shard
    gather_bytes: int  # what this rank sends per all-gather (a codec's wire bytes; the protocol's last inputs)
    quantized: bool  # sent through a codec (``set_gather_codec``), dequantized into the gather dtype
    offloaded: bool  # the shard lives on the CPU, the unsharded parameter on the accelerator
    had_gradient: bool | None = None  # whether this rank had a gradient of it at its last reduction (None: none yet)


@dataclass(frozen=True)
class ReductionFacts:
    """One reduce-scatter of a group per step: a reduce dtype's trainable parameters (the runtime's plan)."""

    dtype: torch.dtype
    params: tuple[ParamFacts, ...]
    row_bytes: int  # every rank's row of the table: padded gradients and a has-gradient flag each
    pre_divide: float  # ``divide_factors``: before the sum
    post_divide: float  # and after it


@dataclass(frozen=True)
class GroupFacts:
    """One group (the parameters of a ``fully_shard`` call on one mesh) as this rank sees it."""

    handle: GroupHandle = field(repr=False)
    modules: tuple[nn.Module, ...]
    call: tuple[GroupHandle, ...] = field(repr=False)  # every group of the same call (one per mesh)
    root: GroupHandle | None = field(repr=False)  # the root group lazy init chose; None before it ran
    label: str  # how errors name it
    mesh_text: str  # which mesh, for a call with groups on several meshes
    params: tuple[ParamFacts, ...]
    world: int  # ranks of the shard group
    replicas: int  # HSDP replicas (1 without)
    hsdp: bool  # a 2-D mesh: an all-reduce follows each reduce-scatter
    backend: str
    gather_widths: tuple[int, ...]  # bytes per rank of each column of the all-gather
    post_forward_ranks: int | None  # reshard_after_forward=<int>: the ranks a slice is kept within
    reductions: tuple[ReductionFacts, ...]
    reshard_after_forward: bool
    reshard_after_backward: bool
    requires_gradient_sync: bool
    requires_all_reduce: bool
    # the root's, or the defaults before the first forward
    prefetch_limit: int
    reduce_limit: int
    # collectives so far: (calls, bytes) per kind, bytes as ``CommStats`` counts them
    traffic: dict[str, tuple[int, int]] = field(compare=False)

    @property
    def trainable(self) -> tuple[ParamFacts, ...]:
        return tuple(p for p in self.params if p.requires_grad)


def _gather_bytes(p: _ShardedParam) -> int:
    """What ``p`` sends per all-gather, without running anything: the protocol's widths once it chose its
    inputs; a codec's wire bytes before its first gather; else the padded shard in the gather dtype.
    A subclass's own protocol is counted as plain bytes until its first unshard."""
    if p.extension is not None:
        return sum(p.form.widths())
    local = p.local_tensor()
    if p.wire is not None and not _has_protocol(local, f"the shard of parameter '{p.fqn}'"):
        return p.wire.wire_nbytes(p.row_layout.padded_numel)
    return p.row_layout.padded_numel * p.layout.gather_dtype.itemsize


def _param_facts(p: _ShardedParam) -> ParamFacts:
    local = p.local_tensor()
    return ParamFacts(
        fqn=p.fqn,
        parameter=p.sharded_param,
        modules=tuple(place.module for place in p.places),
        shape=p.shape,
        unsharded_shape=p.row_layout.shape,
        dtype=p.dtype,
        gather_dtype=p.layout.gather_dtype,
        reduce_dtype=p.layout.reduce_dtype,
        requires_grad=p.requires_grad,
        tensor_parallel=p.tp_spec is not None,
        padded_numel=p.row_layout.padded_numel,
        local_numel=p.row_layout.local_numel,
        local_bytes=local.numel() * local.element_size(),
        gather_bytes=_gather_bytes(p),
        quantized=p.extension.codec is not None if p.extension is not None else p.wire is not None,
        offloaded=p.layout.offloaded,
        had_gradient=p.had_gradient,
    )


def _backend(process_group) -> str:
    try:
        return str(torch.distributed.get_backend(process_group))
    except (RuntimeError, ValueError):
        return "unknown"


def group_facts(handle: GroupHandle) -> GroupFacts:
    """The facts of one group, read now."""
    state = handle._state
    group, settings, root = state.group, state.settings, state.root
    params = {p: _param_facts(p) for p in group.params}
    reductions = tuple(
        ReductionFacts(
            r.dtype,
            tuple(params[p] for p in r.params),
            r.row_bytes,
            *_divide_factors(r.dtype, group.world_size, group.dp_size, settings.gradient_divide_factor),
        )
        for r in group.reduce_plan()
    )
    defaults = _RootState.__dataclass_fields__
    stats = group.stats
    return GroupFacts(
        handle=handle,
        modules=tuple(state.modules),
        call=tuple(_handle(s) for s in (state.primary or state).call_states),
        root=None if root is None else _handle(root.root_module_state),
        label=group.label,
        mesh_text=state.mesh_text,
        params=tuple(params.values()),
        world=group.world_size,
        replicas=group.dp_size // group.world_size,
        hsdp=group.replicate_group is not None,
        backend=_backend(group.process_group),
        gather_widths=tuple(group.layout.sizes),
        post_forward_ranks=None if group.post_forward is None else group.post_forward.ranks,
        reductions=reductions,
        reshard_after_forward=settings.reshard_after_forward,
        reshard_after_backward=settings.reshard_after_backward,
        requires_gradient_sync=settings.requires_gradient_sync,
        requires_all_reduce=settings.requires_all_reduce,
        prefetch_limit=defaults["prefetch_limit"].default if root is None else root.prefetch_limit,
        reduce_limit=defaults["reduce_limit"].default if root is None else root.reduce_limit,
        traffic={
            "all-gather": (stats.all_gathers, stats.all_gather_bytes),
            "reduce-scatter": (stats.reduce_scatters, stats.reduce_scatter_bytes),
            "all-reduce": (stats.all_reduces, stats.all_reduce_bytes),
        },
    )


def groups_in(module: nn.Module) -> list[tuple[str, GroupHandle]]:
    """Every group in ``module``'s subtree with the name of its first module, in tree order."""
    return [(name, _handle(state)) for name, state in _states_in(module)]


def group_of(module: nn.Module) -> GroupHandle | None:
    """The group of ``module``'s ``fully_shard`` call (its first, for a call on several meshes), if any."""
    state = _state_of(module)
    return None if state is None else _handle(state)


def owner_of(parameter: nn.Parameter) -> GroupHandle | None:
    """The group that manages ``parameter`` (its shard, or an original it replaced), if any."""
    state = _owner_of(parameter)
    return None if state is None else _handle(state)


def recorded_order(handle: GroupHandle) -> list[GroupHandle]:
    """The forward order the first step recorded in ``handle``'s tree; empty before it."""
    root = handle._state.root
    order = [] if root is None else root.reference_forward_order or []
    return [_handle(s) for s in order]


def unsharded_bytes(handles: list[GroupHandle]) -> int:
    """Bytes the groups hold for unsharded use now: gathered parameters, or post-forward slices."""
    return sum(h._state.group.unsharded_nbytes() for h in handles)


def unsharded_parameters(handle: GroupHandle) -> list[nn.Parameter]:
    """The unsharded parameters of a group built so far (a measured step labels their storage)."""
    return [p.unsharded_param for p in handle._state.group.params if p.unsharded_param is not None]


@torch.no_grad()
def write_full(parameter: nn.Parameter, full: torch.Tensor) -> None:
    """Write ``full``, the global value of the managed ``parameter`` (its sharded parameter), into this
    rank's shard: ``init_sharded_parameters`` initializes at full size, then keeps this rank's rows."""
    state = _owner_of(parameter)
    p = next((p for p in state.group.params if p.sharded_param is parameter), None) if state is not None else None
    if p is None:
        raise ValueError("write_full: the parameter is not a shard fully_shard manages")
    p.local_tensor().copy_(p.shard_of(full))


def reshards_after_forward(handle: GroupHandle, is_root: bool) -> bool:
    """Whether forward frees the group's parameters, as the runtime decides it for a root or another group."""
    return _schedule.reshards_after_forward(handle._state, is_root)


class ScratchSchedule:
    """The runtime's own schedule functions (``_runtime/schedule.py``) on a scratch root, for ``explain``'s replay
    of a step after the first: built with the first step's ``order`` of ``groups`` under ``root``, so the
    replayed prefetches cannot drift from what training does. Never touches a model's schedule."""

    def __init__(self, root: GroupHandle, groups: list[GroupHandle], order: list[GroupHandle], prefetch_limit: int):
        self._root = _RootState(root._state, [h._state for h in groups], prefetch_limit=prefetch_limit)
        for handle in order:
            _schedule.record_pre_forward(self._root, handle._state)
        _schedule.end_backward(self._root)  # the reference order; the replay's first record ends the first step

    def before_forward(self, handle: GroupHandle) -> list[GroupHandle]:
        """Record ``handle``'s forward; its forward prefetch targets."""
        _schedule.record_pre_forward(self._root, handle._state)
        return self.forward_targets(handle)

    def forward_targets(self, handle: GroupHandle) -> list[GroupHandle]:
        return [_handle(s) for s in _schedule.forward_prefetch_targets(self._root, handle._state)]

    def after_forward(self, handle: GroupHandle) -> None:
        _schedule.record_post_forward(self._root, handle._state)

    def backward_targets(self, handle: GroupHandle) -> list[GroupHandle]:
        return [_handle(s) for s in _schedule.backward_prefetch_targets(self._root, handle._state)]
