"""Pre- and post-forward hooks, the root's lazy init, the identity on a module's inputs that tells backward
when the module's own backward is done, and what keeps torch.compile from tracing a sharded call's hooks."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator
from functools import partial, wraps
from typing import Any, TypeVar

import torch
from torch import nn
from torch._C._dynamo.eval_frame import (
    _FrameAction,
    _FrameExecStrategy,
    get_eval_frame_callback,
    set_code_exec_strategy,
)
from torch.utils._pytree import SUPPORTED_NODES, tree_flatten, tree_leaves, tree_unflatten

from ..._torch_workarounds.functorch import outside_transforms_tensor, signal_inside_transform, transforms_active
from ..refresh import follow_module
from ..schedule import (
    begin_step,
    forward_prefetch_targets,
    record_post_forward,
    record_pre_forward,
    reshards_after_forward,
    unshard_with_prefetch,
)
from ..state import FORWARD, IDLE, IN_BACKWARD, GroupState, RootState, class_name, states_in
from .backward import PostBackwardSignal, inputs_done_hook, pre_backward


def is_tensor_leaf(x: object) -> bool:
    """A tensor pytree treats as a leaf (a tensor subclass could register itself as a node)."""
    return isinstance(x, torch.Tensor) and type(x) not in SUPPORTED_NODES


def output_tensors(output: Any) -> Iterator[torch.Tensor]:
    """Every tensor in ``output``, dataclass fields included: pytree does not look inside dataclass
    instances, so ``Out(value=tensor)`` would hide its tensors from the pre-backward hook."""
    if is_tensor_leaf(output):  # fast paths: a module's usual outputs skip the pytree walk
        yield output
        return
    if type(output) is tuple and all(is_tensor_leaf(x) for x in output):
        yield from output
        return
    for leaf in tree_leaves(output):
        if isinstance(leaf, torch.Tensor):
            yield leaf
        elif dataclasses.is_dataclass(leaf) and not isinstance(leaf, type):
            for field in dataclasses.fields(leaf):
                yield from output_tensors(getattr(leaf, field.name))


def lazy_init(state: GroupState, module: nn.Module) -> None:
    """Make ``module`` the root of every group in its subtree; what can fail runs before anything is
    assigned, so a failed first forward leaves the model as it was."""
    found = states_in(module)
    for _, s in found:  # parameters converted or replaced since fully_shard
        follow_module(s)
    param_names = {id(p): name for name, p in module.named_parameters(remove_duplicate=False)}
    for name, s in found:
        for p in s.group.params:
            if p.sharded_param.device.type == "meta":
                fqn = param_names.get(id(p.sharded_param), p.fqn)
                raise RuntimeError(
                    f"Parameter '{fqn}' of module '{name or '<root>'}' ({class_name(s.module)}) "
                    "is still on the meta device at the first forward; materialize it first: "
                    "model.to_empty(device=...) then fsdp_compose.init_sharded_parameters(model)"
                )
    for name, s in found:  # what fully_shard left to judge here (weights_check.py): collectives, in tree order
        for check in s.first_forward_checks:
            check(name or "<root>")
    for _, s in found:
        s.first_forward_checks.clear()
    root = RootState(root_module_state=state, states=[s for _, s in found])
    for name, s in found:
        s.group.order_check.use_logs(root.collective_logs, root.label_of)
        s.root = root
        s.is_root = s is state or s.primary is state
        s.group.fqn, s.group.mesh_text = name or "<root>", s.mesh_text
        for p in s.group.params:
            p.fqn = param_names.get(id(p.sharded_param), p.fqn)


def plain_tensor_args(args: object, kwargs: dict) -> bool:
    """True when the pytree walk of ``(args, kwargs)`` would find exactly ``args``: the common call then
    skips pytree's flatten/unflatten (a large share of the per-group CPU overhead)."""
    return not kwargs and type(args) is tuple and all(is_tensor_leaf(a) for a in args)


# [Note: the view_as signal]
# A group's post-backward (reduce its gradients, reshard) may run once every forward use of it has its
# inputs' gradients: then no later node of the backward needs its parameters. To hear that moment, the
# inputs of each call are routed through an identity whose backward node carries a hook. For the usual
# single plain tensor that identity is ``x.view_as(x)`` with a hook on its ``grad_fn``: a C++ node, half
# the cost of a Python ``autograd.Function`` (``backward.PostBackwardSignal``, used for several inputs).
# An in-place op on the view replaces its node and loses the hook; the group's post-backward then runs at
# the end of backward (``backward.end_of_backward``), later but still once.


