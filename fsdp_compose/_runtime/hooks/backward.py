"""Backward hooks: pre-backward on forward outputs, post-backward per group, the root's final callback.

A group's post-backward runs once every trainable parameter's gradient was accumulated, every
forward call's grad-requiring inputs got theirs (``forward.py``'s identity tells it) and so did the
outputs of the calls nested in its forward ([Note: nested outputs]): then no node still needs the
unsharded weights, frozen ones included. The end of backward finishes the rest.
"""

from __future__ import annotations

import weakref

import torch
from torch.autograd.graph import get_gradient_edge

from ..._torch_workarounds.functorch import outside_transforms
from ..param_grad import refuse_backward_through_grad, stash_grad
from ..schedule import (
    backward_prefetch_targets,
    end_backward,
    issue_reductions,
    queue_reductions,
    release_held,
    reset_backward,
    unshard_with_prefetch,
    wait_all_reductions,
)
from ..state import IDLE, IN_BACKWARD, POST_BACKWARD, PRE_BACKWARD, GroupState, RootState


def queue_end_of_backward(root: RootState) -> None:
    if root.phase == IN_BACKWARD:
        return
    root.phase = IN_BACKWARD
    root.creates_graph = torch.is_grad_enabled()  # in a hook, grad mode is the backward's create_graph
    torch.autograd.Variable._execution_engine.queue_callback(lambda: end_of_backward(root))


# private (torch 2.11 to 2.14 have it): whether the running backward reaches a node; without it, a
# gradient-only backward with create_graph=True is refused (begin_graph_only)
_will_execute_node = getattr(torch._C, "_will_engine_execute_node", None)


@outside_transforms
def _accumulates(root: RootState) -> bool:
    """Whether the running backward accumulates into a trainable parameter (``backward()``; not
    ``torch.autograd.grad`` nor ``backward(inputs=...)``)."""
    for state in root.states:
        for p in state.group.trainable:
            if p.unsharded_param is None:
                continue
            try:
                if _will_execute_node(get_gradient_edge(p.unsharded_param).node):
                    return True
            except RuntimeError:  # an input of torch.autograd.grad: never accumulated into
                pass
    return False


def begin_graph_only(root: RootState, state: GroupState) -> bool:
    """A backward with ``create_graph=True`` that accumulates into no parameter (a gradient penalty's
    ``torch.autograd.grad``) is not the step's backward: it only gathers. The graph it creates holds the
    unsharded parameters, so the groups it gathered stay gathered until the step's backward ends; its
    end leaves the step's bookkeeping (phases, inputs, reductions) as it was."""
    if not torch.is_grad_enabled() or root.phase == IN_BACKWARD:  # create_graph=False, or recomputation
        return False
    if _will_execute_node is None:
        raise RuntimeError(
            f"a backward with create_graph=True reached {state.group.label}; telling a gradient-only backward "
            "(torch.autograd.grad) from the step's needs torch._C._will_engine_execute_node, which this torch "
            "lacks (torch 2.11 to 2.14 have it)"
        )
    if _accumulates(root):
        return False
    previous, root.phase, root.graph_only = root.phase, IN_BACKWARD, True
    torch.autograd.Variable._execution_engine.queue_callback(lambda: end_of_graph_only(root, previous))
    return True


def end_of_graph_only(root: RootState, previous) -> None:
    root.phase, root.graph_only = previous, False
    for state in root.states:
        if state.group.is_unsharded:
            state.held_by_graph = True
    if root.accumulated_in_graph_only:  # a nested backward (reentrant checkpoint) accumulated after all
        root.accumulated_in_graph_only = False
        end_of_backward(root)


class PostBackwardSignal(torch.autograd.Function):
    """Identity on a module's inputs (``forward.py`` routes them through it); its backward runs when
    their gradients are ready."""

    @staticmethod
    def forward(ctx, state: GroupState, *tensors: torch.Tensor):
        ctx.state = state
        return tensors

    @staticmethod
    def backward(ctx, *grads: torch.Tensor):
        inputs_done_hook(ctx.state)
        return (None, *grads)


