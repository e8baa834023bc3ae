"""Find the ``fully_shard`` groups under a module, and put idle groups back in sharded form.

State-dict, checkpoint, summon and clipping helpers act on whole models; they all start here.
"""

from __future__ import annotations

from torch import nn

from .._runtime.state import IN_BACKWARD, GroupState, states_in


def group_states(module: nn.Module) -> list[GroupState]:
    """Every group with a module in ``module``'s subtree, in tree order."""
    return [s for _, s in states_in(module)]


def check_idle(state: GroupState, action: str) -> None:
    """Refuse whole-model operations in the middle of backward, where shards are in flux."""
    if state.root is not None and state.root.phase == IN_BACKWARD:
        raise RuntimeError(f"{action} cannot run during backward (group {state.group.label})")


def reshard_idle(module: nn.Module, action: str) -> None:
    """Free unsharded parameters left by a forward without backward (e.g. the root's).

    Afterwards ``named_parameters()`` yields the sharded DTensors the optimizer holds; a pending
    backward simply all-gathers again, as it does after ``reshard_after_forward``.
    """
    for state in group_states(module):
        check_idle(state, action)
        state.group.reshard()  # also finishes a pending gather and drops a post-forward slice
