"""Activation checkpointing composed with fully_shard, around a sharded block and inside it.

Recomputation runs a block's forward again during backward, so its forward hooks fire twice
per step. These tests check training still matches an unsharded model, that the recompute
issues no extra all-gather or reduce-scatter, and that every group is resharded after backward.
"""

from __future__ import annotations

from functools import partial

import pytest
import torch
import torch.nn.functional as F
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointImpl, checkpoint_wrapper
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from fsdp_compose import FSDPModule, fully_shard
from fsdp_compose._runtime.state import state_of
from tests.harness import run_on_ranks
from tests.models import DIM, HIDDEN, VOCAB, Block, TinyLM, assert_parity, default_step, train_against_reference


def _save_matmuls(ctx, op, *args, **kwargs) -> CheckpointPolicy:
    """Selective AC: keep matmul outputs, recompute everything else (gelu, layer norm, ...)."""
    if op in (torch.ops.aten.mm.default, torch.ops.aten.addmm.default):
        return CheckpointPolicy.MUST_SAVE
    return CheckpointPolicy.PREFER_RECOMPUTE


def run_checkpointed(flavour: str, fn, *args):
    """Run ``fn(*args)`` under the activation checkpointing ``flavour``."""
    if flavour == "non_reentrant":
        return checkpoint(fn, *args, use_reentrant=False)
    if flavour == "reentrant":
        # Reentrant checkpoint computes only gradients that flow through inputs requiring
        # grad (torch.utils.checkpoint docs); here every input is an activation that does.
        assert any(a.requires_grad for a in args)
        return checkpoint(fn, *args, use_reentrant=True)
    if flavour == "selective":
        context_fn = partial(create_selective_checkpoint_contexts, _save_matmuls)
        return checkpoint(fn, *args, use_reentrant=False, context_fn=context_fn)
    raise ValueError(flavour)


