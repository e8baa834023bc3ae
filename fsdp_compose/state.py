"""State is data: one GroupState per ``fully_shard`` call, one RootState shared by a tree.

Hooks (``fsdp_compose.hooks``) are plain functions that read and write these objects.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field

from torch import nn

from .group import ParamGroup


@dataclass(eq=False)
class GroupState:
    """Per-call state: the group, its options, and this step's backward bookkeeping."""

    module: nn.Module
    group: ParamGroup
    reshard_after_forward: bool
    reshard_after_backward: bool = True
    requires_gradient_sync: bool = True
    is_last_backward: bool = True
    root: RootState | None = None
    fqn: str = ""
    # per step, reset by the root's end-of-backward callback
    ran_forward_with_grad: bool = False
    pre_backward_done: bool = False
    post_backward_done: bool = False
    inputs_pending: int = 0
    grads_ready: set[int] = field(default_factory=set)

    @property
    def is_root(self) -> bool:
        return self.root is not None and self.root.root_state is self

    @property
    def label(self) -> str:
        """How errors name this group: FQN once known, else the class name."""
        name = self.fqn or "<root>" if self.root is not None else ""
        return f"'{name}' ({type(self.module).__name__})" if name else type(self.module).__name__

    def reset_backward(self) -> None:
        self.ran_forward_with_grad = False
        self.pre_backward_done = False
        self.post_backward_done = False
        self.inputs_pending = 0
        self.grads_ready.clear()


@dataclass(eq=False)
class RootState:
    """Shared by every group under one root: the groups in tree order, backward bookkeeping."""

    root_state: GroupState
    states: list[GroupState]
    in_backward: bool = False


# module -> its GroupState; sharded or original parameter -> the GroupState managing it.
_module_states: "weakref.WeakKeyDictionary[nn.Module, GroupState]" = weakref.WeakKeyDictionary()
_param_owners: "weakref.WeakKeyDictionary[nn.Parameter, GroupState]" = weakref.WeakKeyDictionary()


def state_of(module: nn.Module) -> GroupState | None:
    return _module_states.get(module)


def register_state(state: GroupState) -> None:
    _module_states[state.module] = state


def owner_of(param: nn.Parameter) -> GroupState | None:
    return _param_owners.get(param)


def register_owner(param: nn.Parameter, state: GroupState) -> None:
    _param_owners[param] = state
