"""Benchmark: what each CPU fast path of the hooks saves (issue 23, ask 5).

    python benchmarks/bench_fast_paths.py                 # 48 groups, every fast path
    python benchmarks/bench_fast_paths.py --groups 12,192 --only grad_off

A fast path is a second way of doing what a general mechanism already does (``nn.Module``'s hook
loop, pytree, ``torch.no_grad``, an ``autograd.Function``...), kept only because it is cheaper.
Each is switched off here by rewriting one line of the function that holds it (nothing in the
package changes) and measured against the unchanged library on an O(1) process group (the null
backend of ``bench_overhead.py``: collectives cost nothing, so what is timed is the host work of
the library and autograd): one sharded model runs with each path switched off in turn (so where its
tensors happen to lie in memory is the same for all), interleaved in rounds with the unsharded
model and torch's FSDP2 in a shuffled order, so a slow spell of the machine hits all alike.
Figures: the overhead per step (step time minus the unsharded model's) by thread CPU time, its
change when the path is off, and Python calls per step (``sys.setprofile``: exact, untouched by
noise). torch's FSDP2 is timed beside them for scale.
"""

from __future__ import annotations
import __future__

import argparse
import inspect
import os
import random
import sys
import textwrap
import time
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.distributed as dist

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from benchmarks import null_backend  # noqa: E402  (registers the "null" backend)
from benchmarks.bench_overhead import build, shard, stepper  # noqa: E402
from benchmarks.common import median_time  # noqa: E402


@dataclass(frozen=True)
class Rewrite:
    """In ``function`` (``module:Class.name`` or ``module:name``), ``old`` becomes ``new``."""

    function: str
    old: str
    new: str


# name -> (what the path replaces, the rewrites that switch it off)
FAST_PATHS: dict[str, tuple[str, list[Rewrite]]] = {
    "grad_off": (
        "torch.no_grad() around copy-in, copy-out and the reduce-scatter",
        [Rewrite("fsdp_compose._runtime.group:ParamGroup.start_unshard", "grad_off()", "torch.no_grad()"),
         Rewrite("fsdp_compose._runtime.group:ParamGroup._finish_unshard", "grad_off()", "torch.no_grad()"),
         Rewrite("fsdp_compose._runtime.group:ParamGroup.reshard", "grad_off()", "torch.no_grad()"),
         Rewrite("fsdp_compose._runtime.group:ParamGroup.start_reduce", "grad_off()", "torch.no_grad()"),
         Rewrite("fsdp_compose._runtime.group:ParamGroup.issue_reduce", "grad_off()", "torch.no_grad()")],
    ),
    "one_input_view_hook": (
        "PostBackwardSignal (an autograd.Function) for a call's single plain input",
        [Rewrite("fsdp_compose._runtime.hooks.forward:signal_post_backward",
                 "if len(tensors) == 1 and type(tensors[0]) is torch.Tensor:", "if False:")],
    ),
    "one_input_args": (
        "the general walk of a call's arguments, for one plain tensor",
        [Rewrite("fsdp_compose._runtime.hooks.forward:attach_post_backward_signal",
                 "if not kwargs and len(args) == 1 and type(args[0]) is torch.Tensor:", "if False:")],
    ),
    "output_no_pytree": (
        "pytree's walk of a forward output, for a tensor or a tuple of tensors",
        [Rewrite("fsdp_compose._runtime.hooks.forward:post_forward",
                 "if type(output) is torch.Tensor:", "if False:"),
         Rewrite("fsdp_compose._runtime.hooks.forward:output_tensors",
                 "if is_tensor_leaf(output):", "if False:"),
         Rewrite("fsdp_compose._runtime.hooks.forward:output_tensors",
                 "if type(output) is tuple and", "if False and")],
    ),
    "plain_args_no_pytree": (
        "pytree flatten/unflatten of (args, kwargs), for plain tensor arguments",
        [Rewrite("fsdp_compose._runtime.hooks.forward:plain_tensor_args",
                 "return not kwargs and", "return False and")],
    ),
    "cast_no_pytree": (
        "pytree's walk in the mixed-precision casts, for a tensor or a tuple of tensors (with --mp)",
        [Rewrite("fsdp_compose._runtime.hooks.forward:cast_floating", "if is_tensor_leaf(tree):", "if False:"),
         Rewrite("fsdp_compose._runtime.hooks.forward:cast_floating", "= type(tree) is tuple and", "= False and")],
    ),
    "node_prehook": (
        "Tensor.register_hook on a forward output, with a pre-hook on its autograd node",
        [Rewrite("fsdp_compose._runtime.hooks.forward:register_pre_backward",
                 "if node is not None:", "if False:")],
    ),
    "byte_views_cache": (
        "building a shard's byte views for the all-gather at each unshard",
        [Rewrite("fsdp_compose._runtime.storage:Aliased.pieces",
                 "if local is self._source:", "if False:")],
    ),
    "flag_rows_cache": (
        "building the has-gradient flag rows at each reduce-scatter",
        [Rewrite("fsdp_compose._runtime.group:ParamGroup._flag_rows",
                 "cached = self._all_present.get(dtype)", "cached = None")],
    ),
    "divisor_tensor": (
        "dividing fp32 gradients by a Python float (a new 0-dim tensor per call)",
        [Rewrite("fsdp_compose._runtime.group:ParamGroup._divisor",
                 "if dtype != torch.float32:", "if True:")],
    ),
    "direct_c10d": (
        "dist.all_gather_into_tensor / reduce_scatter_tensor and their Python argument checks",
        [Rewrite("fsdp_compose._runtime.collectives:DirectAllGather.__call__",
                 "return _finished(getattr(group, GATHER_METHOD)(output_tensor, input_tensor, ASYNC_ALL_GATHER), "
                 "async_op)",
                 "return dist.all_gather_into_tensor(output_tensor, input_tensor, group, async_op=async_op)"),
         Rewrite("fsdp_compose._runtime.collectives:DirectReduceScatter.__call__",
                 "return _finished(scatter(output_tensor, input_tensor, ASYNC_SUM_REDUCE_SCATTER), async_op)",
                 "return dist.reduce_scatter_tensor(output_tensor, input_tensor, group=group, async_op=async_op)")],
    ),
}


