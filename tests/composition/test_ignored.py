"""Ignored parameters: left exactly as they were, like torch FSDP2's ``ignored_params``.

fully_shard neither shards them, nor moves them, nor reduces their gradients; the user keeps
them in sync (all-reduce their gradients after backward) or keeps them frozen.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from fsdp_compose import FSDPModule, ModuleWrapPolicy, apply_fully_shard
from fsdp_compose._runtime.state import owner_of
from tests.harness import run_on_ranks
from tests.models import Block, TinyLM, assert_parity, default_step, train_against_reference

# a whole module (blocks.1, "ignored module") and one parameter of another module
IGNORED = ["blocks.1.norm.weight", "blocks.1.norm.bias", "blocks.1.fc1.weight", "blocks.1.fc1.bias",
           "blocks.1.fc2.weight", "blocks.1.fc2.bias", "head.bias"]  # fmt: skip


def shard_ignoring(model: nn.Module) -> None:
    ignored = {model.get_parameter(name) for name in IGNORED}
    # every fully_shard call gets ignored_params: blocks.1's own (now empty) group as well as
    # the root, which would otherwise claim head.bias
    apply_fully_shard(model, ModuleWrapPolicy({Block}), ignored_params=ignored)


def _frozen_ignored() -> TinyLM:
    model = TinyLM()
    for name in IGNORED:
        model.get_parameter(name).requires_grad_(False)
    return model


def _ignored_params() -> dict:
    world_size = dist.get_world_size()
    torch.manual_seed(0)
    model = TinyLM()
    originals = {name: model.get_parameter(name) for name in IGNORED}
    shard_ignoring(model)

    checks: dict[str, object] = {}
    ignored = [model.get_parameter(name) for name in IGNORED]
    checks["same_objects"] = all(model.get_parameter(n) is p for n, p in originals.items())
    checks["plain"] = [type(p) is nn.Parameter and not isinstance(p, DTensor) for p in ignored]
    checks["sharded_rest"] = all(isinstance(p, DTensor) for n, p in model.named_parameters() if n not in IGNORED)
    checks["unowned"] = all(owner_of(p) is None for p in ignored)
    checks["no_grad_hooks"] = all(not p._post_accumulate_grad_hooks and not p._backward_hooks for p in ignored)

    ids = torch.randint(0, 37, (2, 6), generator=torch.Generator().manual_seed(dist.get_rank()))
    default_step(model, ids, dist.get_rank(), world_size)
    checks["still_plain_after_step"] = all(model.get_parameter(n) is originals[n] for n in IGNORED)
    # gradients are this rank's own: no collective touched them
    local = torch.cat([p.grad.reshape(-1) for p in ignored])
    gathered = [torch.empty_like(local) for _ in range(world_size)]
    dist.all_gather(gathered, local)
    checks["grads_differ_across_ranks"] = not torch.equal(gathered[0], gathered[1])
    return checks


def _sync_ignored_grads(model, batch, rank, world_size) -> torch.Tensor:
    """The user's side of the contract: average the ignored parameters' gradients."""
    loss = default_step(model, batch, rank, world_size)
    if isinstance(model, FSDPModule):
        for name in IGNORED:
            grad = model.get_parameter(name).grad
            dist.all_reduce(grad)
            grad.div_(world_size)
    return loss


def _ignored_parity() -> list[dict]:
    trained = train_against_reference(TinyLM, shard_ignoring, step_fn=_sync_ignored_grads, steps=3)
    frozen = train_against_reference(_frozen_ignored, shard_ignoring, steps=3)
    return [trained, frozen]


def test_ignored_params_stay_plain_and_unsynced():
    for checks in run_on_ranks(2, _ignored_params):
        assert checks == {
            "same_objects": True,
            "plain": [True] * len(IGNORED),
            "sharded_rest": True,
            "unowned": True,
            "no_grad_hooks": True,
            "still_plain_after_step": True,
            "grads_differ_across_ranks": True,
        }


def test_ignored_params_parity_when_user_syncs_or_freezes_them():
    for results in zip(*run_on_ranks(2, _ignored_parity)):
        assert_parity(list(results))
