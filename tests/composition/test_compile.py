"""torch.compile composed with fully_shard: blocks compiled before or after sharding, and the whole model.

A sharded module's call and fully_shard's hooks run eagerly (_runtime/hooks/forward.py); only
``forward`` is compiled, so a block compiled with ``fullgraph=True`` (torchtitan's
``block.compile(fullgraph=True)`` before ``fully_shard(block)``) compiles as one graph. Each case
trains 3 steps on gloo ranks against an unsharded model on the global batch.

Tolerance: ``assert_parity``'s fp32 1e-5 on losses, parameters and gradients. The sharded model
sums gradients in another order than the reference (per-rank means, then a reduce-scatter), and
the compiled blocks run the traced aten graph (aot_eager: the same kernels; inductor: fused C++
kernels that may round differently). Measured on 2 ranks, every backend and order: losses within
7e-7, parameters within 1.2e-7, gradients within 5e-8, so no looser bound is needed.
"""

from __future__ import annotations

import shutil
from functools import partial

import pytest
import torch
import torch._inductor.config
from torch._dynamo.utils import counters

from fsdp_compose import FSDPModule, fully_shard
from tests.harness import run_on_ranks
from tests.models import TinyLM, assert_parity, default_step, shard_blocks_then_root, train_against_reference

STEPS = 3


def _fresh_dynamo() -> None:
    torch._dynamo.reset()
    counters.clear()


def _compile_stats(result: dict) -> dict:
    """What dynamo did on this rank: graphs compiled and graph breaks taken."""
    result["graphs"] = counters["stats"]["unique_graphs"]
    # dynamo counts a break it resumes after under "graph_break", one that skips the frame under "unimplemented"
    reasons = [*counters["graph_break"], *counters["unimplemented"]]
    result["graph_breaks"] = len(reasons)
    result["breaks_at_sharded_call"] = sum("FSDPModule._call_impl" in reason for reason in reasons)
    return result


def _compile_then_shard(model: TinyLM, backend: str) -> None:
    """torchtitan's order: each block compiled (fullgraph) before fully_shard is called on it."""
    for block in model.blocks:
        block.compile(backend=backend, fullgraph=True)
        fully_shard(block)
    fully_shard(model)


def _shard_then_compile(model: TinyLM, backend: str) -> None:
    shard_blocks_then_root(model)
    for block in model.blocks:
        block.compile(backend=backend, fullgraph=True)


def _blocks_compiled(order: str, backend: str) -> dict:
    _fresh_dynamo()
    shard = partial(_compile_then_shard if order == "before" else _shard_then_compile, backend=backend)
    # inductor compiles C++ kernels in a pool of processes by default; two ranks on a small
    # machine are faster compiling in-process (the kernels compile at the first step, inside)
    with torch._inductor.config.patch(compile_threads=1):
        return _compile_stats(train_against_reference(TinyLM, shard, steps=STEPS))


@pytest.mark.parametrize("backend", ["aot_eager", pytest.param("inductor", marks=pytest.mark.slow)])  # inductor: C++ kernels, in the slow run
def test_blocks_compiled_before_fully_shard(backend):
    if backend == "inductor" and shutil.which("g++") is None:
        pytest.skip("inductor on CPU compiles its C++ kernels with g++ (torch._inductor.config.cpp.cxx), not installed")
    results = run_on_ranks(2, _blocks_compiled, "before", backend)
    assert_parity(results)
    for r in results:
        # one graph for Block.forward, reused by the 3 blocks and 3 steps: swapping sharded and
        # unsharded parameters around it causes no recompilation
        assert (r["graphs"], r["graph_breaks"]) == (1, 0), r


def test_blocks_compiled_after_fully_shard():
    results = run_on_ranks(2, _blocks_compiled, "after", "aot_eager")
    assert_parity(results)
    for r in results:
        assert (r["graphs"], r["graph_breaks"]) == (1, 0), r


class EagerWrapper(torch.nn.Module):
    """Holds a block where ``torch.compile``'s wrapper does (``_orig_mod``), without compiling it."""

    def __init__(self, block: torch.nn.Module) -> None:
        super().__init__()
        self._orig_mod = block

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._orig_mod(x)


def _eager_reference() -> TinyLM:
    """The unsharded reference, eager, with the parameter names the compiled blocks give."""
    model = TinyLM()
    model.blocks = torch.nn.ModuleList(EagerWrapper(block) for block in model.blocks)
    return model


def _sharded_then_wrapped() -> TinyLM:
    torch.manual_seed(0)  # the reference's initial weights (train_against_reference seeds it the same)
    model = TinyLM()
    shard_blocks_then_root(model)
    for i, block in enumerate(model.blocks):
        model.blocks[i] = torch.compile(block, backend="aot_eager", fullgraph=True)
    return model


def _block_wrappers_after_sharding() -> dict:
    _fresh_dynamo()
    result = train_against_reference(_eager_reference, None, steps=STEPS, sharded=_sharded_then_wrapped)
    return _compile_stats(result)


@pytest.mark.slow  # 3 ranks compiling
def test_block_wrappers_compiled_after_fully_shard_on_three_ranks():
    """``torch.compile(block)`` assigned back after sharding; 3 ranks pad every dimension (13, 29)."""
    results = run_on_ranks(3, _block_wrappers_after_sharding)
    assert_parity(results)
    for r in results:
        assert (r["graphs"], r["graph_breaks"]) == (1, 0), r


class WholeModelStep:
    """Runs the sharded model through ``torch.compile(model)``, built once; the reference stays eager."""

    def __init__(self) -> None:
        self.compiled = None

    def __call__(self, model, batch, rank, world_size) -> torch.Tensor:
        if not isinstance(model, FSDPModule):
            return default_step(model, batch, rank, world_size)
        if self.compiled is None:
            self.compiled = torch.compile(model, backend="aot_eager")
        return default_step(self.compiled, batch, rank, world_size)


def _whole_model_compiled() -> dict:
    _fresh_dynamo()
    step = WholeModelStep()
    result = _compile_stats(train_against_reference(TinyLM, shard_blocks_then_root, steps=STEPS, step_fn=step))
    return result


def test_whole_sharded_model_compiled():
    results = run_on_ranks(2, _whole_model_compiled)
    assert_parity(results)
    for r in results:
        # a sharded block's call is a graph break (here inside the loop over blocks, so dynamo runs the
        # model's forward eagerly); each block's forward is still compiled
        assert r["graphs"] >= 1 and r["breaks_at_sharded_call"] >= 1, r
