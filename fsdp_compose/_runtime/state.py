"""State is data: one GroupState per ``fully_shard`` call, one RootState shared by a tree.

Hooks (``fsdp_compose.hooks``) are plain functions that read and write these objects.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import IntEnum

from torch import nn

from .group import ParamGroup
from .._checks.order import CollectiveLogs
from .settings import GroupSettings


class StepPhase(IntEnum):
    """How far one group is in this step; only moves forward (a post-backward waits for every use
    of the group's forward to finish backward), back to ``IDLE`` when the root's backward ends."""

    IDLE = 0
    FORWARD = 1  # ran a forward with grad enabled: a backward will follow
    PRE_BACKWARD = 2  # its parameters were unsharded for backward
    POST_BACKWARD = 3  # its gradients were reduced (or stashed, without sync) and it resharded


IDLE, FORWARD, PRE_BACKWARD, POST_BACKWARD = StepPhase  # plain names for the hooks' hot path


class RootPhase(IntEnum):
    """Where a root's step is: forward, then backward passes (several for a chunked loss); the
    step ends at the root's next forward after a backward."""

    STEP_FORWARD = 0  # no backward ended yet this step
    IN_BACKWARD = 1  # a backward runs: a forward now is activation checkpointing's recomputation
    AFTER_BACKWARD = 2  # a backward ended: the root's next forward begins a new step


STEP_FORWARD, IN_BACKWARD, AFTER_BACKWARD = RootPhase


@dataclass(eq=False)
class GroupState:
    """Per-call state: the group, its settings, and this step's backward bookkeeping."""

    modules: list[nn.Module]  # every module of the call (a list for fully_shard([a, b]))
    group: ParamGroup
    settings: GroupSettings  # the group's too (``group.settings``): fully_shard's options and the setters'
    root: RootState | None = None
    is_root: bool = False  # the root module's state (or one of its companions); set by lazy init
    # per step, reset by the root's end-of-backward callback
    phase: StepPhase = IDLE
    inputs_pending: int = 0  # forward uses whose inputs' gradients backward has not reached yet
    # grad-requiring outputs of groups called inside this one's forward whose gradients backward has not
    # completed: until then this group's own nodes that consume them still need its weights
    nested_pending: int = 0
    grads_ready: set[int] = field(default_factory=set)
    # gathered while a gradient-only backward created a graph (hooks/backward.py): that graph holds the
    # unsharded parameters, so they stay until the step's backward ends
    held_by_graph: bool = False
    # a call whose shard_placement_fn put parameters on several meshes has one state per mesh: the
    # first (registered on the modules) lists the others, which point back to it; each has its own hooks
    companions: list[GroupState] = field(default_factory=list)
    primary: GroupState | None = None
    # what fully_shard could only judge later (weights_check.py): run by the root's lazy init with the module's
    # name in the model, each raising on every rank; kept until one first forward passes them
    first_forward_checks: list[Callable[[str], None]] = field(default_factory=list)

    @property
    def module(self) -> nn.Module:
        """The first module of the call: errors and FQNs name it."""
        return self.modules[0]

    @property
    def mesh_text(self) -> str:
        """Which mesh this group is on, for a call with groups on several meshes (``ShardPlacementResult``)."""
        if not self.companions and self.primary is None:
            return ""
        mesh = self.group.mesh
        names = mesh.mesh_dim_names or tuple(f"dim{i}" for i in range(mesh.ndim))
        return " on mesh (" + ", ".join(f"{n}={size}" for n, size in zip(names, mesh.mesh.shape)) + ")"

    @property
    def call_states(self) -> list[GroupState]:
        """Every state of this ``fully_shard`` call: this one and its companions (one per mesh)."""
        return [self, *self.companions]


@dataclass(eq=False)
class RootState:
    """Shared by every group under one root: the groups in tree order, backward bookkeeping."""

    root_module_state: GroupState  # the root module's own state (each GroupState.root points back here)
    states: list[GroupState]
    phase: RootPhase = STEP_FORWARD
    prefetch_limit: int = 1  # all-gathers in flight ahead of the running group
    reduce_limit: int = 2  # reduce-scatters in flight before the oldest is waited for
    reducing: list[GroupState] = field(default_factory=list)
    # reduce-scatters prepared but not issued yet: on gloo they wait for the next order check (schedule.py)
    unissued: list[tuple[GroupState, list]] = field(default_factory=list)
    # execution order (see schedule.py)
    forward_order: dict[GroupState, None] = field(default_factory=dict)  # first calls, in order
    post_forward_order: list[GroupState] = field(default_factory=list)
    post_forward_index: dict[GroupState, int] = field(default_factory=dict)  # position in post_forward_order
    # the calls (first states) whose forward runs now, outermost first: a call's outputs count for the one below
    open_calls: list[GroupState] = field(default_factory=list)
    reference_forward_order: list[GroupState] | None = None
    reference_index: dict[GroupState, int] = field(default_factory=dict)
    reference_final: bool = False  # the first step ended: later steps are compared with its order
    warned_order_change: bool = False
    # every process group's collective log (_checks/order.py): closed on gloo before each collective, else at backward end
    collective_logs: CollectiveLogs = field(default_factory=CollectiveLogs)
    # a gradient-only backward with create_graph=True runs (hooks/backward.py); a parameter accumulated in it
    graph_only: bool = False
    accumulated_in_graph_only: bool = False
    # the step's backward runs with create_graph=True: its reduced gradients get a graph that refuses a backward
    creates_graph: bool = False

    def label_of(self, uid: int) -> str:
        """Name a group by the id order checks carry (ids agree across ranks; messages name other ranks' groups)."""
        return next((s.group.label for s in self.states if s.group.uid == uid), f"<unknown group {uid}>")


# module -> its GroupState. Parameters are marked with an attribute instead of a weak-keyed
# registry: torch.utils.swap_tensors (used by module.to_empty) refuses tensors with weakrefs.
# The values are weak too: a state holds its modules (``GroupState.modules``), and a strong value would keep
# its key alive for ever (every sharded model leaked). The module holds its state through its hooks.
_module_states: weakref.WeakKeyDictionary[nn.Module, weakref.ref[GroupState]] = weakref.WeakKeyDictionary()
_NO_STATE = lambda: None  # noqa: E731 - what an unregistered module's entry reads as
_OWNER_ATTR = "_fsdp_compose_owner"
_UNOWNED = (lambda: None, None)  # the mark a parameter no group owns reads as
# set in the own namespace of FSDPModule and of the subclasses fully_shard swaps in: names skip them
INTERFACE_MARK = "_fsdp_compose_interface"


def user_class(cls: type) -> type:
    """The user's class behind ``cls``: the first in its MRO that is not an FSDP interface class."""
    return next((c for c in cls.__mro__ if INTERFACE_MARK not in c.__dict__), cls)


def class_name(module: nn.Module) -> str:
    """The user's class name, not the FSDP subclass swapped in by fully_shard."""
    return user_class(type(module)).__name__


def state_of(module: nn.Module) -> GroupState | None:
    return _module_states.get(module, _NO_STATE)()


def states_in(module: nn.Module) -> list[tuple[str, GroupState]]:
    """Every group in ``module``'s subtree with the name of its first module, in tree order.

    A group of several modules (``fully_shard([a, b])``) is listed once; a call's groups on other
    meshes follow its first.
    """
    found, seen = [], set()
    for name, m in module.named_modules():
        state = _module_states.get(m, _NO_STATE)()
        if state is not None and state not in seen:
            seen.add(state)
            found.extend((name, s) for s in state.call_states)
    return found


def register_state(state: GroupState) -> None:
    """Register a call's first state on its modules (its companions are reached through it)."""
    for module in state.modules:
        _module_states[module] = weakref.ref(state)


def owner_of(param: nn.Parameter) -> GroupState | None:
    return getattr(param, _OWNER_ATTR, _UNOWNED)[0]()


def replaced_at(param: nn.Parameter) -> str | None:
    """The name ``param`` had in its group if ``fully_shard`` replaced it by its shard (nothing uses it since)."""
    return getattr(param, _OWNER_ATTR, _UNOWNED)[1]


def register_owner(param: nn.Parameter, state: GroupState, replaced_at: str | None = None) -> None:
    """Mark ``param`` as ``state``'s: a shard, or (``replaced_at``: its name) an original it replaced."""
    setattr(param, _OWNER_ATTR, (weakref.ref(state), replaced_at))
