"""Backward hooks: pre-backward on forward outputs, post-backward per group, the root's final callback.

A group's post-backward runs once every trainable parameter's gradient was accumulated and every
forward call's grad-requiring inputs got theirs (``forward.py``'s identity tells it): then no node
still needs the unsharded weights, frozen ones included. The end of backward finishes the rest.
"""

from __future__ import annotations

from functools import partial

import torch

from ..param_grad import stash_grad
from ..schedule import backward_prefetch_targets, end_backward, unshard_with_prefetch
from ..state import IDLE, IN_BACKWARD, POST_BACKWARD, PRE_BACKWARD, GroupState, RootState


def queue_end_of_backward(root: RootState) -> None:
    if root.phase == IN_BACKWARD:
        return
    root.phase = IN_BACKWARD
    torch.autograd.Variable._execution_engine.queue_callback(lambda: end_of_backward(root))


def pre_backward(state: GroupState) -> None:
    root = state.root
    queue_end_of_backward(root)
    if state.phase >= PRE_BACKWARD:
        return
    state.phase = PRE_BACKWARD
    targets = [t for t in backward_prefetch_targets(root, state) if t.unshard_in_backward]
    if state.unshard_in_backward:
        unshard_with_prefetch(state, targets)
    else:  # set_unshard_in_backward(False): only the prefetches
        for target in targets:
            target.group.start_unshard()
    root.ledgers.flush()  # the reduce-scatters no all-gather above took with its handshake (gloo)


def on_grad_accumulated(state: GroupState, index: int) -> None:
    """Post-accumulate-grad hook of the unsharded parameter ``index`` of the group."""
    if state.root is not None:
        queue_end_of_backward(state.root)
    state.grads_ready.add(index)
    maybe_post_backward(state)


def maybe_post_backward(state: GroupState) -> None:
    if state.phase == POST_BACKWARD or state.inputs_pending > 0:
        return
    if len(state.grads_ready) < len(state.group.trainable):
        return
    post_backward(state)


def post_backward(state: GroupState) -> None:
    """Reduce-scatter the group's gradients (or keep them, without sync), then reshard; callers check
    the group has not done so already this step."""
    state.phase = POST_BACKWARD
    group = state.group
    if state.reshard_after_backward:  # the gradients are separate tensors: free the parameters first
        group.reshard()
    if group.trainable and state.requires_gradient_sync:
        group.start_reduce(all_reduce=state.requires_all_reduce, then=partial(_bound_reductions, state))
    elif group.trainable:  # no-sync micro-batch: keep summing in the reduce dtype
        for p in group.trainable:
            stash_grad(p)


def _bound_reductions(state: GroupState) -> None:
    """Once ``state``'s reductions are issued: wait for the oldest beyond the limit (it bounds their memory)."""
    reducing = state.root.reducing
    reducing.append(state)
    limit = state.reduce_buffers or state.root.reduce_limit
    while len(reducing) > limit:
        reducing.pop(0).group.wait_reduces()


def holds_gradients(state: GroupState) -> bool:
    """Unsharded gradients no reduction took yet: no-sync backwards left them (or a pipeline schedule
    assigned ``.grad`` itself, past the post-accumulate hooks)."""
    return any(
        p.accumulated_grad is not None or (p.unsharded_param is not None and p.unsharded_param.grad is not None)
        for p in state.group.trainable
    )


def end_of_backward(root: RootState, held: bool = False) -> None:
    """Finish the groups backward left open, wait for reductions, reset for the next step. ``held``: also
    the groups that only hold gradients of earlier backwards (a pipeline schedule's step end, which
    turns gradient sync back on after its micro-batches' backwards)."""
    for state in root.states:
        participated = state.phase != IDLE or state.grads_ready or (held and holds_gradients(state))
        if participated and state.phase != POST_BACKWARD:
            post_backward(state)
        elif state.group.is_unsharded and state.reshard_after_backward:
            state.group.reshard()
    root.ledgers.flush()
    if root.root_module_state.is_last_backward:
        for state in root.states:
            if state.group.pending_reduces:  # most groups' reductions finished long ago
                state.group.wait_reduces()
        root.reducing.clear()
    for state in root.states:
        state.reset_backward()
    end_backward(root)
    root.ledgers.close_round()  # may raise ExecutionOrderError, once the step's state is reset