def _resolve(function: str) -> tuple[object, str, object]:
    """(owner to set the attribute on, attribute name, current function)."""
    module_name, qualname = function.split(":")
    owner = sys.modules[module_name]
    *classes, name = qualname.split(".")
    for cls in classes:
        owner = getattr(owner, cls)
    return owner, name, inspect.unwrap(owner.__dict__[name])


def _rewritten(function: str, fn: object, edits: list[Rewrite]) -> object:
    """A copy of ``fn`` (found at ``function``) compiled from its source with ``edits`` applied."""
    lines, first = inspect.getsourcelines(fn)
    source = "\n" * (first - 1) + textwrap.dedent("".join(lines))  # tracebacks show the original lines
    for edit in edits:
        if edit.old not in source:
            raise SystemExit(f"bench_fast_paths: {function} no longer holds {edit.old!r}; update the benchmark")
        source = source.replace(edit.old, edit.new)
    module = sys.modules[function.split(":")[0]]
    code = compile(source, module.__file__, "exec", flags=__future__.annotations.compiler_flag, dont_inherit=True)
    namespace: dict = {}
    exec(code, module.__dict__, namespace)  # the module's globals: the copy sees what the original sees
    return namespace[fn.__name__]


@contextmanager
def switched_off(path: str | None):
    """The library with ``path``'s rewrites applied (``None``: unchanged); restored on exit.

    A rewritten module-level function also replaces the names other modules imported it under."""
    if path is None:
        yield
        return
    by_function: dict[str, list[Rewrite]] = {}
    saved = []
    for edit in FAST_PATHS[path][1]:
        by_function.setdefault(edit.function, []).append(edit)
    for function, edits in by_function.items():
        owner, name, fn = _resolve(function)
        original = owner.__dict__[name]
        new = _rewritten(function, fn, edits)
        holders = [owner] if isinstance(owner, type) else [
            m for m in list(sys.modules.values())
            if m is not None and m.__name__.startswith("fsdp_compose") and m.__dict__.get(name) is original
        ]
        for holder in holders:
            saved.append((holder, name, original))
            setattr(holder, name, new)
    try:
        yield
    finally:
        for holder, name, original in reversed(saved):
            setattr(holder, name, original)