def inputs_done_hook(state: GroupState, *_grads) -> None:
    """A forward call's inputs got their gradients: ``PostBackwardSignal``'s backward, or the hook on the node
    of a single input's identity view (see [Note: the view_as signal] in ``forward.py``)."""
    if state.root.graph_only:  # a gradient-only pass over the forward graph; the step's backward comes
        return
    state.inputs_pending -= 1
    maybe_post_backward(state)


def pre_backward(state: GroupState, enclosing: GroupState | None = None, _grads=None) -> None:
    """The pre-hook ``forward.register_pre_backward`` puts on an output's node (or leaf); ``enclosing``: the
    call whose forward made this call, whose nodes consuming the output have all run now."""
    root = state.root
    first = root.phase != IN_BACKWARD  # the backward's first hook (the checks below return at once after it)
    if root.graph_only or (first and begin_graph_only(root, state)):  # only the data, for the graph being created
        unshard_with_prefetch(state, _prefetched_in_backward(state))
        return
    if first:
        queue_end_of_backward(root)
    if enclosing is not None:
        for s in enclosing.call_states:
            s.nested_pending -= 1
            maybe_post_backward(s)
    if state.phase >= PRE_BACKWARD:  # a later output of the same call: nothing more to do
        return
    state.phase = PRE_BACKWARD
    targets = _prefetched_in_backward(state)
    if state.settings.unshard_in_backward:
        unshard_with_prefetch(state, targets)
    else:  # set_unshard_in_backward(False): only the prefetches
        for target in targets:
            target.group.start_unshard()
    issue_reductions(root)  # after the order check of the all-gathers above (gloo)


def _prefetched_in_backward(state: GroupState) -> list[GroupState]:
    """The groups to all-gather right after ``state``'s in backward (those that unshard in backward)."""
    return [t for t in backward_prefetch_targets(state.root, state) if t.settings.unshard_in_backward]


def on_grad_accumulated(state_ref: weakref.ref[GroupState], index: int, _param=None) -> None:
    """Post-accumulate-grad hook of the unsharded parameter ``index`` of the group.

    It holds its state weakly: torch keeps a tensor's hooks where Python's cycle collector cannot see them,
    so a hook holding the state (which holds the tensor) kept every model that had trained a step alive.
    """
    state = state_ref()
    if state is None:
        return
    root = state.root
    state.grads_ready.add(index)
    if root is not None and root.graph_only:
        root.accumulated_in_graph_only = True
        return
    if root is not None and root.phase != IN_BACKWARD:
        queue_end_of_backward(root)
    maybe_post_backward(state)


def maybe_post_backward(state: GroupState) -> None:
    """Post-backward once every use's inputs, every nested call's outputs and every trainable parameter got
    their gradients."""
    waiting = state.phase == POST_BACKWARD or state.inputs_pending > 0 or state.nested_pending > 0
    if not waiting and len(state.grads_ready) >= len(state.group.trainable):
        post_backward(state)


def post_backward(state: GroupState) -> None:
    """Reduce-scatter the group's gradients (or keep them, without sync), then reshard; callers check
    the group has not done so already this step."""
    state.phase = POST_BACKWARD
    group = state.group
    if state.settings.reshard_after_backward and not state.held_by_graph:  # the gradients are separate tensors
        group.reshard()
    if group.trainable and state.settings.requires_gradient_sync:
        queue_reductions(state.root, state, group.start_reduce(all_reduce=state.settings.requires_all_reduce))
    elif group.trainable:  # no-sync micro-batch: keep summing in the reduce dtype
        for p in group.trainable:
            stash_grad(p)


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
        elif state.group.is_unsharded and state.settings.reshard_after_backward:
            state.group.reshard()
    release_held(root)
    issue_reductions(root)
    if root.root_module_state.settings.is_last_backward:
        wait_all_reductions(root)
        if root.creates_graph:
            for state in root.states:
                for p in state.group.trainable:
                    refuse_backward_through_grad(p, state.group.label)
    for state in root.states:
        reset_backward(state)
    end_backward(root)
    root.collective_logs.close_round()  # may raise ExecutionOrderError, once the step's state is reset
