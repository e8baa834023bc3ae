"""``use_as_torch_fsdp``: code written against torch's FSDP2 names runs on fsdp_compose, and the patch undoes."""

from __future__ import annotations

import importlib

import pytest
import torch

import fsdp_compose
from fsdp_compose._runtime.state import state_of
from fsdp_compose_compat import OUR_NAMES, TORCH_MODULES, use_as_torch_fsdp

from tests.harness import run_on_ranks
from tests.models import TinyLM, assert_parity, train_against_reference


def fsdp2_style_shard(model: torch.nn.Module) -> None:
    """Written for torch's FSDP2, as a third-party trainer would be: it never names fsdp_compose."""
    from torch.distributed._composable.fsdp import fully_shard as legacy_fully_shard
    from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard, register_fsdp_forward_method

    policy = MixedPrecisionPolicy(reduce_dtype=torch.float32)
    for block in model.blocks:
        fully_shard(block, mp_policy=policy)
    legacy_fully_shard(model, mp_policy=policy)
    register_fsdp_forward_method(model, "forward")
    assert isinstance(model, FSDPModule)
    assert state_of(model) is not None, "torch's fully_shard ran, not ours"


def _train_through_patch() -> dict:
    with use_as_torch_fsdp():
        result = train_against_reference(TinyLM, fsdp2_style_shard, steps=3)
    from torch.distributed.fsdp import fully_shard

    result["restored"] = fully_shard is not fsdp_compose.fully_shard
    return result


def test_fsdp2_style_training_function_runs_on_ours_at_parity() -> None:
    results = run_on_ranks(2, _train_through_patch)
    assert_parity(results)
    assert all(r["restored"] for r in results)


def test_patch_covers_every_path_and_undoes() -> None:
    originals = {
        (path, name): getattr(importlib.import_module(path), name)
        for path in TORCH_MODULES
        for name in OUR_NAMES
        if name in vars(importlib.import_module(path))
    }
    assert ("torch.distributed.fsdp", "fully_shard") in originals
    assert ("torch.distributed._composable.fsdp", "FSDPModule") in originals
    assert ("torch.distributed.fsdp._fully_shard", "CPUOffloadPolicy") in originals
    handle = use_as_torch_fsdp()
    try:
        for (path, name), _ in originals.items():
            assert getattr(importlib.import_module(path), name) is OUR_NAMES[name], f"{path}.{name}"
        with pytest.raises(RuntimeError, match="already active"):
            use_as_torch_fsdp()
    finally:
        handle.undo()
    handle.undo()  # a second undo does nothing
    for (path, name), original in originals.items():
        assert getattr(importlib.import_module(path), name) is original, f"{path}.{name} not restored"
    with use_as_torch_fsdp() as handle:
        assert handle.active
    assert not handle.active