class InnerACBlock(Block):
    """A block whose MLP is recomputed in backward: AC *inside* the sharded block."""

    def __init__(self, flavour: str) -> None:
        super().__init__()
        self.flavour = flavour

    def mlp(self, h: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(h)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + run_checkpointed(self.flavour, self.mlp, self.norm(x))


class OuterACLM(TinyLM):
    """Each (sharded) block is called through checkpoint: AC *around* the sharded block."""

    def __init__(self, flavour: str) -> None:
        super().__init__()
        self.flavour = flavour

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        for block in self.blocks:
            x = run_checkpointed(self.flavour, block, x)
        return self.head(self.norm(x))


def build(flavour: str, where: str) -> TinyLM:
    """TinyLM with AC of ``flavour`` placed ``where`` ("around" or "inside" the sharded blocks)."""
    if flavour == "wrapper":
        model = TinyLM()
        for block in model.blocks:
            if where == "inside":
                block.fc1 = checkpoint_wrapper(block.fc1, checkpoint_impl=CheckpointImpl.NO_REENTRANT)
                block.fc2 = checkpoint_wrapper(block.fc2, checkpoint_impl=CheckpointImpl.NO_REENTRANT)
        if where == "around":
            model.blocks = torch.nn.ModuleList(
                checkpoint_wrapper(b, checkpoint_impl=CheckpointImpl.NO_REENTRANT) for b in model.blocks
            )
        return model
    if where == "around":
        return OuterACLM(flavour)
    model = TinyLM()
    model.blocks = torch.nn.ModuleList(InnerACBlock(flavour) for _ in model.blocks)
    return model


def shard(model: TinyLM) -> None:
    for block in model.blocks:
        # checkpoint_wrapper around a block: shard the block itself, so the wrapper's
        # checkpoint call runs the block's hooks inside the checkpointed region.
        fully_shard(getattr(block, "_checkpoint_wrapped_module", block))
    fully_shard(model)


def groups(model: TinyLM) -> list:
    return [s for m in model.modules() if (s := state_of(m)) is not None and s.module is m]


class StepProbe:
    """Observations of the sharded model per step, taken by a custom step function."""

    def __init__(self) -> None:
        self.collectives: list[list[tuple[int, int]]] = []  # per group: (all-gathers, reduce-scatters)
        self.unsharded_after: list[int] = []  # bytes still unsharded after backward
        self.unsharded_at_embedding: list[int] = []  # block bytes unsharded when grad reaches embed
        self.fc1_calls: list[int] = []
        self._fc1_calls = 0
        self._model = None

    def _attach(self, model: TinyLM) -> None:
        def count_fc1(*_) -> None:
            self._fc1_calls += 1

        def watch_embedding_grad(_module, _args, out) -> None:
            blocks = [s for s in groups(model) if not s.is_root]
            out.register_hook(lambda _g: self.unsharded_at_embedding.append(sum(s.group.unsharded_nbytes() for s in blocks)))

        for m in model.modules():
            if isinstance(m, torch.nn.Linear) and m.out_features == HIDDEN:
                m.register_forward_pre_hook(count_fc1)
        model.embed.register_forward_hook(watch_embedding_grad)
        self._model = model

    def step(self, model, batch, rank, world_size) -> torch.Tensor:
        if not isinstance(model, FSDPModule):  # the unsharded reference
            return default_step(model, batch, rank, world_size)
        if self._model is None:
            self._attach(model)
        self._fc1_calls = 0
        before = [(s.group.stats.all_gathers, s.group.stats.reduce_scatters) for s in groups(model)]
        loss = default_step(model, batch, rank, world_size)
        after = [(s.group.stats.all_gathers, s.group.stats.reduce_scatters) for s in groups(model)]
        self.collectives.append([(a[0] - b[0], a[1] - b[1]) for a, b in zip(after, before)])
        self.unsharded_after.append(sum(s.group.unsharded_nbytes() for s in groups(model)))
        self.fc1_calls.append(self._fc1_calls)
        return loss


def _ac_parity(flavour: str, where: str) -> dict:
    probe = StepProbe()
    result = train_against_reference(partial(build, flavour, where), shard, step_fn=probe.step)
    result.update(
        collectives=probe.collectives,
        unsharded_after=probe.unsharded_after,
        unsharded_at_embedding=probe.unsharded_at_embedding,
        fc1_calls=probe.fc1_calls,
    )
    return result


FLAVOURS = ["non_reentrant", "reentrant", "selective", "wrapper"]


@pytest.mark.parametrize("where", ["around", "inside"])
@pytest.mark.parametrize("flavour", FLAVOURS)
def test_ac_parity_and_no_extra_collectives(flavour, where):
    results = run_on_ranks(2, _ac_parity, flavour, where)
    assert_parity(results)
    for r in results:
        # groups in tree order: root, then the 3 blocks. Per step, each block gathers once in
        # forward and once in backward (recompute reuses the backward gather); the root,
        # kept unsharded after forward, gathers once; every group reduces once.
        assert r["collectives"] == [[(1, 1)] + [(2, 1)] * 3] * 4, r["collectives"]
        # every group is resharded after backward ...
        assert r["unsharded_after"] == [0] * 4, r["unsharded_after"]
        # ... and each block already during backward, not only in the end-of-backward
        # callback: the recompute attached no second post-backward signal left waiting
        assert r["unsharded_at_embedding"] == [0] * 4, r["unsharded_at_embedding"]
        # the recompute really ran: each block's fc1 ran in forward and again in backward
        assert r["fc1_calls"] == [2 * 3] * 4, r["fc1_calls"]


class FeatureNet(torch.nn.Module):
    """Blocks fed straight from the (integer) input: the first checkpointed input has no grad."""

    def __init__(self, make_input_require_grad: bool) -> None:
        super().__init__()
        self.make_input_require_grad = make_input_require_grad
        self.blocks = torch.nn.ModuleList(Block() for _ in range(2))
        self.head = torch.nn.Linear(DIM, VOCAB)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = F.one_hot(ids % DIM, DIM).float()
        if self.make_input_require_grad:
            # torch.utils.checkpoint docs: with use_reentrant=True, at least one input must
            # require grad, or the checkpointed region's parameters get no gradient.
            x.requires_grad_()
        for block in self.blocks:
            x = checkpoint(block, x, use_reentrant=True)
        return self.head(x)


def _reentrant_first_block(make_input_require_grad: bool) -> dict:
    without_grad: list[list[str]] = []

    def step(model, batch, rank, world_size) -> torch.Tensor:
        loss = default_step(model, batch, rank, world_size)
        if isinstance(model, FSDPModule):
            without_grad.append([name for name, p in model.named_parameters() if p.grad is None])
        return loss

    def shard_net(model: FeatureNet) -> None:
        for block in model.blocks:
            fully_shard(block)
        fully_shard(model)

    result = train_against_reference(partial(FeatureNet, make_input_require_grad), shard_net, step_fn=step, steps=2)
    result["without_grad"] = without_grad
    return result


@pytest.mark.parametrize("make_input_require_grad", [True, False])
def test_reentrant_checkpoint_needs_an_input_requiring_grad(make_input_require_grad):
    # Sharded or not, the model behaves the same (assert_parity also compares which grads
    # are None): with a grad-requiring input every block trains; without one, reentrant
    # checkpoint cuts the graph at the first block, so no block gets a gradient.
    results = run_on_ranks(2, _reentrant_first_block, make_input_require_grad)
    assert_parity(results)
    block_params = [n for n in results[0]["names"] if n.startswith("blocks.")]
    for r in results:
        assert r["without_grad"] == [[] if make_input_require_grad else block_params] * 2, r["without_grad"]