def signal_post_backward(state: GroupState, tensors: list[torch.Tensor]) -> tuple[torch.Tensor, ...]:
    """``tensors`` routed through autograd nodes whose backward tells ``state`` this call's inputs got
    their gradients: see [Note: the view_as signal]."""
    state.inputs_pending += 1
    if len(tensors) == 1 and type(tensors[0]) is torch.Tensor:
        view = tensors[0].view_as(tensors[0])
        node = view.grad_fn
        if node is not None:  # None only inside torch.func.jvp, for a tensor made outside it
            node.register_hook(partial(inputs_done_hook, state))
            return (view,)
    elif not transforms_active():  # PostBackwardSignal, an old-style Function, raises under a transform
        return PostBackwardSignal.apply(state, *tensors)
    return signal_inside_transform(partial(inputs_done_hook, state), tensors)  # _torch_workarounds/functorch.py


def attach_post_backward_signal(state: GroupState, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """Route grad-requiring inputs through an identity whose backward tells us the module is done."""
    if not kwargs and len(args) == 1 and type(args[0]) is torch.Tensor:  # the usual call: one plain tensor
        return (signal_post_backward(state, [args[0]])[0],) if args[0].requires_grad else args, kwargs
    plain = plain_tensor_args(args, kwargs)
    flat, spec = (list(args), None) if plain else tree_flatten((args, kwargs))
    positions = [i for i, x in enumerate(flat) if isinstance(x, torch.Tensor) and x.requires_grad]
    if not positions:
        return args, kwargs
    outputs = signal_post_backward(state, [flat[i] for i in positions])
    for i, out in zip(positions, outputs):
        flat[i] = out
    return (tuple(flat), {}) if plain else tree_unflatten(flat, spec)


def cast_floating(tree: Any, dtype: torch.dtype) -> Any:
    """Cast every floating-point tensor in a pytree; leave everything else as it is."""
    if is_tensor_leaf(tree):  # fast path: a single tensor (a module's usual output)
        return tree.to(dtype) if tree.is_floating_point() and tree.dtype != dtype else tree
    plain = type(tree) is tuple and all(is_tensor_leaf(x) for x in tree)  # fast path: a plain tuple, no pytree
    flat, spec = (tree, None) if plain else tree_flatten(tree)
    if not any(isinstance(x, torch.Tensor) and x.is_floating_point() and x.dtype != dtype for x in flat):
        return tree
    cast = [x.to(dtype) if isinstance(x, torch.Tensor) and x.is_floating_point() else x for x in flat]
    return tuple(cast) if plain else tree_unflatten(cast, spec)


def pre_forward(state: GroupState, module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    if state.root is None:
        lazy_init(state, module)
    root = state.root
    policy = state.settings.mp_policy
    if policy.cast_forward_inputs and policy.param_dtype is not None:
        args = cast_floating(args, policy.param_dtype)
        if kwargs:
            kwargs = cast_floating(kwargs, policy.param_dtype)
    if root.phase == IN_BACKWARD:  # activation-checkpoint recomputation: just make the data available
        state.group.unshard()
        return args, kwargs
    if state.is_root:
        begin_step(root)
    record_pre_forward(root, state)
    unshard_with_prefetch(state, forward_prefetch_targets(root, state))
    if torch.is_grad_enabled():
        if state.phase == IDLE:
            state.phase = FORWARD
        args, kwargs = attach_post_backward_signal(state, args, kwargs)
        if state.primary is None:  # a call is entered once, by its first state
            root.open_calls.append(state)
    return args, kwargs


# [Note: nested outputs]
# A group's own nodes may consume tensors that are neither its inputs nor made from its trainable
# parameters: the outputs of groups called inside its forward (the root's final norm reads the last
# block's output). Its trainable parameters' gradients can all be ready before those nodes run (a peft
# ``modules_to_save`` head at the root: the head's copy accumulates first, then the norm's backward reads
# the norm's weight). So each grad-requiring output of a call made inside another call's forward counts
# for the enclosing call until the output's node runs, i.e. until every node consuming it has run.


def leave_forward(root: RootState, state: GroupState) -> GroupState | None:
    """Close ``state``'s call; the call whose forward encloses it, whose nodes consume its outputs (None
    at the outermost call, for a companion state: its first state counts the outputs once, and for an
    enclosing call with no parameters: no weights of its own to keep)."""
    if state.primary is not None:
        return None
    calls = root.open_calls
    if calls and calls[-1] is state:
        calls.pop()
    if not calls:
        return None
    enclosing = calls[-1]
    return enclosing if enclosing.group.params or enclosing.companions else None


def post_forward(state: GroupState, module: nn.Module, args: tuple, output: Any) -> Any:
    root = state.root
    if state.settings.mp_policy.output_dtype is not None:
        output = cast_floating(output, state.settings.mp_policy.output_dtype)
    if root.phase == IN_BACKWARD:
        return output
    enclosing = leave_forward(root, state)
    if not torch.is_grad_enabled():
        # no backward will follow: free everything, prefetched groups included at the root
        for s in root.states if state.is_root else [state]:
            if not s.held_by_graph:
                s.group.reshard()
        return output
    record_post_forward(root, state)
    if reshards_after_forward(state) and not state.held_by_graph:
        state.group.reshard(after_forward=True)
    if type(output) is torch.Tensor:  # the usual output: no generator
        if output.requires_grad:
            register_pre_backward(output, state, enclosing)
        elif transforms_active():
            register_pre_backward_outside_transforms(output, state, enclosing)
        return output
    for x in output_tensors(output):
        if x.requires_grad:
            register_pre_backward(x, state, enclosing)
        elif transforms_active():
            register_pre_backward_outside_transforms(x, state, enclosing)
    return output


def register_pre_backward(x: torch.Tensor, state: GroupState, enclosing: GroupState | None = None) -> None:
    """Run ``pre_backward(state, enclosing)`` when backward reaches ``x``: a pre-hook on ``x``'s node (one C++
    call, where ``Tensor.register_hook`` runs a page of Python), or on a leaf the tensor hook. ``x`` counts for
    ``enclosing`` until then (see [Note: nested outputs])."""
    node = x.grad_fn
    hook = partial(pre_backward, state, enclosing)  # a partial: backward runs no function of this file
    if node is not None:
        node.register_prehook(hook)
    else:
        x.register_hook(hook)
    if enclosing is not None:
        for s in enclosing.call_states:
            s.nested_pending += 1


def register_pre_backward_outside_transforms(x: torch.Tensor, state: GroupState, enclosing: GroupState | None) -> None:
    """Inside ``torch.func.jvp`` or ``vmap`` an output reports ``requires_grad=False``; the tensor it wraps in the
    outer graph gets the pre-backward hook (``_torch_workarounds/functorch.py``)."""
    outer = outside_transforms_tensor(x)
    if outer is not None and outer.requires_grad:
        register_pre_backward(outer, state, enclosing)


# ----- keeping torch.compile (dynamo) out of a sharded module's call and fully_shard's hooks -----------
# The hooks issue collectives and keep Python state, nothing a graph can hold, so they run eagerly and
# only what they call (the module's ``forward``) is compiled. ``FSDPModule._call_impl`` is
# ``frame_not_traced`` (a compiled block starts compiling at ``forward``; from a compiled caller it is a
# graph break); the hooks are ``not_traced``. Only dynamo's C entry points are used: ``import
# fsdp_compose`` stays light.

F = TypeVar("F", bound=Callable)


def frame_not_traced(fn: F) -> F:
    """Dynamo does not trace ``fn``'s own frame (the mark ``skip`` sets, on the code object) but compiles
    the frames it calls; a call from a traced frame is a graph break, explained in dynamo's logs."""
    set_code_exec_strategy(fn.__code__, _FrameExecStrategy(_FrameAction.SKIP, _FrameAction.DEFAULT))
    fn._torchdynamo_disable = True
    fn._torchdynamo_disable_msg = "fsdp_compose: a sharded module's call and hooks run eagerly"
    return fn


def not_traced(fn: F) -> F:
    """``fn`` as a function dynamo never traces, nor anything it calls (``torch._dynamo.disable`` inside
    a compiled region, a direct call outside one)."""
    disabled: list[Callable] = []

    @wraps(fn)
    def run_eagerly(*args, **kwargs):
        # set (not None) while torch.compile runs a compiled region; a C function, so a frame dynamo
        # skips can call it without starting a frame dynamo would trace
        if get_eval_frame_callback() is None:
            return fn(*args, **kwargs)
        if not disabled:
            import torch._dynamo

            disabled.append(torch._dynamo.disable(fn, recursive=True, reason="fsdp_compose's hooks run eagerly"))
        return disabled[0](*args, **kwargs)

    return frame_not_traced(run_eagerly)


# what fully_shard registers as the module's hooks: nn.Module's hook loop calls them, also inside a
# torch.compile region
pre_forward_hook = not_traced(pre_forward)
post_forward_hook = not_traced(post_forward)