def python_calls(run) -> int:
    """Python function calls during ``run()`` (C functions not counted)."""
    count = [0]

    def profile(frame, event, arg):
        if event == "call":
            count[0] += 1

    sys.setprofile(profile)
    try:
        run()
    finally:
        sys.setprofile(None)
    return count[0]


def measure(groups: int, paths: list[str], args) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy as TorchPolicy
    from torch.distributed.fsdp import fully_shard as torch_fully_shard
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from fsdp_compose import MixedPrecisionPolicy, fully_shard

    mp = (torch.bfloat16, torch.float32, torch.float32) if args.mp else ()  # compute, reductions, outputs
    dist.init_process_group(args.backend, store=FakeStore(), rank=0, world_size=args.world_size)
    mesh = init_device_mesh("cpu", (args.world_size,))
    x = torch.randn(4, args.dim)
    kinds: dict[str, tuple[object, str | None]] = {"compute": (build(groups, args.dim), None)}
    kinds["torch"] = (shard(build(groups, args.dim), torch_fully_shard, mesh, mp_policy=TorchPolicy(*mp)), None)
    ours = shard(build(groups, args.dim), fully_shard, mesh, mp_policy=MixedPrecisionPolicy(*mp))
    for path in [None, *paths]:  # one model, each path switched off in turn: no layout differences
        kinds[path or "ours"] = (ours, path)
    calls, times = {}, {kind: [] for kind in kinds}
    for kind, (model, path) in kinds.items():
        with switched_off(path):
            for _ in range(3):
                stepper(model, x)()
            calls[kind] = python_calls(stepper(model, x))
    order = list(kinds)
    for _ in range(args.rounds):
        random.Random(len(times["ours"])).shuffle(order)  # no kind always follows the same one
        for kind in order:
            model, path = kinds[kind]
            with switched_off(path):
                times[kind].append(median_time(stepper(model, x), args.steps, time.thread_time))
    dist.destroy_process_group()
    best = {kind: min(samples) for kind, samples in times.items()}
    over = {kind: (best[kind] - best["compute"]) * 1e6 for kind in kinds}
    print(f"{groups} groups of Linear({args.dim},{args.dim}) + root, {args.backend} process group "
          f"ws {args.world_size}; {'bf16 mixed precision; ' if args.mp else ''}best of {args.rounds} rounds "
          f"of median-of-{args.steps}, thread CPU time; "
          f"torch's FSDP2 overhead {over['torch']:.0f} us/step, ours {over['ours']:.0f} "
          f"(ours/torch {over['ours'] / over['torch']:.3f})")
    print(f"    {'switched off':22s} {'overhead us/step':>16s} {'change':>8s} {'ours/torch':>10s} "
          f"{'py calls/step':>14s} {'change':>7s}   what it replaces")
    for kind in ["ours", *paths]:
        change = (over[kind] - over["ours"]) / over["ours"] * 100
        extra = calls[kind] - calls["ours"]
        what = "" if kind == "ours" else FAST_PATHS[kind][0]
        print(f"    {'(none)' if kind == 'ours' else kind:22s} {over[kind]:16.0f} {change:+7.1f}% "
              f"{over[kind] / over['torch']:10.3f} {calls[kind]:14d} {extra:+7d}   {what}")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--world-size", type=int, default=8)
    parser.add_argument("--groups", default="48", help="comma-separated group counts")
    parser.add_argument("--dim", type=int, default=16)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--backend", default=null_backend.NAME,
                        help="null: collectives cost nothing (benchmarks/null_backend.py), so the step is "
                        "the libraries' own host work; fake: torch's fake backend, as bench_overhead.py")
    parser.add_argument("--mp", action="store_true", help="MixedPrecisionPolicy(bf16, fp32, fp32) in both libraries")
    parser.add_argument("--only", default="", help="comma-separated fast paths (default: all)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    paths = args.only.split(",") if args.only else list(FAST_PATHS)
    for groups in [int(g) for g in args.groups.split(",")]:
        measure(groups, paths, args)


if __name__ == "__main__":
    main()
