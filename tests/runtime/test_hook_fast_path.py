"""The hooks' fast path (no pytree walk for a plain tuple of tensors) gives what the walk gives."""

from collections import namedtuple
from types import SimpleNamespace

import torch
from torch.utils._pytree import tree_flatten, tree_map

from fsdp_compose._runtime.hooks.forward import attach_post_backward_signal, cast_floating, plain_tensor_args

Pair = namedtuple("Pair", "a b")


def _walked_cast(tree, dtype):
    """What the pytree walk returns: every floating tensor cast once any one needs it."""
    flat, _ = tree_flatten(tree)
    if not any(isinstance(x, torch.Tensor) and x.is_floating_point() and x.dtype != dtype for x in flat):
        return tree
    return tree_map(lambda x: x.to(dtype) if isinstance(x, torch.Tensor) and x.is_floating_point() else x, tree)


def _same(a, b) -> bool:
    fa, sa = tree_flatten(a)
    fb, sb = tree_flatten(b)
    return sa == sb and all(
        (x.dtype == y.dtype and torch.equal(x, y)) if isinstance(x, torch.Tensor) else x == y for x, y in zip(fa, fb)
    )


def test_only_a_plain_tuple_of_tensors_without_kwargs_takes_the_fast_path():
    t = torch.ones(2)
    assert plain_tensor_args((t, t.long()), {})
    assert plain_tensor_args((), {})
    assert not plain_tensor_args((t,), {"mask": t})
    assert not plain_tensor_args((t, None), {})
    assert not plain_tensor_args(Pair(t, t), {})
    assert not plain_tensor_args([t], {})


def test_cast_floating_matches_the_pytree_walk():
    f32, f16, i64 = torch.randn(3), torch.randn(3).half(), torch.arange(3)
    trees = [f32, f16, i64, (f32, i64), (f16, f32, i64), (i64,), (), Pair(f32, i64), [f32, {"x": f16}], (f32, None)]
    for tree in trees:
        for dtype in (torch.float16, torch.float32):
            got = cast_floating(tree, dtype)
            assert _same(got, _walked_cast(tree, dtype)), (tree, dtype)
            if _walked_cast(tree, dtype) is tree:
                assert got is tree  # nothing to cast: the very same object back


def test_post_backward_signal_wraps_exactly_the_grad_requiring_inputs():
    state = SimpleNamespace(inputs_pending=0)
    x, y, n = torch.randn(2, requires_grad=True), torch.randn(2), torch.arange(2)
    args, kwargs = attach_post_backward_signal(state, (x, y, n), {})
    assert kwargs == {} and len(args) == 3 and state.inputs_pending == 1
    assert args[0] is not x and torch.equal(args[0], x) and args[0].requires_grad
    assert args[1] is y and args[2] is n
    same_args, _ = attach_post_backward_signal(state, (y, n), {})
    assert same_args == (y, n) and state.inputs_pending == 1  # nothing needs grad: untouched
