"""Execution order, prefetch targets, and issuing the prefetches.

A step ends at the root's next forward after a backward (several backward passes are one step).
Forward prefetch follows the first step's order (a later step that differs is reported once);
backward prefetch follows the post-forward order since the previous backward, reversed.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterable

from .group import PendingReduce
from .state import AFTER_BACKWARD, IDLE, STEP_FORWARD, GroupState, RootState


def reshards_after_forward(state: GroupState, is_root: bool | None = None) -> bool:
    """Whether forward frees the group's parameters: not at the root unless the user asked for it.

    Backward needs the root's parameters first, so by default it keeps them gathered.
    """
    is_root = state.is_root if is_root is None else is_root
    return bool(state.settings.reshard_after_forward) and (state.settings.reshard_after_forward_chosen or not is_root)


def reset_backward(state: GroupState) -> None:
    """The group's backward bookkeeping back to the start of a step."""
    state.phase = IDLE
    state.inputs_pending = 0
    state.grads_ready.clear()


def record_pre_forward(root: RootState, state: GroupState) -> None:
    if state is root.root_module_state and root.phase == AFTER_BACKWARD:
        end_step(root)
    root.forward_order.setdefault(state)


def record_post_forward(root: RootState, state: GroupState) -> None:
    if state not in root.post_forward_index:
        root.post_forward_index[state] = len(root.post_forward_order)
        root.post_forward_order.append(state)


def forward_prefetch_targets(root: RootState, state: GroupState) -> list[GroupState]:
    if state.settings.forward_prefetch is not None:
        return state.settings.forward_prefetch
    index = root.reference_index.get(state)
    if index is None:
        return []
    return root.reference_forward_order[index + 1 : index + 1 + root.prefetch_limit]


def backward_prefetch_targets(root: RootState, state: GroupState) -> list[GroupState]:
    if state.settings.backward_prefetch is not None:
        return state.settings.backward_prefetch
    index = root.post_forward_index.get(state)
    if index is None:
        return []
    return root.post_forward_order[max(0, index - root.prefetch_limit) : index][::-1]


def end_backward(root: RootState) -> None:
    """A backward pass ended; the step goes on until the root's next forward (more backward
    passes may follow). While the first step runs, its order so far is the reference."""
    root.phase = AFTER_BACKWARD
    if not root.reference_final and root.forward_order:
        _set_reference(root, root.forward_order)
    root.post_forward_order = []
    root.post_forward_index = {}


def release_held(root: RootState, always: bool = False) -> None:
    """Reshard the groups a created graph held (hooks/backward.py's ``begin_graph_only``): the backward that
    used the graph is over (as ``reshard_after_backward`` says), or the step is (``always``)."""
    for state in root.states:
        if state.held_by_graph:
            state.held_by_graph = False
            if always or state.settings.reshard_after_backward:
                state.group.reshard()


def end_step(root: RootState, failed: bool = False) -> None:
    """Keep the first step's order as the reference; warn once if a later step's differs.

    A ``failed`` step (``reset_iter_state``, after an exception) is dropped instead: every group
    finishes its in-flight collectives and reshards, and the step's orders and bookkeeping go."""
    order = list(root.forward_order)
    root.phase = STEP_FORWARD
    release_held(root, always=True)  # a graph created for a backward that never came: let its groups go
    if failed:
        root.unissued.clear()
        for s in root.states:
            s.group.discard_step()
            reset_backward(s)
        root.reducing.clear()
        root.post_forward_order = []
        root.post_forward_index = {}
    elif order:
        if not root.reference_final:
            _set_reference(root, order)
            root.reference_final = True
        elif order != root.reference_forward_order and not root.warned_order_change:
            root.warned_order_change = True
            first = next(
                (i for i, (a, b) in enumerate(zip(order, root.reference_forward_order)) if a is not b),
                min(len(order), len(root.reference_forward_order)),
            )
            warnings.warn(
                "fsdp_compose: the forward order of sharded modules differs from the first iteration "
                f"at position {first} ({_name(order, first)} instead of "
                f"{_name(root.reference_forward_order, first)}); forward prefetch follows the first "
                "order, so overlap may suffer",
                stacklevel=2,
            )
    root.forward_order = {}


def _set_reference(root: RootState, order: Iterable[GroupState]) -> None:
    root.reference_forward_order = list(order)
    root.reference_index = {s: i for i, s in enumerate(order)}


def _name(order: list[GroupState], index: int) -> str:
    return order[index].group.label if index < len(order) else "<end>"


def queue_reductions(root: RootState, state: GroupState, reductions: list[PendingReduce]) -> None:
    """Issue ``state``'s reduce-scatters now, or, while a gloo round holds logged ones, after it closes: the
    next all-gather's order check (``issue_reductions`` follows it) or the end of backward covers them.
    See [Note: gloo reduce-scatter deferral]."""
    root.unissued.append((state, reductions))
    if not root.collective_logs.awaiting():
        issue_reductions(root, flush=False)  # no round to close: no second scan of the collective logs


# [Note: gloo reduce-scatter deferral]
# On gloo each collective is logged in its process group's collective log (``_checks/order.py``) and the round is closed,
# an agreement among the ranks, before the collective is issued: ranks that disagree raise
# ``ExecutionOrderError`` instead of hanging inside it. A reduce-scatter's round is left open, so that the next
# order check on its process group (the next all-gather's, or ``CollectiveLogs.flush`` at the end of backward) covers
# both in one agreement; until that round closes, the reduce-scatter waits here in ``root.unissued``. Off gloo
# the rounds close at the end of backward and reduce-scatters are issued at once.


def issue_reductions(root: RootState, flush: bool = True) -> None:
    """Close the rounds the queued reduce-scatters were logged in (gloo), issue them, and wait for the oldest
    reductions beyond the limit (it bounds their memory). See [Note: gloo reduce-scatter deferral]."""
    if not root.unissued:
        return
    if flush:
        root.collective_logs.flush()
    queued, root.unissued = root.unissued, []
    for state, reductions in queued:
        for reduction in reductions:
            state.group.issue_reduce(reduction)
        root.reducing.append(state)
        limit = state.settings.reduce_buffers or root.reduce_limit
        while len(root.reducing) > limit:
            root.reducing.pop(0).group.wait_reduces()


def wait_all_reductions(root: RootState) -> None:
    """Finish every group's reductions in flight (most finished long ago)."""
    for state in root.states:
        if state.group.pending_reduces:
            state.group.wait_reduces()
    root.reducing.clear()


def begin_step(root: RootState) -> None:
    """At the root's forward: finish the reductions a non-last backward left in flight, and wait for the
    events ``set_post_optim_event`` gave (each once: the next step needs a new one)."""
    wait_all_reductions(root)
    for state in root.states:
        event = state.settings.post_optim_event
        if event is not None:  # gather only after the optimizer step
            state.settings.post_optim_event = None
            event.wait()


def unshard_with_prefetch(state: GroupState, targets: list[GroupState]) -> None:
    """Finish our all-gather (usually prefetched already), then issue the targets', which move while
    this group computes; after our copy-out, so our buffer is freed before theirs is allocated."""
    state.group.unshard()
    for target in targets:
        target.group.start_unshard()
